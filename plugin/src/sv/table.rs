//! The acceptance table: the target's acceptance probability β of a draft, looked up from the
//! companion's indicators (S, A). Fitted once on profiling runs of plain speculation (every
//! drafted position records S, A and the target's α); static afterwards (SV spec §2.4).
//!
//! Bins hold equal numbers of observations per axis (marginal quantiles, a product grid). A
//! cell with fewer than `min_count` observations falls back to its S bin's mean, and that to
//! the overall mean. A has a point mass at 1 (wherever c(x) ≥ q(x)); repeated quantile edges
//! are dropped, so that mass gets a bin of its own and no bin is empty by construction.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use verdict_heads::ModelFingerprint;

/// One drafted position of a profiling run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// S of the draft and companion distributions.
    pub s: f32,
    /// A of the drafted token.
    pub a: f32,
    /// The target's acceptance probability of the drafted token: min(1, p(x)/q(x)), or
    /// 1 / 0 for kept / refused under greedy decoding.
    pub alpha: f32,
}

/// What a table was fitted for; a table is refused for other models.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TableOrigin {
    pub target: String,
    pub draft: String,
    pub companion: String,
    pub dataset: String,
    /// Drafts per step in the profiling runs.
    pub gamma: usize,
    /// The target the table was profiled with; a table is refused for another.
    #[serde(default)]
    pub target_fingerprint: Option<ModelFingerprint>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceTable {
    pub origin: TableOrigin,
    /// Interior bin edges, ascending: a value v falls in the bin counting the edges ≤ v.
    pub s_edges: Vec<f32>,
    pub a_edges: Vec<f32>,
    /// Mean α per (S bin, A bin), row-major by S bin.
    pub beta: Vec<f32>,
    pub count: Vec<u32>,
    /// Mean α per S bin alone: the fallback of thin cells, and the β that `exact` SV uses
    /// for a draft before it is sampled.
    pub beta_by_s: Vec<f32>,
    pub count_by_s: Vec<u32>,
    /// Mean α over every observation.
    pub overall: f32,
    /// Cells (and S bins) with fewer observations fall back.
    pub min_count: u32,
}

/// Interior edges splitting `values` into at most `bins` bins of near-equal counts.
fn quantile_edges(values: &[f32], bins: usize) -> Vec<f32> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f32::total_cmp);
    let n = sorted.len();
    let mut edges: Vec<f32> = (1..bins).map(|k| sorted[k * n / bins]).collect();
    edges.dedup();
    // An edge at the smallest value would leave the bin below it empty.
    edges.retain(|&e| e > sorted[0]);
    edges
}

fn bin_of(edges: &[f32], v: f32) -> usize {
    edges.partition_point(|&e| e <= v)
}

fn mean(sum: f64, count: u32) -> f32 {
    if count == 0 {
        0.0
    } else {
        (sum / count as f64) as f32
    }
}

impl AcceptanceTable {
    /// Fits the table: `s_bins` × `a_bins` quantile bins (fewer where values repeat).
    pub fn fit(
        observations: &[Observation],
        s_bins: usize,
        a_bins: usize,
        min_count: u32,
        origin: TableOrigin,
    ) -> Result<Self> {
        ensure!(!observations.is_empty(), "no profiling observations to fit an acceptance table on");
        ensure!(s_bins >= 1 && a_bins >= 1, "s_bins and a_bins must be at least 1 (got {s_bins}, {a_bins})");
        for o in observations {
            ensure!(
                [o.s, o.a, o.alpha].iter().all(|v| (0.0..=1.0).contains(v)),
                "observation outside [0, 1]: {o:?}"
            );
        }
        let s: Vec<f32> = observations.iter().map(|o| o.s).collect();
        let a: Vec<f32> = observations.iter().map(|o| o.a).collect();
        let (s_edges, a_edges) = (quantile_edges(&s, s_bins), quantile_edges(&a, a_bins));
        let (ns, na) = (s_edges.len() + 1, a_edges.len() + 1);
        let (mut sum, mut count) = (vec![0f64; ns * na], vec![0u32; ns * na]);
        let (mut sum_s, mut count_s) = (vec![0f64; ns], vec![0u32; ns]);
        let mut total = 0f64;
        for o in observations {
            let (i, j) = (bin_of(&s_edges, o.s), bin_of(&a_edges, o.a));
            sum[i * na + j] += o.alpha as f64;
            count[i * na + j] += 1;
            sum_s[i] += o.alpha as f64;
            count_s[i] += 1;
            total += o.alpha as f64;
        }
        Ok(Self {
            origin,
            beta: sum.iter().zip(&count).map(|(&s, &c)| mean(s, c)).collect(),
            beta_by_s: sum_s.iter().zip(&count_s).map(|(&s, &c)| mean(s, c)).collect(),
            count,
            count_by_s: count_s,
            overall: (total / observations.len() as f64) as f32,
            s_edges,
            a_edges,
            min_count,
        })
    }

    /// β for a draft with indicators (S, A): its cell, or the fallbacks of thin cells.
    pub fn beta(&self, s: f32, a: f32) -> f32 {
        let (i, j) = (bin_of(&self.s_edges, s), bin_of(&self.a_edges, a));
        let cell = i * (self.a_edges.len() + 1) + j;
        if self.count[cell] >= self.min_count {
            self.beta[cell]
        } else {
            self.beta_by_s(s)
        }
    }

    /// The S bin holding `s`, counted from 0.
    pub fn bin_of_s(&self, s: f32) -> usize {
        bin_of(&self.s_edges, s)
    }

