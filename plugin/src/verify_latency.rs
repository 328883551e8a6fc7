//! T_v(n): what the target's verify forward over n rows costs on this machine. SV and the
//! combined proposer weigh a draft's expected gain against the time its row adds; on a CPU
//! the first rows are nearly free, then each costs about the same.
//!
//! Fitted from timings (`verdict forward-cost` measures them): the median per row count,
//! made non-decreasing (pool adjacent violators: a noisy dip must not make a longer verify
//! look cheaper), linear between measured counts and extended past the last one by the last
//! slope.

use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VerifyLatency {
    /// (rows, milliseconds), rows strictly ascending, milliseconds non-decreasing.
    points: Vec<(usize, f64)>,
}

impl VerifyLatency {
    /// Where learning starts with no table: a one-row verify of 50 ms and 15 % more per
    /// further row (a CPU's shape; the first samples rescale it to the machine).
    pub fn generic_prior() -> Self {
        Self::linear(50.0, 7.5)
    }

    /// From (rows, milliseconds) timings, any order, repeats allowed.
    pub fn fit(samples: &[(usize, f64)]) -> Result<Self> {
        ensure!(!samples.is_empty(), "no verify timings to fit T_v on");
        for &(rows, ms) in samples {
            ensure!(rows >= 1 && ms.is_finite() && ms > 0.0, "bad verify timing: {ms} ms for {rows} rows");
        }
        let mut rows: Vec<usize> = samples.iter().map(|s| s.0).collect();
        rows.sort_unstable();
        rows.dedup();
        let medians: Vec<(usize, f64)> = rows
            .iter()
            .map(|&n| {
                let mut ms: Vec<f64> = samples.iter().filter(|s| s.0 == n).map(|s| s.1).collect();
                ms.sort_by(f64::total_cmp);
                let m = ms.len();
                let median = if m % 2 == 1 { ms[m / 2] } else { (ms[m / 2 - 1] + ms[m / 2]) / 2.0 };
                (n, median)
            })
            .collect();
        Ok(Self { points: isotonic(&medians) })
    }

    /// `base` ms for one row and `per_row` ms for each further row.
    pub fn linear(base: f64, per_row: f64) -> Self {
        Self { points: vec![(1, base), (2, base + per_row)] }
    }

    /// The fitted (rows, milliseconds), rows ascending.
    pub fn points(&self) -> &[(usize, f64)] {
        &self.points
    }

    /// "1: 48.7, 2: 59.9, …" over the first `count` points, for logs.
    pub fn describe(&self, count: usize) -> String {
        let shown: Vec<String> = self.points.iter().take(count).map(|(n, ms)| format!("{n}: {ms:.1}")).collect();
        shown.join(", ")
    }

    /// Milliseconds of a verify over `rows` rows (at least one: the last committed token).
    pub fn at(&self, rows: usize) -> f64 {
        let rows = rows.max(1);
        let p = &self.points;
        if p.len() == 1 {
            return p[0].1;
        }
        // The segment holding `rows`, or the first / last one to extend.
        let k = p.partition_point(|&(n, _)| n <= rows).clamp(1, p.len() - 1);
        let ((n0, t0), (n1, t1)) = (p[k - 1], p[k]);
        let slope = (t1 - t0) / (n1 - n0) as f64;
        (t0 + slope * (rows as f64 - n0 as f64)).max(p[0].1)
    }
}

/// Pool adjacent violators: the closest non-decreasing sequence (equal weights per point).
fn isotonic(points: &[(usize, f64)]) -> Vec<(usize, f64)> {
    // Blocks of (sum, count) whose means increase.
    let mut blocks: Vec<(f64, usize)> = Vec::new();
    for &(_, t) in points {
        blocks.push((t, 1));
        while blocks.len() > 1 {
            let (s1, c1) = blocks[blocks.len() - 1];
            let (s0, c0) = blocks[blocks.len() - 2];
            if s0 / c0 as f64 <= s1 / c1 as f64 {
                break;
            }
            blocks.pop();
            *blocks.last_mut().unwrap() = (s0 + s1, c0 + c1);
        }
    }
    let means = blocks.iter().flat_map(|&(s, c)| std::iter::repeat_n(s / c as f64, c));
    points.iter().zip(means).map(|(&(n, _), t)| (n, t)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_between_and_extends_past_the_measured_counts() {
        let t = VerifyLatency::fit(&[(1, 34.6), (5, 41.8), (8, 59.0)]).unwrap();
        assert!((t.at(1) - 34.6).abs() < 1e-9);
        assert!((t.at(3) - (34.6 + 2.0 * 7.2 / 4.0)).abs() < 1e-9);
        assert!((t.at(8) - 59.0).abs() < 1e-9);
        // Past 8: the last slope, (59 − 41.8) / 3 a row.
        assert!((t.at(11) - (59.0 + 3.0 * 17.2 / 3.0)).abs() < 1e-9);
        assert!((t.at(0) - 34.6).abs() < 1e-9, "0 rows counts as one");
        assert_eq!(t.describe(2), "1: 34.6, 5: 41.8");
    }

    #[test]
    fn medians_are_taken_and_dips_pooled() {
        // Repeats per count: medians 10, 14 (a dip after 15 at 2 rows), 20.
        let t = VerifyLatency::fit(&[(1, 10.0), (1, 11.0), (1, 9.0), (2, 15.0), (3, 14.0), (4, 20.0)]).unwrap();
        assert_eq!(t.points, vec![(1, 10.0), (2, 14.5), (3, 14.5), (4, 20.0)]);
        for rows in 1..10 {
            assert!(t.at(rows + 1) >= t.at(rows), "T_v decreases after {rows} rows");
        }
    }

    #[test]
    fn linear_is_base_plus_rows() {
        let t = VerifyLatency::linear(30.0, 4.0);
        assert_eq!(t.at(1), 30.0);
        assert_eq!(t.at(6), 50.0);
    }

    #[test]
    fn bad_timings_are_refused() {
        assert!(VerifyLatency::fit(&[]).is_err());
        let err = VerifyLatency::fit(&[(0, 3.0)]).unwrap_err().to_string();
        assert!(err.contains("0 rows"), "{err}");
        assert!(VerifyLatency::fit(&[(2, f64::NAN)]).is_err());
    }
}
