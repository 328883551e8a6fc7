//! The judge stack on tiny generated models: disabled judges change nothing, DropMatch
//! without dropout is lossless and reproduces with a seed, AutoJudge and PAD heads made in
//! code do what their outputs say, and heads for other models are refused.

mod common;

use std::{path::Path, sync::Arc};

use common::{config, prompts, spec, tiny_pair};
use mistralrs_core::speculative_hook::StepReport;
use verdict::{
    assembly::stack::judge_stack,
    config::Config,
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    judge::JudgeStack,
    metrics::{Counters, Metrics},
    rules::BaseRule,
    tiny_model::TinyArch,
};
use verdict_heads::{FeatureSpec, LogisticHead, PivotMlp};

const GAMMA: usize = 3;
const MAX_TOKENS: usize = 40;

struct Outcome {
    texts: Vec<String>,
    counters: Counters,
    steps: Vec<StepReport>,
}

fn run(models: &LoadedModels, config: &Config, stack: JudgeStack) -> Outcome {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let metrics = Arc::new(Metrics::default());
        let engine = Engine::speculative(models, SpeculativeSetup { gamma: GAMMA, stack, seed: 0, metrics: metrics.clone(), scheduling: Scheduling::from(1) })
            .await
            .unwrap();
        let rule = engine.rule.clone().unwrap();
        rule.record_steps();
        let mut texts = Vec::new();
        for p in prompts() {
            let g = generate(&engine.mistralrs, &Prompt::Text(p), &config.sampling)
                .await
                .unwrap();
            engine.settle().await;
            texts.push(g.text);
        }
        Outcome {
            texts,
            counters: metrics.snapshot(),
            steps: rule.recorded_steps(),
        }
    })
}

/// A tiny Llama pair whose draft disagrees with the target often enough to test rescues.
fn setup(dir: &Path) -> (LoadedModels, Config) {
    tiny_pair(dir, &spec(TinyArch::Llama, 21), 0.3);
    let config = config(dir, GAMMA, "exact", MAX_TOKENS);
    let models = LoadedModels::load(&config).unwrap();
    (models, config)
}

/// `config` with `judges` (TOML `[[judge]]` tables) appended.
fn with_judges(config: &Config, judges: &str) -> Config {
    let base = format!(
        "[models]\ntarget = {:?}\ndraft = {:?}\n[speculative]\ngamma = {GAMMA}\n[sampling]\nmax_tokens = {MAX_TOKENS}\n",
        config.models.target,
        config.models.draft.as_ref().unwrap()
    );
    Config::from_toml(&format!("{base}{judges}")).unwrap()
}

fn stack(models: &LoadedModels, config: &Config, judges: &str) -> JudgeStack {
    judge_stack(&with_judges(config, judges), &models.fingerprints()).unwrap()
}

/// Steps that ended before the sequence did (a finished step may stop early at EOS).
fn running(steps: &[StepReport]) -> impl Iterator<Item = &StepReport> {
    steps.iter().filter(|s| !s.finished)
}

#[test]
fn disabled_judges_are_the_lossless_base_rule() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let lossless = run(&models, &config, JudgeStack::lossless(BaseRule::Exact));
    let judges = "[[judge]]\nkind = \"fsd\"\nthreshold = 0.6\nenabled = false\n\
                  [[judge]]\nkind = \"dropmatch\"\np = 0.9\nenabled = false\n\
                  [[judge]]\nkind = \"autojudge\"\nhead = \"missing.safetensors\"\nenabled = false\n\
                  [[judge]]\nkind = \"pad\"\nhead = \"missing.safetensors\"\nfloor = 1.0\nenabled = false\n";
    let disabled = run(&models, &config, stack(&models, &config, judges));
    assert_eq!(disabled.texts, lossless.texts);
    assert_eq!(
        disabled.counters.accepted_tokens,
        lossless.counters.accepted_tokens
    );
    assert!(disabled.counters.judges.is_empty());
}

