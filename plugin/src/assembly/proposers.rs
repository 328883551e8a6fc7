//! The proposer a config asks for: the EAGLE-3 head, prompt lookup, both combined, or the
//! draft model, each under the verify-length policy of [`super::policy`].

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::{
    config::{Config, EagleDrafting},
    engine::LoadedModels,
    proposers::{
        combined::CombinedProposer,
        draft_model::DraftModelProposer,
        eagle_proposer::{EagleProposer, DEFAULT_PREFIX_CACHE_BYTES},
        ngram::{NgramProposer, NgramSettings},
    },
    sv::policy::VerifyPolicy,
};

impl LoadedModels {
    /// Prompt lookup and the EAGLE head `head` together, each step taking the proposal worth
    /// most, under the verify-length policy `drafting` describes.
    pub fn combined_proposer(
        &self,
        config: &Config,
        head: Arc<EagleProposer>,
        head_gamma: usize,
        drafting: &EagleDrafting,
    ) -> Result<Arc<VerifyPolicy<CombinedProposer>>> {
        let lookup = Arc::new(self.lookup(config)?);
        let combined = CombinedProposer::new(lookup, head, config.speculative.ngram_gamma, head_gamma);
        self.verify_policy(config, drafting, Arc::new(combined))
    }

    /// The prompt-lookup proposer `[speculative]`'s n-gram lengths describe, under the
    /// verify-length policy `[sv]` describes.
    pub fn ngram_proposer(&self, config: &Config) -> Result<Arc<VerifyPolicy<NgramProposer>>> {
        self.verify_policy(config, &config.eagle_drafting(), Arc::new(self.lookup(config)?))
    }

    /// SV over the draft model as `drafting` says: `None` without SV (every step drafts γ).
    /// Its sequences then step one at a time, each verified alone.
    pub fn draft_model_policy(&self, config: &Config, drafting: &EagleDrafting) -> Result<Option<Arc<VerifyPolicy<DraftModelProposer>>>> {
        if !drafting.sv {
            return Ok(None);
        }
        let Some(draft) = &self.draft_fingerprint else {
            bail!("SV over the draft model needs models.draft loaded");
        };
        // A draft model's confidence is its own, not fitted to the target's choices as a
        // head's is: unless the config says, SV learns what each confidence is kept at.
        let learn_keep_rates = config.sv.learn_keep_rates.unwrap_or(config.sv.table.is_none());
        let drafting = EagleDrafting { learn_keep_rates, ..*drafting };
        self.verify_policy(config, &drafting, Arc::new(DraftModelProposer::new(draft.vocab_size))).map(Some)
    }

    fn lookup(&self, config: &Config) -> Result<NgramProposer> {
        let s = &config.speculative;
        NgramProposer::new(NgramSettings { min_n: s.ngram_min, max_n: s.ngram_max }, self.target_fingerprint.vocab_size)
    }

    /// The EAGLE-3 head of `speculative.eagle_head`, checked against the loaded target, under
    /// the verify-length policy `[sv]` describes.
    pub fn eagle_proposer(&self, config: &Config) -> Result<Arc<VerifyPolicy<EagleProposer>>> {
        self.eagle_proposer_with(config, &config.eagle_drafting())
    }

    /// [`Self::eagle_proposer`] drafting as `drafting` says (its γ is the engine's).
    pub fn eagle_proposer_with(&self, config: &Config, drafting: &EagleDrafting) -> Result<Arc<VerifyPolicy<EagleProposer>>> {
        self.named_eagle_proposer(config, None, drafting)
    }

    /// The head `speculative.eagle_heads` names `head` (`None`: `eagle_head`), drafting as
    /// `drafting` says, under its verify-length policy.
    pub fn named_eagle_proposer(&self, config: &Config, head: Option<&str>, drafting: &EagleDrafting) -> Result<Arc<VerifyPolicy<EagleProposer>>> {
        self.verify_policy(config, drafting, self.eagle_head(config, head, drafting)?)
    }

    /// The head `speculative.eagle_heads` names `head` (`None`: `eagle_head`), drafting as
    /// `drafting` says, with no policy: every draft it makes is verified.
    pub fn eagle_head(&self, config: &Config, head: Option<&str>, drafting: &EagleDrafting) -> Result<Arc<EagleProposer>> {
        let head = config.eagle_head_named(head)?;
        let proposer = EagleProposer::load(&head, drafting.weights, &self.target_source, &self.target_fingerprint)?;
        // The head's rows for cached prefixes, kept while the engine keeps the target's.
        let head_rows_kept = config.server.prefix_cache_bytes().map_or(0, |_| DEFAULT_PREFIX_CACHE_BYTES);
        Ok(Arc::new(
            proposer
                .with_min_confidence(drafting.min_confidence)?
                .with_min_first_confidence(drafting.min_first_confidence)?
                .with_prefix_cache_bytes(head_rows_kept)
                .with_batched_drafting(drafting.batched)
                .with_packed_verify_rows(drafting.packed),
        ))
    }
}
