//! The bench's modes: what each compared way of decoding runs. A mode is a string in a
//! small grammar (`plain`, a stack name, `eagle:<stack>`, `eagle@<head>-<options>:<stack>`,
//! `ngram:<stack>`, `ngram+eagle…:<stack>`, `draft-sv:<stack>`), or the name of a
//! `[[mode]]` table of the config, which spells out to that grammar (docs/benchmarking.md
//! has the table of both).

use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use verdict::{
    assembly::stack::judge_stack,
    config::{Config, EagleDrafting, ModeConfig, RESERVED_MODE_NAMES},
    judge::JudgeStack,
    judges::{build_stack, LoadedFingerprints},
    rules::BaseRule,
};

/// The bench mode that decodes plainly once more, after every other mode of a problem.
pub const PLAIN_AGAIN_MODE: &str = "plain-again";

/// Bench modes that draft by prompt lookup start with this (`ngram:exact`).
pub const NGRAM_MODE_PREFIX: &str = "ngram:";

/// Bench modes that draft by prompt lookup and the EAGLE head together start with this
/// before an EAGLE mode (`ngram+eagle:exact`, `ngram+eagle-sv:exact`).
pub const COMBINED_MODE_PREFIX: &str = "ngram+";

/// Bench modes that draft with the draft model under SV's verify-length policy start with
/// this (`draft-sv:exact`); without it a stack's name drafts γ with the draft model.
pub const DRAFT_SV_MODE_PREFIX: &str = "draft-sv:";

/// Bench modes that draft with the EAGLE head start with this (`eagle:exact`); the rest
/// names the judge stack.
pub const EAGLE_MODE_PREFIX: &str = "eagle:";

/// One way of decoding compared by the bench: `plain` (the target alone), or the name of
/// a judge stack (`exact`, `rejection`, `config`, or a `[[stack]]` of the config).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Mode(pub String);

impl Mode {
    pub fn plain() -> Self {
        Mode("plain".into())
    }

    pub fn is_plain(&self) -> bool {
        self.0 == "plain"
    }

    /// `plain-again`: plain decoding once more, after every other mode of each problem. Its
    /// texts equal `plain`'s unless state leaks between engines or requests.
    pub fn plain_again() -> Self {
        Mode(PLAIN_AGAIN_MODE.into())
    }

    /// The target alone decodes (`plain` or `plain-again`): no stack, no draft.
    pub fn decodes_plainly(&self) -> bool {
        self.is_plain() || self.0 == PLAIN_AGAIN_MODE
    }

    /// Lossless stacks, whose divergences from plain decoding the bench explains.
    pub fn is_lossless(&self) -> bool {
        matches!(self.stack_name(), "exact" | "rejection")
    }

    /// `eagle:<stack>` drafts with the EAGLE head as configured; `eagle-<options>:<stack>`
    /// changes how, so drafting choices compare in one run. Options, dash-separated: a weight
    /// format (f32, q8_0, q4k), `g<N>` (up to N drafts a step), `c<P>` (stop before a draft
    /// of head probability below P), `s<P>` (draft nothing, decoding one token, when the first
    /// draft's probability is below P), `sv` / `nosv` (SV's goodput with `[sv]`'s T_v
    /// decides how many drafts are verified, or not), `learn` / `nolearn` (SV prices drafts
    /// by the keep rates the mode's stack shows, learned as it runs; implies nothing without
    /// `sv`; by default a lossy stack learns unless `sv.table` is given), `tvlearn` /
    /// `tvfixed` (SV's T_v learned from the steps run, starting from `sv.verify_ms`, or that
    /// table as given), `serial` / `batched` (with `--batch`: the
    /// sequences of a step draft one after another, or in one head forward per draft
    /// position), `packed` / `padded` (a batched verify feeds each sequence's own rows, or
    /// pads them to the widest): `eagle-q4k-g6-c0.5:exact`, `eagle-sv:exact`. `eagle@<name>`
    /// drafts with the head `speculative.eagle_heads` names: `eagle@general-sv:exact`. Returns the
    /// options' text ("" when as configured) and the stack.
    fn eagle_parts(&self) -> Option<(&str, &str)> {
        self.eagle_head_and_parts().map(|(_, options, stack)| (options, stack))
    }

