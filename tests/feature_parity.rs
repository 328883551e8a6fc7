//! Train/serve parity of AutoJudge's features on a tiny generated pair. Its own test binary:
//! mistral.rs's hidden-state capture, which `train-head features` uses, is armed for the whole
//! process, so no other test may run forwards beside it.

mod common;

use std::sync::Arc;

use common::{config, prompts, spec, tiny_pair};
use verdict::{
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
    tiny_model::TinyArch,
};
use verdict_heads::{FeatureSpec, LogisticHead};

const GAMMA: usize = 3;

/// The tests here take turns: the capture is armed for the whole process.
static FORWARDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Greedy `exact` decoding of the common prompts under `stack`, drafted by the draft model or
/// by `proposer`.
fn run(models: &LoadedModels, stack: JudgeStack, proposer: Option<Arc<dyn mistralrs_core::speculative_hook::Proposer>>) {
    let config = config(std::path::Path::new("unused"), GAMMA, "exact", 40);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let metrics = Arc::new(Metrics::default());
        let engine = match proposer {
            Some(proposer) => Engine::with_proposer(models, proposer, SpeculativeSetup { gamma: GAMMA, stack, seed: 0, metrics, scheduling: Scheduling::from(1) }).await.unwrap(),
            None => Engine::speculative(models, SpeculativeSetup { gamma: GAMMA, stack, seed: 0, metrics, scheduling: Scheduling::from(1) }).await.unwrap(),
        };
        for p in prompts() {
            generate(&engine.mistralrs, &Prompt::Text(p), &config.sampling).await.unwrap();
            engine.settle().await;
        }
    })
}

/// Each draft AutoJudge was asked about: the tokens up to and including it, and its features.
type SeenDrafts = Arc<std::sync::Mutex<Vec<(Vec<u32>, verdict::judges::JudgeFeatures)>>>;

/// Records the features AutoJudge reads for each draft it is asked about, with the tokens up
/// to and including that draft, then judges as AutoJudge does.
struct RecordingAutoJudge {
    judge: verdict::judges::AutoJudge,
    seen: SeenDrafts,
}

impl verdict::judge::Judge for RecordingAutoJudge {
    fn name(&self) -> &str {
        "autojudge"
    }
    fn target_capture(&self) -> mistralrs_core::speculative_hook::CaptureRequest {
        self.judge.target_capture()
    }
    fn draft_capture(&self) -> mistralrs_core::speculative_hook::CaptureRequest {
        self.judge.draft_capture()
    }
    fn rescues(&self, view: &verdict::step_view::StepView, position: usize) -> anyhow::Result<bool> {
        if let Some(features) = self.judge.features(view, position)? {
            let mut context = view.ctx.prefix.to_vec();
            context.extend_from_slice(&view.ctx.draft_tokens[..=position]);
            self.seen.lock().unwrap().push((context, features));
        }
        self.judge.rescues(view, position)
    }
}

