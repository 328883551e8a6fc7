//! T_v learned while decoding, from the steps this machine actually runs. A verify row's
//! price differs several-fold between CPUs (docs/throughput.md), so a table measured
//! elsewhere makes SV verify too many drafts or too few; learned, `[sv]` works on any machine without a profile.
//!
//! Each step's time, from the start of its drafting to the head's next observation (drafts,
//! verify, accept rule), is a sample for its verify's row count. The estimate for a measured
//! count n is the prior's T_v(n), rescaled to this machine by the mean ratio of samples to
//! prior and counted as `prior_weight` samples, averaged with the samples of n rows; older
//! samples fade (`memory` per sample), so context growth and load changes are followed.
//! Counts never measured keep the prior's shape, scaled as the measured counts around them.
//! Which drafts are verified still depends only on earlier steps and the head's confidence,
//! never on the drafts: sampling stays exact.

use std::collections::BTreeMap;

use anyhow::{ensure, Result};

use crate::verify_latency::VerifyLatency;

/// A weighted mean whose old samples fade.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Fading {
    sum: f64,
    weight: f64,
}

impl Fading {
    fn add(&mut self, value: f64, memory: f64) {
        self.sum = self.sum * memory + value;
        self.weight = self.weight * memory + 1.0;
    }

    fn mean(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.sum / self.weight)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LearnedLatency {
    prior: VerifyLatency,
    prior_weight: f64,
    memory: f64,
    /// Samples / prior, over all row counts: how this machine compares with the prior.
    scale: Fading,
    by_rows: BTreeMap<usize, Fading>,
    /// The estimate, refitted after each sample.
    current: VerifyLatency,
    /// Samples taken (bad ones ignored, clipped ones counted).
    samples: u64,
}

/// Samples the prior counts as at each row count.
pub const DEFAULT_PRIOR_WEIGHT: f64 = 3.0;
/// Each sample's weight falls by this factor with every later sample of its row count.
pub const DEFAULT_MEMORY: f64 = 0.97;
/// Row counts always estimated (the rescaled prior's shape past the measured ones).
const MIN_ROWS_ESTIMATED: usize = 8;
/// A sample further than this factor from the estimate (once it has samples) is clipped to
/// it: a step that shared the cores with something else must not move T_v far.
const OUTLIER_FACTOR: f64 = 3.0;

impl LearnedLatency {
    pub fn new(prior: VerifyLatency, prior_weight: f64, memory: f64) -> Result<Self> {
        ensure!(prior_weight.is_finite() && prior_weight > 0.0, "T_v prior weight must be > 0, got {prior_weight}");
        ensure!((0.0..=1.0).contains(&memory) && memory > 0.0, "T_v memory must be in (0, 1], got {memory}");
        Ok(Self { current: prior.clone(), prior, prior_weight, memory, scale: Fading::default(), by_rows: BTreeMap::new(), samples: 0 })
    }

    /// Learning from [`VerifyLatency::generic_prior`] with the default weights.
    pub fn without_prior() -> Self {
        Self::new(VerifyLatency::generic_prior(), DEFAULT_PRIOR_WEIGHT, DEFAULT_MEMORY).expect("valid defaults")
    }

    /// A step whose verify had `rows` rows took `ms` milliseconds.
    pub fn record(&mut self, rows: usize, ms: f64) {
        if rows == 0 || !ms.is_finite() || ms <= 0.0 {
            return;
        }
        let seen = self.by_rows.get(&rows).is_some_and(|f| f.weight >= 1.0);
        let ms = match seen {
            true => {
                let expected = self.current.at(rows);
                ms.clamp(expected / OUTLIER_FACTOR, expected * OUTLIER_FACTOR)
            }
            false => ms,
        };
        self.scale.add(ms / self.prior.at(rows), self.memory);
        self.by_rows.entry(rows).or_default().add(ms, self.memory);
        self.current = self.fit();
        self.samples += 1;
    }

    /// Samples taken so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// T_v as learned so far (the prior until the first sample).
    pub fn current(&self) -> &VerifyLatency {
        &self.current
    }

    /// The row counts sampled so far.
    pub fn row_counts_seen(&self) -> Vec<usize> {
        self.by_rows.keys().copied().collect()
    }

