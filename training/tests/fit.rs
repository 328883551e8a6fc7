//! The fit recovers a planted linear rule, and the head it writes is loaded and applied by
//! the plugin's code with the trainer's probabilities.

use rand::{rngs::StdRng, Rng, SeedableRng};
use verdict_heads::{FeatureSpec, LogisticHead, ModelFingerprint};
use verdict_training::fit::{fit_logistic, FitOptions, Sample};

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
