//! `train-head eagle`'s pieces on a tiny generated target: features captured through the real
//! pipeline, a head that learns them, a killed run that resumes to the same parameters, and
//! a saved head that the runtime loads with the trainer's logits.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use verdict::{
    config::Config,
    engine::LoadedModels,
    proposers::eagle_proposer::target_embeddings,
    tiny_model::{write_tiny_model, TinyArch, TinySpec},
};
use verdict_heads::{Eagle3Config, Eagle3Head};
use verdict_training::{
    eagle_capture::{capture_sequence, features_path, SequenceFeatures},
    eagle_fit::{draft_vocabulary, EagleFitOptions, EagleTrainer},
    engine::{MistralEngines, Model},
};

const LAYERS: [usize; 3] = [0, 1, 1];

/// mistral.rs's hidden-state capture is armed for the whole process: tests that capture run
/// one at a time, or one would record the other's forwards.
static CAPTURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn capturing() -> std::sync::MutexGuard<'static, ()> {
    CAPTURING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Features of the tiny target's greedy responses to 12 prompts, in `dir/features`.
fn captured(dir: &Path) -> (LoadedModels, Vec<PathBuf>, Vec<Vec<u32>>) {
    let spec = TinySpec::new(TinyArch::Llama, 11);
    write_tiny_model(&spec, &dir.join("target")).unwrap();
    let config = Config::from_toml(&format!(
        "[models]\ntarget = {:?}\n[speculative]\nenabled = false\n",
        dir.join("target").to_str().unwrap()
    ))
    .unwrap();
    let models = LoadedModels::load(&config).unwrap();
    let mut engines = MistralEngines::target_only(&models).unwrap();
    let features = dir.join("features");
    std::fs::create_dir_all(&features).unwrap();
    let (mut files, mut responses) = (Vec::new(), Vec::new());
    for i in 0..12 {
        // Token ids of words: 7 + word index (the tiny vocabulary's layout).
        let prompt: Vec<u32> = [i, (i * 7 + 3) % 50, 20 + i].iter().map(|w| 7 + *w as u32).collect();
        let response = engines.greedy(Model::Target, &prompt, 24).unwrap();
        let tokens: Vec<u32> = prompt.iter().chain(&response).copied().collect();
        let f = capture_sequence(&mut engines, &tokens, prompt.len(), &LAYERS).unwrap();
        assert_eq!(f.aux.dims(), &[tokens.len(), 3 * spec.hidden_size]);
        let path = features_path(&features, i);
        f.save(&path).unwrap();
        files.push(path);
        responses.push(response);
    }
    (models, files, responses)
}

/// A tiny target (in `dir/target`) loaded alone, and a random EAGLE-3 head over its whole
/// vocabulary with the embeddings it drafts with.
fn target_with_random_head(dir: &Path) -> (TinySpec, LoadedModels, std::sync::Arc<Eagle3Head>, std::sync::Arc<dyn verdict::proposers::eagle::TokenEmbeddings>) {
    let spec = TinySpec::new(TinyArch::Llama, 11);
    write_tiny_model(&spec, &dir.join("target")).unwrap();
    let config = Config::from_toml(&format!("[models]\ntarget = {:?}\n[speculative]\nenabled = false\n", dir.join("target").to_str().unwrap())).unwrap();
    let models = LoadedModels::load(&config).unwrap();
    let vocab = models.target_fingerprint.vocab_size;
    let (head, embeddings) = verdict::tiny_model::random_eagle3_head(spec.hidden_size, vocab, (0..vocab as u32).collect()).unwrap();
    (spec, models, std::sync::Arc::new(head), std::sync::Arc::new(embeddings))
}

fn head_config(vocab_size: usize, draft_vocab: usize) -> Eagle3Config {
    serde_json::from_value(serde_json::json!({
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab_size, "draft_vocab_size": draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 2]},
    }))
    .unwrap()
}

fn options(epochs: usize) -> EagleFitOptions {
    EagleFitOptions {
        ttt_steps: 3,
        epochs,
        lr: 3e-3,
        batch: 3,
        checkpoint_secs: 3600,
        seed: 5,
        ..EagleFitOptions::default()
    }
}