    fn fit(&self) -> VerifyLatency {
        let scale = self.scale.mean().unwrap_or(1.0);
        // Measured counts: the rescaled prior and their samples, and what that is to the prior.
        let ratios: Vec<(usize, f64)> = self
            .by_rows
            .iter()
            .map(|(&n, seen)| {
                let prior = self.prior.at(n);
                (n, (self.prior_weight * scale * prior + seen.sum) / (self.prior_weight + seen.weight) / prior)
            })
            .collect();
        let widest = ratios.last().map_or(1, |r| r.0).max(MIN_ROWS_ESTIMATED);
        // Other counts keep the prior's shape, scaled as their measured neighbours are.
        let points: Vec<(usize, f64)> = (1..=widest).map(|n| (n, self.prior.at(n) * ratio_at(&ratios, n, scale))).collect();
        VerifyLatency::fit(&points).expect("positive estimates")
    }
}

/// The ratio at `n`, linear between the measured counts around it, the nearest one's past
/// either end, `scale` with none measured.
fn ratio_at(ratios: &[(usize, f64)], n: usize, scale: f64) -> f64 {
    let k = ratios.partition_point(|&(m, _)| m < n);
    match (k.checked_sub(1).map(|i| ratios[i]), ratios.get(k)) {
        (_, Some(&(m, r))) if m == n => r,
        (Some((m0, r0)), Some(&(m1, r1))) => r0 + (r1 - r0) * (n - m0) as f64 / (m1 - m0) as f64,
        (Some((_, r)), None) | (None, Some(&(_, r))) => r,
        (None, None) => scale,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn before_any_sample_it_is_the_prior() {
        let prior = VerifyLatency::fit(&[(1, 40.0), (5, 60.0)]).unwrap();
        let learned = LearnedLatency::new(prior.clone(), 3.0, 1.0).unwrap();
        for n in 1..12 {
            assert!(close(learned.current().at(n), prior.at(n)), "{n} rows");
        }
    }

    #[test]
    fn one_sample_rescales_every_count_and_weighs_against_the_prior_where_taken() {
        // Prior: 40 ms + 5 ms a row. One step of 3 rows took 100 ms, twice the prior's 50.
        let mut learned = LearnedLatency::new(VerifyLatency::linear(40.0, 5.0), 3.0, 1.0).unwrap();
        learned.record(3, 100.0);
        assert_eq!(learned.samples(), 1);
        let t = learned.current();
        // Unmeasured counts: the prior doubled.
        assert!(close(t.at(1), 80.0), "{}", t.at(1));
        assert!(close(t.at(5), 120.0), "{}", t.at(5));
        // 3 rows: (3 · 100 + 100) / (3 + 1).
        assert!(close(t.at(3), 100.0));
    }

    #[test]
    fn samples_teach_a_shape_the_prior_did_not_have() {
        // The prior says rows are nearly free; this machine pays 20 ms a row.
        let mut learned = LearnedLatency::new(VerifyLatency::linear(50.0, 1.0), 3.0, 1.0).unwrap();
        for _ in 0..200 {
            for rows in [1, 3, 5] {
                learned.record(rows, 30.0 + 20.0 * rows as f64);
            }
        }
        let t = learned.current();
        for (rows, truth) in [(1, 50.0), (3, 90.0), (5, 130.0)] {
            assert!((t.at(rows) - truth).abs() < 0.05 * truth, "{rows} rows: {} against {truth}", t.at(rows));
        }
        assert!(t.at(5) / t.at(1) > 2.4, "a 5-row verify now costs {}× one", t.at(5) / t.at(1));
        // Between and past the measured counts, the prior's shape scaled as its neighbours.
        let ratio = |n: usize| t.at(n) / (50.0 + (n - 1) as f64);
        assert!((ratio(2) - (ratio(1) + ratio(3)) / 2.0).abs() < 1e-9);
        assert!((ratio(8) - ratio(5)).abs() < 1e-9 && t.at(8) > t.at(5));
        assert_eq!(learned.row_counts_seen(), vec![1, 3, 5]);
    }

    #[test]
    fn ratios_interpolate_between_measured_counts_and_hold_past_them() {
        let ratios = [(2, 1.0), (6, 3.0)];
        assert_eq!(ratio_at(&ratios, 2, 9.0), 1.0);
        assert_eq!(ratio_at(&ratios, 3, 9.0), 1.5);
        assert_eq!(ratio_at(&ratios, 1, 9.0), 1.0);
        assert_eq!(ratio_at(&ratios, 10, 9.0), 3.0);
        assert_eq!(ratio_at(&[], 4, 9.0), 9.0);
    }

    #[test]
    fn old_samples_fade() {
        let mut learned = LearnedLatency::new(VerifyLatency::linear(50.0, 5.0), 1.0, 0.9).unwrap();
        for _ in 0..100 {
            learned.record(2, 60.0);
        }
        // The machine got slower (a longer context, a busier core): 90 ms, within the outlier bound.
        for _ in 0..60 {
            learned.record(2, 90.0);
        }
        assert!((learned.current().at(2) - 90.0).abs() < 1.0, "{}", learned.current().at(2));
    }

    #[test]
    fn an_outlier_is_clipped_and_bad_samples_ignored() {
        let mut learned = LearnedLatency::new(VerifyLatency::linear(50.0, 0.0), 1.0, 1.0).unwrap();
        learned.record(1, 50.0);
        learned.record(1, 5000.0);
        // Clipped to 3 × 50: (1 · 50 · scale + 50 + 150) / 3 with scale = (1 + 3) / 2.
        assert!(close(learned.current().at(1), (100.0 + 200.0) / 3.0), "{}", learned.current().at(1));
        let before = learned.clone();
        learned.record(0, 10.0);
        learned.record(2, f64::NAN);
        learned.record(2, -1.0);
        assert_eq!(learned, before);
        assert_eq!(learned.samples(), 2);
    }

    #[test]
    fn estimates_never_fall_with_more_rows() {
        let mut learned = LearnedLatency::without_prior();
        learned.record(4, 40.0);
        learned.record(2, 80.0);
        let t = learned.current();
        for rows in 1..20 {
            assert!(t.at(rows + 1) >= t.at(rows), "{rows} rows");
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        let prior = VerifyLatency::linear(50.0, 5.0);
        assert!(LearnedLatency::new(prior.clone(), 0.0, 0.9).is_err());
        assert!(LearnedLatency::new(prior.clone(), 1.0, 0.0).is_err());
        assert!(LearnedLatency::new(prior, 1.0, 1.5).is_err());
    }
}
