//! The verify-length policy a config asks for: Speculative Verification around any
//! proposer, with its budget (T_v and the goodput options), the acceptance table or the keep
//! rates it learns, and the T_v it learns and keeps on this machine.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use verdict_heads::ModelFingerprint;

use crate::{
    config::{Config, EagleDrafting, SvConfig, DEFAULT_KEEP_RATE_PRIOR_WEIGHT},
    engine::LoadedModels,
    proposers::scored::ScoredProposer,
    sv::{
        keep_rates::KeepRates,
        latency_store::LatencyStore,
        learned_latency::{LearnedLatency, DEFAULT_MEMORY, DEFAULT_PRIOR_WEIGHT},
        policy::{PolicySettings, VerifyPolicy},
        schedule::{GoodputOptions, Search},
        table::AcceptanceTable,
        verify_budget::VerifyBudget,
    },
};

/// Confidence bins of learned keep rates.
pub const KEEP_RATE_BINS: usize = 20;

impl LoadedModels {
    /// SV over `proposer` as `drafting` and `[sv]` say: with `drafting.sv`, the drafts verified
    /// are the ones worth their rows, priced by learned keep rates and T_v where asked.
    pub fn verify_policy<P: ScoredProposer>(&self, config: &Config, drafting: &EagleDrafting, proposer: Arc<P>) -> Result<Arc<VerifyPolicy<P>>> {
        if drafting.learn_keep_rates && !drafting.sv {
            tracing::warn!("sv.learn_keep_rates does nothing without SV: set sv.enabled = true (bench option `sv`)");
        }
        let learn_verify_ms = drafting.sv && drafting.learn_verify_ms;
        let store = latency_store(config, &self.target_fingerprint);
        if store.is_some() && !learn_verify_ms {
            tracing::warn!("sv.learned_verify_ms_file is kept only while SV learns T_v (sv.enabled and sv.learn_verify_ms, or the bench option `tvlearn`)");
        }
        let store = store.filter(|_| learn_verify_ms);
        let (learned_latency, earlier_samples) = latency_learner(&config.sv, learn_verify_ms, store.as_ref())?.unzip();
        let budget = match drafting.sv {
            true => Some(VerifyBudget { padded: !drafting.packed, ..sv_budget(config, &self.target_fingerprint)? }),
            false => None,
        };
        Ok(Arc::new(VerifyPolicy::new(
            proposer,
            PolicySettings {
                budget,
                keep_rates: keep_rates(&config.sv, drafting.sv && drafting.learn_keep_rates)?,
                learned_latency,
                latency_store: store.zip(earlier_samples),
            },
        )))
    }
}

/// Empty learned keep rates as configured (`learn` asks for them; `sv.table` and
/// learning both say what a draft is worth, so they exclude each other).
pub fn keep_rates(sv: &SvConfig, learn: bool) -> Result<Option<KeepRates>> {
    if !learn {
        return Ok(None);
    }
    if let Some(table) = &sv.table {
        bail!(
            "sv.learn_keep_rates and sv.table = {} both give the chance a draft is kept: choose one",
            table.display()
        );
    }
    KeepRates::new(KEEP_RATE_BINS, sv.keep_rate_prior_weight.unwrap_or(DEFAULT_KEEP_RATE_PRIOR_WEIGHT)).map(Some)
}

/// T_v to learn from, when `learn`: the one `store` kept for this target on this
/// machine, else the configured one; with the samples that taught the kept one.
pub fn latency_learner(sv: &SvConfig, learn: bool, store: Option<&LatencyStore>) -> Result<Option<(LearnedLatency, u64)>> {
    if !learn {
        return Ok(None);
    }
    let kept = match store {
        Some(store) => store.load().context("sv.learned_verify_ms_file")?,
        None => None,
    };
    let (start, samples) = match kept {
        Some((latency, samples)) => {
            tracing::info!(
                "SV: learning T_v from the one learned on this machine over {samples} steps, in {} (rows: ms) {}",
                store.map_or_else(String::new, |s| s.path().display().to_string()),
                latency.describe(8)
            );
            (latency, samples)
        }
        None => (sv.configured_latency()?, 0),
    };
    Ok(Some((LearnedLatency::new(start, DEFAULT_PRIOR_WEIGHT, DEFAULT_MEMORY)?, samples)))
}