#[test]
fn dropmatch_without_dropout_accepts_exactly_what_exact_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let lossless = run(&models, &config, JudgeStack::lossless(BaseRule::Exact));
    let dm = run(
        &models,
        &config,
        stack(
            &models,
            &config,
            "[[judge]]\nkind = \"dropmatch\"\np = 0.0\n",
        ),
    );
    assert_eq!(dm.texts, lossless.texts);
    assert_eq!(
        dm.counters.accepted_tokens,
        lossless.counters.accepted_tokens
    );
    let judge = &dm.counters.judges["dropmatch"];
    assert!(judge.calls > 0, "DropMatch was never asked");
    assert_eq!(judge.rescues, 0);
}

#[test]
fn dropmatch_with_the_same_seed_reproduces_and_rescues() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let judges = "[[judge]]\nkind = \"dropmatch\"\np = 0.5\ncriterion = \"naive\"\nseed = 3\n";
    let first = run(&models, &config, stack(&models, &config, judges));
    let second = run(&models, &config, stack(&models, &config, judges));
    assert_eq!(first.texts, second.texts);
    let (a, b) = (
        &first.counters.judges["dropmatch"],
        &second.counters.judges["dropmatch"],
    );
    assert_eq!((a.calls, a.rescues), (b.calls, b.rescues));
    assert!(
        a.rescues > 0,
        "no rescue: the test would pass with a judge that never fires"
    );
}

#[test]
fn dropmatch_over_candidates_covering_the_vocabulary_decides_as_the_full_lm_head() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    for criterion in ["naive", "js+majority"] {
        let judges = |candidates: usize| {
            format!("[[judge]]\nkind = \"dropmatch\"\np = 0.5\ncriterion = \"{criterion}\"\nseed = 3\ncandidates = {candidates}\n")
        };
        let full = run(&models, &config, stack(&models, &config, &judges(0)));
        // The tiny LM head's rows read from the target's file, every token a candidate.
        let rows = run(&models, &config, stack(&models, &config, &judges(1 << 20)));
        assert_eq!(rows.texts, full.texts, "{criterion}");
        let (a, b) = (&full.counters.judges["dropmatch"], &rows.counters.judges["dropmatch"]);
        assert_eq!((a.calls, a.rescues), (b.calls, b.rescues), "{criterion}");
        if criterion == "naive" {
            assert!(a.rescues > 0, "no rescue: the comparison would pass with judges that never fire");
        }
    }
    // A target without an LM head to read is refused naming the option.
    let err = verdict::judges::DropMatch::load(
        toml::from_str("candidates = 8").unwrap(),
        &verdict::judges::LoadedFingerprints { target: &models.target_fingerprint, draft: None, target_source: None },
    )
    .err()
    .expect("candidates without the target's weights were accepted");
    assert!(format!("{err:#}").contains("candidates"), "{err:#}");
}

fn write_autojudge(models: &LoadedModels, dir: &Path, features: FeatureSpec, p: f32) -> String {
    let head = LogisticHead::constant(
        features,
        models.target_fingerprint.clone(),
        features
            .uses_draft()
            .then(|| models.draft_fingerprint.clone().unwrap()),
        p,
    );
    let path = dir.join(format!("autojudge-{}-{p}.safetensors", features.name()));
    head.save(&path).unwrap();
    format!(
        "[[judge]]\nkind = \"autojudge\"\nhead = {:?}\nthreshold = 0.5\n",
        path.to_str().unwrap()
    )
}

#[test]
fn autojudge_forced_important_is_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let lossless = run(&models, &config, JudgeStack::lossless(BaseRule::Exact));
    let judges = write_autojudge(&models, dir.path(), FeatureSpec::TargetOnly, 0.99);
    let judged = run(&models, &config, stack(&models, &config, &judges));
    assert_eq!(judged.texts, lossless.texts);
    let judge = &judged.counters.judges["autojudge"];
    assert!(judge.calls > 0 && judge.rescues == 0, "{judge:?}");
}

