//! On-disk formats and candle modules of Verdict's learned heads: AutoJudge's logistic head,
//! PAD's pivot MLP, and EAGLE-1 and EAGLE-3 draft heads (in the layouts other engines load).
//!
//! Every head is a safetensors file whose `__metadata__` says what it is (`kind`), which
//! models it was made for ([`ModelFingerprint`]), its recommended threshold and its training
//! report. Loading a head for other models is refused, naming both.

pub mod compute_pool;
pub mod decoder_layer;
pub mod eagle1;
pub mod eagle3;
pub mod file;
pub mod fingerprint;
pub mod logistic;
pub mod pivot;
pub mod projection;
#[cfg(test)]
mod pth_fixture;

pub use compute_pool::on_compute_pool;
pub use eagle1::{Eagle1Config, Eagle1Head};
pub use eagle3::{CacheSegment, Eagle3Config, Eagle3Head, HeadCache};
pub use fingerprint::ModelFingerprint;
pub use logistic::{FeatureSpec, LogisticHead};
pub use pivot::PivotMlp;
pub use projection::WeightFormat;
