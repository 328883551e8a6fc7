//! A head's weight matrices: f32 `Linear` layers while training (candle-nn, differentiable),
//! optionally stored in one of ggml's block formats for drafting, where a draft step reads
//! every matrix once for one row and memory traffic sets its cost.

use std::str::FromStr;

use anyhow::{bail, ensure, Result};
use candle_core::{
    quantized::{GgmlDType, QMatMul, QTensor},
    Module, Tensor,
};
use candle_nn::{linear_b, Linear, VarBuilder};
use serde::{Deserialize, Serialize};

pub enum Projection {
    Float(Linear),
    Quantized { weight: QMatMul, bias: Option<Tensor> },
}

/// `out × in` weights (and a bias when `bias`) under `vb`, as f32.
pub fn projection(inputs: usize, outputs: usize, bias: bool, vb: VarBuilder) -> Result<Projection> {
    Ok(Projection::Float(linear_b(inputs, outputs, bias, vb)?))
}

impl Projection {
    /// Store the weights as `format` (biases stay f32). A quantized projection is for
    /// inference only: it has no gradient.
    pub fn quantize(&mut self, format: WeightFormat) -> Result<()> {
        let Some(dtype) = format.ggml() else { return Ok(()) };
        if let Projection::Float(linear) = self {
            let (rows, columns) = linear.weight().dims2()?;
            ensure!(
                columns % dtype.block_size() == 0,
                "a {rows}×{columns} matrix cannot be stored as {format}: its rows of {columns} values are not whole blocks of {}",
                dtype.block_size()
            );
            let weight = QMatMul::from_qtensor(QTensor::quantize(linear.weight(), dtype)?)?;
            *self = Projection::Quantized { weight, bias: linear.bias().cloned() };
        }
        Ok(())
    }
}

impl Module for Projection {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Projection::Float(linear) => linear.forward(x),
            Projection::Quantized { weight, bias } => {
                let y = weight.forward(x)?;
                match bias {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }
}

/// How a drafting head keeps its matrices in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum WeightFormat {
    /// As trained.
    #[default]
    #[serde(rename = "f32")]
    F32,
    /// 8-bit blocks of 32 (≈ 1.06 bytes a weight).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4-bit super-blocks of 256 (≈ 0.56 bytes a weight), the target's own format.
    #[serde(rename = "q4k")]
    Q4K,
}

impl WeightFormat {
    fn ggml(self) -> Option<GgmlDType> {
        match self {
            WeightFormat::F32 => None,
            WeightFormat::Q8_0 => Some(GgmlDType::Q8_0),
            WeightFormat::Q4K => Some(GgmlDType::Q4K),
        }
    }
}

impl FromStr for WeightFormat {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "f32" => WeightFormat::F32,
            "q8_0" => WeightFormat::Q8_0,
            "q4k" => WeightFormat::Q4K,
            other => bail!("unknown head weight format {other:?}: use \"f32\", \"q8_0\" or \"q4k\""),
        })
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4K => "q4k",
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use candle_nn::VarMap;

    use super::*;

    #[test]
    fn quantized_projections_stay_close_to_f32_and_keep_the_bias() {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let mut p = projection(256, 8, true, vb.pp("p")).unwrap();
        for (name, var) in varmap.data().lock().unwrap().iter() {
            if name.ends_with("bias") {
                var.set(&var.as_tensor().ones_like().unwrap()).unwrap();
            }
        }
        let x = Tensor::randn(0f32, 1.0, (3, 256), &Device::Cpu).unwrap();
        let exact = p.forward(&x).unwrap();
        let scale = exact.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        for (format, tolerance) in [(WeightFormat::Q8_0, 0.02), (WeightFormat::Q4K, 0.15)] {
            let mut q = projection(256, 8, true, vb.pp("p")).unwrap();
            q.quantize(format).unwrap();
            let got = q.forward(&x).unwrap();
            let err = (&got - &exact).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < tolerance * scale, "{format}: error {err} at scale {scale}");
        }
        p.quantize(WeightFormat::F32).unwrap();
        assert!(matches!(p, Projection::Float(_)));
    }

    #[test]
    fn formats_parse_and_a_width_off_the_blocks_is_refused() {
        assert_eq!("q4k".parse::<WeightFormat>().unwrap(), WeightFormat::Q4K);
        let err = "q5".parse::<WeightFormat>().unwrap_err().to_string();
        assert!(err.contains("\"q5\"") && err.contains("q8_0"), "{err}");
        let varmap = VarMap::new();
        let mut p = projection(96, 4, false, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let err = p.quantize(WeightFormat::Q4K).unwrap_err().to_string();
        assert!(err.contains("4×96") && err.contains("256"), "{err}");
    }
}