fn params(trainer: &EagleTrainer) -> Vec<(String, Vec<f32>)> {
    let vars = trainer.varmap.data().lock().unwrap();
    let mut all: Vec<(String, Vec<f32>)> = vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

#[test]
fn a_head_learns_the_targets_features_and_resumes_exactly() {
    let _capturing = capturing();
    let dir = tempfile::tempdir().unwrap();
    let (models, files, responses) = captured(dir.path());
    let vocab_size = models.target_fingerprint.vocab_size;
    let used = draft_vocabulary(&responses, 16, &[], vocab_size).unwrap();
    let embeddings = target_embeddings(&models.target_source).unwrap();
    let config = head_config(vocab_size, used.len());

    // Uninterrupted: 4 epochs over the 12 problems.
    let mut whole = EagleTrainer::new(config.clone(), used.clone(), embeddings.clone(), options(4), &dir.path().join("a")).unwrap();
    let before = whole.validate(&files).unwrap();
    assert!(whole.fit(&files, &files, &dir.path().join("a")).unwrap());
    let after = whole.progress.validation.last().unwrap().clone();
    assert!(
        after[0] > before[0] + 0.2,
        "step-0 accuracy on the training problems went from {before:?} to {after:?}"
    );

    // Killed after 5 updates (mid-epoch), then resumed from its checkpoint in a new trainer.
    let ckpt = dir.path().join("b");
    let mut first = EagleTrainer::new(config.clone(), used.clone(), embeddings.clone(), EagleFitOptions { stop_after_updates: Some(5), ..options(4) }, &ckpt).unwrap();
    assert!(!first.fit(&files, &files, &ckpt).unwrap());
    drop(first);
    let mut resumed = EagleTrainer::new(config.clone(), used.clone(), embeddings.clone(), options(4), &ckpt).unwrap();
    assert_eq!(resumed.progress.updates, 5);
    assert!(resumed.fit(&files, &files, &ckpt).unwrap());
    assert_eq!(params(&resumed), params(&whole), "a resumed run ends elsewhere than an uninterrupted one");
    assert_eq!(resumed.progress.validation, whole.progress.validation);

    // A checkpoint is not resumed on other problems or with another learning rate.
    let mut other = EagleTrainer::new(config.clone(), used.clone(), embeddings.clone(), EagleFitOptions { lr: 1e-3, ..options(4) }, &ckpt).unwrap();
    let err = format!("{:#}", other.fit(&files[1..], &files, &ckpt).unwrap_err());
    assert!(err.contains("training problems (12 then, 11 now)") && err.contains("lr (0.003 then, 0.001 now)"), "{err}");

    // The saved head loads in the runtime and computes the trainer's logits: exactly from
    // f32 weights, within f16's rounding from the shipped f16 file.
    let f = SequenceFeatures::load(&files[0]).unwrap();
    let aux = f.aux.to_dtype(DType::F32).unwrap();
    let embeds = Tensor::randn(0f32, 1.0, (f.len(), 32), &Device::Cpu).unwrap();
    let trained = whole.head.forward_ttt(&aux, std::slice::from_ref(&embeds)).unwrap();
    for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::F16, 2e-2)] {
        let out = dir.path().join(format!("head-{dtype:?}"));
        whole.save_head(&out, dtype).unwrap();
        let loaded = Eagle3Head::load(&out, &Device::Cpu).unwrap();
        let got = loaded.forward_ttt(&aux, std::slice::from_ref(&embeds)).unwrap();
        let gap = (&trained[0].logits - &got[0].logits).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(gap < tolerance, "{dtype:?}: the loaded head's logits differ by {gap}");
        for (d, &t) in used.iter().enumerate() {
            assert_eq!(loaded.target_id(d as u32), t);
        }
    }
}

