//! PAD's rollout labels on a scripted engine whose success rates are known in advance.

use anyhow::Result;
use verdict_eval::tasks::TaskAdapter;
use verdict_training::{
    labels::{LabelStore, Mismatch, ProblemLabels},
    pad_mine::{mine_pivots, read_pivot_labels, PadPlan, RolloutEngine},
};

/// Rollouts succeed ("right") with a rate set by the last token of the prefix: the
/// token's value in tenths, so token 10 always succeeds and token 5 half the time.
struct Scripted {
    calls: usize,
}

impl RolloutEngine for Scripted {
    fn rollouts(
        &mut self,
        _prompt: &str,
        prefixes: &[Vec<u32>],
        n: usize,
        _temperature: f64,
        _max: usize,
    ) -> Result<Vec<Vec<String>>> {
        self.calls += 1;
        Ok(prefixes
            .iter()
            .map(|prefix| {
                let rate = *prefix.last().unwrap() as usize;
                (0..n)
                    .map(|i| if i * 10 < rate * n { "right" } else { "wrong" }.to_string())
                    .collect()
            })
            .collect())
    }
}

struct RightOrWrong;

impl TaskAdapter for RightOrWrong {
    type Problem = ();
    fn prompt(&self, _: &()) -> String {
        "p".into()
    }
    fn extract_answer(&self, response: &str) -> Option<String> {
        Some(response.to_string())
    }
    fn is_correct(&self, _: &(), response: &str) -> bool {
        response == "right"
    }
}

fn mismatch(position: usize, target_token: u32, draft_token: u32) -> Mismatch {
    Mismatch {
        position,
        target_token,
        draft_token,
        important: false,
        prefix: vec![1; position],
        shortcut: false,
        draft_probability: None,
    }
}

#[test]
fn pivots_follow_the_success_rates_and_a_rerun_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let labels = dir.path().join("labels.jsonl");
    let mut store = LabelStore::open(&labels).unwrap();
    store
        .append(&ProblemLabels {
            problem_id: 0,
            target_answer: Some("right".into()),
            mismatches: vec![
                // base 10/10, candidate 10/10: not a pivot
                mismatch(2, 10, 10),
                // base 10/10, candidate 5/10 < 0.8: pivot
                mismatch(5, 10, 5),
                // base 5/10, candidate 4/10 ≥ 0.8 × 5/10: not a pivot
                mismatch(7, 5, 4),
            ],
            final_response: vec![],
            generated_tokens: 0,
            seconds: 0.0,
        })
        .unwrap();
    // A problem the target gets wrong offers no base to undercut: never rolled out.
    store
        .append(&ProblemLabels {
            problem_id: 1,
            target_answer: Some("wrong".into()),
            mismatches: vec![mismatch(3, 10, 5)],
            final_response: vec![],
            generated_tokens: 0,
            seconds: 0.0,
        })
        .unwrap();
    let out = dir.path().join("pad.jsonl");
    let plan = PadPlan {
        rollouts: 10,
        ..PadPlan::default()
    };
    let mut engine = Scripted { calls: 0 };
    mine_pivots(&mut engine, &RightOrWrong, &[(), ()], &labels, &plan, &out).unwrap();
    let got: Vec<(usize, usize, usize, bool)> = read_pivot_labels(&out)
        .unwrap()
        .iter()
        .map(|l| (l.position, l.base_successes, l.candidate_successes, l.pivot))
        .collect();
    assert_eq!(
        got,
        vec![(2, 10, 10, false), (5, 10, 5, true), (7, 5, 4, false)]
    );
    assert_eq!(engine.calls, 3, "one batched call per candidate");

    // Everything is labelled: a rerun asks the engine nothing.
    let mut again = Scripted { calls: 0 };
    mine_pivots(&mut again, &RightOrWrong, &[(), ()], &labels, &plan, &out).unwrap();
    assert_eq!(again.calls, 0);
    assert_eq!(read_pivot_labels(&out).unwrap().len(), 3);
}
