//! What one decode step could cost at most on this machine: the bytes of weights a one-token
//! forward streams from memory, and how fast this machine streams bytes at all. A decode step
//! reads every matmul weight once, so its time is bounded below by bytes ÷ bandwidth; the
//! ratio of the two says how close the forward is to that bound.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    path::Path,
    time::Instant,
};

use anyhow::{Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct StreamingRead {
    pub threads: usize,
    pub bytes: usize,
    /// Best of the repeats (the others saw the same bytes with more interference).
    pub gb_per_second: f64,
}

/// Sum `bytes` of a buffer far larger than the caches, split over `threads`, `repeats`
/// times; the best pass's rate. A lower bound on what the machine can stream: a C loop of
/// 256-bit loads reached up to a fifth more on the machines we ran.
pub fn streaming_read(threads: usize, bytes: usize, repeats: usize) -> StreamingRead {
    let words = bytes / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads.max(1));
    let mut best = 0f64;
    let mut checksum = 0u64;
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = buffer.chunks(chunk).map(|part| s.spawn(move || sum_words(part))).collect();
            handles.into_iter().map(|h| h.join().expect("a summing thread panicked")).collect()
        });
        let seconds = start.elapsed().as_secs_f64();
        checksum = sums.iter().fold(checksum, |a, &b| a.wrapping_add(b));
        best = best.max(bytes as f64 / seconds / 1e9);
    }
    // The sums are used, so no pass can be optimised away.
    std::hint::black_box(checksum);
    StreamingRead { threads, bytes: words * 8, gb_per_second: best }
}

/// The words' wrapping sum: a reduction the compiler vectorises (hand-split lanes ran
/// several times slower).
fn sum_words(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

/// Bytes of the matmul weights one token's forward reads in the GGUF model at `path`: every
/// 2-D tensor, except the token embedding when the model has its own output matrix (a
/// forward then gathers one embedding row, not the whole table).
pub fn weights_read_per_token(path: &Path) -> Result<u64> {
    Ok(weights_by_role(path)?.values().map(|(bytes, _)| bytes).sum())
}

/// Per matmul role of a decode step (`attn_q`, `ffn_down`, `output`, …: the GGUF tensor
/// name without `blk.N.` and `.weight`), the bytes one token's forward reads over all
/// layers and the quant types stored. A model without its own output matrix reads the
/// token embedding as its LM head.
pub fn weights_by_role(path: &Path) -> Result<BTreeMap<String, (u64, BTreeSet<String>)>> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let content = gguf_file::Content::read(&mut file).with_context(|| format!("reading GGUF header of {}", path.display()))?;
    let separate_output = content.tensor_infos.contains_key("output.weight");
    let mut roles: BTreeMap<String, (u64, BTreeSet<String>)> = BTreeMap::new();
    for (name, info) in content.tensor_infos.iter().filter(|(_, info)| info.shape.dims().len() == 2) {
        let role = match name.as_str() {
            "token_embd.weight" if separate_output => continue,
            "token_embd.weight" => "output".to_string(),
            other => other.strip_suffix(".weight").unwrap_or(other).split('.').next_back().unwrap_or(other).to_string(),
        };
        let entry = roles.entry(role).or_default();
        entry.0 += tensor_bytes(info.ggml_dtype, info.shape.elem_count());
        entry.1.insert(format!("{:?}", info.ggml_dtype));
    }
    Ok(roles)
}

/// Bytes of `elements` values stored as `dtype` (whole blocks).
pub fn tensor_bytes(dtype: GgmlDType, elements: usize) -> u64 {
    (elements.div_ceil(dtype.block_size()) * dtype.type_size()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_and_sizes_are_exact() {
        let words: Vec<u64> = (1..=19).collect();
        assert_eq!(sum_words(&words), 190);
        // Q4_K: 256 values in 144 bytes; Q6_K: 256 in 210; F32: 4 bytes each.
        assert_eq!(tensor_bytes(GgmlDType::Q4K, 1536 * 256), 1536 * 144);
        assert_eq!(tensor_bytes(GgmlDType::Q6K, 512), 420);
        assert_eq!(tensor_bytes(GgmlDType::F32, 10), 40);
        let read = streaming_read(2, 1 << 20, 2);
        assert!(read.gb_per_second > 0.0 && read.bytes == 1 << 20, "{read:?}");
    }
}
