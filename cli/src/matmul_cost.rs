//! The isolated quantized matmuls of a GGUF model: one row per distinct (type, shape) of its
//! 2-D weights, timed over m input rows for each CPU kernel, interleaved. Tells how much of a
//! forward's cost is the matmuls and how it scales with the number of tokens.
//!
//! Timed back to back, a weight that fits in the last-level cache is read from there, not from
//! memory as inside a forward, so the multi-row rows here are optimistic; the forward rows of
//! `verdict forward-cost` are the real cost. (Flushing the caches before each call was tried:
//! it made every call, m = 1 included, slower than inside the model, as the threads also
//! went cold.)

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

/// The one-row rate of a quantized matmul kernel on weights too big for the caches.
#[derive(Debug, Serialize)]
pub struct QuantRate {
    pub dtype: String,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of the quantized weights (whole blocks).
    pub bytes: u64,
    /// Each repeat's time of one input row, in order.
    pub milliseconds: Vec<f64>,
    pub median_ms: f64,
    /// Bytes over the median time.
    pub gb_per_second: f64,
}

/// One random `rows × cols` matrix quantized to each of `dtypes`, one input row through
/// each under the row-invariant kernel, the types taking turns `repeats` times: how fast each
/// type's one-row kernel reads weights from memory, on the same shape and in the same minute.
/// The first call of each, with two rows, is untimed (the panel kernels repack the weights
/// then).
pub fn quant_rates(rows: usize, cols: usize, dtypes: &[GgmlDType], repeats: usize) -> Result<Vec<QuantRate>> {
    use candle_core::quantized::QTensor;
    let device = Device::Cpu;
    let initial = QuantKernel::selected();
    QuantKernel::RowInvariant.select();
    let values = Tensor::randn(0f32, 1.0, (rows, cols), &device)?;
    let weights: Vec<QMatMul> = dtypes
        .iter()
        .map(|&dtype| Ok(QMatMul::from_qtensor(QTensor::quantize(&values, dtype)?)?))
        .collect::<Result<_>>()?;
    drop(values);
    let input = Tensor::randn(0f32, 1.0, (1, 2, cols), &device)?;
    for weight in &weights {
        weight.forward(&input)?;
    }
    let one = input.narrow(1, 0, 1)?;
    let mut times = vec![Vec::with_capacity(repeats); dtypes.len()];
    for _ in 0..repeats {
        for (weight, times) in weights.iter().zip(&mut times) {
            let start = Instant::now();
            weight.forward(&one)?;
            times.push(start.elapsed().as_secs_f64() * 1000.0);
        }
    }
    initial.select();
    Ok(dtypes
        .iter()
        .zip(times)
        .map(|(&dtype, milliseconds)| {
            let bytes = crate::memory_bandwidth::tensor_bytes(dtype, rows * cols);
            let median_ms = median(milliseconds.clone());
            QuantRate { dtype: format!("{dtype:?}"), rows, cols, bytes, milliseconds, median_ms, gb_per_second: bytes as f64 / median_ms / 1e6 }
        })
        .collect())
}
