//! On-disk formats and candle modules of Verdict's learned heads.
//!
//! Every head is a safetensors file whose `__metadata__` says what it is (`kind`), which
//! models it was made for ([`ModelFingerprint`]), its recommended threshold and its training
//! report. Loading a head for other models is refused, naming both.

pub mod file;
pub mod fingerprint;
pub mod logistic;
pub mod pivot;

pub use fingerprint::ModelFingerprint;
pub use logistic::{FeatureSpec, LogisticHead};
pub use pivot::PivotMlp;
