//! Learned heads.
