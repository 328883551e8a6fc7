//! Plain greedy runs of a tiny target, and a proposer that drafts their known continuation,
//! so a test decides which drafts a step keeps and how many rows its verify forward has.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use candle_core::{Device, Tensor};
use mistralrs_core::speculative_hook::{Proposer, TargetFeatures};
use verdict::{
    config::Config,
    engine::{generate_with_top_tokens, Engine, LoadedModels, Prompt},
    tiny_model::{vocab, TinySpec, FIRST_WORD_ID},
};

/// A plain greedy completion: its text, its token ids, whether it stopped at EOS.
pub struct PlainRun {
    pub text: String,
    pub ids: Vec<u32>,
    pub stopped: bool,
}

/// Plain greedy completions of the target for `prompts`.
pub fn plain_runs(models: &LoadedModels, config: &Config, prompts: &[String]) -> Vec<PlainRun> {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let plain = Engine::plain(models, 1).await;
        let mut out = Vec::new();
        for p in prompts {
            let g = generate_with_top_tokens(&plain.mistralrs, &Prompt::Text(p.clone()), &config.sampling, 1)
                .await
                .unwrap();
            // Greedy: each position's best candidate is the emitted token.
            let ids = g.top_tokens.iter().map(|(_, best)| best[0].0).collect();
            out.push(PlainRun { text: g.text, ids, stopped: g.finish_reason == "stop" });
        }
        out
    })
}

/// Drafts the target's known plain continuation, at most `max_drafts` a step (0: the
/// verify forward is one row, a token decoded alone), with one draft spoiled every
/// `spoil_every` steps, so a test decides which steps keep every draft.
pub struct ScriptedProposer {
    completions: Vec<Vec<u32>>,
    vocab: usize,
    spoil_every: Option<usize>,
    max_drafts: usize,
    /// seq id → (completion index, prompt length, committed length).
    sequences: Mutex<HashMap<usize, (usize, usize, usize)>>,
    steps: Mutex<usize>,
}

impl Proposer for ScriptedProposer {
    fn target_layers(&self) -> Vec<usize> {
        vec![0]
    }

    fn observe_target(&self, f: &TargetFeatures<'_>) -> candle_core::Result<()> {
        let rows = f.layers[0].1.dim(0)?;
        assert_eq!(rows, f.next_tokens.len());
        let mut sequences = self.sequences.lock().unwrap();
        let started = sequences.len();
        let entry = sequences.entry(f.seq_id).or_insert((started, f.start + rows, 0));
        entry.2 = f.start + rows + 1;
        Ok(())
    }

    fn propose(
        &self,
        seq_id: usize,
        gamma: usize,
        sample: &mut dyn FnMut(&Tensor) -> candle_core::Result<u32>,
    ) -> candle_core::Result<(Vec<u32>, Tensor)> {
        let (which, prompt_len, committed) = self.sequences.lock().unwrap()[&seq_id];
        let done = committed - prompt_len;
        let mut step = self.steps.lock().unwrap();
        *step += 1;
        let spoil = self.spoil_every.is_some_and(|k| step.is_multiple_of(k));
        let drafts = gamma.min(self.max_drafts);
        let mut tokens = Vec::new();
        let mut rows = Vec::new();
        for i in 0..drafts {
            let mut token = self.completions[which].get(done + i).copied().unwrap_or(FIRST_WORD_ID as u32);
            if spoil && i == drafts / 2 {
                token = if token == FIRST_WORD_ID as u32 { token + 1 } else { FIRST_WORD_ID as u32 };
            }
            let mut row = vec![f32::NEG_INFINITY; self.vocab];
            row[token as usize] = 0.0;
            let row = Tensor::new(row, &Device::Cpu)?;
            tokens.push(sample(&row)?);
            rows.push(row.unsqueeze(0)?);
        }
        let logits = match rows.is_empty() {
            true => Tensor::zeros((0, self.vocab), candle_core::DType::F32, &Device::Cpu)?,
            false => Tensor::cat(&rows, 0)?,
        };
        Ok((tokens, logits))
    }

    fn release(&self, seq_id: usize) {
        if let Some(s) = self.sequences.lock().unwrap().get_mut(&seq_id) {
            s.2 = 0;
        }
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.sequences.lock().unwrap().get(&seq_id).map_or(0, |s| s.2.saturating_sub(1))
    }
}

/// A [`ScriptedProposer`] of `plain`'s completions (in the order the prompts are sent),
/// drafting up to γ a step.
pub fn scripted(plain: &[PlainRun], s: &TinySpec, spoil_every: Option<usize>) -> Arc<dyn Proposer> {
    scripted_at_most(plain, s, spoil_every, usize::MAX)
}

/// [`scripted`], drafting at most `max_drafts` a step.
pub fn scripted_at_most(
    plain: &[PlainRun],
    s: &TinySpec,
    spoil_every: Option<usize>,
    max_drafts: usize,
) -> Arc<dyn Proposer> {
    // The tiny models' EOS: `<|im_end|>` (3) with an EOS word, else `<|endoftext|>`.
    let eos = if s.eos_word.is_some() { 3 } else { 1 };
    Arc::new(ScriptedProposer {
        completions: plain
            .iter()
            .map(|run| {
                let mut ids = run.ids.clone();
                if run.stopped && ids.last() != Some(&eos) {
                    ids.push(eos);
                }
                ids
            })
            .collect(),
        vocab: vocab(s).len(),
        spoil_every,
        max_drafts,
        sequences: Mutex::new(HashMap::new()),
        steps: Mutex::new(0),
    })
}
