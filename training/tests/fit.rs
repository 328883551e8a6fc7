//! The fit recovers a planted linear rule, and the head it writes is loaded and applied by
//! the plugin's code with the trainer's probabilities.

use rand::{rngs::StdRng, Rng, SeedableRng};
use verdict_heads::{FeatureSpec, LogisticHead, ModelFingerprint};
use std::collections::BTreeSet;

use verdict_training::fit::{fit_logistic, split_for_selection, FitOptions, Sample};

fn planted(n: usize, seed: u64) -> Vec<Sample> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            // Features on very different scales and offsets; important iff 3·x0 − x2/50 > 1.
            let x: Vec<f32> = vec![
                rng.random_range(-1.0..1.0),
                rng.random_range(-5.0..5.0),
                rng.random_range(0.0..100.0),
                rng.random_range(-1.0..1.0) * 1e-3,
            ];
            let important = 3.0 * x[0] - x[2] / 50.0 > -1.0;
            Sample {
                source: 0,
                problem_id: i / 4,
                features: x,
                important,
            }
        })
        .collect()
}

#[test]
fn fit_recovers_a_planted_rule_and_the_head_reproduces_its_probabilities() {
    let samples = planted(2000, 1);
    let options = FitOptions {
        c_grid: vec![0.01, 1.0, 100.0],
        ..Default::default()
    };
    let fitted = fit_logistic(&samples, &options).unwrap();
    assert!(
        fitted.report.validation_auc > 0.98,
        "{:?}",
        fitted.report.grid
    );
    let recall = fitted
        .report
        .thresholds
        .iter()
        .find(|r| r.tau == fitted.report.chosen_tau)
        .unwrap()
        .recall;
    assert!(recall >= 0.9, "chosen τ has recall {recall}");

    let fingerprint = ModelFingerprint {
        architecture: "test".into(),
        hidden_size: 4,
        num_layers: 1,
        vocab_size: 1,
        tokenizer_sha256: "00".repeat(32),
        source: String::new(),
    };
    let head = LogisticHead {
        features: FeatureSpec::TargetOnly,
        weight: fitted.weight.clone(),
        bias: fitted.bias,
        target: fingerprint,
        draft: None,
        threshold: fitted.report.chosen_tau as f32,
        report: serde_json::to_value(&fitted.report).unwrap(),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("head.safetensors");
    head.save(&path).unwrap();
    let loaded = LogisticHead::load(&path).unwrap();
    // The trainer's probabilities (standardised model) on fresh samples against what the
    // plugin's loaded head (standardisation folded in, f32) says.
    for s in planted(50, 9) {
        let expected = fitted.probability(&s.features);
        let got = loaded.probability(None, &s.features).unwrap() as f64;
        assert!((got - expected).abs() < 1e-5, "{got} vs {expected}");
    }
}

/// Two label sets fitted together: each reports its own counts and validation AUC. The
/// second set's labels are noise, so its AUC is near chance while the first's stays high:
/// a pooled AUC alone would hide which set the head fails on.
#[test]
fn each_label_set_reports_its_own_validation_auc() {
    let mut samples = planted(1200, 3);
    let mut rng = StdRng::seed_from_u64(4);
    samples.extend(planted(1200, 5).into_iter().map(|s| Sample { source: 1, important: rng.random_bool(0.3), ..s }));
    let options = FitOptions { c_grid: vec![0.01, 1.0], ..Default::default() };
    let fitted = fit_logistic(&samples, &options).unwrap();
    let per_source = &fitted.report.per_source;
    assert_eq!(per_source.iter().map(|s| (s.source, s.samples)).collect::<Vec<_>>(), vec![(0, 1200), (1, 1200)]);
    assert_eq!(per_source.iter().map(|s| s.validation_samples).sum::<usize>(), fitted.report.validation_samples);
    assert!(per_source[0].validation_auc > 0.9, "{per_source:?}");
    assert!((per_source[1].validation_auc - 0.5).abs() < 0.15, "{per_source:?}");
    assert!(per_source.iter().all(|s| s.validation_samples > 0), "each set holds out problems: {per_source:?}");
}

/// The AUC reported comes from problems that chose neither C nor τ. Here the features
/// predict the labels on the training and selection problems and are noise on the
/// validation ones: the selection AUC is high, the reported one near chance. Reporting the
/// AUC of the problems that chose C (the best of the grid) would say 0.99.
#[test]
fn the_reported_auc_comes_from_problems_that_chose_nothing() {
    let samples = planted(2000, 7);
    let options = FitOptions { c_grid: vec![0.01, 1.0], ..Default::default() };
    let (train, selection, validation) = split_for_selection(&samples, options.selection_share, options.validation_share, options.seed);
    let problems = |rows: &[usize]| rows.iter().map(|&i| samples[i].problem_id).collect::<BTreeSet<_>>();
    let (p_train, p_sel, p_val) = (problems(&train), problems(&selection), problems(&validation));
    assert_eq!((p_train.len(), p_sel.len(), p_val.len()), (405, 45, 50));
    assert!(p_train.is_disjoint(&p_sel) && p_train.is_disjoint(&p_val) && p_sel.is_disjoint(&p_val));
    assert_eq!(train.len() + selection.len() + validation.len(), samples.len());

    let mut rng = StdRng::seed_from_u64(8);
    let samples: Vec<Sample> = samples
        .into_iter()
        .map(|s| if p_val.contains(&s.problem_id) { Sample { important: rng.random_bool(0.5), ..s } } else { s })
        .collect();
    let report = fit_logistic(&samples, &options).unwrap().report;
    assert_eq!((report.selection_problems, report.validation_problems), (45, 50));
    assert!(report.selection_auc > 0.98, "selection AUC {}", report.selection_auc);
    assert!((report.validation_auc - 0.5).abs() < 0.1, "validation AUC {} on noise", report.validation_auc);
    assert_eq!(report.validation_at_tau.tau, report.chosen_tau);
}

/// The learning curve fits on a quarter, a half and all of the training problems and scores
/// each on the validation problems. With a planted rule the AUC is high at every point; with
/// the validation problems' labels replaced by noise it is near chance at every point (a curve
/// scored on the problems it trained on would still say 0.99).
#[test]
fn the_learning_curve_scores_shares_of_the_training_problems_on_validation_problems() {
    let samples = planted(2000, 7);
    let options = FitOptions { c_grid: vec![0.01, 1.0], ..Default::default() };
    let report = fit_logistic(&samples, &options).unwrap().report;
    let curve = &report.learning_curve;
    // 405 training problems of 4 mismatches each: round(405 / 4) = 101, round(405 / 2) = 203.
    assert_eq!(curve.iter().map(|p| (p.train_problems, p.train_samples)).collect::<Vec<_>>(), vec![(101, 404), (203, 812), (405, 1620)]);
    assert_eq!(curve[2].validation_auc, report.validation_auc);
    assert!(curve.iter().all(|p| p.validation_auc > 0.95), "{curve:?}");

    let (_, _, validation) = split_for_selection(&samples, options.selection_share, options.validation_share, options.seed);
    let p_val = validation.iter().map(|&i| samples[i].problem_id).collect::<BTreeSet<_>>();
    let mut rng = StdRng::seed_from_u64(8);
    let noisy: Vec<Sample> = samples
        .into_iter()
        .map(|s| if p_val.contains(&s.problem_id) { Sample { important: rng.random_bool(0.5), ..s } } else { s })
        .collect();
    let curve = fit_logistic(&noisy, &options).unwrap().report.learning_curve;
    assert!(curve.iter().all(|p| (p.validation_auc - 0.5).abs() < 0.1), "{curve:?}");
}