/// Mining with an EAGLE head (`train-head mine --eagle-head`): the prediction at each
/// response position is the first draft the runtime drafter makes there after committing
/// every position before it, so the mismatches mined are the ones speculation meets.
#[test]
fn eagle_mining_predicts_the_runtime_drafters_first_drafts() {
    let _capturing = capturing();
    use verdict::proposers::eagle::SequenceDrafter;
    use verdict_training::{eagle_capture::capture_layers, eagle_mine::EagleMiningEngine};

    let dir = tempfile::tempdir().unwrap();
    let (spec, models, head, embeddings) = target_with_random_head(dir.path());
    let vocab = models.target_fingerprint.vocab_size;
    let engines = MistralEngines::target_only(&models).unwrap();
    let mut miner = EagleMiningEngine::with_head(engines, head.clone(), embeddings.clone(), LAYERS.to_vec());

    let prompt: Vec<u32> = [3u32, 24, 41, 9].iter().map(|w| 7 + w).collect();
    let response = miner.engines().greedy(Model::Target, &prompt, 16).unwrap();
    let tokens: Vec<u32> = prompt.iter().chain(&response).copied().collect();
    let predictions = miner.head_predictions(&tokens, prompt.len()).unwrap();
    assert_eq!(predictions.len(), response.len());

    // The runtime drafter's first draft at each position from `from` on, committing rows
    // 0..position − 1 (each with the token after it) of a capture of the whole sequence.
    let drafter_firsts = |miner: &mut EagleMiningEngine, tokens: &[u32], from: usize| -> Vec<u32> {
        let (_, aux) = capture_layers(miner.engines(), Model::Target, tokens, &LAYERS).unwrap();
        let aux = aux.to_dtype(DType::F32).unwrap();
        let mut greedy = |row: &Tensor| Ok(row.argmax(candle_core::D::Minus1)?.to_scalar::<u32>()?);
        (from..tokens.len())
            .map(|position| {
                let mut drafter = SequenceDrafter::default();
                drafter.commit(&head, &*embeddings, 0, &aux.narrow(0, 0, position - 1).unwrap(), &tokens[1..position]).unwrap();
                drafter.draft(&head, &*embeddings, 1, vocab, &mut greedy).unwrap().tokens[0]
            })
            .collect()
    };
    // A continuation after a swap shares the prompt and three response tokens with the first:
    // its layers there come from the first capture, the rest from a partial forward.
    let swapped = prompt.len() + 3;
    let mut second: Vec<u32> = tokens[..swapped].to_vec();
    second.push(predictions[3]);
    let rest = miner.engines().greedy(Model::Target, &second, 8).unwrap();
    second.extend(rest);
    let second_predictions = miner.head_predictions(&second, swapped).unwrap();
    assert!(miner.reused_rows() >= swapped - 2, "the second capture recomputed the shared prefix ({} rows reused)", miner.reused_rows());
    // The references capture each sequence whole (clearing the caches).
    assert_eq!(drafter_firsts(&mut miner, &tokens, prompt.len()), predictions, "the drafter's first drafts against the mined predictions");
    assert_eq!(drafter_firsts(&mut miner, &second, swapped), second_predictions, "after a swap, with layers reused");
    let mut distinct = predictions.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(distinct.len() > 1, "a random head predicted one token everywhere ({predictions:?}): the comparison says nothing");

    // Features for such labels read the target alone (`features --target-only`): the draft
    // side is empty, and only a target-feature head can be fitted on them.
    use verdict_heads::FeatureSpec;
    use verdict_training::{
        autojudge_head::{load_samples, LabelSet},
        features::{feature_path, problem_features},
        labels::{LabelStore, Mismatch, ProblemLabels},
    };
    let labels = ProblemLabels {
        problem_id: 0,
        target_answer: Some("1".into()),
        mismatches: (0..2)
            .map(|i| Mismatch { position: i, target_token: response[i], draft_token: predictions[i], important: i == 0, prefix: response[..i].to_vec(), shortcut: false, draft_probability: None })
            .collect(),
        final_response: response.clone(),
        generated_tokens: response.len(),
        seconds: 0.0,
    };
    let label_file = dir.path().join("labels.jsonl");
    LabelStore::open(&label_file).unwrap().append(&labels).unwrap();
    let features = problem_features(miner.engines(), "Add one and one.", &labels).unwrap();
    assert_eq!(features.target_last.dims(), &[2, spec.hidden_size]);
    assert_eq!(features.draft_last.dims(), &[2, 0]);
    let feature_dir = dir.path().join("judge-features");
    std::fs::create_dir_all(&feature_dir).unwrap();
    features.save(&feature_path(&feature_dir, 0)).unwrap();
    let set = LabelSet { labels: label_file.clone(), features: feature_dir.clone() };
    let samples = load_samples(&set, 0, FeatureSpec::TargetOnly).unwrap();
    assert_eq!(samples.iter().map(|s| s.features.len()).collect::<Vec<_>>(), vec![spec.hidden_size; 2]);
    let err = format!("{:#}", load_samples(&set, 0, FeatureSpec::DraftAndTarget).unwrap_err());
    assert!(err.contains("without a draft model") && err.contains("--spec target"), "{err}");
}

