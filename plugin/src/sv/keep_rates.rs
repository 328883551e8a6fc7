//! The chance the running judge stack keeps a draft of a given confidence, learned while
//! serving from the drafts already verified. SV prices a draft by that chance. The head's
//! confidence is calibrated for exact matching (`train-head sv-profile`: Brier 0.1440 raw
//! against 0.1448 with a fitted table), but a lossy stack (DropMatch, FSD) keeps more than
//! the target's own choice, and a profiled table knows only the stack it was profiled
//! under. Learning online prices drafts for the stack, prompts and head actually running.
//!
//! Each confidence bin starts from the confidence itself, weighted as `prior_weight`
//! drafts, so an empty bin says what the head says and a busy bin says what happened.
//! Whether a draft is verified depends only on earlier steps and the head's confidence,
//! never on the draft itself, so sampling stays exact.

use anyhow::{ensure, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct KeepRates {
    /// Per equal-width confidence bin: drafts verified that the chain reached, and kept.
    reached: Vec<f64>,
    kept: Vec<f64>,
    prior_weight: f64,
}

impl KeepRates {
    pub fn new(bins: usize, prior_weight: f64) -> Result<Self> {
        ensure!(bins >= 1, "keep-rate bins must be at least 1, got {bins}");
        ensure!(
            prior_weight.is_finite() && prior_weight > 0.0,
            "sv.keep_rate_prior_weight must be a number > 0 (drafts the head's own confidence counts as), got {prior_weight}"
        );
        Ok(Self { reached: vec![0.0; bins], kept: vec![0.0; bins], prior_weight })
    }

    fn bin(&self, confidence: f32) -> usize {
        let bins = self.reached.len();
        ((confidence.clamp(0.0, 1.0) * bins as f32) as usize).min(bins - 1)
    }

    /// A verified draft of `confidence` that the step's chain reached, and whether the
    /// stack kept it.
    pub fn record(&mut self, confidence: f32, kept: bool) {
        let b = self.bin(confidence);
        self.reached[b] += 1.0;
        self.kept[b] += f64::from(u8::from(kept));
    }

    /// The chance a draft of `confidence` is kept: the bin's record, with the confidence
    /// itself counted as `prior_weight` drafts.
    pub fn keep_rate(&self, confidence: f32) -> f32 {
        let b = self.bin(confidence);
        let prior = f64::from(confidence.clamp(0.0, 1.0));
        ((self.kept[b] + self.prior_weight * prior) / (self.reached[b] + self.prior_weight)) as f32
    }

    /// [`Self::keep_rate`] of each confidence.
    pub fn keep_rates(&self, confidences: &[f32]) -> Vec<f32> {
        confidences.iter().map(|&c| self.keep_rate(c)).collect()
    }

    /// Drafts recorded so far.
    pub fn recorded(&self) -> usize {
        self.reached.iter().sum::<f64>() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_bin_says_what_the_head_says() {
        let rates = KeepRates::new(10, 20.0).unwrap();
        for c in [0.0, 0.05, 0.37, 0.99, 1.0] {
            assert!((rates.keep_rate(c) - c).abs() < 1e-6, "{c}");
        }
    }

    #[test]
    fn the_record_moves_the_rate_by_its_weight_against_the_prior() {
        let mut rates = KeepRates::new(10, 20.0).unwrap();
        // Bin [0.3, 0.4): 30 drafts reached, 24 kept.
        for i in 0..30 {
            rates.record(0.35, i < 24);
        }
        // (24 + 20 · 0.35) / (30 + 20) = 31 / 50.
        assert!((rates.keep_rate(0.35) - 0.62).abs() < 1e-6, "{}", rates.keep_rate(0.35));
        // (24 + 20 · 0.3) / 50 = 0.6: the prior is each draft's own confidence.
        assert!((rates.keep_rate(0.3) - 0.6).abs() < 1e-6);
        // Other bins are untouched.
        assert!((rates.keep_rate(0.45) - 0.45).abs() < 1e-6);
        assert_eq!(rates.recorded(), 30);
        assert_eq!(rates.keep_rates(&[0.35, 0.45]), vec![rates.keep_rate(0.35), 0.45]);
    }

    #[test]
    fn edges_fall_in_the_first_and_last_bins() {
        let mut rates = KeepRates::new(4, 1.0).unwrap();
        rates.record(1.0, false);
        rates.record(-0.5, true);
        // Last bin: (0 + 1 · 0.9) / 2; first bin: (1 + 0.1) / 2.
        assert!((rates.keep_rate(0.9) - 0.45).abs() < 1e-6);
        assert!((rates.keep_rate(0.1) - 0.55).abs() < 1e-6);
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        assert!(KeepRates::new(0, 1.0).is_err());
        for w in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let err = format!("{:#}", KeepRates::new(10, w).unwrap_err());
            assert!(err.contains("sv.keep_rate_prior_weight"), "{err}");
        }
    }
}
