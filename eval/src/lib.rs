//! What Verdict is measured on: tasks that prompt a model and grade its answers, the
//! datasets behind them (rebuilt from registry packages and checked by sha256), the paired
//! statistics that compare two ways of decoding on the same problems, and the prompt
//! mixture general-purpose heads are trained on; and the bench that decodes problems in
//! several modes, interleaved in one process, and pools its reports.

pub mod bench;
pub mod benchmark;
pub mod datasets;
pub mod jsonl;
pub mod mixture;
pub mod modes;
pub mod packaged;
pub mod paired;
pub mod pool;
pub mod prompts;
pub mod sandbox;
pub mod subset;
pub mod suite;
pub mod tasks;
pub mod wheels;
