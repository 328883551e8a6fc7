//! The quantized matmuls of one Qwen2.5-1.5B Q4_K_M forward, on random weights, over m rows.
//!
//! Each of the 28 layers gets its own weights (q, k, v, o, gate, up, down; v and down are Q6_K
//! in every other layer, as in the GGUF), plus the Q6_K LM head, so every matmul reads its
//! weights from memory as inside the model, unlike `verdict forward-cost`'s isolated table,
//! where a weight timed back to back stays in the last-level cache. Sizes alternate within each
//! repeat; prints the median total per m and its ratio to the first size, and the mean per
//! kind of weight.
//!
//! ```sh
//! cargo run --release -p verdict-cli --example forward_matmuls -- 1,8 5 [stock|weight-stationary]
//! ```
use std::{collections::BTreeMap, time::Instant};

use anyhow::{Context, Result};
use candle_core::{
    quantized::{set_weight_stationary_matmul, GgmlDType, QMatMul, QTensor},
    Device, Module, Tensor,
};
use verdict_cli::matmul_cost::median;

const LAYERS: usize = 28;
const HIDDEN: usize = 1536;
const KV: usize = 256;
const FFN: usize = 8960;
const VOCAB: usize = 151936;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let sizes: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "1,8".into())
        .split(',')
        .map(|m| m.parse().with_context(|| format!("bad size {m:?}")))
        .collect::<Result<_>>()?;
    let repeats: usize = args
        .next()
        .map_or(Ok(5), |r| r.parse())
        .context("bad repeats")?;
    match args.next().as_deref() {
        None | Some("weight-stationary") => set_weight_stationary_matmul(true),
        Some("stock") => set_weight_stationary_matmul(false),
        Some(other) => anyhow::bail!("unknown kernel {other:?} (stock, weight-stationary)"),
    }
    let device = Device::Cpu;
    let random = |n: usize, k: usize| Tensor::randn(0f32, 0.05, (n, k), &device);
    let (attn, kv, ffn_in, ffn_out) = (
        random(HIDDEN, HIDDEN)?,
        random(KV, HIDDEN)?,
        random(FFN, HIDDEN)?,
        random(HIDDEN, FFN)?,
    );
    let quantize = |w: &Tensor, dtype| -> Result<QMatMul> {
        Ok(QMatMul::from_qtensor(QTensor::quantize(w, dtype)?)?)
    };
    eprintln!("quantizing {LAYERS} layers and the LM head…");
    let mut weights: Vec<(&str, QMatMul)> = Vec::new();
    for layer in 0..LAYERS {
        let (mixed, kind) = if layer % 2 == 0 {
            (GgmlDType::Q6K, "down (Q6_K)")
        } else {
            (GgmlDType::Q4K, "down (Q4_K)")
        };
        weights.push(("q", quantize(&attn, GgmlDType::Q4K)?));
        weights.push(("k", quantize(&kv, GgmlDType::Q4K)?));
        weights.push(("v", quantize(&kv, mixed)?));
        weights.push(("o", quantize(&attn, GgmlDType::Q4K)?));
        weights.push(("gate", quantize(&ffn_in, GgmlDType::Q4K)?));
        weights.push(("up", quantize(&ffn_in, GgmlDType::Q4K)?));
        weights.push((kind, quantize(&ffn_out, mixed)?));
    }
    weights.push((
        "lm head",
        quantize(&random(VOCAB, HIDDEN)?, GgmlDType::Q6K)?,
    ));
    let inputs: Vec<(Tensor, Tensor)> = sizes
        .iter()
        .map(|&m| {
            Ok((
                Tensor::randn(0f32, 1.0, (m, HIDDEN), &device)?,
                Tensor::randn(0f32, 1.0, (m, FFN), &device)?,
            ))
        })
        .collect::<Result<_>>()?;
    let mut totals = vec![Vec::new(); sizes.len()];
    let mut by_kind: BTreeMap<(usize, &str), f64> = BTreeMap::new();
    // Repeat 0 is a warm-up: the first multi-row call repacks the weights for the VNNI kernels.
    for repeat in 0..=repeats {
        for (si, (hidden, ffn)) in inputs.iter().enumerate() {
            let start = Instant::now();
            for (kind, w) in &weights {
                let x = if kind.starts_with("down") {
                    ffn
                } else {
                    hidden
                };
                let t = Instant::now();
                w.forward(x)?;
                if repeat > 0 {
                    *by_kind.entry((si, kind)).or_default() += t.elapsed().as_secs_f64() * 1e3;
                }
            }
            if repeat > 0 {
                totals[si].push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let first = median(totals[0].clone());
    for (si, m) in sizes.iter().enumerate() {
        let total = median(totals[si].clone());
        println!(
            "m = {m:3}: {total:7.1} ms ({:.2}× m = {})",
            total / first,
            sizes[0]
        );
        let kinds: Vec<String> = by_kind
            .iter()
            .filter(|((s, _), _)| *s == si)
            .map(|((_, kind), ms)| format!("{kind} {:.1}", ms / repeats as f64))
            .collect();
        println!("         {}", kinds.join(", "));
    }
    Ok(())
}
