//! Divergences between two next-token distributions, given as log-probabilities.
//!
//! Inputs are log-softmaxes in f32 with masked (-inf) entries floored at [`LOG_PROB_FLOOR`],
//! so every divergence is finite; sums accumulate in f64. A NaN (from NaN logits) fails
//! every `< threshold` test, which is how callers treat it: as a rejection.

use serde::{Deserialize, Serialize};

/// Log-probability given to tokens a logit mask removed (e^-10000 is 0 in f32).
pub const LOG_PROB_FLOOR: f32 = -1.0e4;

/// Which divergence FSD compares p (target) and q (draft) with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Divergence {
    /// Textbook Jensen–Shannon, ½KL(P‖M) + ½KL(Q‖M), natural log, at most ln 2.
    Js,
    /// What the FSD authors' code computes: ½KL(M‖P) + ½KL(M‖Q). Unbounded; thresholds
    /// from the paper (0.3–0.7) are on this scale.
    JsFsd,
    /// KL(P‖Q): target relative to draft.
    KlTargetDraft,
    /// KL(Q‖P): draft relative to target.
    KlDraftTarget,
    /// Total variation, ½Σ|P − Q|.
    Tv,
}

impl Divergence {
    pub fn name(self) -> &'static str {
        match self {
            Divergence::Js => "js",
            Divergence::JsFsd => "js-fsd",
            Divergence::KlTargetDraft => "kl-target-draft",
            Divergence::KlDraftTarget => "kl-draft-target",
            Divergence::Tv => "tv",
        }
    }

    /// Div(P, Q) for target log-probabilities `log_p` and draft log-probabilities `log_q`.
    pub fn between(self, log_p: &[f32], log_q: &[f32]) -> f64 {
        debug_assert_eq!(log_p.len(), log_q.len());
        // Per-token terms in f32 (the inputs' precision), summed in f64.
        let mut sum = 0.0f64;
        // Where q is 0 (a draft vocabulary smaller than the target's: EAGLE heads draft over
        // a few thousand ids of 151,936), JS's term is ½·p·ln 2 and TV's ½·p: summed as
        // ½·c·(1 − Σ_{q>0} p) they cost a comparison per token, not two exponentials and a
        // logarithm. `p_where_q` is that Σ.
        let closed_form = match self {
            Divergence::Js => Some(0.5 * std::f64::consts::LN_2),
            Divergence::Tv => Some(0.5),
            _ => None,
        };
        let (mut p_where_q, mut q_has_zeros) = (0.0f64, false);
        for (&lp, &lq) in log_p.iter().zip(log_q) {
            if closed_form.is_some() && lq <= LOG_PROB_FLOOR {
                q_has_zeros = true;
                continue;
            }
            let p = lp.exp();
            p_where_q += p as f64;
            sum += self.term(lp, p, lq) as f64;
        }
        if let (Some(c), true) = (closed_form, q_has_zeros) {
            sum += c * (1.0 - p_where_q).max(0.0);
        }
        sum
    }

    /// One token's term. A token both distributions give no mass (m = 0 after underflow)
    /// contributes nothing.
    fn term(self, lp: f32, p: f32, lq: f32) -> f32 {
        let q = lq.exp();
        match self {
            Divergence::Js | Divergence::JsFsd => {
                let m = 0.5 * (p + q);
                if m == 0.0 {
                    return 0.0;
                }
                let lm = m.ln();
                if self == Divergence::Js {
                    0.5 * (p * (lp - lm) + q * (lq - lm))
                } else {
                    0.5 * m * ((lm - lp) + (lm - lq))
                }
            }
            Divergence::KlTargetDraft => p * (lp - lq),
            Divergence::KlDraftTarget => q * (lq - lp),
            Divergence::Tv => 0.5 * (p - q).abs(),
        }
    }
}

/// log-softmax of raw logits at temperature 1, floored at [`LOG_PROB_FLOOR`].
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| (l - max).exp() as f64).sum();
    let log_z = max + sum.ln() as f32;
    logits
        .iter()
        // Not f32::max, which would turn a NaN into the floor.
        .map(|&l| match l - log_z {
            v if v < LOG_PROB_FLOOR => LOG_PROB_FLOOR,
            v => v,
        })
        .collect()
}

