//! How many drafts each sequence verifies: the choice that maximises goodput, expected kept
//! tokens per millisecond of the step (SV spec §3–4).
//!
//! A sequence's drafts are worth their *gains*: gain i is the probability that drafts
//! 0..=i are all kept, so verifying γ drafts is expected to keep Σ_{i<γ} gain_i of them. Only a
//! prefix of a draft can be verified, so each sequence offers one candidate at a time, its
//! next draft; the batch greedy adds the candidate with the largest gain while goodput
//! improves (`EarlyStop`, the paper's rule), or runs the greedy order to its end and keeps
//! its best prefix (`Exhaustive`).
//!
//! `Exactness::Paper` uses β(S_i, A_i) for draft i, which depends on the sampled token
//! itself: under sampling that biases the output (spec §6). `Exact` prices draft i with what
//! is known before it is sampled, β(S_i) times the chance the drafts before it are kept, so
//! whether a draft is verified never depends on the draft: speculative sampling stays exact.
//! That holds for the greedy search only; `Exhaustive` looks at later drafts to decide on
//! earlier ones and is refused with `Exact`. Greedy decoding is lossless either way.

use anyhow::{bail, Result};
use serde::Deserialize;

use super::table::AcceptanceTable;
use crate::verify_latency::VerifyLatency;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Exactness {
    Paper,
    Exact,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Search {
    EarlyStop,
    Exhaustive,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GoodputOptions {
    /// Count the token every verify yields (the correction or bonus) as gained: `E[N] + 1`.
    pub count_bonus: bool,
    /// Milliseconds a step costs besides its verify (drafting, the companion).
    pub fixed_ms: f64,
    /// Drafts every sequence verifies at least (where it has them).
    pub min_gamma: usize,
    pub search: Search,
}

impl Default for GoodputOptions {
    fn default() -> Self {
        Self { count_bonus: true, fixed_ms: 0.0, min_gamma: 0, search: Search::EarlyStop }
    }
}

impl GoodputOptions {
    /// Refuses a search that would make `Exact` inexact.
    pub fn check(&self, exactness: Exactness) -> Result<()> {
        if exactness == Exactness::Exact && self.search == Search::Exhaustive {
            bail!("exactness = \"exact\" needs search = \"early-stop\": an exhaustive search decides on a draft from the drafts after it");
        }
        Ok(())
    }
}

/// Each draft's gain from the companion's indicators of every draft of one sequence.
pub fn gains(table: &AcceptanceTable, s: &[f32], a: &[f32], exactness: Exactness) -> Vec<f64> {
    assert_eq!(s.len(), a.len(), "one S and one A per draft");
    let mut kept_before = 1.0f64;
    s.iter()
        .zip(a)
        .map(|(&s, &a)| {
            let beta = table.beta(s, a) as f64;
            let gain = match exactness {
                Exactness::Paper => kept_before * beta,
                Exactness::Exact => kept_before * table.beta_by_s(s) as f64,
            };
            kept_before *= beta;
            gain
        })
        .collect()
}

/// Expected drafts kept when the first `gamma` are verified.
pub fn expected_kept(gains: &[f64], gamma: usize) -> f64 {
    gains[..gamma].iter().sum()
}

fn goodput(kept: f64, sequences: usize, rows: usize, latency: &VerifyLatency, opts: &GoodputOptions) -> f64 {
    let tokens = kept + if opts.count_bonus { sequences as f64 } else { 0.0 };
    tokens / (opts.fixed_ms + latency.at(rows))
}

/// How many drafts one sequence verifies.
pub fn choose_gamma(gains: &[f64], latency: &VerifyLatency, opts: &GoodputOptions) -> usize {
    schedule_batch(&[gains.to_vec()], latency, opts)[0]
}

/// How many drafts each sequence of a batch verifies, all verified in one forward over
/// Σ_b (γ_b + 1) rows (each sequence's last committed token plus its drafts).
pub fn schedule_batch(gains: &[Vec<f64>], latency: &VerifyLatency, opts: &GoodputOptions) -> Vec<usize> {
    let mut gamma: Vec<usize> = gains.iter().map(|g| opts.min_gamma.min(g.len())).collect();
    let mut kept: f64 = gains.iter().zip(&gamma).map(|(g, &n)| expected_kept(g, n)).sum();
    let mut rows: usize = gamma.iter().map(|n| n + 1).sum();
    let mut best = goodput(kept, gains.len(), rows, latency, opts);
    let mut best_gamma = gamma.clone();
    loop {
        // The next draft of the sequence whose next draft gains most (the first on ties).
        let next = (0..gains.len())
            .filter(|&b| gamma[b] < gains[b].len())
            .fold(None, |top: Option<usize>, b| match top {
                Some(t) if gains[t][gamma[t]] >= gains[b][gamma[b]] => Some(t),
                _ => Some(b),
            });
        let Some(b) = next else { break };
        kept += gains[b][gamma[b]];
        gamma[b] += 1;
        rows += 1;
        let g = goodput(kept, gains.len(), rows, latency, opts);
        if g > best {
            best = g;
            best_gamma = gamma.clone();
        } else if opts.search == Search::EarlyStop {
            break;
        }
    }
    best_gamma
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::*;
    use crate::sv::{
        indicators::{companion_acceptance, similarity},
        table::{Observation, TableOrigin},
    };

    fn constant(beta: f64, k: usize) -> Vec<f64> {
        (1..=k).map(|i| beta.powi(i as i32)).collect()
    }

    #[test]
    fn expected_kept_with_constant_beta_is_the_closed_form() {
        for beta in [0.3f64, 0.7, 0.95] {
            for gamma in 0..=8 {
                let closed = (1.0 - beta.powi(gamma as i32 + 1)) / (1.0 - beta) - 1.0;
                assert!((expected_kept(&constant(beta, 8), gamma) - closed).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn expected_kept_agrees_with_independent_draws() {
        let betas = [0.9, 0.6, 0.8, 0.3];
        let mut g = Vec::new();
        let mut cum = 1.0;
        for b in betas {
            cum *= b;
            g.push(cum);
        }
        let mut rng = StdRng::seed_from_u64(7);
        let trials = 200_000;
        let total: usize = (0..trials).map(|_| betas.iter().take_while(|&&b| rng.random::<f64>() < b).count()).sum();
        let mean = total as f64 / trials as f64;
        assert!((mean - expected_kept(&g, 4)).abs() < 0.01, "{mean} vs {}", expected_kept(&g, 4));
    }

    #[test]
    fn flat_cost_and_certain_drafts_verify_everything() {
        let flat = VerifyLatency::linear(40.0, 0.0);
        let gamma = schedule_batch(&[vec![1.0; 6], vec![1.0; 4]], &flat, &GoodputOptions::default());
        assert_eq!(gamma, vec![6, 4]);
    }

    #[test]
    fn steep_cost_and_hopeless_drafts_verify_the_minimum() {
        let steep = VerifyLatency::linear(10.0, 50.0);
        let hopeless = constant(0.01, 6);
        assert_eq!(schedule_batch(&[hopeless.clone(), hopeless.clone()], &steep, &GoodputOptions::default()), vec![0, 0]);
        let at_least_two = GoodputOptions { min_gamma: 2, ..Default::default() };
        assert_eq!(schedule_batch(&[hopeless.clone(), hopeless], &steep, &at_least_two), vec![2, 2]);
    }

    #[test]
    fn one_draft_pays_when_its_gain_beats_the_extra_row() {
        // T(1) = 10, T(2) = 15: a draft pays iff (1 + g) / 15 > 1 / 10, i.e. g > 0.5.
        let t = VerifyLatency::linear(10.0, 5.0);
        let opts = GoodputOptions::default();
        assert_eq!(choose_gamma(&[0.51], &t, &opts), 1);
        assert_eq!(choose_gamma(&[0.49], &t, &opts), 0);
        // Without the bonus token in the numerator, any gain beats nothing.
        assert_eq!(choose_gamma(&[0.49], &t, &GoodputOptions { count_bonus: false, ..opts }), 1);
    }

    /// A small deterministic generator for the property tests.
    fn draws(seed: u64) -> impl FnMut() -> f64 {
        let mut rng = StdRng::seed_from_u64(seed);
        move || rng.random::<f64>()
    }

    #[test]
    fn early_stop_equals_exhaustive_when_goodput_is_unimodal() {
        // Non-increasing gains and a convex, increasing T_v make goodput unimodal in the
        // greedy order.
        let mut r = draws(11);
        for _ in 0..500 {
            let batch = 1 + (r() * 6.0) as usize;
            let gains: Vec<Vec<f64>> = (0..batch)
                .map(|_| {
                    let mut cum = 1.0;
                    (0..1 + (r() * 8.0) as usize).map(|_| { cum *= r(); cum }).collect()
                })
                .collect();
            let (base, slope, curve) = (10.0 + 40.0 * r(), 10.0 * r(), r());
            let samples: Vec<(usize, f64)> =
                (1..=64).map(|n| (n, base + slope * n as f64 + curve * (n * n) as f64)).collect();
            let t = VerifyLatency::fit(&samples).unwrap();
            let early = schedule_batch(&gains, &t, &GoodputOptions::default());
            let full = schedule_batch(&gains, &t, &GoodputOptions { search: Search::Exhaustive, ..Default::default() });
            assert_eq!(early, full, "gains {gains:?}");
        }
    }

    #[test]
    fn batch_greedy_takes_the_largest_gains_as_prefixes() {
        // With non-increasing gains, the greedy picks the top k gains over the batch: each
        // sequence's verified drafts are a prefix, and no unpicked gain beats a picked one.
        let mut r = draws(5);
        for _ in 0..300 {
            let gains: Vec<Vec<f64>> = (0..4)
                .map(|_| {
                    let mut cum = 1.0;
                    (0..6).map(|_| { cum *= 0.5 + 0.5 * r(); cum }).collect()
                })
                .collect();
            let t = VerifyLatency::linear(30.0, 2.0 + 6.0 * r());
            let gamma = schedule_batch(&gains, &t, &GoodputOptions::default());
            let smallest_picked = (0..4).filter(|&b| gamma[b] > 0).map(|b| gains[b][gamma[b] - 1]).fold(f64::INFINITY, f64::min);
            let largest_left = (0..4).filter(|&b| gamma[b] < 6).map(|b| gains[b][gamma[b]]).fold(0.0, f64::max);
            assert!(gamma.iter().all(|&g| g <= 6));
            assert!(smallest_picked >= largest_left, "{gamma:?} {gains:?}");
        }
    }

    #[test]
    fn ties_go_to_the_first_sequence() {
        // Room for exactly one draft: T(2) = 10, T(3) = 10, T(4) = 100.
        let t = VerifyLatency::fit(&[(2, 10.0), (3, 10.0), (4, 100.0)]).unwrap();
        let gamma = schedule_batch(&[vec![0.5], vec![0.5]], &t, &GoodputOptions::default());
        assert_eq!(gamma, vec![1, 0]);
    }

    #[test]
    fn exact_mode_refuses_the_exhaustive_search() {
        let exhaustive = GoodputOptions { search: Search::Exhaustive, ..Default::default() };
        assert!(exhaustive.check(Exactness::Exact).is_err());
        assert!(exhaustive.check(Exactness::Paper).is_ok());
        assert!(GoodputOptions::default().check(Exactness::Exact).is_ok());
    }

    /// Spec §6: vocabulary {a, b}, draft q = (.5, .5), target p = (.9, .1), companion
    /// c = (.95, .05). The paper's rule verifies a drafted `a` (A = 1, β .9) and discards a
    /// drafted `b` (A = .1, β .2) for a fresh target sample, so `a` comes out with
    /// probability .5 + .5 × .9 = .95 instead of .9. `Exact` prices both with β(S) = .55 and
    /// keeps the target's .9.
    #[test]
    fn the_paper_rule_is_biased_under_sampling_and_exact_is_not() {
        let (q, p, c) = ([0.5f32, 0.5], [0.9f32, 0.1], [0.95f32, 0.05]);
        let s = similarity(&q, &c);
        let a_of = |x: usize| companion_acceptance(&q, &c, x);
        let mut observations = vec![Observation { s, a: a_of(0), alpha: 0.9 }; 100];
        observations.extend(vec![Observation { s, a: a_of(1), alpha: 0.2 }; 100]);
        let table = AcceptanceTable::fit(&observations, 1, 2, 1, TableOrigin::default()).unwrap();
        assert!((table.beta(s, a_of(0)) - 0.9).abs() < 1e-6 && (table.beta(s, a_of(1)) - 0.2).abs() < 1e-6);
        // T(1) = 10, T(2) = 15: a draft is verified iff its gain exceeds 0.5.
        let t = VerifyLatency::linear(10.0, 5.0);
        let opts = GoodputOptions::default();
        for (exactness, expected) in [(Exactness::Paper, 0.95), (Exactness::Exact, 0.90)] {
            let mut rng = StdRng::seed_from_u64(3);
            let n = 200_000;
            let mut a_out = 0;
            for _ in 0..n {
                let x = usize::from(rng.random::<f32>() >= q[0]);
                let g = gains(&table, &[s], &[a_of(x)], exactness);
                let token = if choose_gamma(&g, &t, &opts) == 1 {
                    // Speculative sampling; the residual norm(max(0, p − q)) is all `a`.
                    if rng.random::<f32>() < (p[x] / q[x]).min(1.0) { x } else { 0 }
                } else {
                    usize::from(rng.random::<f32>() >= p[0])
                };
                a_out += usize::from(token == 0);
            }
            let freq = a_out as f64 / n as f64;
            assert!((freq - expected).abs() < 0.005, "{exactness:?}: P(a) = {freq}, expected {expected}");
        }
    }
}