    /// [`Self::eagle_parts`] with the head the mode names: `eagle@<name>…` drafts with the
    /// head `speculative.eagle_heads` calls `name` (`None`: `eagle_head`).
    fn eagle_head_and_parts(&self) -> Option<(Option<&str>, &str, &str)> {
        let eagle = self.0.strip_prefix(COMBINED_MODE_PREFIX).unwrap_or(&self.0);
        let rest = eagle.strip_prefix(EAGLE_MODE_PREFIX.trim_end_matches(':'))?;
        let (head, rest) = match rest.strip_prefix('@') {
            Some(named) => {
                let end = named.find([':', '-'])?;
                (Some(&named[..end]), &named[end..])
            }
            None => (None, rest),
        };
        if let Some(stack) = rest.strip_prefix(':') {
            return Some((head, "", stack));
        }
        let (options, stack) = rest.strip_prefix('-')?.split_once(':')?;
        Some((head, options, stack))
    }

    /// The named head this mode drafts with (`eagle@<name>:…`), if it names one.
    pub fn eagle_head_name(&self) -> Option<&str> {
        self.eagle_head_and_parts().and_then(|(head, _, _)| head)
    }

    /// Drafts by prompt lookup and the EAGLE head together (`ngram+eagle…:<stack>`).
    pub fn combines_lookup_and_head(&self) -> bool {
        self.0.starts_with(COMBINED_MODE_PREFIX) && self.drafts_with_eagle()
    }

    /// Drafts from the EAGLE head rather than the draft model.
    pub fn drafts_with_eagle(&self) -> bool {
        self.eagle_parts().is_some()
    }

    /// Drafts by prompt lookup alone (`ngram:<stack>`): no model drafts.
    pub fn drafts_by_lookup(&self) -> bool {
        self.0.starts_with(NGRAM_MODE_PREFIX)
    }

    /// Drafts with the draft model under SV (`draft-sv:<stack>`).
    pub fn drafts_with_model_under_sv(&self) -> bool {
        self.0.starts_with(DRAFT_SV_MODE_PREFIX)
    }

    /// The judge stack the mode runs (its name without the `eagle…:`, `ngram:` or
    /// `draft-sv:` prefix).
    pub fn stack_name(&self) -> &str {
        if let Some(stack) = self.0.strip_prefix(NGRAM_MODE_PREFIX).or_else(|| self.0.strip_prefix(DRAFT_SV_MODE_PREFIX)) {
            return stack;
        }
        self.eagle_parts().map_or(&self.0, |(_, stack)| stack)
    }

    /// How the head drafts in this mode: `configured`, changed by the options it names.
    pub fn eagle_drafting(&self, configured: EagleDrafting) -> Result<EagleDrafting> {
        let mut drafting = configured;
        let options = self.eagle_parts().map_or("", |(options, _)| options);
        for option in options.split('-').filter(|o| !o.is_empty()) {
            let bad = || format!("bench mode {:?}: option {option:?}", self.0);
            if option == "sv" || option == "nosv" {
                drafting.sv = option == "sv";
            } else if option == "learn" || option == "nolearn" {
                drafting.learn_keep_rates = option == "learn";
            } else if option == "tvlearn" || option == "tvfixed" {
                drafting.learn_verify_ms = option == "tvlearn";
            } else if option == "serial" || option == "batched" {
                drafting.batched = option == "batched";
            } else if option == "packed" || option == "padded" {
                drafting.packed = option == "packed";
            } else if let Some(n) = option.strip_prefix('g') {
                drafting.gamma = n.parse().with_context(bad)?;
                ensure!((1..=32).contains(&drafting.gamma), "{}: γ must be 1..=32", bad());
            } else if let Some(p) = option.strip_prefix('c') {
                drafting.min_confidence = p.parse().with_context(bad)?;
                ensure!((0.0..1.0).contains(&drafting.min_confidence), "{}: a probability below 1", bad());
            } else if let Some(p) = option.strip_prefix('s') {
                drafting.min_first_confidence = p.parse().with_context(bad)?;
                ensure!((0.0..1.0).contains(&drafting.min_first_confidence), "{}: a probability below 1", bad());
            } else {
                drafting.weights = option.parse().with_context(bad)?;
            }
        }
        Ok(drafting)
    }

    pub fn name(&self) -> String {
        self.0.clone()
    }

    /// Whether the mode's options say whether SV learns keep rates (`learn` / `nolearn`).
    fn names_keep_rate_learning(&self) -> bool {
        let options = self.eagle_parts().map_or("", |(options, _)| options);
        options.split('-').any(|o| o == "learn" || o == "nolearn")
    }
}

/// How an EAGLE mode's head drafts: as configured, changed by the mode's options; unless
/// `sv.learn_keep_rates` or the mode says, SV learns keep rates by default under the mode's
/// own stack (not the config's top-level one) when it is lossy.
pub fn mode_drafting(config: &Config, mode: &Mode) -> Result<EagleDrafting> {
    let mut drafting = mode.eagle_drafting(config.eagle_drafting())?;
    if config.sv.learn_keep_rates.is_none() && !mode.names_keep_rate_learning() {
        drafting.learn_keep_rates = config.sv.learns_keep_rates_by_default(drafting.sv, !mode.is_lossless());
    }
    Ok(drafting)
}

