//! Proposers: what drafts the tokens the target verifies. The draft model's chain lives in
//! the patched pipeline; EAGLE heads draft from the target's own hidden states here, and
//! prompt lookup from the text so far.

pub mod combined;
pub mod eagle;
pub mod embeddings;
pub mod eagle_proposer;
pub mod head_prefix_cache;
pub mod ngram;
pub mod timed;
