//! What a companion model says about a draft, without running the target: S, how much of the
//! draft's distribution the companion shares, and A, the drafted token's acceptance
//! probability were the companion the target. A alone misses how aligned the two models are
//! overall; S alone misses the sampled token itself (SV spec §2.2).

/// S = Σ_v min(q(v), c(v)) = 1 − TV(q, c): 1 for identical distributions, 0 for disjoint
/// supports. `q` is the draft's distribution, `c` the companion's, over one vocabulary.
pub fn similarity(q: &[f32], c: &[f32]) -> f32 {
    assert_eq!(q.len(), c.len(), "draft and companion distributions over different vocabularies");
    q.iter().zip(c).map(|(&a, &b)| a.min(b)).sum::<f32>().min(1.0)
}

/// A = min(1, c(x) / q(x)) for the drafted token `x`: speculative sampling's acceptance
/// probability with the companion standing in for the target. Its expectation over
/// x ~ q is S.
pub fn companion_acceptance(q: &[f32], c: &[f32], x: usize) -> f32 {
    assert_eq!(q.len(), c.len(), "draft and companion distributions over different vocabularies");
    let (qx, cx) = (q[x], c[x]);
    if qx <= 0.0 {
        // A sampled token has q(x) > 0; a greedy draft from a degenerate row still gets a value.
        return if cx > 0.0 { 1.0 } else { 0.0 };
    }
    (cx / qx).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_distributions_share_everything() {
        let q = [0.1, 0.2, 0.3, 0.4];
        assert!((similarity(&q, &q) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn disjoint_supports_share_nothing() {
        assert_eq!(similarity(&[0.5, 0.5, 0.0, 0.0], &[0.0, 0.0, 0.7, 0.3]), 0.0);
    }

    #[test]
    fn hand_values() {
        // q = (.5, .5), c = (.9, .1): S = .5 + .1 = .6, A(a) = min(1, .9/.5) = 1, A(b) = .2.
        let (q, c) = ([0.5, 0.5], [0.9, 0.1]);
        assert!((similarity(&q, &c) - 0.6).abs() < 1e-6);
        assert_eq!(companion_acceptance(&q, &c, 0), 1.0);
        assert!((companion_acceptance(&q, &c, 1) - 0.2).abs() < 1e-6);
        // S = 1 − ½‖q − c‖₁, and it is symmetric.
        assert!((similarity(&c, &q) - (1.0 - 0.5 * (0.4 + 0.4))).abs() < 1e-6);
    }

    #[test]
    fn expected_companion_acceptance_is_the_similarity() {
        // Σ_x q(x)·A(x) = S, for a few lopsided pairs.
        let pairs: [([f32; 4], [f32; 4]); 3] = [
            ([0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]),
            ([0.05, 0.05, 0.45, 0.45], [0.6, 0.3, 0.1, 0.0]),
            ([0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]),
        ];
        for (q, c) in pairs {
            let expected: f32 = (0..4).map(|x| q[x] * companion_acceptance(&q, &c, x)).sum();
            assert!((expected - similarity(&q, &c)).abs() < 1e-6, "{q:?} {c:?}");
        }
    }
}