/// Its answer: the last word of the response (the tiny target's text has no numbers).
struct LastWord;

impl verdict_eval::tasks::TaskAdapter for LastWord {
    type Problem = String;
    fn prompt(&self, problem: &String) -> String {
        problem.clone()
    }
    fn extract_answer(&self, response: &str) -> Option<String> {
        response.split_whitespace().last().map(str::to_string)
    }
    fn is_correct(&self, _: &String, _: &str) -> bool {
        false
    }
}

/// `mine --eagle-head --together`: the continuations of several problems decoded as one
/// batch (ragged lengths, prefix caches kept across problems, layers recorded by the
/// decode) give each problem the labels it gets mined alone (layers captured).
#[test]
fn eagle_mining_problems_together_gives_the_labels_mined_alone() {
    let _capturing = capturing();
    use verdict::tiny_model::words;
    use verdict_training::{
        eagle_mine::EagleMiningEngine,
        labels::LabelStore,
        mine::{mine, MiningPlan},
    };

    let dir = tempfile::tempdir().unwrap();
    let (_, models, head, embeddings) = target_with_random_head(dir.path());
    let problems: Vec<String> = [[3, 24, 41, 9], [5, 11, 30, 2], [17, 8, 44, 1], [40, 13, 6, 27], [21, 33, 2, 50]].iter().map(|w| words(w)).collect();
    let plan = |together| MiningPlan { problems: 0..problems.len(), max_response_tokens: 14, important_below: None, together };
    // Each problem's labels with the run's wall time left out, and apart from them the
    // target's probabilities of its drafts.
    let labels = |path: &Path| {
        let mut all = LabelStore::read_all(path).unwrap();
        all.sort_by_key(|p| p.problem_id);
        all.into_iter()
            .map(|mut problem| {
                problem.seconds = 0.0;
                let probabilities: Vec<f32> = problem.mismatches.iter_mut().map(|m| m.draft_probability.take().expect("the miner reads the draft's probability")).collect();
                (problem, probabilities)
            })
            .collect::<Vec<_>>()
    };

    let alone = dir.path().join("alone.jsonl");
    let mut miner = EagleMiningEngine::with_head(MistralEngines::target_only(&models).unwrap(), head.clone(), embeddings.clone(), LAYERS.to_vec());
    mine(&mut miner, &LastWord, &problems, &plan(1), &alone).unwrap();
    drop(miner);
    // Together as `train-head mine` runs: the layers from the decodes' recordings.
    let together = dir.path().join("together.jsonl");
    let recorder = std::sync::Arc::new(verdict_training::decode_layers::DecodeLayerRecorder::new(LAYERS.to_vec()));
    let mut engines = MistralEngines::target_only_recording(&models, recorder).unwrap();
    engines.batch_continuations(3, 1 << 28);
    let mut miner = EagleMiningEngine::with_head(engines, head, embeddings, LAYERS.to_vec());
    mine(&mut miner, &LastWord, &problems, &plan(3), &together).unwrap();
    assert!(miner.recorded_rows() > 0, "no layers came from the decodes");

    let (alone, together) = (labels(&alone), labels(&together));
    assert_eq!(together.len(), problems.len());
    let tested: usize = alone.iter().map(|(p, _)| p.mismatches.len()).sum();
    let regenerated = alone.iter().map(|(p, _)| p.generated_tokens).sum::<usize>() > alone.iter().map(|(p, _)| p.final_response.len()).sum::<usize>();
    assert!(tested >= 3 && regenerated, "too little was mined to compare ({tested} mismatches)");
    // A decode alone and one in a ragged batch (whose make-up depends on timing) sum in
    // different orders: the target's probabilities differ in the last bits, and now and then
    // (about one run in eight here) a near-tie flips one problem's labels. A continuation
    // handed to the wrong search changes every problem's.
    let same: Vec<usize> = alone.iter().zip(&together).filter(|((a, _), (b, _))| a == b).map(|((a, _), _)| a.problem_id).collect();
    assert!(same.len() >= problems.len() - 2, "only problems {same:?} got the labels they get mined alone");
    for ((_, a), (_, b)) in alone.iter().zip(&together).filter(|((a, _), (b, _))| a == b) {
        for (a, b) in a.iter().zip(b) {
            assert!((a - b).abs() <= 1e-4 * a.max(*b), "the draft's probability {a} alone, {b} together");
        }
    }
}

