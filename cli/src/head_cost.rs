//! What an EAGLE head costs per drafted token in each weight format: the head alone, on
//! synthetic features (timing does not depend on what the features say), interleaved
//! format by format within every repeat. The bench's "draft ms / drafted token" is the same
//! cost inside decoding (plus the embedding look-ups and the sampling).

use std::{path::Path, time::Instant};

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor, D};
use serde::Serialize;
use verdict_heads::{CacheSegment, Eagle3Config, Eagle3Head, HeadCache, WeightFormat};

use crate::matmul_cost::median;

#[derive(Debug, Serialize)]
pub struct HeadCost {
    pub format: WeightFormat,
    /// The head's matrices in this format.
    pub weight_megabytes: f64,
    /// One draft step (one row through the layer and the LM head), median.
    pub draft_ms_per_token: f64,
    /// Taking in γ + 1 verified positions as after every verify forward (fc over their
    /// target features, keys and values of every row, the rest of the layer and the LM head
    /// on the last row only), median.
    pub observe_ms: f64,
    /// The same with the whole layer and the LM head on every row (how the head took them
    /// in before 2026-11-27), median.
    pub observe_every_row_ms: f64,
    pub draft_ratio_to_first: f64,
}

/// Weights of the head's matrices (fc, q/k/v/o, the MLP, the LM head).
fn matrix_weights(c: &Eagle3Config) -> usize {
    let (h, hd) = (c.hidden_size, c.head_dim());
    let attention = 2 * h * (c.num_attention_heads + 2 * c.num_key_value_heads) * hd + c.num_attention_heads * hd * h;
    3 * c.target_hidden() * h + attention + 3 * h * c.intermediate_size + h * c.draft_vocab()
}

fn bytes_per_weight(format: WeightFormat) -> f64 {
    match format {
        WeightFormat::F32 => 4.0,
        WeightFormat::Q8_0 => 34.0 / 32.0,
        WeightFormat::Q4K => 144.0 / 256.0,
    }
}

/// Time the head in `head_dir` in each of `formats` with `context` positions already in its
/// cache, drafting chains of `gamma` tokens.
pub fn measure(head_dir: &Path, formats: &[WeightFormat], context: usize, gamma: usize, repeats: usize) -> Result<Vec<HeadCost>> {
    ensure!(!formats.is_empty() && context > 0 && gamma > 0 && repeats > 0, "formats, context, γ and repeats must be non-empty / positive");
    let device = Device::Cpu;
    let mut heads = Vec::new();
    for &format in formats {
        let mut head = Eagle3Head::load(head_dir, &device)?;
        head.quantize(format)?;
        heads.push(head);
    }
    let c = heads[0].config.clone();
    let (h, positions) = (c.hidden_size, context + gamma + 1);
    let aux = Tensor::randn(0f32, 1.0, (positions, 3 * c.target_hidden()), &device)?;
    let embeds = Tensor::randn(0f32, 0.05, (positions, h), &device)?;
    let mut caches = Vec::new();
    for head in &heads {
        let mut cache = HeadCache::default();
        let ctx = head.fuse(&aux.narrow(0, 0, context)?)?;
        head.forward(&embeds.narrow(0, 0, context)?, &ctx, 0, &mut cache)?;
        caches.push(cache);
    }
    let runs = || vec![Vec::new(); heads.len()];
    let (mut draft, mut observe, mut observe_every_row) = (runs(), runs(), runs());
    // Repeat 0 warms up and is not counted.
    for repeat in 0..=repeats {
        for (i, head) in heads.iter().enumerate() {
            let cache = &mut caches[i];
            let mut take_in = |last_row_only: bool| -> Result<f64> {
                let start = Instant::now();
                let verified = head.fuse(&aux.narrow(0, context, gamma + 1)?)?;
                let embeds = embeds.narrow(0, context, gamma + 1)?;
                let segment = CacheSegment { start: context, rows: gamma + 1, cache: &mut *cache };
                let out = match last_row_only {
                    true => head.forward_last_rows(&embeds, &verified, &mut [segment])?,
                    false => head.forward_segments(&embeds, &verified, &mut [segment])?,
                };
                out.logits.argmax(D::Minus1)?;
                let ms = start.elapsed().as_secs_f64() * 1000.0;
                cache.truncate(context)?;
                Ok(ms)
            };
            let (observed, observed_every_row) = (take_in(true)?, take_in(false)?);

            let start = Instant::now();
            let mut hidden = head.fuse(&aux.narrow(0, context - 1, 1)?)?;
            for step in 0..gamma {
                let out = head.forward(&embeds.narrow(0, context + step, 1)?, &hidden, context + step, cache)?;
                out.logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
                hidden = out.hidden;
            }
            let drafted = start.elapsed().as_secs_f64() * 1000.0 / gamma as f64;
            cache.truncate(context)?;
            if repeat > 0 {
                observe[i].push(observed);
                observe_every_row[i].push(observed_every_row);
                draft[i].push(drafted);
            }
        }
    }
    let first = median(draft[0].clone());
    Ok(formats
        .iter()
        .enumerate()
        .map(|(i, &format)| {
            let d = median(draft[i].clone());
            HeadCost {
                format,
                weight_megabytes: matrix_weights(&c) as f64 * bytes_per_weight(format) / 1e6,
                draft_ms_per_token: d,
                observe_ms: median(observe[i].clone()),
                observe_every_row_ms: median(observe_every_row[i].clone()),
                draft_ratio_to_first: d / first,
            }
        })
        .collect())
}
