//! Paired comparison of a decoding mode with plain decoding on the same problems: which
//! answers changed for better and for worse, whether that is more than chance (exact
//! McNemar test), and a bootstrap interval of the accuracy difference.
//!
//! Both runs of a problem share its difficulty, so the paired test sees a one-problem change
//! that two separate accuracies hide in their sampling noise.

use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// One problem decoded both ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    pub plain_correct: bool,
    pub mode_correct: bool,
    /// Both committed to the same answer, or neither committed to one.
    pub same_answer: bool,
}

/// A mode against plain decoding over the problems both ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairedStats {
    pub problems: usize,
    /// Plain wrong, mode right.
    pub better: usize,
    /// Plain right, mode wrong.
    pub worse: usize,
    /// Mode accuracy minus plain accuracy, as a fraction.
    pub accuracy_difference: f64,
    /// Percentile bootstrap interval of `accuracy_difference` (problems resampled).
    pub difference_ci95: (f64, f64),
    /// Two-sided exact McNemar p-value (binomial test on the discordant pairs).
    pub mcnemar_p: f64,
    /// Share of problems whose committed answer is the same as plain decoding's.
    pub agreement: f64,
}

/// Resamples of the bootstrap; fixed so reports are reproducible.
pub const BOOTSTRAP_RESAMPLES: usize = 10_000;
const BOOTSTRAP_SEED: u64 = 0x5eed;

pub fn paired_stats(pairs: &[Pair]) -> PairedStats {
    let n = pairs.len();
    let better = pairs.iter().filter(|p| p.mode_correct && !p.plain_correct).count();
    let worse = pairs.iter().filter(|p| !p.mode_correct && p.plain_correct).count();
    let differences: Vec<i8> = pairs
        .iter()
        .map(|p| p.mode_correct as i8 - p.plain_correct as i8)
        .collect();
    PairedStats {
        problems: n,
        better,
        worse,
        accuracy_difference: mean(&differences),
        difference_ci95: bootstrap_interval(&differences, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED),
        mcnemar_p: mcnemar_exact(better, worse),
        agreement: pairs.iter().filter(|p| p.same_answer).count() as f64 / n.max(1) as f64,
    }
}

fn mean(values: &[i8]) -> f64 {
    values.iter().map(|&v| v as f64).sum::<f64>() / values.len().max(1) as f64
}

/// Exact two-sided McNemar test: under "no difference" each of the `b + c` discordant
/// pairs goes either way with probability ½, so p = min(1, 2·P[Binomial(b + c, ½) ≤ min(b, c)]).
pub fn mcnemar_exact(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    // ln C(n, i) accumulated term by term keeps large n finite.
    let ln_half_n = n as f64 * 0.5f64.ln();
    let mut ln_choose = 0.0f64;
    let mut tail = 0.0f64;
    for i in 0..=b.min(c) {
        if i > 0 {
            ln_choose += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_choose + ln_half_n).exp();
    }
    (2.0 * tail).min(1.0)
}

/// 95 % percentile interval of the mean of `differences` over `resamples` bootstrap
/// resamples (problems drawn with replacement), seeded.
pub fn bootstrap_interval(differences: &[i8], resamples: usize, seed: u64) -> (f64, f64) {
    let n = differences.len();
    if n == 0 || resamples == 0 {
        return (0.0, 0.0);
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut means: Vec<f64> = (0..resamples)
        .map(|_| {
            let sum: i64 = (0..n)
                .map(|_| differences[rng.random_range(0..n)] as i64)
                .sum();
            sum as f64 / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * resamples as f64) as usize).min(resamples - 1)];
    (at(0.025), at(0.975))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(both: usize, better: usize, worse: usize, neither: usize) -> Vec<Pair> {
        let pair = |plain_correct, mode_correct| Pair {
            plain_correct,
            mode_correct,
            same_answer: plain_correct == mode_correct,
        };
        std::iter::repeat_n(pair(true, true), both)
            .chain(std::iter::repeat_n(pair(false, true), better))
            .chain(std::iter::repeat_n(pair(true, false), worse))
            .chain(std::iter::repeat_n(pair(false, false), neither))
            .collect()
    }

    #[test]
    fn mcnemar_matches_hand_computed_binomial_tails() {
        // b = 1, c = 9: 2 · (1 + 10) / 2^10 = 22 / 1024.
        assert!((mcnemar_exact(1, 9) - 22.0 / 1024.0).abs() < 1e-12);
        // b = 2, c = 5: 2 · (1 + 7 + 21) / 128 = 58 / 128.
        assert!((mcnemar_exact(2, 5) - 58.0 / 128.0).abs() < 1e-12);
        // Symmetric, and a balanced table is no evidence at all.
        assert_eq!(mcnemar_exact(9, 1), mcnemar_exact(1, 9));
        assert_eq!(mcnemar_exact(4, 4), 1.0);
        // b = 0, c = 6: 2 / 64.
        assert!((mcnemar_exact(0, 6) - 2.0 / 64.0).abs() < 1e-12);
    }

    #[test]
    fn mcnemar_stays_finite_for_many_discordant_pairs() {
        let p = mcnemar_exact(500, 620);
        assert!(p > 0.0 && p < 0.001, "{p}");
    }

    #[test]
    fn zero_discordant_pairs_give_no_difference() {
        let stats = paired_stats(&pairs(30, 0, 0, 20));
        assert_eq!((stats.better, stats.worse), (0, 0));
        assert_eq!(stats.mcnemar_p, 1.0);
        assert_eq!(stats.accuracy_difference, 0.0);
        assert_eq!(stats.difference_ci95, (0.0, 0.0));
        assert_eq!(stats.agreement, 1.0);
    }

    #[test]
    fn counts_and_difference_from_a_known_table() {
        let stats = paired_stats(&pairs(20, 2, 6, 22));
        assert_eq!(stats.problems, 50);
        assert_eq!((stats.better, stats.worse), (2, 6));
        assert!((stats.accuracy_difference - (-4.0 / 50.0)).abs() < 1e-12);
        assert!((stats.mcnemar_p - 2.0 * (1.0 + 8.0 + 28.0) / 256.0).abs() < 1e-12);
        assert!((stats.agreement - 42.0 / 50.0).abs() < 1e-12);
    }

    #[test]
    fn bootstrap_interval_contains_the_point_estimate() {
        let stats = paired_stats(&pairs(20, 2, 6, 22));
        let (lo, hi) = stats.difference_ci95;
        assert!(lo < stats.accuracy_difference && stats.accuracy_difference < hi, "{lo} {hi}");
        // Normal approximation by hand: differences are +1 (2×), −1 (6×), 0 (42×), mean −0.08,
        // variance 8/50 − 0.08² = 0.1536, standard error √(0.1536/50) = 0.0554, so
        // −0.08 ± 1.96·0.0554 = (−0.189, 0.029); the percentile interval lands near it.
        assert!((lo + 0.189).abs() < 0.03 && (hi - 0.029).abs() < 0.03, "{lo} {hi}");
    }

    #[test]
    fn bootstrap_is_reproducible() {
        let d = [1i8, 0, -1, -1, 0, 0, 1, -1];
        assert_eq!(bootstrap_interval(&d, 2000, 7), bootstrap_interval(&d, 2000, 7));
    }
}