#[test]
fn autojudge_forced_unimportant_keeps_every_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let judges = write_autojudge(&models, dir.path(), FeatureSpec::TargetOnly, 0.01);
    let judged = run(&models, &config, stack(&models, &config, &judges));
    assert!(judged.counters.judges["autojudge"].rescues > 0);
    for s in running(&judged.steps) {
        assert_eq!(s.accepted, s.drafted, "a draft was refused: {s:?}");
    }
}

#[test]
fn autojudge_with_draft_features_leaves_the_last_draft_to_the_base_rule() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let judges = write_autojudge(&models, dir.path(), FeatureSpec::DraftAndTarget, 0.01);
    let judged = run(&models, &config, stack(&models, &config, &judges));
    assert!(judged.counters.judges["autojudge"].rescues > 0);
    let mut refused_last = 0;
    for s in running(&judged.steps) {
        // Every draft but the last is rescued; the last has no draft state encoding it.
        assert!(s.accepted >= s.drafted - 1, "{s:?}");
        refused_last += (s.accepted == s.drafted - 1) as usize;
    }
    assert!(refused_last > 0, "the last position was never refused");
}

#[test]
fn a_head_for_another_model_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let mut other = models.target_fingerprint.clone();
    other.hidden_size += 8;
    other.source = "other-model.gguf".into();
    let path = dir.path().join("other.safetensors");
    LogisticHead::constant(FeatureSpec::TargetOnly, other, None, 0.5)
        .save(&path)
        .unwrap();
    let judges = format!(
        "[[judge]]\nkind = \"autojudge\"\nhead = {:?}\n",
        path.to_str().unwrap()
    );
    let err = format!(
        "{:#}",
        judge_stack(&with_judges(&config, &judges), &models.fingerprints())
            .err()
            .expect("a head for another model was accepted")
    );
    let hidden = models.target_fingerprint.hidden_size;
    assert!(
        err.contains("other-model.gguf") && err.contains("target"),
        "{err}"
    );
    assert!(
        err.contains(&format!("hidden size {}", hidden + 8))
            && err.contains(&format!("hidden size {hidden}")),
        "{err}"
    );
}

fn write_pad(models: &LoadedModels, dir: &Path, p_pivot: f32) -> std::path::PathBuf {
    let path = dir.join(format!("pad-{p_pivot}.safetensors"));
    PivotMlp::constant(-1, models.target_fingerprint.clone(), p_pivot, 0.5)
        .unwrap()
        .save(&path)
        .unwrap();
    path
}

#[test]
fn pad_floor_vetoes_drafts_the_base_rule_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let lossless = run(&models, &config, JudgeStack::lossless(BaseRule::Exact));
    assert!(lossless.counters.accepted_tokens > 0);
    // Every target probability is below 1: every draft is vetoed, even exact matches.
    let path = write_pad(&models, dir.path(), 0.99);
    let judges = format!(
        "[[judge]]\nkind = \"pad\"\nhead = {:?}\nfloor = 1.0\n",
        path.to_str().unwrap()
    );
    let vetoed = run(&models, &config, stack(&models, &config, &judges));
    assert_eq!(vetoed.counters.accepted_tokens, 0);
    assert!(vetoed.counters.judges["pad"].vetoes > 0);
}

#[test]
fn pad_non_pivots_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (models, config) = setup(dir.path());
    let path = write_pad(&models, dir.path(), 0.01);
    let judges = format!(
        "[[judge]]\nkind = \"pad\"\nhead = {:?}\nfloor = 0.0\n",
        path.to_str().unwrap()
    );
    let kept = run(&models, &config, stack(&models, &config, &judges));
    assert!(kept.counters.judges["pad"].rescues > 0);
    for s in running(&kept.steps) {
        assert_eq!(s.accepted, s.drafted, "{s:?}");
    }
}
