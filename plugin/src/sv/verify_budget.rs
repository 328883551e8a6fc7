//! How many drafts each sequence of a decode batch sends to the target, from the drafter's
//! own confidence: SV's goodput-greedy schedule (spec §4) with the EAGLE head as its own
//! companion. Here a verify row is nearly free for one sequence and costs about as much as
//! a decoded token's share once 8 sequences are verified together (T_v is flat, then
//! linear), so the drafts worth verifying shrink as the batch grows.
//!
//! β of draft i is the head's probability of its best token at i, known before the draft
//! is drawn: for greedy decoding that is the probability it gives the drafted token, and
//! whether a draft is verified never depends on the draft itself, so sampling stays exact
//! (`Exactness::Exact`'s argument). It is the head's own estimate, not a fitted table: a
//! head trained by cross-entropy on the target's tokens is roughly calibrated to it.

use super::{
    schedule::{schedule_batch, GoodputOptions},
    table::AcceptanceTable,
};
use crate::verify_latency::VerifyLatency;

#[derive(Clone, Debug, PartialEq)]
pub struct VerifyBudget {
    pub latency: VerifyLatency,
    pub options: GoodputOptions,
    /// The batched verify pads every sequence's rows to the longest (the engine's does):
    /// a verify of widths w_b costs T_v(B · max w_b), so drafts up to the widest are free
    /// and the choice is one width for the batch. `false`: rows packed, T_v(Σ w_b), the
    /// paper's per-draft greedy.
    pub padded: bool,
    /// The chance the target keeps a draft of a given confidence, fitted by `train-head
    /// sv-profile`; `None`: the confidence itself.
    pub table: Option<AcceptanceTable>,
}

impl VerifyBudget {
    /// Verified drafts per sequence, given each draft's confidence (`confidences[b][i]`:
    /// draft i of sequence b; a sequence may have drafted none).
    pub fn lengths(&self, confidences: &[Vec<f32>]) -> Vec<usize> {
        let gains = chain_gains(confidences, self.table.as_ref());
        if !self.padded {
            return schedule_batch(&gains, &self.latency, &self.options);
        }
        let verified = |drafts: usize| -> Vec<usize> {
            gains.iter().map(|g| g.len().min(drafts.max(self.options.min_gamma))).collect()
        };
        let widest = gains.iter().map(Vec::len).max().unwrap_or(0);
        let goodput = |drafts: usize| -> f64 {
            let lengths = verified(drafts);
            let kept: f64 = gains.iter().zip(&lengths).map(|(g, &n)| g[..n].iter().sum::<f64>()).sum();
            let width = lengths.iter().max().map_or(1, |n| n + 1);
            let bonus = if self.options.count_bonus { gains.len() as f64 } else { 0.0 };
            (kept + bonus) / (self.options.fixed_ms + self.latency.at(gains.len() * width))
        };
        // Widen while goodput improves (it is unimodal in the width as in γ).
        let (mut drafts, mut best) = (0, goodput(0));
        while drafts < widest {
            let wider = goodput(drafts + 1);
            if wider <= best {
                break;
            }
            (drafts, best) = (drafts + 1, wider);
        }
        verified(drafts)
    }
}

impl VerifyBudget {
    /// For a sequence verified alone (rows 1 + its drafts): whether drafting one more, whose
    /// confidence is the last of `confidences` (the drafts before it first), raises the
    /// step's goodput. Drafting stops at the first draft that does not (SV's early stop):
    /// known before the draft is drawn, so sampling stays exact.
    pub fn one_more_pays_alone(&self, confidences: &[f32]) -> bool {
        self.one_more_pays_alone_at(confidences, 0.0)
    }

    /// [`Self::one_more_pays_alone`] when each draft also costs `draft_ms` to make (a draft
    /// model's forward), besides its verify row.
    pub fn one_more_pays_alone_at(&self, confidences: &[f32], draft_ms: f64) -> bool {
        let drafts = confidences.len();
        if drafts <= self.options.min_gamma {
            return true;
        }
        let gains = chain_gains(&[confidences.to_vec()], self.table.as_ref()).remove(0);
        let bonus = if self.options.count_bonus { 1.0 } else { 0.0 };
        let goodput = |n: usize| {
            (bonus + gains[..n].iter().sum::<f64>()) / (self.options.fixed_ms + n as f64 * draft_ms + self.latency.at(n + 1))
        };
        goodput(drafts) > goodput(drafts - 1)
    }
}

