//! The mining engine on real mistral.rs pipelines over tiny generated models: prefix-cache
//! hits must not change what the target generates or what the features are, and the
//! draft's teacher-forced predictions must be what the draft itself would generate.

use std::path::Path;

use mistralrs_core::hidden_capture::CaptureRequest;
use verdict::{
    config::Config,
    engine::LoadedModels,
    tiny_model::{words, write_tiny_model, write_tiny_model_perturbed, TinyArch, TinySpec},
};
use verdict_training::{
    engine::{MistralEngines, Model},
    features::last_row,
    miner::MiningEngine,
};

const CAP: usize = 14;

fn engines(dir: &Path) -> MistralEngines {
    let spec = TinySpec::new(TinyArch::Qwen2, 7);
    write_tiny_model(&spec, &dir.join("target")).unwrap();
    write_tiny_model_perturbed(&spec, &dir.join("draft"), Some((99, 0.4))).unwrap();
    let config = Config::from_toml(&format!(
        "[models]\ntarget = {:?}\ndraft = {:?}\n",
        dir.join("target").to_str().unwrap(),
        dir.join("draft").to_str().unwrap(),
    ))
    .unwrap();
    MistralEngines::new(&LoadedModels::load(&config).unwrap()).unwrap()
}

fn last_hidden(engines: &MistralEngines, model: Model, tokens: &[u32]) -> Vec<f32> {
    let (_, states) = engines
        .capture(
            model,
            tokens,
            CaptureRequest {
                last_hidden: true,
                ..Default::default()
            },
        )
        .unwrap();
    last_row(&states.last_hidden.unwrap()).unwrap()
}

/// The prefix caches' byte count is the process's: tests that hold caches run one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn continuations_and_features_do_not_depend_on_the_prefix_cache() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut engines = engines(dir.path());
    let prompt = words(&[3, 1, 4, 1, 5]);
    let full = engines.continue_response(&prompt, &[], CAP).unwrap();
    assert!(full.response.len() > 6, "{:?}", full.response);
    assert_eq!(full.predictions.len(), full.response.len());

    // Continuing from any prefix of the response (the cache holds the longer sequence)
    // gives the same greedy tokens and the same draft predictions.
    for k in [1, 3, full.response.len() - 1] {
        let again = engines
            .continue_response(&prompt, &full.response[..k], CAP)
            .unwrap();
        assert_eq!(again.response, full.response, "prefix of {k}");
        assert_eq!(again.predictions, full.predictions[k..], "prefix of {k}");
    }

    // After a swap at k, the draft's teacher-forced pass takes prompt ⊕ response[..k] from
    // its prefix cache (our patch caches these passes) and recomputes only from the swap.
    let prompt_len = engines.prompt_tokens(&prompt).unwrap().len();
    for k in [2, 5] {
        let mut prefix = full.response[..k].to_vec();
        let other = (0u32..).find(|t| *t != full.response[k]).unwrap();
        prefix.push(other);
        engines.continue_response(&prompt, &prefix, CAP).unwrap();
        assert_eq!(engines.last_draft_cached(), prompt_len + k, "swap at {k}");
    }

    // A pass that itself began with a hit is cached under all its tokens, so extending it
    // by one token reuses all of it (keyed by the recomputed suffix alone, it never
    // matched again and every later pass fell back to the hit it started from).
    let mut branch = engines.prompt_tokens(&prompt).unwrap();
    branch.extend_from_slice(&full.response[..2]);
    let fresh_token = (0u32..).filter(|t| *t != full.response[2]).nth(1).unwrap();
    branch.extend_from_slice(&[fresh_token, full.response[0], full.response[1]]);
    let (first, _) = engines.draft_argmax(&branch).unwrap();
    assert_eq!(
        first,
        prompt_len + 2,
        "branch off the response after 2 tokens"
    );
    branch.push(full.response[0]);
    let (first, _) = engines.draft_argmax(&branch).unwrap();
    assert_eq!(first, prompt_len + 5, "the branch extended by one token");

    // A prediction is the draft's own greedy next token after the response so far.
    let prompt_tokens = engines.prompt_tokens(&prompt).unwrap();
    for p in [0, 2, full.response.len() - 1] {
        let mut context = prompt_tokens.clone();
        context.extend_from_slice(&full.response[..p]);
        let next = engines.greedy(Model::Draft, &context, 1).unwrap();
        assert_eq!(next.first(), Some(&full.predictions[p]), "position {p}");
    }

    // The hidden state at a draft token, read after the cache has seen the prefix (one
    // new token), equals the one read by a fresh engine over the whole sequence. The second
    // probe extends a finished request by its sampled token and one more: that token's KV
    // was never computed, so the cache must not claim it.
    let mut swapped = prompt_tokens.clone();
    swapped.extend_from_slice(&full.response[..4]);
    swapped.push(full.response[0]);
    let probes: Vec<(Model, Vec<u32>)> = [Model::Target, Model::Draft]
        .into_iter()
        .flat_map(|m| {
            let mut extended = prompt_tokens.clone();
            extended.extend_from_slice(&full.response[..2]);
            let sampled = engines.greedy(m, &extended, 1).unwrap();
            extended.extend_from_slice(&sampled);
            extended.push(full.response[0]);
            [(m, swapped.clone()), (m, extended)]
        })
        .collect();
    let warm: Vec<Vec<f32>> = probes
        .iter()
        .map(|(m, tokens)| last_hidden(&engines, *m, tokens))
        .collect();
    drop(engines);
    let fresh_dir = tempfile::tempdir().unwrap();
    let fresh = self::engines(fresh_dir.path());
    for (probe, ((m, tokens), warm)) in probes.iter().zip(&warm).enumerate() {
        let cold = last_hidden(&fresh, *m, tokens);
        assert_eq!(cold.len(), warm.len());
        let worst = cold
            .iter()
            .zip(warm)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-4,
            "probe {probe}, {m:?} {tokens:?}: hidden states differ by {worst}"
        );
    }
}

/// Teacher-forced passes (the captures behind features and the EAGLE miner's head drafts) are
/// cached for later hits, and like finished generations they stay within the CPU byte
/// bound: a mining run makes thousands of them, and unbounded they grew its memory until
/// the machine ran out.
#[test]
fn teacher_forced_passes_stay_within_the_prefix_cache_bound() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut engines = engines(dir.path());
    // Eight prompts of the same length that share no prefix past the chat template.
    let passes: Vec<Vec<u32>> = (0..8usize)
        .map(|k| engines.prompt_tokens(&words(&(0..24).map(|i| (k * 5 + i * 3) % 40).collect::<Vec<_>>())).unwrap())
        .collect();
    engines.raw_forward(Model::Target, &passes[0]).unwrap();
    let held = mistralrs_core::cpu_prefix_cache_bytes();
    assert!(held > 0, "a teacher-forced pass was not cached");
    // Room for one pass and a half in the target's cache: each later pass evicts the one
    // before it. (The draft's cache holds only its start-up passes, under `held`.)
    mistralrs_core::set_cpu_prefix_cache_limit(Some(held * 3 / 2));
    let mut after = Vec::new();
    for pass in &passes[1..] {
        engines.raw_forward(Model::Target, pass).unwrap();
        after.push(mistralrs_core::cpu_prefix_cache_bytes());
    }
    mistralrs_core::set_cpu_prefix_cache_limit(None);
    assert!(after.iter().all(|&bytes| bytes <= held * 5 / 2), "bytes held after each pass {after:?}, the first pass's {held}");
}
