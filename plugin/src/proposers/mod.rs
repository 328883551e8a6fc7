//! Proposers: what drafts the tokens the target verifies. The draft model's forwards live in
//! the patched pipeline (under SV, [`draft_model`] decides how many it draws); EAGLE heads
//! draft from the target's own hidden states here, and prompt lookup from the text so far.

pub mod combined;
pub mod draft_model;
pub mod eagle;
pub mod embeddings;
pub mod eagle_proposer;
pub mod head_prefix_cache;
pub mod ngram;
pub mod scored;
pub mod timed;
