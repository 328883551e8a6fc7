//! Greedy chain drafting replayed offline on held-out problems: the runtime drafter commits
//! the target's recorded features step by step and drafts γ tokens where greedy `exact`
//! speculation would, so the figure is the τ a bench of those responses would measure. The
//! per-step accuracies of validation count every position alike; steps start more often
//! right after a miss, where the head tends to miss again, so they overstate τ.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use serde::Serialize;
use verdict::proposers::eagle::{SequenceDrafter, TokenEmbeddings};
use verdict_heads::Eagle3Head;

use crate::eagle_capture::SequenceFeatures;

/// What greedy chain drafting accepted over some responses.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ChainReplay {
    pub gamma: usize,
    /// Verify steps (each drafts γ tokens).
    pub steps: u64,
    pub accepted: u64,
    /// `accepted_per_position[i]`: steps whose draft i was kept.
    pub accepted_per_position: Vec<u64>,
}

impl ChainReplay {
    /// τ = 1 + accepted / steps, as the bench reports it.
    pub fn tau(&self) -> f64 {
        1.0 + self.accepted as f64 / self.steps.max(1) as f64
    }

    /// Replay one problem: from the prompt's features (the target's first forward) to the end
    /// of its response, draft γ tokens, keep the prefix that equals the response, commit the
    /// kept positions' features (the target's verify), repeat.
    pub fn add(
        &mut self,
        head: &Eagle3Head,
        embeddings: &dyn TokenEmbeddings,
        features: &SequenceFeatures,
        vocab_size: usize,
    ) -> Result<()> {
        let tokens = &features.tokens;
        let t = tokens.len();
        let start = features.response_start;
        ensure!(start >= 1 && start < t, "response start {start} outside 1..{t}");
        if self.accepted_per_position.len() < self.gamma {
            self.accepted_per_position.resize(self.gamma, 0);
        }
        let aux = features.aux.to_dtype(DType::F32)?;
        let mut drafter = SequenceDrafter::default();
        drafter.commit(head, embeddings, 0, &aux.narrow(0, 0, start)?, &tokens[1..=start])?;
        // `committed` positions have features; the token at `committed` is known (the
        // target's), the drafts guess the ones after it.
        let mut committed = start;
        while committed + 1 < t {
            let drafts = drafter.draft(head, embeddings, self.gamma, vocab_size, &mut |row: &Tensor| {
                Ok(row.argmax(0)?.to_scalar::<u32>()?)
            })?;
            let kept = drafts
                .tokens
                .iter()
                .zip(&tokens[committed + 1..])
                .take_while(|(d, r)| d == r)
                .count();
            self.steps += 1;
            self.accepted += kept as u64;
            for slot in &mut self.accepted_per_position[..kept] {
                *slot += 1;
            }
            // The verify forward's features: positions committed..=committed + kept, each with
            // the token after it (the last one the target's correction or bonus).
            let rows = (kept + 1).min(t - 1 - committed);
            drafter.commit(
                head,
                embeddings,
                committed,
                &aux.narrow(0, committed, rows)?,
                &tokens[committed + 1..committed + 1 + rows],
            )?;
            committed += rows;
        }
        Ok(())
    }
}

/// [`ChainReplay`] over the features files of held-out problems.
pub fn replay_problems(
    head: &Eagle3Head,
    embeddings: &dyn TokenEmbeddings,
    problems: &[PathBuf],
    gamma: usize,
    vocab_size: usize,
) -> Result<ChainReplay> {
    let mut replay = ChainReplay { gamma, ..Default::default() };
    for path in problems {
        replay.add(head, embeddings, &SequenceFeatures::load(path)?, vocab_size)?;
    }
    Ok(replay)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, D};
    use verdict::proposers::eagle::DenseEmbeddings;

    use super::*;

    const VOCAB: usize = 30;
    const HIDDEN: usize = 16;
    const GAMMA: usize = 3;

    fn head_and_embeddings() -> (Eagle3Head, DenseEmbeddings) {
        // Draft ids map to the even target ids 2..=24; odd ids are never drafted.
        verdict::tiny_model::random_eagle3_head(HIDDEN, VOCAB, (1..=12).map(|i| i * 2).collect()).unwrap()
    }

    fn features(tokens: Vec<u32>, response_start: usize, aux: &Tensor) -> SequenceFeatures {
        let t = tokens.len();
        SequenceFeatures {
            tokens,
            response_start,
            aux: aux.narrow(0, 0, t).unwrap().to_dtype(DType::F16).unwrap(),
            top_ids: Tensor::zeros((t, 1), DType::U32, &Device::Cpu).unwrap(),
            top_logits: Tensor::zeros((t, 1), DType::F16, &Device::Cpu).unwrap(),
        }
    }

    /// A response written by the drafter itself, in the replay's own step pattern: every
    /// step's γ drafts, then an odd "correction" token no draft can be. Replayed, every step
    /// keeps all γ drafts — unless the replay commits other rows or tokens than the runtime.
    #[test]
    fn a_response_of_the_heads_own_drafts_is_accepted_whole() {
        let (head, embeddings) = head_and_embeddings();
        let steps = 5;
        let prompt: Vec<u32> = vec![1, 3, 5, 7, 9];
        let total = prompt.len() + 1 + steps * (GAMMA + 1);
        let aux = Tensor::randn(0f32, 1.0, (total, 3 * HIDDEN), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let mut tokens = prompt.clone();
        tokens.push(11);
        let mut drafter = SequenceDrafter::default();
        let start = prompt.len();
        drafter.commit(&head, &embeddings, 0, &aux.narrow(0, 0, start).unwrap(), &tokens[1..=start]).unwrap();
        let mut committed = start;
        for _ in 0..steps {
            let drafts = drafter
                .draft(&head, &embeddings, GAMMA, VOCAB, &mut |row: &Tensor| Ok(row.argmax(D::Minus1)?.to_scalar::<u32>()?))
                .unwrap();
            assert!(drafts.tokens.iter().all(|t| t % 2 == 0), "{:?}", drafts.tokens);
            tokens.extend(&drafts.tokens);
            tokens.push(13);
            drafter
                .commit(&head, &embeddings, committed, &aux.narrow(0, committed, GAMMA + 1).unwrap(), &tokens[committed + 1..])
                .unwrap();
            committed += GAMMA + 1;
        }
        assert_eq!(tokens.len(), total);

        let mut replay = ChainReplay { gamma: GAMMA, ..Default::default() };
        replay.add(&head, &embeddings, &features(tokens.clone(), start, &aux), VOCAB).unwrap();
        assert_eq!(replay.steps, steps as u64);
        assert_eq!(replay.accepted_per_position, vec![steps as u64; GAMMA]);
        assert_eq!(replay.tau(), 1.0 + GAMMA as f64);

        // A response of tokens the head never drafts: one step per token, nothing kept.
        let odd: Vec<u32> = prompt.iter().copied().chain((0..9).map(|i| 2 * i + 1)).collect();
        let mut replay = ChainReplay { gamma: GAMMA, ..Default::default() };
        replay.add(&head, &embeddings, &features(odd, start, &aux), VOCAB).unwrap();
        assert_eq!((replay.steps, replay.accepted, replay.tau()), (8, 0, 1.0));
    }
}
