//! Rows of the target's large (vocab, hidden) matrices without a dense copy: its token
//! embeddings for a draft head, its LM head's rows for judges that score a few tokens. From a
//! GGUF each asked-for row's blocks are dequantized on their own (151,936 × 1,536 values are
//! ≈ 0.9 GB as f32).

use std::{borrow::Cow, path::Path, sync::Arc};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{
    quantized::{gguf_file, QStorage, QTensor},
    safetensors::MmapedSafetensors,
    DType, Device, Tensor,
};

use super::eagle::{DenseEmbeddings, TokenEmbeddings};
use crate::models::ModelSource;

/// The target's input embeddings.
pub fn target_embeddings(target: &ModelSource) -> Result<Arc<dyn TokenEmbeddings>> {
    matrix_rows(target, &["token_embd.weight"], &["model.embed_tokens.weight"])
}

/// The target's LM head (its output projection; the embeddings when they are tied).
pub fn target_output_rows(target: &ModelSource) -> Result<Arc<dyn TokenEmbeddings>> {
    matrix_rows(
        target,
        &["output.weight", "token_embd.weight"],
        &["lm_head.weight", "model.embed_tokens.weight"],
    )
}

/// The first of `gguf_names` in a GGUF (kept quantized), or of `dense_names` in a
/// safetensors folder (as f32).
fn matrix_rows(target: &ModelSource, gguf_names: &[&str], dense_names: &[&str]) -> Result<Arc<dyn TokenEmbeddings>> {
    match target {
        ModelSource::Gguf(path) => Ok(Arc::new(QuantizedEmbeddings::from_gguf(path, gguf_names)?)),
        ModelSource::Safetensors(dir) => {
            let files = std::fs::read_dir(dir)
                .with_context(|| format!("cannot list {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect::<Vec<_>>();
            // Mapped, so only the one matrix asked for is read, whichever file holds it.
            let weights = unsafe { MmapedSafetensors::multi(&files) }
                .with_context(|| format!("cannot read the safetensors files of {}", dir.display()))?;
            let Some(name) = dense_names.iter().find(|n| weights.get(n).is_ok()) else {
                bail!("{} has none of {dense_names:?}", dir.display());
            };
            let table = weights.load(name, &Device::Cpu)?;
            Ok(Arc::new(DenseEmbeddings(table.to_dtype(DType::F32)?)))
        }
    }
}

pub struct QuantizedEmbeddings {
    table: QTensor,
    /// Bytes of one row of blocks.
    row_bytes: usize,
    hidden: usize,
}

impl QuantizedEmbeddings {
    /// A (vocab, hidden) quantized table.
    pub fn new(table: QTensor) -> Result<Self> {
        let (vocab, hidden) = table.shape().dims2()?;
        let dtype = table.dtype();
        ensure!(hidden % dtype.block_size() == 0, "embedding width {hidden} is not a whole number of {dtype:?} blocks");
        let row_bytes = hidden / dtype.block_size() * dtype.type_size();
        ensure!(table.data()?.len() == vocab * row_bytes, "embedding table size does not match its shape");
        Ok(Self { table, row_bytes, hidden })
    }

    /// The first tensor of `names` that a GGUF model holds.
    pub fn from_gguf(path: &Path, names: &[&str]) -> Result<Self> {
        let mut file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let content = gguf_file::Content::read(&mut file)
            .with_context(|| format!("{} is not a GGUF file", path.display()))?;
        let Some(name) = names.iter().find(|n| content.tensor_infos.contains_key(**n)) else {
            bail!("{} has none of {names:?}", path.display());
        };
        Self::new(content.tensor(&mut file, name, &Device::Cpu)?)
    }

    pub fn vocab_size(&self) -> usize {
        self.table.shape().dims()[0]
    }
}

impl TokenEmbeddings for QuantizedEmbeddings {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let data = self.table.data()?;
        let rows = tokens
            .iter()
            .map(|&token| {
                let t = token as usize;
                ensure!(t < self.vocab_size(), "token {token} is outside the vocabulary of {}", self.vocab_size());
                let bytes = &data[t * self.row_bytes..(t + 1) * self.row_bytes];
                let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, self.table.dtype())?;
                Ok(QTensor::new(storage, (1, self.hidden))?.dequantize(&Device::Cpu)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&rows, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{quantized::GgmlDType, IndexOp};

    use super::*;

    #[test]
    fn rows_equal_the_whole_table_dequantized() {
        let dense = Tensor::randn(0f32, 1.0, (10, 512), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
            let table = QTensor::quantize(&dense, dtype).unwrap();
            let whole = table.dequantize(&Device::Cpu).unwrap();
            let embeddings = QuantizedEmbeddings::new(table).unwrap();
            let rows = embeddings.embed(&[3, 9, 3, 0]).unwrap();
            for (i, token) in [3usize, 9, 3, 0].into_iter().enumerate() {
                let diff = (rows.i(i).unwrap() - whole.i(token).unwrap()).unwrap().abs().unwrap();
                assert_eq!(diff.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
            }
        }
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_named() {
        let dense = Tensor::zeros((4, 256), candle_core::DType::F32, &Device::Cpu).unwrap();
        let embeddings = QuantizedEmbeddings::new(QTensor::quantize(&dense, GgmlDType::Q8_0).unwrap()).unwrap();
        let err = embeddings.embed(&[1, 4]).unwrap_err().to_string();
        assert!(err.contains("token 4") && err.contains("vocabulary of 4"), "{err}");
    }
}
