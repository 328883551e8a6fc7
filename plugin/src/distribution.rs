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

/// Tokens whose logit is this many temperature-scaled nats below the best get probability 0:
/// a whole vocabulary of them weighs under 1e-12 of the sum, below f32's rounding of it, so
/// the distribution is the full softmax's to the last bit that f32 keeps.
const NEGLIGIBLE_NATS: f32 = 40.0;

/// Probabilities of sampling each token from `logits` under `sampling` (`temperature` must
/// be set; greedy decoding never needs a distribution). Masked (−∞) and NaN logits get 0.
///
/// Rows are as long as the vocabulary and this runs for every drafted and verified token
/// when sampling, so only the tokens that can carry probability are visited after one scan
/// (a head's draft row has a few thousand among the whole vocabulary), and the top-k / top-p
/// head is found among the few tokens above a probability floor, without a full sort.
pub fn probabilities(logits: &[f32], sampling: &SamplingSettings) -> Vec<f32> {
    let temperature = sampling.temperature.unwrap_or(1.0) as f32;
    // Softmax in f32 with the max subtracted.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let floor = max - NEGLIGIBLE_NATS * temperature;
    let mut support: Vec<usize> = (0..logits.len()).filter(|&t| logits[t] >= floor).collect();
    let mut probs = vec![0.0f32; logits.len()];
    for &t in &support {
        probs[t] = ((logits[t] - max) / temperature).exp();
    }
    normalise(&mut probs, &support);
    if sampling.top_k.is_some() || sampling.top_p.is_some() {
        let kept = ranked_head(&probs, &support, sampling.top_k, sampling.top_p);
        let mut head = vec![0.0f32; probs.len()];
        for &token in &kept {
            head[token] = probs[token];
        }
        probs = head;
        support = kept;
    }
    if let Some(min_p) = sampling.min_p {
        let floor = support.iter().map(|&t| probs[t]).fold(0.0, f32::max) * min_p as f32;
        for &t in &support {
            if probs[t] < floor {
                probs[t] = 0.0;
            }
        }
    }
    normalise(&mut probs, &support);
    probs
}

/// The tokens of `support` (every token with probability) that top-k / top-p keep, in rank
/// order (most probable first, ties to the lower id), exactly as a sort of the whole
/// vocabulary would give them.
///
/// The tokens at or above a probability floor are a prefix of that ranking, so only they are
/// sorted; the floor drops until the prefix holds the top-p mass or top-k tokens (or is
/// everything).
fn ranked_head(probs: &[f32], support: &[usize], top_k: Option<usize>, top_p: Option<f64>) -> Vec<usize> {
    let by_rank = |a: &usize, b: &usize| probs[*b].total_cmp(&probs[*a]).then(a.cmp(b));
    let limit = top_k.unwrap_or(support.len()).min(support.len());
    if limit == 0 {
        return Vec::new();
    }
    let best = support.iter().map(|&t| probs[t]).fold(0.0f32, f32::max);
    let mut floor = best / 4096.0;
    loop {
        let mut prefix: Vec<usize> = support.iter().copied().filter(|&t| probs[t] >= floor).collect();
        prefix.sort_unstable_by(by_rank);
        // The smallest prefix whose mass reaches top_p.
        let mut mass = 0.0f64;
        let reached = top_p.and_then(|top_p| {
            prefix.iter().take(limit).position(|&token| {
                mass += probs[token] as f64;
                mass >= top_p
            })
        });
        let keep = match reached {
            Some(rank) => Some(rank + 1),
            None if prefix.len() >= limit || floor == 0.0 => Some(limit.min(prefix.len())),
            None => None,
        };
        if let Some(keep) = keep {
            prefix.truncate(keep);
            return prefix;
        }
        // Below 2^-126 the next floor would be subnormal: take every token instead.
        floor = if floor > f32::MIN_POSITIVE * 65536.0 { floor / 65536.0 } else { 0.0 };
    }
}

/// Scale the probabilities of `support` (the only non-zero ones) to sum to 1.
fn normalise(probs: &mut [f32], support: &[usize]) {
    let sum: f32 = support.iter().map(|&t| probs[t]).sum();
    if sum > 0.0 {
        support.iter().for_each(|&t| probs[t] /= sum);
    }
}

/// Draw a token with the given (unnormalised, non-negative) weights. Only the tokens with
/// weight are indexed: a truncated row has a few among the whole vocabulary. (NaN and
/// negative weights are indexed too, so that they are refused.)
pub fn sample(weights: &[f32], rng: &mut impl Rng) -> Result<u32> {
    let support: Vec<usize> = (0..weights.len()).filter(|&t| weights[t] != 0.0).collect();
    match WeightedIndex::new(support.iter().map(|&t| weights[t])) {
        Ok(index) => Ok(support[index.sample(rng)] as u32),
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
        let everything: Vec<usize> = (0..probs.len()).collect();
        normalise(&mut probs, &everything);
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
            let got = ranked_head(&probs, &everything, top_k, top_p);
            assert_eq!(got, &full[..want], "top_k {top_k:?} top_p {top_p:?}");
        }
    }

    /// A token 40 temperature-scaled nats below the best is dropped; one just above keeps
    /// its softmax probability (e^-39.9, which f32 holds).
    #[test]
    fn negligible_tokens_get_zero_probability() {
        let p = probabilities(&[0.0, -0.5 * 40.1, -0.5 * 39.9], &sampled(0.5));
        assert_eq!(p[1], 0.0);
        let want = (-39.9f32).exp();
        assert!((p[2] - want).abs() <= want * 1e-5, "{p:?}");
        assert!(p[0] > 0.999_999, "{p:?}");
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

    /// Only tokens with weight are drawn, at their rates, whatever their place in the row;
    /// rows with no weight, a negative or a NaN one are refused.
    #[test]
    fn samples_follow_the_weights_of_a_sparse_row() {
        use rand::{rngs::StdRng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(3);
        let mut weights = vec![0.0f32; 1000];
        weights[17] = 1.0;
        weights[998] = 3.0;
        let draws = 20_000;
        let mut late = 0;
        for _ in 0..draws {
            match sample(&weights, &mut rng).unwrap() {
                998 => late += 1,
                17 => {}
                other => panic!("drew token {other}, which has no weight"),
            }
        }
        // 0.75 expected; 5 standard deviations is 0.015.
        assert!((late as f64 / draws as f64 - 0.75).abs() < 0.015, "{late} of {draws}");
        assert!(sample(&[0.0, 0.0], &mut rng).is_err());
        assert!(sample(&[1.0, -0.5], &mut rng).is_err());
        assert!(sample(&[1.0, f32::NAN], &mut rng).is_err());
    }

    #[test]
    fn argmax_takes_the_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }
}

