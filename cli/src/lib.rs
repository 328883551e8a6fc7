//! The `verdict` command's parts: the OpenAI-compatible server, the benchmark and its paired
//! statistics, pooling of bench reports, plots, forward and matmul cost probes, fetching
//! models and datasets, and the task adapters (GSM8K) that benchmarks and `train-head` share. A deployment that embeds the
//! `verdict` library compiles none of this.

// Evaluation data and tasks live in `verdict-eval`; re-exported under their old paths.
pub use verdict_eval::{datasets, jsonl, paired, subset, tasks, wheels};

pub mod bench;
pub mod forward_cost;
pub mod head_cost;
pub mod matmul_cost;
pub mod model_fetch;
pub mod openai_conventions;
pub mod plot;
pub mod plot_load;
pub mod pool;
pub mod server;
