//! Logits → the distribution a token is drawn from.
//!
//! Draft and target rows go through the same function, so `q` and `p` in the accept rules
//! are exactly the distributions the sampler would use (temperature, top-k, top-p, min-p).

use anyhow::{bail, Result};
use mistralrs_core::speculative_hook::SamplingSettings;
use rand::{distr::weighted::WeightedIndex, prelude::Distribution, Rng};

/// Index of the largest logit; the first one on ties, as candle's arg-max.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Probabilities of sampling each token from `logits` under `sampling` (`temperature` must
/// be set; greedy decoding never needs a distribution).
pub fn probabilities(logits: &[f32], sampling: &SamplingSettings) -> Vec<f32> {
    let temperature = sampling.temperature.unwrap_or(1.0) as f32;
    // Softmax in f32 with the max subtracted: masked logits (-inf) become exact zeros.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits
        .iter()
        .map(|&l| ((l - max) / temperature).exp())
        .collect();
    normalise(&mut probs);
    if sampling.top_k.is_some() || sampling.top_p.is_some() {
        let order = ranked_head(&probs, sampling.top_k, sampling.top_p);
        for &token in &order.tokens[order.keep..] {
            probs[token] = 0.0;
        }
    }
    if let Some(min_p) = sampling.min_p {
        let floor = probs.iter().copied().fold(0.0, f32::max) * min_p as f32;
        probs
            .iter_mut()
            .filter(|p| **p < floor)
            .for_each(|p| *p = 0.0);
    }
    normalise(&mut probs);
    probs
}

/// Every token, the first `keep` of them the ones top-k / top-p keep, in rank order (most
/// probable first, ties to the lower id); the rest in no order.
struct RankedHead {
    tokens: Vec<usize>,
    keep: usize,
}

/// The kept head of the ranking without sorting the whole vocabulary: the best `c` tokens are
/// selected (linear) and only they are sorted, `c` doubling until the top-p prefix ends inside
/// them. The ranking is a total order, so the head is exactly a full sort's.
fn ranked_head(probs: &[f32], top_k: Option<usize>, top_p: Option<f64>) -> RankedHead {
    let by_rank = |a: &usize, b: &usize| probs[*b].total_cmp(&probs[*a]).then(a.cmp(b));
    let mut tokens: Vec<usize> = (0..probs.len()).collect();
    let limit = top_k.unwrap_or(probs.len()).min(probs.len());
    if limit == 0 {
        return RankedHead { tokens, keep: 0 };
    }
    let mut head = match top_p {
        Some(_) => limit.min(64),
        None => limit,
    };
    loop {
        if head < tokens.len() {
            tokens.select_nth_unstable_by(head - 1, by_rank);
        }
        tokens[..head].sort_unstable_by(by_rank);
        // The smallest prefix whose mass reaches top_p.
        let mut mass = 0.0f64;
        let reached = top_p.and_then(|top_p| {
            tokens[..head].iter().position(|&token| {
                mass += probs[token] as f64;
                mass >= top_p
            })
        });
        match reached {
            Some(rank) => return RankedHead { tokens, keep: rank + 1 },
            None if head == limit => return RankedHead { tokens, keep: limit },
            None => head = (2 * head).min(limit),
        }
    }
}

fn normalise(probs: &mut [f32]) {
    let sum: f32 = probs.iter().sum();
    if sum > 0.0 {
        probs.iter_mut().for_each(|p| *p /= sum);
    }
}

/// Draw a token with the given (unnormalised, non-negative) weights.
pub fn sample(weights: &[f32], rng: &mut impl Rng) -> Result<u32> {
    match WeightedIndex::new(weights) {
        Ok(index) => Ok(index.sample(rng) as u32),
        Err(e) => bail!("cannot sample from this distribution: {e}"),
    }
}