/// Shannon entropy (nats) of a distribution given by its log-probabilities.
pub fn entropy(log_p: &[f32]) -> f64 {
    log_p
        .iter()
        .map(|&lp| {
            let p = (lp as f64).exp();
            if p > 0.0 {
                -p * lp as f64
            } else {
                0.0
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logs(p: &[f64]) -> Vec<f32> {
        p.iter()
            .map(|&x| (x.ln() as f32).max(LOG_PROB_FLOOR))
            .collect()
    }

    fn div(d: Divergence, p: &[f64], q: &[f64]) -> f64 {
        d.between(&logs(p), &logs(q))
    }

    fn close(a: f64, b: f64, tol: f64) {
        assert!((a - b).abs() < tol, "{a} vs {b}");
    }

    /// Values computed by hand (natural log), as in the FSD method notes.
    #[test]
    fn hand_computed_values() {
        let (p, q) = ([0.9, 0.1], [0.5, 0.5]);
        close(div(Divergence::Js, &p, &q), 0.1017, 1e-4);
        close(div(Divergence::JsFsd, &p, &q), 0.1180, 1e-4);
        close(div(Divergence::Tv, &p, &q), 0.4, 1e-6);
        // .9 ln 1.8 + .1 ln .2 and .5 ln(.5/.9) + .5 ln 5.
        close(div(Divergence::KlTargetDraft, &p, &q), 0.368064, 1e-5);
        close(div(Divergence::KlDraftTarget, &p, &q), 0.510826, 1e-5);
        let (p, q) = ([0.7, 0.2, 0.1], [0.6, 0.3, 0.1]);
        close(div(Divergence::Js, &p, &q), 0.0070, 1e-4);
        close(div(Divergence::JsFsd, &p, &q), 0.0070, 1e-4);
        close(div(Divergence::Tv, &p, &q), 0.1, 1e-6);
        let (p, q) = ([0.9, 0.1], [0.1, 0.9]);
        close(div(Divergence::Js, &p, &q), 0.3681, 1e-4);
        close(div(Divergence::JsFsd, &p, &q), 0.5108, 1e-4);
    }

    #[test]
    fn identical_distributions_have_zero_divergence() {
        let p = [0.2, 0.3, 0.5];
        for d in [
            Divergence::Js,
            Divergence::JsFsd,
            Divergence::KlTargetDraft,
            Divergence::KlDraftTarget,
            Divergence::Tv,
        ] {
            close(div(d, &p, &p), 0.0, 1e-7);
        }
    }

    #[test]
    fn disjoint_supports_stay_finite_and_textbook_js_is_ln2() {
        let p = log_softmax(&[0.0, f32::NEG_INFINITY]);
        let q = log_softmax(&[f32::NEG_INFINITY, 0.0]);
        close(Divergence::Js.between(&p, &q), std::f64::consts::LN_2, 1e-6);
        close(Divergence::Tv.between(&p, &q), 1.0, 1e-6);
        let fsd = Divergence::JsFsd.between(&p, &q);
        assert!(fsd.is_finite() && fsd > 1.0, "{fsd}");
        assert!(Divergence::KlTargetDraft.between(&p, &q).is_finite());
    }

    /// The closed form for tokens the draft cannot produce equals summing every token's term.
    #[test]
    fn a_reduced_draft_vocabulary_gives_the_per_token_sums() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37 % 101) as f32) / 9.0 - 4.0).collect();
        let p = log_softmax(&logits);
        // The draft gives mass to every seventh token only, as a reduced vocabulary does.
        let draft: Vec<f32> = (0..500)
            .map(|i| if i % 7 == 0 { ((i * 13 % 29) as f32) / 5.0 } else { f32::NEG_INFINITY })
            .collect();
        let q = log_softmax(&draft);
        for d in [Divergence::Js, Divergence::Tv] {
            let every_token: f64 = p.iter().zip(&q).map(|(&lp, &lq)| d.term(lp, lp.exp(), lq) as f64).sum();
            close(d.between(&p, &q), every_token, 1e-6);
        }
        // Hand-computed: q = (1, 0), p = (0.75, 0.25): JS = ½(.75 ln(.75/.875) + ln(1/.875))
        // + ½·.25·ln 2, TV = 0.25.
        let (p, q) = (logs(&[0.75, 0.25]), log_softmax(&[0.0, f32::NEG_INFINITY]));
        let js = 0.5 * (0.75 * (0.75f64 / 0.875).ln() + (1.0f64 / 0.875).ln()) + 0.125 * std::f64::consts::LN_2;
        close(Divergence::Js.between(&p, &q), js, 1e-6);
        close(Divergence::Tv.between(&p, &q), 0.25, 1e-6);
    }

    #[test]
    fn textbook_js_is_symmetric_and_bounded() {
        let p = log_softmax(&[3.0, -1.0, 0.5, 2.0]);
        let q = log_softmax(&[-2.0, 4.0, 0.0, 1.0]);
        let (a, b) = (
            Divergence::Js.between(&p, &q),
            Divergence::Js.between(&q, &p),
        );
        close(a, b, 1e-9);
        assert!(a > 0.0 && a <= std::f64::consts::LN_2);
    }

    #[test]
    fn nan_logits_give_nan_which_fails_any_threshold() {
        let p = log_softmax(&[f32::NAN, 0.0]);
        let q = log_softmax(&[0.0, 0.0]);
        let d = Divergence::Js.between(&p, &q);
        assert!(d.is_nan() && d.partial_cmp(&10.0).is_none());
    }

    #[test]
    fn entropy_of_uniform_is_ln_n() {
        close(entropy(&log_softmax(&[1.0; 4])), 4f64.ln(), 1e-6);
        close(entropy(&log_softmax(&[0.0, f32::NEG_INFINITY])), 0.0, 1e-9);
    }
}