/// The budget the EAGLE proposer applies; `None` when `[sv]` is off.
pub fn verify_budget(sv: &SvConfig) -> Result<Option<VerifyBudget>> {
    match sv.enabled {
        true => budget(sv).map(Some),
        false => Ok(None),
    }
}

/// The budget these settings make, whether `[sv]` is on or not (a bench mode may ask
/// for it).
pub fn budget(sv: &SvConfig) -> Result<VerifyBudget> {
    let fixed_ms = sv.checked_fixed_ms()?;
    Ok(VerifyBudget {
        // When learning, the proposer prices rows by the learned T_v instead.
        latency: sv.configured_latency()?,
        options: GoodputOptions {
            count_bonus: sv.count_bonus,
            fixed_ms,
            min_gamma: sv.min_gamma,
            search: Search::EarlyStop,
        },
        // As mistral.rs 0018 verifies without 0022's packing; the EAGLE proposer sets it
        // from `speculative.packed_verify_rows`.
        padded: true,
        table: None,
    })
}

/// `[sv]`'s budget with its acceptance table loaded, for `target`: a table fitted for
/// another target is refused.
pub fn sv_budget(config: &Config, target: &ModelFingerprint) -> Result<VerifyBudget> {
    let mut budget = budget(&config.sv)?;
    if let Some(path) = &config.sv.table {
        let path = config.base_dir.join(path);
        let table = AcceptanceTable::load(&path).with_context(|| format!("sv.table = {:?}", config.sv.table.as_ref().unwrap()))?;
        let Some(profiled) = &table.origin.target_fingerprint else {
            bail!("sv.table {} does not say which target it was profiled with: profile it again with `train-head sv-profile`", path.display());
        };
        profiled
            .check_loaded(&format!("sv.table {}", path.display()), "target", target)
            .context("profile this target with `train-head sv-profile`")?;
        budget.table = Some(table);
    }
    Ok(budget)
}