/// Train/serve parity: the features `train-head features` stores for a mismatch
/// (`features::context_features`, the last hidden states after the tokens up to the draft)
/// are the ones the runtime AutoJudge reads for that draft from the verify forward and the
/// draft's forwards, to float rounding: the two come from forwards over different splits of
/// the same tokens (≈ 1e-7 of the largest entry when written; 1e-5 allowed).
#[test]
fn mined_features_are_the_judges_features_at_run_time() {
    use verdict::judge::Judge;
    let _turn = FORWARDS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // A tiny Llama pair whose draft disagrees with the target often enough.
    tiny_pair(dir.path(), &spec(TinyArch::Llama, 21), 0.3);
    let models = LoadedModels::load(&config(dir.path(), GAMMA, "exact", 40)).unwrap();
    // Never keeps a mismatch, so the run is plain `exact` decoding with the judge asked at
    // every refused draft.
    let head = LogisticHead::constant(FeatureSpec::DraftAndTarget, models.target_fingerprint.clone(), models.draft_fingerprint.clone(), 0.99);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let judge = RecordingAutoJudge { judge: verdict::judges::AutoJudge::new(head, 0.5), seen: seen.clone() };
    assert!(judge.target_capture().last_hidden && judge.draft_capture().last_hidden);
    run(&models, JudgeStack { judges: vec![Box::new(judge)], ..JudgeStack::lossless(BaseRule::Exact) }, None);
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 3, "the judge was asked about {} drafts", seen.len());

    let engines = verdict_training::engine::MistralEngines::new(&models).unwrap();
    let contexts: Vec<Vec<u32>> = seen.iter().map(|(context, _)| context.clone()).collect();
    let mined = verdict_training::features::context_features(&engines, &contexts).unwrap();
    let (target, draft) = (mined.target_last.to_vec2::<f32>().unwrap(), mined.draft_last.to_vec2::<f32>().unwrap());
    for (i, (context, features)) in seen.iter().enumerate() {
        let t = relative_difference(&features.target, &target[i]);
        let d = relative_difference(features.draft.as_deref().unwrap(), &draft[i]);
        assert!(t < 1e-5 && d < 1e-5, "draft {i} ({} tokens): relative differences {t:e} (target), {d:e} (draft)", context.len());
    }
}

/// The largest difference between `a` and `b`, relative to `a`'s largest entry.
fn relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Parity for a judge of EAGLE drafts (`train-head mine --eagle-head`, then `features
/// --target-only` and `fit --spec target`): the target's last hidden state at a refused head
/// draft, as the verify forward of the proposer pipeline gives it to AutoJudge, equals the one
/// `features --target-only` computes for the same tokens on target-only engines.
#[test]
fn target_only_features_of_eagle_drafts_are_the_judges_at_run_time() {
    use verdict::{judge::Judge, tiny_model::{write_tiny_eagle3_head, write_tiny_model, FIRST_WORD_ID}};
    let _turn = FORWARDS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Llama, 21);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    // A random head over a few words: often wrong, so the judge is asked often.
    let vocab: Vec<u32> = (0..6).map(|i| (FIRST_WORD_ID + 3 * i) as u32).collect();
    write_tiny_eagle3_head(&s, &dir.path().join("head"), &vocab, [1, 2, 2], 5).unwrap();
    let config = verdict::config::Config::from_toml(&format!(
        "[models]\ntarget = {:?}\n[speculative]\nproposer = \"eagle\"\neagle_head = {:?}\ngamma = {GAMMA}\n[sampling]\ntemperature = 0.0\nmax_tokens = 40\n",
        dir.path().join("target").to_str().unwrap(),
        dir.path().join("head").to_str().unwrap(),
    ))
    .unwrap();
    let models = LoadedModels::load(&config).unwrap();
    assert!(models.draft.is_none());
    let head = LogisticHead::constant(FeatureSpec::TargetOnly, models.target_fingerprint.clone(), None, 0.99);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let judge = RecordingAutoJudge { judge: verdict::judges::AutoJudge::new(head, 0.5), seen: seen.clone() };
    assert!(judge.target_capture().last_hidden && !judge.draft_capture().last_hidden);
    let proposer = models.eagle_proposer(&config).unwrap();
    run(&models, JudgeStack { judges: vec![Box::new(judge)], ..JudgeStack::lossless(BaseRule::Exact) }, Some(proposer));
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 3, "the judge was asked about {} drafts", seen.len());
    assert!(seen.iter().all(|(_, f)| f.draft.is_none()), "a target-only head read the draft's states");

    let engines = verdict_training::engine::MistralEngines::target_only(&models).unwrap();
    let contexts: Vec<Vec<u32>> = seen.iter().map(|(context, _)| context.clone()).collect();
    let mined = verdict_training::features::context_features(&engines, &contexts).unwrap();
    let target = mined.target_last.to_vec2::<f32>().unwrap();
    for (i, (context, features)) in seen.iter().enumerate() {
        let t = relative_difference(&features.target, &target[i]);
        assert!(t < 1e-5, "draft {i} ({} tokens): relative difference {t:e}", context.len());
    }
}
