//! Training.