/// Gain of draft i: the chance that drafts 0..=i are all kept, the product of their β (the
/// table's for each confidence, or the confidence itself).
fn chain_gains(confidences: &[Vec<f32>], table: Option<&AcceptanceTable>) -> Vec<Vec<f64>> {
    confidences
        .iter()
        .map(|c| {
            c.iter()
                .scan(1.0f64, |kept, &confidence| {
                    let beta = table.map_or(confidence, |t| t.beta_by_s(confidence));
                    *kept *= beta.clamp(0.0, 1.0) as f64;
                    Some(*kept)
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's verify forward (`verdict forward-cost`, one row of n tokens, ms).
    fn measured() -> VerifyLatency {
        VerifyLatency::fit(&[(1, 49.1), (5, 53.9), (8, 72.1), (10, 74.0), (16, 108.3), (24, 166.4), (32, 210.0)])
            .unwrap()
    }

    fn budget(latency: VerifyLatency) -> VerifyBudget {
        VerifyBudget { latency, options: GoodputOptions::default(), padded: false, table: None }
    }

    fn padded(latency: VerifyLatency) -> VerifyBudget {
        VerifyBudget { padded: true, ..budget(latency) }
    }

    #[test]
    fn a_fitted_table_prices_drafts_by_how_often_the_target_kept_them() {
        use crate::sv::table::{Observation, TableOrigin};
        // A profile where every draft was kept, or none, whatever the head's confidence.
        let table = |kept: bool| {
            let profile: Vec<Observation> =
                (0..100).map(|i| Observation { s: i as f32 / 100.0, a: 1.0, alpha: kept as u8 as f32 }).collect();
            AcceptanceTable::fit(&profile, 4, 1, 1, TableOrigin::default()).unwrap()
        };
        let with = |t: AcceptanceTable| VerifyBudget { table: Some(t), ..padded(measured()) };
        let confidences = [vec![0.9, 0.8, 0.8, 0.8], vec![0.9, 0.9, 0.1, 0.9]];
        assert_eq!(padded(measured()).lengths(&confidences), vec![2, 2]);
        // Always kept: widths 0..=4 give 2 / 50.3, 4 / 52.7, 6 / 60.0, 8 / 72.1, 10 / 74.0.
        assert_eq!(with(table(true)).lengths(&confidences), vec![4, 4]);
        assert_eq!(with(table(false)).lengths(&confidences), vec![0, 0]);
    }

    #[test]
    fn alone_a_draft_pays_when_its_expected_token_costs_less_than_its_row() {
        // T_v 50 ms for one row, 10 more a row: one draft at β 0.5 gives 1.5 / 60 > 1 / 50; at 0.1, 1.1 / 60 < 1 / 50.
        let steep = budget(VerifyLatency::linear(50.0, 10.0));
        assert!(steep.one_more_pays_alone(&[0.5]));
        assert!(!steep.one_more_pays_alone(&[0.1]));
        // A second draft at 0.9 after one at 0.5 adds 0.45: 1.95 / 70 > 1.5 / 60.
        assert!(steep.one_more_pays_alone(&[0.5, 0.9]));
        // After one at 0.2 it adds 0.18: 1.38 / 70 < 1.2 / 60.
        assert!(!steep.one_more_pays_alone(&[0.2, 0.9]));
        // A verify as cheap alone as here (49.1 ms for 1 row, 53.9 for 5) takes unlikely drafts.
        assert!(budget(measured()).one_more_pays_alone(&[0.9, 0.8, 0.1]));
        // min_gamma drafts are always made; a table prices by the fitted β.
        let at_least_one = VerifyBudget { options: GoodputOptions { min_gamma: 1, ..GoodputOptions::default() }, ..steep.clone() };
        assert!(at_least_one.one_more_pays_alone(&[0.0]));
        // A draft that costs 30 ms to make: at β 0.5, 1.5 / 90 < 1 / 50; at 0.99, 1.99 / 90 > 1 / 50.
        assert!(!steep.one_more_pays_alone_at(&[0.5], 30.0));
        assert!(steep.one_more_pays_alone_at(&[0.99], 30.0));
    }

    #[test]
    fn padded_rows_make_one_width_for_the_batch() {
        // Two sure sequences and six unsure ones: packed, only the sure drafts are verified;
        // padded, a sure draft makes every row that wide, and the unsure drafts ride free.
        let mut confidences = vec![vec![0.95, 0.9, 0.9, 0.9]; 2];
        confidences.extend(vec![vec![0.3, 0.9, 0.9, 0.9]; 6]);
        // 8 rows: 8 / 72.1 = 0.111; 16 rows (one draft each): (8 + 1.9 + 1.8) / 108.3 = 0.108.
        assert_eq!(padded(measured()).lengths(&confidences), vec![0; 8]);
        // Alone the verify is flat: every draft is worth it, padded or not.
        assert_eq!(padded(measured()).lengths(&[vec![0.9, 0.8, 0.7, 0.6]]), vec![4]);
        // Two sequences: widths 1, 2, 3, 4 cost 50.3, 52.7, 60.0, 72.1 ms for 2 rows each;
        // goodput 0.040, 0.072, 0.089, then 0.083 (the second's third draft gains 0.08).
        let two = padded(measured()).lengths(&[vec![0.9, 0.8, 0.8, 0.8], vec![0.9, 0.9, 0.1, 0.9]]);
        assert_eq!(two, vec![2, 2]);
        // A sequence that drafted less verifies what it has: 0.072, 0.077, then 0.074.
        assert_eq!(padded(measured()).lengths(&[vec![0.9; 4], vec![0.9]]), vec![2, 1]);
    }

    #[test]
    fn gains_are_running_products_of_confidences() {
        let g = chain_gains(&[vec![0.5, 0.5, 1.0], vec![]], None);
        assert_eq!(g, vec![vec![0.5, 0.25, 0.25], vec![]]);
    }

    #[test]
    fn one_sequence_on_a_flat_verify_sends_every_likely_draft() {
        // 1 → 5 rows costs 4.8 ms on 49: a draft pays from a ≈ 3 % chance of being kept.
        assert_eq!(budget(measured()).lengths(&[vec![0.9, 0.8, 0.7, 0.6]]), vec![4]);
    }

    #[test]
    fn eight_sequences_send_only_drafts_likely_enough_to_pay_for_their_row() {
        // 8 rows cost 72.1 ms, 16 rows 108.3: the two sure sequences' 8 drafts (gains 0.95
        // down to 0.69) lift goodput from 0.111 to 0.134 tokens/ms; a 17th row at ≈ 7 ms
        // more would need a gain above ≈ 0.95, and the others' first drafts offer 0.3.
        let mut confidences = vec![vec![0.95, 0.9, 0.9, 0.9]; 2];
        confidences.extend(vec![vec![0.3, 0.9, 0.9, 0.9]; 6]);
        let lengths = budget(measured()).lengths(&confidences);
        assert_eq!(&lengths[2..], &[0; 6], "unlikely first drafts stay home: {lengths:?}");
        assert!(lengths[0] >= 2 && lengths[1] >= 2, "{lengths:?}");
        // Alone, the same unlikely drafts pay: the forward is nearly flat.
        assert!(budget(measured()).lengths(&[vec![0.3, 0.9, 0.9, 0.9]])[0] >= 1);
    }

    #[test]
    fn no_confidence_sends_nothing_and_certainty_sends_everything() {
        let b = budget(VerifyLatency::linear(50.0, 6.0));
        let (unsure, sure) = (vec![vec![0.0; 4]; 3], vec![vec![1.0; 4]; 3]);
        assert_eq!(b.lengths(&unsure), vec![0; 3]);
        assert_eq!(b.lengths(&sure), vec![4; 3]);
    }
}
