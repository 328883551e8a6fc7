//! Rejection sampling must emit tokens distributed exactly as the target, whatever the draft.

use std::{sync::Arc, time::Duration};

use candle_core::{Device, Tensor};
use mistralrs_core::speculative_hook::{AcceptRule, HiddenStates, SamplingSettings, VerifyContext};
use verdict::{judge::JudgeStack, metrics::Metrics, rules::BaseRule, VerdictRule};

const DRAWS: usize = 100_000;
/// Chi-square critical value for 15 degrees of freedom at p = 1e-6: a correct sampler
/// fails this test once in a million runs.
const CHI2_CRITICAL_DF15: f64 = 53.0;

fn log_rows(rows: &[[f32; 4]]) -> Tensor {
    let flat: Vec<f32> = rows.iter().flatten().map(|p| p.ln()).collect();
    Tensor::from_vec(flat, (rows.len(), 4), &Device::Cpu).unwrap()
}

/// Runs `DRAWS` two-token speculative steps and counts the emitted (first, second) pairs.
fn emitted_pairs(base: BaseRule, q: [[f32; 4]; 2], p: [[f32; 4]; 3]) -> (Vec<f64>, f64) {
    let rule = VerdictRule::new(JudgeStack::lossless(base), 7, Arc::new(Metrics::default()));
    let sampling = SamplingSettings {
        temperature: Some(1.0),
        ..Default::default()
    };
    let draft_logits = log_rows(&q);
    let target_logits = log_rows(&p);
    let hidden = HiddenStates::default();
    let mut counts = vec![0f64; 16];
    let mut accepted_total = 0usize;
    for _ in 0..DRAWS {
        let drafts: Vec<u32> = (0..2)
            .map(|i| {
                rule.sample_draft(0, &draft_logits.get(i).unwrap(), &sampling)
                    .unwrap()
            })
            .collect();
        let ctx = VerifyContext {
            seq_id: 0,
            prefix: &[],
            draft_tokens: &drafts,
            draft_logits: &draft_logits,
            target_logits: &target_logits,
            target_hidden: &hidden,
            draft_hidden: &hidden,
            target_lm_head: None,
            sampling: &sampling,
            draft_time: Duration::ZERO,
            verify_time: Duration::ZERO,
        };
        let decision = rule.accept(&ctx).unwrap();
        accepted_total += decision.accepted;
        let mut emitted: Vec<u32> = drafts[..decision.accepted].to_vec();
        emitted.push(decision.next_token);
        // The first two emitted tokens; a refusal at position 0 leaves only one, whose
        // successor would come from the next step, so count it with a fresh target draw.
        if emitted.len() < 2 {
            let second = rule
                .sample_draft(0, &target_logits.get(1).unwrap(), &sampling)
                .unwrap();
            emitted.push(second);
        }
        counts[(emitted[0] * 4 + emitted[1]) as usize] += 1.0;
    }
    (counts, accepted_total as f64 / DRAWS as f64)
}

fn chi_square(counts: &[f64], expected: &[f64]) -> f64 {
    counts
        .iter()
        .zip(expected)
        .map(|(o, e)| (o - e * DRAWS as f64).powi(2) / (e * DRAWS as f64))
        .sum()
}

fn product(a: [f32; 4], b: [f32; 4]) -> Vec<f64> {
    a.iter()
        .flat_map(|x| b.iter().map(move |y| (*x as f64) * (*y as f64)))
        .collect()
}

const P1: [f32; 4] = [0.1, 0.2, 0.3, 0.4];
const P2: [f32; 4] = [0.25, 0.25, 0.4, 0.1];
const Q1: [f32; 4] = [0.4, 0.3, 0.2, 0.1];
const Q2: [f32; 4] = [0.7, 0.1, 0.1, 0.1];

#[test]
fn rejection_sampling_preserves_the_target_distribution() {
    let (counts, _) = emitted_pairs(BaseRule::Rejection, [Q1, Q2], [P1, P2, P2]);
    let chi2 = chi_square(&counts, &product(P1, P2));
    assert!(
        chi2 < CHI2_CRITICAL_DF15,
        "chi-square {chi2:.1} against the target distribution"
    );
}

#[test]
fn the_test_detects_a_sampler_that_follows_the_draft() {
    // Negative control: the emitted pairs are far from the draft's own distribution.
    let (counts, _) = emitted_pairs(BaseRule::Rejection, [Q1, Q2], [P1, P2, P2]);
    let chi2 = chi_square(&counts, &product(Q1, Q2));
    assert!(
        chi2 > 10.0 * CHI2_CRITICAL_DF15,
        "chi-square {chi2:.1} should reject the draft distribution"
    );
}

#[test]
fn rejection_keeps_the_expected_share_of_drafts() {
    // E[accepted] = a1 + a1·a2 where a_i = Σ min(p_i, q_i).
    let a1 = 0.1 + 0.2 + 0.2 + 0.1;
    let a2 = 0.25 + 0.1 + 0.1 + 0.1;
    let (_, mean_accepted) = emitted_pairs(BaseRule::Rejection, [Q1, Q2], [P1, P2, P2]);
    let expected = a1 + a1 * a2;
    assert!(
        (mean_accepted - expected).abs() < 0.01,
        "{mean_accepted} vs {expected}"
    );
}

#[test]
fn exact_matching_under_sampling_is_lossless_too() {
    let (counts, mean_accepted) = emitted_pairs(BaseRule::Exact, [Q1, Q2], [P1, P2, P2]);
    let chi2 = chi_square(&counts, &product(P1, P2));
    assert!(chi2 < CHI2_CRITICAL_DF15, "chi-square {chi2:.1}");
    // Σ p·q = 0.04+0.06+0.06+0.04 = 0.2 at position 1: matching keeps fewer than rejection.
    assert!(mean_accepted < 0.3, "{mean_accepted}");
}
