//! Which CPU quantized matmul candle runs. Our candle-core patch adds weight-stationary
//! kernels (each weight block read once for all rows of a multi-token forward) and keeps
//! candle's original row-by-row loop behind a process-wide switch, so that both can be timed
//! in one process, interleaved, on the same prompts. A third choice also sends single rows
//! (decoding) through the multi-row kernels, so that a row's logits do not depend on how many
//! rows share its forward.

use std::{fmt, str::FromStr};

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuantKernel {
    /// candle 0.10.2's loop: every input row streams the whole weight matrix.
    Stock,
    /// The patched weight-stationary kernels (candle's default once patched); one row keeps
    /// candle's loop.
    WeightStationary,
    /// Weight-stationary, and one row too goes through the repacked panel kernels (Q4K / Q6K on
    /// AVX2 and AVX-512 VNNI CPUs; every other kernel is bit-exact with candle's loop).
    /// What `verdict` selects at start-up.
    RowInvariant,
}

impl QuantKernel {
    pub const ALL: [QuantKernel; 3] = [
        QuantKernel::Stock,
        QuantKernel::WeightStationary,
        QuantKernel::RowInvariant,
    ];

    /// Switches every later quantized matmul of this process to this kernel.
    pub fn select(self) {
        candle_core::quantized::set_weight_stationary_matmul(self != QuantKernel::Stock);
        candle_core::quantized::set_one_row_on_panels(self == QuantKernel::RowInvariant);
    }

    /// Holds each Q4_K / Q6_K matrix loaded from now on once, as the panels the row-invariant
    /// kernels read (its blocks dropped; ≈ 1 GB less for the 1.5B target), or, with `false`,
    /// as blocks with panels made beside them on first use: what kernel comparisons need,
    /// since panels held alone multiply the same way whichever kernel is selected.
    pub fn hold_weights_once(once: bool) {
        candle_core::quantized::set_panels_replace_blocks(once);
    }

    pub fn selected() -> Self {
        if !candle_core::quantized::weight_stationary_matmul() {
            QuantKernel::Stock
        } else if candle_core::quantized::one_row_on_panels() {
            QuantKernel::RowInvariant
        } else {
            QuantKernel::WeightStationary
        }
    }

    /// The instruction set the patched kernels run in this process: chosen at run time from
    /// the CPU (AVX-512 VNNI where it has it, else AVX2; `CANDLE_WS_ISA=avx2` keeps AVX2 on an
    /// AVX-512 CPU), "none" on a build without them (candle's loops run).
    pub fn instruction_set() -> &'static str {
        candle_core::quantized::kernel_isa().map_or("none", |isa| isa.name())
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantKernel::Stock => "stock",
            QuantKernel::WeightStationary => "weight-stationary",
            QuantKernel::RowInvariant => "row-invariant",
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
            "row-invariant" => Ok(QuantKernel::RowInvariant),
            other => anyhow::bail!(
                "unknown quantized matmul kernel {other:?}: expected \"stock\", \"weight-stationary\" or \"row-invariant\""
            ),
        }
    }
}

/// Which thread runs a CPU forward (a hook of the patched mistral.rs): a thread of the rayon
/// pool that candle's kernels split each op over, the pool's other threads kept polling for
/// work until the forward ends (what `verdict` runs); the same with the other threads
/// falling asleep between parallel ops, as rayon lets them; or the engine thread that asks
/// for it, as upstream does, handing every parallel op to the pool and waiting for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardThread {
    ComputePool,
    ComputePoolSleeping,
    Caller,
}

impl ForwardThread {
    /// Switches every later CPU forward of this process's pipelines to this thread.
    pub fn select(self) {
        mistralrs_core::hidden_capture::set_forward_on_compute_pool(self != ForwardThread::Caller);
        mistralrs_core::hidden_capture::set_pool_awake_during_forward(self == ForwardThread::ComputePool);
    }

    pub fn name(self) -> &'static str {
        match self {
            ForwardThread::ComputePool => "pool",
            ForwardThread::ComputePoolSleeping => "pool-sleeping",
            ForwardThread::Caller => "caller",
        }
    }
}

impl fmt::Display for ForwardThread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ForwardThread {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "pool" => Ok(ForwardThread::ComputePool),
            "pool-sleeping" => Ok(ForwardThread::ComputePoolSleeping),
            "caller" => Ok(ForwardThread::Caller),
            other => anyhow::bail!(
                "unknown forward thread {other:?}: expected \"pool\", \"pool-sleeping\" or \"caller\""
            ),
        }
    }
}