/// Where SV keeps the T_v it learns for `target` (`sv.learned_verify_ms_file`, resolved
/// against the config file's folder).
pub fn latency_store(config: &Config, target: &ModelFingerprint) -> Option<LatencyStore> {
    let path = config.sv.learned_verify_ms_file.as_ref()?;
    Some(LatencyStore::new(config.base_dir.join(path), target.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProposerKind;

    const MINIMAL: &str = "[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n";

    fn error_of(text: &str) -> String {
        format!("{:#}", Config::from_toml(text).unwrap_err())
    }

    #[test]
    fn learned_keep_rates_and_an_sv_table_exclude_each_other() {
        let eagle = "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n";
        let sv = |extra: &str| Config::from_toml(&format!("{eagle}[sv]\nenabled = true\nverify_ms = [[1, 50.0]]\n{extra}")).unwrap().sv;
        assert_eq!(keep_rates(&sv(""), true).unwrap().unwrap(), KeepRates::new(KEEP_RATE_BINS, DEFAULT_KEEP_RATE_PRIOR_WEIGHT).unwrap());
        assert!(keep_rates(&sv("learn_keep_rates = true\n"), false).unwrap().is_none());
        let err = format!("{:#}", keep_rates(&sv("table = \"t.json\"\n"), true).unwrap_err());
        assert!(err.contains("sv.table = t.json") && err.contains("learn_keep_rates"), "{err}");
        let err = format!("{:#}", keep_rates(&sv("keep_rate_prior_weight = -2.0\n"), true).unwrap_err());
        assert!(err.contains("sv.keep_rate_prior_weight") && err.contains("-2"), "{err}");
        let config = Config::from_toml(&format!("{MINIMAL}[sv]\nlearn_keep_rates = true\n")).unwrap();
        assert!(config.eagle_drafting().learn_keep_rates);
    }

    #[test]
    fn an_sv_table_profiled_with_another_target_is_refused() {
        use crate::sv::table::{Observation, TableOrigin};
        let fingerprint = |sha: &str| ModelFingerprint {
            architecture: "qwen2".into(),
            hidden_size: 8,
            num_layers: 2,
            vocab_size: 30,
            tokenizer_sha256: sha.into(),
            source: format!("{sha}.gguf"),
        };
        let dir = tempfile::tempdir().unwrap();
        let origin = TableOrigin { target_fingerprint: Some(fingerprint("aaaa")), ..TableOrigin::default() };
        let profile = [Observation { s: 0.5, a: 1.0, alpha: 1.0 }, Observation { s: 0.9, a: 1.0, alpha: 0.0 }];
        AcceptanceTable::fit(&profile, 2, 1, 1, origin).unwrap().save(&dir.path().join("t.json")).unwrap();
        let config = |table: &str| {
            let mut c = Config::from_toml(&format!(
                "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n[sv]\nenabled = true\nverify_ms = [[1, 50.0]]\ntable = {table:?}\n"
            ))
            .unwrap();
            c.base_dir = dir.path().to_path_buf();
            c
        };
        let budget = sv_budget(&config("t.json"), &fingerprint("aaaa")).unwrap();
        assert_eq!(budget.table.unwrap().beta_by_s(0.95), 0.0);
        let err = format!("{:#}", sv_budget(&config("t.json"), &fingerprint("bbbb")).unwrap_err());
        assert!(err.contains("aaaa.gguf") && err.contains("bbbb.gguf") && err.contains("sv-profile"), "{err}");
        let err = format!("{:#}", sv_budget(&config("none.json"), &fingerprint("aaaa")).unwrap_err());
        assert!(err.contains("sv.table") && err.contains("none.json"), "{err}");
    }

    #[test]
    fn sv_wraps_every_proposer_and_needs_a_verify_profile() {
        let eagle = "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n";
        assert!(verify_budget(&Config::from_toml(eagle).unwrap().sv).unwrap().is_none(), "[sv] is off by default");
        let draft_model = Config::from_toml(&format!("{MINIMAL}[sv]\nenabled = true\n")).unwrap();
        assert_eq!(draft_model.speculative.proposer, ProposerKind::DraftModel);
        assert!(draft_model.eagle_drafting().sv, "SV wraps the draft model too");
        let lookup = "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"ngram\"\n[sv]\nenabled = true\n";
        assert!(verify_budget(&Config::from_toml(lookup).unwrap().sv).unwrap().is_some(), "SV wraps prompt lookup too");
        let err = error_of(&format!("{eagle}[sv]\nenabled = true\nlearn_verify_ms = false\n"));
        assert!(err.contains("sv.verify_ms = []") && err.contains("learn_verify_ms"), "{err}");
        let err = error_of(&format!("{eagle}[sv]\nenabled = true\nverify_ms = [[0, 50.0]]\n"));
        assert!(err.contains("sv.verify_ms") && err.contains("0 rows"), "{err}");
        let err = error_of(&format!("{eagle}[sv]\nenabled = true\nverify_ms = [[1, 50.0]]\nfixed_ms = -1\n"));
        assert!(err.contains("sv.fixed_ms") && err.contains("-1"), "{err}");
        let config = Config::from_toml(&format!("{eagle}[sv]\nenabled = true\nverify_ms = [[1, 50.0], [9, 60.0]]\n")).unwrap();
        let budget = verify_budget(&config.sv).unwrap().unwrap();
        assert!(budget.options.count_bonus && budget.options.min_gamma == 0);
        assert_eq!(budget.latency.at(5), 55.0);
    }

    #[test]
    fn sv_learns_t_v_without_a_table_and_from_one_when_asked() {
        let eagle = "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n[sv]\nenabled = true\n";
        let sv = |extra: &str| Config::from_toml(&format!("{eagle}{extra}")).unwrap().sv;
        // No table: learned, from the generic shape.
        let untabled = sv("");
        assert!(untabled.learns_verify_ms() && verify_budget(&untabled).unwrap().is_some());
        let (learner, samples) = latency_learner(&untabled, true, None).unwrap().unwrap();
        assert_eq!((learner, samples), (LearnedLatency::without_prior(), 0));
        assert!(latency_learner(&untabled, false, None).unwrap().is_none(), "bench option tvfixed");
        // A table is used as given unless learning is asked for; then it is where learning starts.
        let tabled = sv("verify_ms = [[1, 40.0], [5, 60.0]]\n");
        assert!(!tabled.learns_verify_ms());
        let learning = sv("verify_ms = [[1, 40.0], [5, 60.0]]\nlearn_verify_ms = true\n");
        assert!(learning.learns_verify_ms());
        assert_eq!(latency_learner(&learning, true, None).unwrap().unwrap().0.current().at(3), 50.0);
        let config = Config::from_toml(&format!("{eagle}learn_verify_ms = true\n")).unwrap();
        assert!(config.eagle_drafting().learn_verify_ms);
    }
}
