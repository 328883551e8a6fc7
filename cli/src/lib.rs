//! The `verdict` command's parts: the OpenAI-compatible server, plots, forward and matmul
//! cost probes, and fetching models. The bench, its tasks and statistics live in
//! `verdict-eval`. A deployment that embeds the `verdict` library compiles none of this.

// Evaluation data and tasks live in `verdict-eval`; re-exported under their old paths.
pub use verdict_eval::{bench, datasets, jsonl, modes, paired, pool, subset, tasks, wheels};

pub mod forward_cost;
pub mod head_cost;
pub mod matmul_cost;
pub mod memory_bandwidth;
pub mod model_fetch;
pub mod op_profile;
pub mod openai_conventions;
pub mod plot;
mod plot_font;
pub mod plot_load;
pub mod request_metrics;
pub mod server;
pub mod task_prompts;