/// The modes `names` stand for: a `[[mode]]` table's name spelled out in the bench's mode
/// grammar (`ngram+eagle@general-sv:exact`), which reports and checkpoints key runs by, so
/// a named mode resumes the runs of the same mode written out; any other name as it is.
pub fn resolve_modes(config: &Config, names: &[Mode]) -> Vec<Mode> {
    names
        .iter()
        .map(|name| match config.modes.iter().find(|m| m.name == name.0) {
            Some(table) => {
                let mode = Mode(spelled_out(table));
                tracing::info!("mode {} runs {}", name.0, mode.0);
                mode
            }
            None => name.clone(),
        })
        .collect()
}

/// A `[[mode]]` table in the mode grammar (the config checked its fields).
fn spelled_out(table: &ModeConfig) -> String {
    let stack = table.stack.as_deref().unwrap_or("exact");
    let with_head = |prefix: &str| {
        let head = table.head.as_ref().map_or(String::new(), |h| format!("@{h}"));
        let options: String = table.options.iter().map(|o| format!("-{o}")).collect();
        format!("{prefix}{}{head}{options}:{stack}", EAGLE_MODE_PREFIX.trim_end_matches(':'))
    };
    match table.proposer.as_str() {
        "plain" => Mode::plain().0,
        "draft-model" => stack.to_string(),
        "draft-model-sv" => format!("{DRAFT_SV_MODE_PREFIX}{stack}"),
        "ngram" => format!("{NGRAM_MODE_PREFIX}{stack}"),
        "eagle" => with_head(""),
        _ => with_head(COMBINED_MODE_PREFIX),
    }
}

impl FromStr for Mode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        if s.is_empty() {
            bail!("empty bench mode");
        }
        Ok(Mode(s.to_string()))
    }
}

/// Every mode `verdict bench` accepts with `config`: each stack with the draft model
/// (alone, and with `draft-sv:` before it), with `eagle:` before it when an EAGLE head is
/// configured, and with `ngram:` (prompt lookup) before it.
pub fn known_modes(config: &Config) -> Vec<String> {
    let stacks: Vec<String> = RESERVED_MODE_NAMES
        .iter()
        .map(|s| s.to_string())
        .chain(config.stacks.iter().map(|s| s.name.clone()))
        .collect();
    let speculative: Vec<&String> = stacks.iter().filter(|s| s.as_str() != "plain" && s.as_str() != PLAIN_AGAIN_MODE).collect();
    let has_head = config.speculative.eagle_head.is_some() || !config.speculative.eagle_heads.is_empty();
    let eagle: Vec<String> = match has_head {
        true => speculative
            .iter()
            .flat_map(|s| [format!("{EAGLE_MODE_PREFIX}{s}"), format!("{COMBINED_MODE_PREFIX}{EAGLE_MODE_PREFIX}{s}")])
            .collect(),
        false => Vec::new(),
    };
    let ngram: Vec<String> = speculative.iter().map(|s| format!("{NGRAM_MODE_PREFIX}{s}")).collect();
    let draft_sv: Vec<String> = speculative.iter().map(|s| format!("{DRAFT_SV_MODE_PREFIX}{s}")).collect();
    stacks.iter().cloned().chain(eagle).chain(ngram).chain(draft_sv).collect()
}