/// The layers a recording target's decode computed for a continuation are the ones a
/// teacher-forced capture of the same tokens records: for first responses decoded together,
/// and for a swap's continuation, whose prefix comes from the response before it.
#[test]
fn layers_recorded_while_decoding_match_a_teacher_forced_capture() {
    let _capturing = capturing();
    use verdict::tiny_model::words;
    use verdict_training::{decode_layers::DecodeLayerRecorder, eagle_capture::capture_layers, eagle_mine::EagleMiningEngine, miner::MiningEngine};

    let dir = tempfile::tempdir().unwrap();
    let (_, models, head, embeddings) = target_with_random_head(dir.path());
    let recorder = std::sync::Arc::new(DecodeLayerRecorder::new(LAYERS.to_vec()));
    let mut engines = MistralEngines::target_only_recording(&models, recorder).unwrap();
    engines.batch_continuations(3, 1 << 28);
    let mut miner = EagleMiningEngine::with_head(engines, head, embeddings, LAYERS.to_vec());
    let mut reference = MistralEngines::target_only(&models).unwrap();
    // Rows 0..T − 2 of prompt ⊕ response: what the head's drafts along the response read.
    let mut compare = |miner: &mut EagleMiningEngine, prompt: &str, response: &[u32]| {
        let mut tokens = miner.engines().prompt_tokens(prompt).unwrap();
        tokens.extend_from_slice(response);
        let tokens = &tokens[..tokens.len() - 2];
        let recorded_before = miner.recorded_rows();
        let layers = miner.target_layers(tokens).unwrap().to_dtype(DType::F32).unwrap();
        let recorded = miner.recorded_rows() - recorded_before;
        let (_, captured) = capture_layers(&mut reference, Model::Target, tokens, &LAYERS).unwrap();
        let captured = captured.to_dtype(DType::F32).unwrap();
        let gap: f32 = (&layers - &captured).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        let scale: f32 = captured.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        // Both are stored as f16: one rounding apart at most, where the sums agree.
        assert!(gap <= 2e-3 * scale.max(1.0), "recorded layers of {prompt:?} miss the capture's by {gap} (scale {scale})");
        recorded
    };

    let prompts: Vec<String> = [[3, 24, 41, 9], [5, 11, 30, 2], [17, 8, 44, 1]].iter().map(|w| words(w)).collect();
    let requests: Vec<(&str, &[u32])> = prompts.iter().map(|p| (p.as_str(), &[][..])).collect();
    let first = miner.continue_responses_unpredicted(&requests, 16).unwrap();
    for (prompt, continuation) in prompts.iter().zip(&first) {
        assert!(continuation.response.len() >= 4, "a response too short to compare: {:?}", continuation.response);
        let recorded = compare(&mut miner, prompt, &continuation.response);
        assert!(recorded >= continuation.response.len() - 2, "{recorded} rows of {prompt:?} came from its decode");
    }

    // A swap in the second problem's response: the target's prefix cache holds its first
    // three tokens, so the decode records from there and the rows before come from the
    // first response's layers.
    let response = &first[1].response;
    let mut prefix = response[..3].to_vec();
    prefix.push(if response[3] == 7 { 8 } else { 7 });
    let swapped = miner.continue_responses_unpredicted(&[(prompts[1].as_str(), &prefix[..])], 16).unwrap().pop().unwrap();
    let reused_before = miner.reused_rows();
    let recorded = compare(&mut miner, &prompts[1], &swapped.response);
    assert!(recorded >= swapped.response.len() - 5, "only {recorded} rows of the swap's continuation came from its decode");
    assert!(miner.reused_rows() > reused_before, "the prefix's rows were not taken from the first response");
}
