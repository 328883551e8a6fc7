//! The target's layers as its own decoding computes them, so that mining needs no second,
//! teacher-forced forward over every continuation it keeps.
//!
//! [`DecodeLayerRecorder`] is a proposer that never drafts: under mistral.rs's speculative
//! pipeline each step is then a plain decode (one row a sequence, batched), and the pipeline
//! hands the proposer the layers it asked for at every position it commits: the prompt
//! step's rows past the prefix cache, then one row a step. The recorder keeps them per
//! sequence and gives each finished sequence's up when asked.
//!
//! The last step of a sequence (the one that emits its final token) is not handed over, so a
//! recording covers its positions up to the third-to-last token of prompt ⊕ response (plus
//! one after an EOS). That is what an EAGLE head's first drafts along the response read.

use std::{collections::HashMap, sync::Mutex};

use candle_core::{DType, Device, Result, Tensor, D};
use mistralrs_core::speculative_hook::{Proposer, TargetFeatures};

/// The layers one sequence's forwards computed, from position `start` on.
#[derive(Clone, Debug)]
pub struct Recording {
    /// The sequence's tokens from position 0 through the token after the last recorded row.
    pub tokens: Vec<u32>,
    /// Position of the first recorded row (the prefix cache supplied those before).
    pub start: usize,
    /// `(rows, layers × H)` f16: the recorded layers side by side, in the recorder's order.
    pub layers: Tensor,
}

impl Recording {
    /// Rows recorded.
    pub fn rows(&self) -> Result<usize> {
        self.layers.dim(0)
    }
}

/// A sequence still decoding: its rows so far, one tensor a step.
struct Live {
    tokens: Vec<u32>,
    start: usize,
    steps: Vec<Tensor>,
    rows: usize,
}

impl Live {
    fn starting_at(start: usize) -> Self {
        Self { tokens: Vec::new(), start, steps: Vec::new(), rows: 0 }
    }
}

/// A proposer that drafts nothing and records the target layers `layers` of every sequence.
pub struct DecodeLayerRecorder {
    layers: Vec<usize>,
    live: Mutex<HashMap<usize, Live>>,
    finished: Mutex<Vec<Recording>>,
}

impl DecodeLayerRecorder {
    /// Records the outputs of decoder layers `layers` (0-based), side by side in this order.
    pub fn new(layers: Vec<usize>) -> Self {
        Self { layers, live: Mutex::new(HashMap::new()), finished: Mutex::new(Vec::new()) }
    }

    /// The recordings of the sequences finished since the last call.
    pub fn take_finished(&self) -> Vec<Recording> {
        std::mem::take(&mut *self.finished.lock().unwrap())
    }

    /// Drop every recording, live or finished (an engine was rebuilt, or a batch starts).
    pub fn clear(&self) {
        self.live.lock().unwrap().clear();
        self.finished.lock().unwrap().clear();
    }
}

impl Proposer for DecodeLayerRecorder {
    fn target_layers(&self) -> Vec<usize> {
        self.layers.clone()
    }

    fn observe_target(&self, features: &TargetFeatures<'_>) -> Result<()> {
        if features.layers.len() != self.layers.len() {
            candle_core::bail!("{} layers handed over, {} asked for", features.layers.len(), self.layers.len());
        }
        let step = Tensor::cat(&features.layers.iter().map(|(_, t)| t.to_dtype(DType::F16)).collect::<Result<Vec<_>>>()?, D::Minus1)?;
        let rows = step.dim(0)?;
        let mut live = self.live.lock().unwrap();
        let sequence = live.entry(features.seq_id).or_insert_with(|| Live::starting_at(features.start));
        let end = sequence.start + sequence.rows;
        if features.start != end {
            // Decoding without drafts commits every row it computes, so the rows follow on;
            // anything else (rows replaced, a gap) starts the recording over from here.
            tracing::debug!("sequence {}: rows from {} after {end} recorded; recording restarts", features.seq_id, features.start);
            *sequence = Live::starting_at(features.start);
        }
        sequence.steps.push(step);
        sequence.rows += rows;
        sequence.tokens = features.tokens.to_vec();
        Ok(())
    }

    fn propose(&self, _seq_id: usize, _gamma: usize, _sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<(Vec<u32>, Tensor)> {
        Ok((Vec::new(), Tensor::zeros((0, 1), DType::F32, &Device::Cpu)?))
    }

    fn release(&self, seq_id: usize) {
        let Some(sequence) = self.live.lock().unwrap().remove(&seq_id) else {
            return;
        };
        match Tensor::cat(&sequence.steps, 0) {
            Ok(layers) => self.finished.lock().unwrap().push(Recording { tokens: sequence.tokens, start: sequence.start, layers }),
            Err(e) => tracing::warn!("sequence {seq_id}: its recorded layers do not join ({e}); dropped"),
        }
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.live.lock().unwrap().get(&seq_id).map_or(0, |s| s.start + s.rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(recorder: &DecodeLayerRecorder, seq_id: usize, start: usize, rows: usize, tokens: &[u32]) {
        let layers: Vec<(usize, Tensor)> = [1usize, 3]
            .iter()
            .map(|&l| (l, Tensor::full((start * 10 + l) as f32, (rows, 2), &Device::Cpu).unwrap()))
            .collect();
        let features = TargetFeatures { seq_id, start, layers: &layers, next_tokens: &tokens[start + 1..], tokens };
        recorder.observe_target(&features).unwrap();
    }

    #[test]
    fn rows_of_a_sequence_join_in_order_and_come_out_once_released() {
        let recorder = DecodeLayerRecorder::new(vec![1, 3]);
        step(&recorder, 7, 2, 3, &[0, 1, 2, 3, 4, 5]);
        step(&recorder, 7, 5, 1, &[0, 1, 2, 3, 4, 5, 6]);
        step(&recorder, 8, 0, 2, &[9, 9, 9]);
        assert_eq!(recorder.cache_len(7), 6);
        assert!(recorder.take_finished().is_empty(), "nothing finished yet");
        recorder.release(7);
        let finished = recorder.take_finished();
        assert_eq!(finished.len(), 1);
        let r = &finished[0];
        assert_eq!((r.start, r.rows().unwrap(), r.tokens.clone()), (2, 4, vec![0, 1, 2, 3, 4, 5, 6]));
        // Rows side by side in the recorder's layer order: the first step's, then the second's.
        let values: Vec<Vec<f32>> = r.layers.to_dtype(DType::F32).unwrap().to_vec2().unwrap();
        assert_eq!(values[0], vec![21.0, 21.0, 23.0, 23.0]);
        assert_eq!(values[3], vec![51.0, 51.0, 53.0, 53.0]);
        assert!(recorder.take_finished().is_empty(), "a recording is handed out once");
        assert_eq!(recorder.cache_len(8), 2, "another sequence's rows are its own");
    }

    #[test]
    fn rows_that_do_not_follow_on_restart_the_recording() {
        let recorder = DecodeLayerRecorder::new(vec![1, 3]);
        step(&recorder, 1, 0, 4, &[0, 1, 2, 3, 4]);
        step(&recorder, 1, 2, 1, &[0, 1, 2, 3]);
        recorder.release(1);
        let r = recorder.take_finished().pop().unwrap();
        assert_eq!((r.start, r.rows().unwrap()), (2, 1));
    }

    #[test]
    fn it_never_drafts() {
        let recorder = DecodeLayerRecorder::new(vec![0]);
        let (tokens, logits) = recorder.propose(0, 4, &mut |_| unreachable!()).unwrap();
        assert!(tokens.is_empty());
        assert_eq!(logits.dim(0).unwrap(), 0);
    }
}