/// norm(max(0, p − q)): where rejection sampling draws its correction. Falls back to `p`
/// when p ≤ q everywhere (only when p = q, where a rejection cannot happen in exact maths).
pub fn residual(p: &[f32], q: &[f32]) -> Vec<f32> {
    let residual: Vec<f32> = p.iter().zip(q).map(|(p, q)| (p - q).max(0.0)).collect();
    if residual.iter().any(|&r| r > 0.0) {
        residual
    } else {
        p.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(temperature: f64) -> SamplingSettings {
        SamplingSettings {
            temperature: Some(temperature),
            ..Default::default()
        }
    }

    #[test]
    fn softmax_matches_hand_computed_values() {
        let p = probabilities(&[0.0, (3.0f32).ln()], &sampled(1.0));
        assert!(
            (p[0] - 0.25).abs() < 1e-6 && (p[1] - 0.75).abs() < 1e-6,
            "{p:?}"
        );
    }

    #[test]
    fn temperature_sharpens() {
        // T = 0.5 squares the odds: 3:1 becomes 9:1.
        let p = probabilities(&[0.0, (3.0f32).ln()], &sampled(0.5));
        assert!((p[1] - 0.9).abs() < 1e-6, "{p:?}");
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert!(
            got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6),
            "{got:?} vs {want:?}"
        );
    }

    #[test]
    fn top_k_and_top_p_keep_the_head() {
        let logits = [4.0f32, 3.0, 2.0, 1.0].map(|x| x.ln());
        let top_k = SamplingSettings {
            top_k: Some(2),
            ..sampled(1.0)
        };
        assert_close(
            &probabilities(&logits, &top_k),
            &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0],
        );
        // 0.4 + 0.3 = 0.7 reaches top_p = 0.65.
        let top_p = SamplingSettings {
            top_p: Some(0.65),
            ..sampled(1.0)
        };
        assert_close(
            &probabilities(&logits, &top_p),
            &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0],
        );
    }

    /// The kept head found without a full sort is the full sort's, ties included, for every
    /// top-k / top-p, including a top-p prefix longer than the first selection.
    #[test]
    fn the_kept_head_is_a_full_sorts() {
        use rand::{rngs::StdRng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(7);
        // Few distinct values, so ties are everywhere; one flat tail so top-p runs long.
        let mut probs: Vec<f32> = (0..5000).map(|_| (rng.random_range(0..40) as f32).powi(3)).collect();
        probs.iter_mut().take(1000).for_each(|p| *p = 1.0);
        normalise(&mut probs);
        let mut full: Vec<usize> = (0..probs.len()).collect();
        full.sort_unstable_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        for (top_k, top_p) in [(None, Some(0.5)), (None, Some(0.95)), (None, Some(0.999_999)), (Some(7), None), (Some(300), Some(0.9)), (Some(3), Some(0.99))] {
            let limit = top_k.unwrap_or(probs.len());
            let mut mass = 0.0f64;
            let want = top_p
                .and_then(|p| full.iter().take(limit).position(|&t| {
                    mass += probs[t] as f64;
                    mass >= p
                }))
                .map_or(limit, |rank| rank + 1);
            let got = ranked_head(&probs, top_k, top_p);
            assert_eq!(got.keep, want, "top_k {top_k:?} top_p {top_p:?}");
            assert_eq!(&got.tokens[..got.keep], &full[..want], "top_k {top_k:?} top_p {top_p:?}");
        }
    }

    #[test]
    fn masked_logits_get_zero_probability() {
        let p = probabilities(&[f32::NEG_INFINITY, 0.0, 0.0], &sampled(1.0));
        assert_eq!(p, vec![0.0, 0.5, 0.5]);
    }

    #[test]
    fn residual_is_the_positive_part() {
        assert_eq!(
            residual(&[0.5, 0.5, 0.0], &[0.25, 0.5, 0.25]),
            vec![0.25, 0.0, 0.0]
        );
        assert_eq!(residual(&[0.5, 0.5], &[0.5, 0.5]), vec![0.5, 0.5]);
    }

    #[test]
    fn argmax_takes_the_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }
}
