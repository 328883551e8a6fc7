//! Which CPU quantized matmul candle runs. Our candle-core patch adds weight-stationary
//! kernels (each weight block read once for all rows of a multi-token forward) and keeps
//! candle's original row-by-row loop behind a process-wide switch, so that both can be timed
//! in one process, interleaved, on the same prompts.

use std::{fmt, str::FromStr};

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuantKernel {
    /// candle 0.10.2's loop: every input row streams the whole weight matrix.
    Stock,
    /// The patched weight-stationary kernels (the default).
    WeightStationary,
}

impl QuantKernel {
    pub const ALL: [QuantKernel; 2] = [QuantKernel::Stock, QuantKernel::WeightStationary];

    /// Switches every later quantized matmul of this process to this kernel.
    pub fn select(self) {
        candle_core::quantized::set_weight_stationary_matmul(self == QuantKernel::WeightStationary)
    }

    pub fn selected() -> Self {
        if candle_core::quantized::weight_stationary_matmul() {
            QuantKernel::WeightStationary
        } else {
            QuantKernel::Stock
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantKernel::Stock => "stock",
            QuantKernel::WeightStationary => "weight-stationary",
        }
    }
}

impl fmt::Display for QuantKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QuantKernel {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "stock" => Ok(QuantKernel::Stock),
            "weight-stationary" | "ws" => Ok(QuantKernel::WeightStationary),
            other => anyhow::bail!(
                "unknown quantized matmul kernel {other:?}: expected \"stock\" or \"weight-stationary\""
            ),
        }
    }
}