/// The stack a bench mode names: `exact` and `rejection` (lossless), `config` (the
/// top-level judges) or a `[[stack]]` name.
pub fn named_stack(config: &Config, name: &str, models: &LoadedFingerprints) -> Result<JudgeStack> {
    match name {
        "exact" => Ok(JudgeStack::lossless(BaseRule::Exact)),
        "rejection" => Ok(JudgeStack::lossless(BaseRule::Rejection)),
        "config" => {
            let mut stack = judge_stack(config, models)?;
            stack.name = "config".into();
            Ok(stack)
        }
        _ => {
            let (i, s) = config
                .stacks
                .iter()
                .enumerate()
                .find(|(_, s)| s.name == name)
                .with_context(|| {
                    format!(
                        "no stack named {name:?}; known: {}",
                        known_modes(config).join(", ")
                    )
                })?;
            let base = s.base_rule.unwrap_or(config.speculative.base_rule);
            build_stack(
                name,
                base,
                &s.judges,
                &format!("stack[{i}].judge"),
                &config.base_dir,
                models,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use verdict_heads::WeightFormat;

    use super::*;

    /// The built-in modes are the names a config may not give a `[[stack]]` or `[[mode]]`.
    #[test]
    fn built_in_modes_are_the_reserved_names() {
        let config = Config::from_toml("[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n").unwrap();
        let known = known_modes(&config);
        for name in [Mode::plain().0, Mode::plain_again().0, "exact".into(), "rejection".into(), "config".into()] {
            assert!(RESERVED_MODE_NAMES.contains(&name.as_str()) && known.contains(&name), "{name}");
        }
    }

    /// Heads add `eagle:` and `ngram+eagle:` modes; stacks add their own names.
    #[test]
    fn known_modes_follow_heads_and_stacks() {
        let head = Config::from_toml("[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n").unwrap();
        let known = known_modes(&head);
        assert!(known.contains(&"eagle:exact".to_string()) && known.contains(&"ngram+eagle:exact".to_string()));
        assert!(!known.contains(&"eagle:plain".to_string()));
        let stacks = Config::from_toml("[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n[[stack]]\nname = \"dm\"\n[[stack.judge]]\nkind = \"dropmatch\"\n").unwrap();
        let known = known_modes(&stacks);
        assert!(known.contains(&"dm".to_string()) && known.contains(&"ngram:dm".to_string()));
        assert!(!known.iter().any(|m| m.starts_with("eagle")), "no head configured");
    }

    /// `[[mode]]` names spell out as the mode grammar, so named modes run (and resume) the
    /// same modes as written out; other names pass as they are.
    #[test]
    fn named_modes_spell_out_as_the_mode_grammar() {
        let config = Config::from_toml(
            r#"
[models]
target = "t"
[speculative]
proposer = "eagle"
eagle_head = "h"
eagle_heads = { general = "g" }
[[stack]]
name = "lenient"
[[mode]]
name = "lookup+head"
proposer = "ngram+eagle"
head = "general"
stack = "rejection"
[[mode]]
name = "head-sv"
proposer = "eagle"
options = ["sv", "q4k"]
[[mode]]
name = "lookup"
proposer = "ngram"
stack = "lenient"
[[mode]]
name = "draft"
proposer = "draft-model"
[[mode]]
name = "draft-sv"
proposer = "draft-model-sv"
[[mode]]
name = "target"
proposer = "plain"
"#,
        )
        .unwrap();
        let names: Vec<Mode> = ["lookup+head", "head-sv", "lookup", "draft", "draft-sv", "target", "eagle:exact"].iter().map(|n| n.parse().unwrap()).collect();
        let resolved: Vec<String> = resolve_modes(&config, &names).into_iter().map(|m| m.0).collect();
        assert_eq!(resolved, ["ngram+eagle@general:rejection", "eagle-sv-q4k:exact", "ngram:lenient", "exact", "draft-sv:exact", "plain", "eagle:exact"]);
        // The spelled-out modes parse as the grammar means them.
        let head_sv = Mode(resolved[1].clone());
        assert!(head_sv.drafts_with_eagle() && head_sv.stack_name() == "exact");
        let lookup_head = Mode(resolved[0].clone());
        assert!(lookup_head.combines_lookup_and_head() && lookup_head.eagle_head_name() == Some("general"));
    }

    #[test]
    fn eagle_modes_name_their_stack_and_how_the_head_drafts() {
        let mode = |s: &str| s.parse::<Mode>().unwrap();
        let configured = EagleDrafting { weights: WeightFormat::Q8_0, gamma: 4, min_confidence: 0.0, min_first_confidence: 0.0, sv: false, learn_keep_rates: false, learn_verify_ms: false, batched: true, packed: true };
        assert_eq!(mode("eagle:dropmatch").stack_name(), "dropmatch");
        assert_eq!(mode("eagle:dropmatch").eagle_drafting(configured).unwrap(), configured);
        let q4k = mode("eagle-q4k:exact");
        assert!(q4k.drafts_with_eagle() && !mode("exact").drafts_with_eagle());
        assert_eq!(
            (q4k.stack_name(), q4k.eagle_drafting(configured).unwrap()),
            ("exact", EagleDrafting { weights: WeightFormat::Q4K, ..configured })
        );
        assert!(q4k.is_lossless());
        // A named head: the name ends at the options or the stack.
        for (name, head, stack, sv) in [
            ("eagle@general:exact", Some("general"), "exact", false),
            ("eagle@general-sv:exact", Some("general"), "exact", true),
            ("ngram+eagle@gsm8k:rejection", Some("gsm8k"), "rejection", false),
            ("eagle-sv:exact", None, "exact", true),
        ] {
            let m = mode(name);
            assert!(m.drafts_with_eagle(), "{name}");
            assert_eq!((m.eagle_head_name(), m.stack_name(), m.eagle_drafting(configured).unwrap().sv), (head, stack, sv), "{name}");
        }
        assert!(mode("ngram+eagle@gsm8k:exact").combines_lookup_and_head());
        assert!(!mode("eagle@general").drafts_with_eagle());
        assert!(!mode("eagles:exact").drafts_with_eagle());
        assert_eq!(
            mode("eagle-g6-c0.5-s0.25-f32:fsd").eagle_drafting(configured).unwrap(),
            EagleDrafting { weights: WeightFormat::F32, gamma: 6, min_confidence: 0.5, min_first_confidence: 0.25, sv: false, learn_keep_rates: false, learn_verify_ms: false, batched: true, packed: true }
        );
        assert!(mode("eagle-sv:exact").eagle_drafting(configured).unwrap().sv);
        assert!(!mode("eagle-nosv:exact").eagle_drafting(EagleDrafting { sv: true, ..configured }).unwrap().sv);
        assert!(mode("eagle-sv-learn:dropmatch").eagle_drafting(configured).unwrap().learn_keep_rates);
        let learning = EagleDrafting { learn_keep_rates: true, ..configured };
        assert!(!mode("eagle-nolearn:exact").eagle_drafting(learning).unwrap().learn_keep_rates);
        assert!(mode("eagle-sv-tvlearn:exact").eagle_drafting(configured).unwrap().learn_verify_ms);
        let learning_t_v = EagleDrafting { learn_verify_ms: true, ..configured };
        assert!(!mode("eagle-tvfixed:exact").eagle_drafting(learning_t_v).unwrap().learn_verify_ms);
        assert!(!mode("eagle-serial:exact").eagle_drafting(configured).unwrap().batched);
        let serial = EagleDrafting { batched: false, ..configured };
        assert!(mode("eagle-batched:exact").eagle_drafting(serial).unwrap().batched);
        assert!(!mode("eagle-padded:exact").eagle_drafting(configured).unwrap().packed);
        let padded = EagleDrafting { packed: false, ..configured };
        assert!(mode("eagle-packed:exact").eagle_drafting(padded).unwrap().packed);
        let err = format!("{:#}", mode("eagle-q5:exact").eagle_drafting(configured).unwrap_err());
        assert!(err.contains("eagle-q5:exact") && err.contains("\"q5\""), "{err}");
        for bad in ["eagle-g0:exact", "eagle-gx:exact", "eagle-c1.5:exact", "eagle-s1:exact"] {
            let err = format!("{:#}", mode(bad).eagle_drafting(configured).unwrap_err());
            assert!(err.contains(bad), "{err}");
        }
        // Without the colon it is a stack's name, not an EAGLE mode.
        assert!(!mode("eagle-q4k").drafts_with_eagle());
        // The draft model under SV names its stack after the prefix.
        let draft_sv = mode("draft-sv:rejection");
        assert!(draft_sv.drafts_with_model_under_sv() && !draft_sv.drafts_with_eagle() && !draft_sv.drafts_by_lookup());
        assert_eq!(draft_sv.stack_name(), "rejection");
        assert!(draft_sv.is_lossless());
    }

    /// With SV, a mode over a lossy stack learns keep rates unless the mode or `[sv]` says
    /// otherwise; a lossless mode does not, whatever the config's top-level stack.
    #[test]
    fn lossy_modes_learn_keep_rates_by_default() {
        let config = |sv: &str| {
            Config::from_toml(&format!(
                "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n[sv]\n{sv}\n[[judge]]\nkind = \"fsd\"\nthreshold = 0.5\n"
            ))
            .unwrap()
        };
        let learns = |config: &Config, name: &str| mode_drafting(config, &name.parse().unwrap()).unwrap().learn_keep_rates;
        let sv = config("enabled = true");
        assert!(learns(&sv, "eagle:dropmatch"));
        assert!(!learns(&sv, "eagle:exact"), "a lossless mode under a config whose own stack is lossy");
        assert!(!learns(&sv, "eagle-nolearn:dropmatch"));
        assert!(!learns(&config(""), "eagle:dropmatch"), "no SV");
        assert!(learns(&config(""), "eagle-sv:dropmatch"), "SV turned on by the mode");
        assert!(learns(&sv, "eagle-learn:exact"));
        assert!(!learns(&config("enabled = true\nlearn_keep_rates = false"), "eagle:dropmatch"));
    }
}
