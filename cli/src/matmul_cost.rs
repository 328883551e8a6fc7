//! The isolated quantized matmuls of a GGUF model: one row per distinct (type, shape) of its
//! 2-D weights, timed over m input rows for each CPU kernel, interleaved. Tells how much of a
//! forward's cost is the matmuls and how it scales with the number of tokens.
//!
//! Timed back to back, a weight that fits in the last-level cache is read from there, not from
//! memory as inside a forward, so the multi-row rows here are optimistic; the forward rows of
//! `verdict forward-cost` are the real cost. (Flushing the caches before each call was tried:
//! it made every call, m = 1 included, 2–3× slower than inside the model, as the threads
//! also went cold.)

use std::{collections::BTreeMap, fs::File, path::Path, time::Instant};

use anyhow::{Context, Result};
use candle_core::{
    quantized::{gguf_file, GgmlDType, QMatMul},
    Device, Module, Tensor,
};
use serde::Serialize;

use verdict::kernels::QuantKernel;

#[derive(Debug, Serialize)]
pub struct MatmulCost {
    pub dtype: String,
    /// Output features × input features.
    pub rows: usize,
    pub cols: usize,
    /// How many weights of the model have this type and shape.
    pub count: usize,
    pub kernel: QuantKernel,
    /// Input rows (tokens).
    pub m: usize,
    /// Median over the repeats.
    pub milliseconds: f64,
    /// Cost relative to m = 1 with the same kernel.
    pub ratio_to_one: f64,
}

/// One representative weight per (type, shape), with its count, in a stable order.
fn distinct_weights(content: &gguf_file::Content) -> Vec<(String, GgmlDType, usize, usize, usize)> {
    let mut groups: BTreeMap<(String, usize, usize), (String, GgmlDType, usize)> = BTreeMap::new();
    for (name, info) in &content.tensor_infos {
        let dims = info.shape.dims();
        if dims.len() != 2 || matches!(info.ggml_dtype, GgmlDType::F32 | GgmlDType::F16) {
            continue;
        }
        let key = (format!("{:?}", info.ggml_dtype), dims[0], dims[1]);
        let entry = groups
            .entry(key)
            .or_insert_with(|| (name.clone(), info.ggml_dtype, 0));
        entry.2 += 1;
    }
    groups
        .into_iter()
        .map(|((_, rows, cols), (name, dtype, count))| (name, dtype, rows, cols, count))
        .collect()
}

/// The middle value (the upper one of an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Times `QMatMul::forward` on the model's own weights for every m in `sizes`.
pub fn measure(
    gguf: &Path,
    sizes: &[usize],
    kernels: &[QuantKernel],
    repeats: usize,
) -> Result<Vec<MatmulCost>> {
    let mut file = File::open(gguf).with_context(|| format!("opening {}", gguf.display()))?;
    let content = gguf_file::Content::read(&mut file)
        .with_context(|| format!("reading GGUF header of {}", gguf.display()))?;
    let device = Device::Cpu;
    let initial = QuantKernel::selected();
    let mut costs = Vec::new();
    for (name, dtype, rows, cols, count) in distinct_weights(&content) {
        let weight = QMatMul::from_qtensor(content.tensor(&mut file, &name, &device)?)?;
        let max_m = sizes.iter().copied().max().unwrap_or(1);
        let input = Tensor::randn(0f32, 1.0, (1, max_m, cols), &device)?;
        // Untimed: the first multi-row call of a kernel may prepare the weights (the panel
        // kernels repack them once). One row never does.
        if max_m > 1 {
            for kernel in kernels {
                kernel.select();
                weight.forward(&input)?;
            }
        }
        let mut times = vec![vec![Vec::new(); sizes.len()]; kernels.len()];
        for _ in 0..repeats {
            for (ki, kernel) in kernels.iter().enumerate() {
                kernel.select();
                for (si, &m) in sizes.iter().enumerate() {
                    let xs = input.narrow(1, 0, m)?;
                    let start = Instant::now();
                    weight.forward(&xs)?;
                    times[ki][si].push(start.elapsed().as_secs_f64() * 1000.0);
                }
            }
        }
        for (ki, &kernel) in kernels.iter().enumerate() {
            let medians: Vec<f64> = times[ki].iter().cloned().map(median).collect();
            for (si, &m) in sizes.iter().enumerate() {
                costs.push(MatmulCost {
                    dtype: format!("{dtype:?}"),
                    rows,
                    cols,
                    count,
                    kernel,
                    m,
                    milliseconds: medians[si],
                    ratio_to_one: medians[si] / medians[0],
                });
            }
        }
    }
    initial.select();
    Ok(costs)
}