    /// β from S alone: what is known of a draft before it is sampled.
    pub fn beta_by_s(&self, s: f32) -> f32 {
        let i = self.bin_of_s(s);
        if self.count_by_s[i] >= self.min_count {
            self.beta_by_s[i]
        } else {
            self.overall
        }
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let table: Self = serde_json::from_str(&text)
            .with_context(|| format!("{} is not an SV acceptance table", path.display()))?;
        let cells = (table.s_edges.len() + 1) * (table.a_edges.len() + 1);
        ensure!(
            table.beta.len() == cells
                && table.count.len() == cells
                && table.beta_by_s.len() == table.s_edges.len() + 1
                && table.count_by_s.len() == table.s_edges.len() + 1,
            "{}: the table's cells do not match its bin edges",
            path.display()
        );
        Ok(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(s: f32, a: f32, alpha: f32) -> Observation {
        Observation { s, a, alpha }
    }

    #[test]
    fn quantile_edges_give_near_equal_counts() {
        let values: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 / 1000.0).collect();
        let edges = quantile_edges(&values, 10);
        assert_eq!(edges.len(), 9);
        let mut counts = [0usize; 10];
        for &v in &values {
            counts[bin_of(&edges, v)] += 1;
        }
        assert!(counts.iter().all(|&c| c == 100), "{counts:?}");
    }

    #[test]
    fn a_point_mass_at_one_gets_its_own_bin() {
        // 60 % of A at exactly 1: repeated edges are dropped, 1 sits alone in the last bin.
        let mut values: Vec<f32> = (0..40).map(|i| i as f32 / 40.0).collect();
        values.extend(std::iter::repeat_n(1.0, 60));
        let edges = quantile_edges(&values, 10);
        assert_eq!(*edges.last().unwrap(), 1.0);
        assert!(edges.windows(2).all(|w| w[0] < w[1]), "{edges:?}");
        let last = edges.len();
        assert_eq!(values.iter().filter(|&&v| bin_of(&edges, v) == last).count(), 60);
        assert!((0..=last).all(|b| values.iter().any(|&v| bin_of(&edges, v) == b)), "an empty bin");
    }

    #[test]
    fn boundary_values_land_in_the_upper_bin() {
        let edges = [0.25, 0.5, 0.75];
        assert_eq!(bin_of(&edges, 0.0), 0);
        assert_eq!(bin_of(&edges, 0.2499), 0);
        assert_eq!(bin_of(&edges, 0.25), 1);
        assert_eq!(bin_of(&edges, 0.75), 3);
        assert_eq!(bin_of(&edges, 1.0), 3);
    }

    #[test]
    fn fitting_recovers_a_known_beta() {
        // α is kept with probability β(S, A) = S·A, drawn deterministically per cell.
        let mut observations = Vec::new();
        for i in 0..40 {
            for j in 0..40 {
                let (s, a) = ((i as f32 + 0.5) / 40.0, (j as f32 + 0.5) / 40.0);
                observations.push(obs(s, a, s * a));
            }
        }
        let table = AcceptanceTable::fit(&observations, 4, 4, 1, TableOrigin::default()).unwrap();
        // The cell of S, A in [0.5, 0.75) has mean S·A = 0.625² ≈ 0.39 (means of the centres).
        let beta = table.beta(0.6, 0.6);
        assert!((beta - 0.625 * 0.625).abs() < 0.01, "{beta}");
        assert!(table.beta(0.9, 0.9) > table.beta(0.1, 0.9));
        assert!(table.beta(0.9, 0.9) > table.beta(0.9, 0.1));
        assert!((table.overall - 0.25).abs() < 0.01, "{}", table.overall);
    }

    #[test]
    fn thin_cells_fall_back_to_their_s_bin_then_to_the_overall_mean() {
        let mut observations: Vec<Observation> = (0..50).map(|i| obs(0.1, i as f32 / 100.0, 0.2)).collect();
        observations.extend((0..50).map(|i| obs(0.9, 0.5 + i as f32 / 100.0, 0.8)));
        observations.push(obs(0.9, 0.0, 0.0)); // alone in its cell
        let table = AcceptanceTable::fit(&observations, 2, 2, 5, TableOrigin::default()).unwrap();
        // The lone (0.9, 0.0) cell has 1 observation: its S bin's mean (50×0.8 + 0)/51 instead.
        assert!((table.beta(0.9, 0.0) - 40.0 / 51.0).abs() < 1e-5, "{}", table.beta(0.9, 0.0));
        // With every bin too thin, the overall mean.
        let thin = AcceptanceTable::fit(&observations[..3], 2, 2, 5, TableOrigin::default()).unwrap();
        assert_eq!(thin.beta(0.1, 0.0), thin.overall);
    }

    #[test]
    fn json_round_trip_keeps_the_table() {
        let observations: Vec<Observation> =
            (0..200).map(|i| obs((i % 17) as f32 / 17.0, (i % 11) as f32 / 11.0, (i % 2) as f32)).collect();
        let origin = TableOrigin { target: "t".into(), draft: "d".into(), companion: "c".into(), dataset: "gsm8k".into(), gamma: 5, target_fingerprint: None };
        let table = AcceptanceTable::fit(&observations, 5, 4, 3, origin).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sv_table.json");
        table.save(&path).unwrap();
        assert_eq!(AcceptanceTable::load(&path).unwrap(), table);
    }

    #[test]
    fn bad_inputs_are_refused_with_the_value() {
        let err = AcceptanceTable::fit(&[obs(1.5, 0.5, 1.0)], 2, 2, 1, TableOrigin::default()).unwrap_err();
        assert!(err.to_string().contains("1.5"), "{err}");
        assert!(AcceptanceTable::fit(&[], 2, 2, 1, TableOrigin::default()).is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        std::fs::write(&path, "{\"nonsense\": 1}").unwrap();
        assert!(format!("{:#}", AcceptanceTable::load(&path).unwrap_err()).contains("not an SV acceptance table"));
    }
}
