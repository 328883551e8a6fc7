//! Counters of speculative decoding, named after vLLM's where one exists, plus the
//! per-judge rescue/veto counts that no engine reports.

use std::{collections::BTreeMap, fmt::Write, sync::Mutex, time::Duration};

use mistralrs_core::speculative_hook::StepReport;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JudgeCounters {
    pub calls: u64,
    pub rescues: u64,
    pub vetoes: u64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    /// Speculative steps (one verify forward each).
    pub steps: u64,
    /// Steps that drafted nothing: a proposer's first step of a request, a plain target
    /// forward over the prompt (a head needs the target's features before it can draft).
    #[serde(default)]
    pub undrafted_steps: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Tokens appended to sequences: accepted drafts plus one correction or bonus per step.
    pub emitted_tokens: u64,
    /// `accepted_per_position[i]`: steps whose draft at position i was kept.
    pub accepted_per_position: Vec<u64>,
    pub draft_seconds: f64,
    /// A head proposer taking in the target's features of the committed positions after
    /// each verify (its own forward over them); the draft model has none.
    #[serde(default)]
    pub observe_seconds: f64,
    /// Target verify forwards over γ + 1 tokens, prompt steps excluded.
    pub verify_seconds: f64,
    /// First steps of requests, whose verify forward also processed the prompt.
    pub prefill_steps: u64,
    pub prefill_verify_seconds: f64,
    /// Time spent deciding (base rule and judges), per step.
    pub accept_seconds: f64,
    pub judges: BTreeMap<String, JudgeCounters>,
}

impl Counters {
    /// τ = 1 + accepted / steps: tokens emitted per verify forward of γ drafts (steps that
    /// drafted nothing excluded).
    pub fn mean_acceptance_length(&self) -> f64 {
        let steps = self.steps - self.undrafted_steps;
        if steps == 0 {
            return 0.0;
        }
        1.0 + self.accepted_tokens as f64 / steps as f64
    }

    pub fn draft_acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            return 0.0;
        }
        self.accepted_tokens as f64 / self.draft_tokens as f64
    }

    /// The sum of `each`; `None` when there is none (a plain decoding run has no counters).
    pub fn total<'a>(each: impl IntoIterator<Item = &'a Counters>) -> Option<Counters> {
        each.into_iter().fold(None, |total: Option<Counters>, c| {
            Some(match total {
                None => c.clone(),
                Some(total) => total.plus(c),
            })
        })
    }

    /// The sum of two sets of counters (the inverse of [`Counters::since`]).
    pub fn plus(&self, b: &Counters) -> Counters {
        let a = self;
        let mut per_position = a.accepted_per_position.clone();
        if per_position.len() < b.accepted_per_position.len() {
            per_position.resize(b.accepted_per_position.len(), 0);
        }
        for (slot, n) in per_position.iter_mut().zip(&b.accepted_per_position) {
            *slot += n;
        }
        let mut judges = a.judges.clone();
        for (name, j) in &b.judges {
            let slot = judges.entry(name.clone()).or_default();
            slot.calls += j.calls;
            slot.rescues += j.rescues;
            slot.vetoes += j.vetoes;
            slot.seconds += j.seconds;
        }
        Counters {
            steps: a.steps + b.steps,
            undrafted_steps: a.undrafted_steps + b.undrafted_steps,
            draft_tokens: a.draft_tokens + b.draft_tokens,
            accepted_tokens: a.accepted_tokens + b.accepted_tokens,
            emitted_tokens: a.emitted_tokens + b.emitted_tokens,
            accepted_per_position: per_position,
            draft_seconds: a.draft_seconds + b.draft_seconds,
            observe_seconds: a.observe_seconds + b.observe_seconds,
            verify_seconds: a.verify_seconds + b.verify_seconds,
            prefill_steps: a.prefill_steps + b.prefill_steps,
            prefill_verify_seconds: a.prefill_verify_seconds + b.prefill_verify_seconds,
            accept_seconds: a.accept_seconds + b.accept_seconds,
            judges,
        }
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &Counters) -> Counters {
        let mut per_position = self.accepted_per_position.clone();
        for (now, before) in per_position.iter_mut().zip(&earlier.accepted_per_position) {
            *now -= before;
        }
        let judges = self
            .judges
            .iter()
            .map(|(name, now)| {
                let before = earlier.judges.get(name).cloned().unwrap_or_default();
                let diff = JudgeCounters {
                    calls: now.calls - before.calls,
                    rescues: now.rescues - before.rescues,
                    vetoes: now.vetoes - before.vetoes,
                    seconds: now.seconds - before.seconds,
                };
                (name.clone(), diff)
            })
            .collect();
        Counters {
            steps: self.steps - earlier.steps,
            undrafted_steps: self.undrafted_steps - earlier.undrafted_steps,
            draft_tokens: self.draft_tokens - earlier.draft_tokens,
            accepted_tokens: self.accepted_tokens - earlier.accepted_tokens,
            emitted_tokens: self.emitted_tokens - earlier.emitted_tokens,
            accepted_per_position: per_position,
            draft_seconds: self.draft_seconds - earlier.draft_seconds,
            observe_seconds: self.observe_seconds - earlier.observe_seconds,
            verify_seconds: self.verify_seconds - earlier.verify_seconds,
            prefill_steps: self.prefill_steps - earlier.prefill_steps,
            prefill_verify_seconds: self.prefill_verify_seconds - earlier.prefill_verify_seconds,
            accept_seconds: self.accept_seconds - earlier.accept_seconds,
            judges,
        }
    }
}

/// Thread-safe accumulation of [`Counters`].
#[derive(Default)]
pub struct Metrics {
    counters: Mutex<Counters>,
}

impl Metrics {
    pub fn snapshot(&self) -> Counters {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counters> {
        // A panic elsewhere must not take the counters down with it.
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn record_timing(
        &self,
        draft: Duration,
        verify: Duration,
        accept: Duration,
        prefill: bool,
    ) {
        let mut c = self.lock();
        c.draft_seconds += draft.as_secs_f64();
        if prefill {
            c.prefill_steps += 1;
            c.prefill_verify_seconds += verify.as_secs_f64();
        } else {
            c.verify_seconds += verify.as_secs_f64();
        }
        c.accept_seconds += accept.as_secs_f64();
    }

    pub fn record_observe(&self, observe: Duration) {
        self.lock().observe_seconds += observe.as_secs_f64();
    }

    /// Mean time of one verify forward over γ + 1 tokens (prompt steps excluded).
    pub fn mean_verify_seconds(c: &Counters) -> f64 {
        c.verify_seconds / c.steps.saturating_sub(c.prefill_steps).max(1) as f64
    }

    pub fn record_step(&self, report: &StepReport) {
        let mut c = self.lock();
        c.steps += 1;
        c.undrafted_steps += (report.drafted == 0) as u64;
        c.draft_tokens += report.drafted as u64;
        c.accepted_tokens += report.accepted as u64;
        c.emitted_tokens += report.emitted as u64;
        if c.accepted_per_position.len() < report.drafted {
            c.accepted_per_position.resize(report.drafted, 0);
        }
        for slot in &mut c.accepted_per_position[..report.accepted] {
            *slot += 1;
        }
    }

    pub fn record_judge(&self, name: &str, rescued: bool, vetoed: bool, elapsed: Duration) {
        let mut c = self.lock();
        let judge = c.judges.entry(name.to_string()).or_default();
        judge.calls += 1;
        judge.rescues += rescued as u64;
        judge.vetoes += vetoed as u64;
        judge.seconds += elapsed.as_secs_f64();
    }

    /// Prometheus text exposition (version 0.0.4).
    pub fn render_prometheus(&self) -> String {
        let c = self.snapshot();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP verdict_{name} {help}\n# TYPE verdict_{name} {kind}\nverdict_{name} {value}");
        };
        metric(
            "spec_decode_num_steps_total",
            "counter",
            "Speculative steps (target verify forwards).",
            c.steps as f64,
        );
        metric(
            "spec_decode_num_draft_tokens_total",
            "counter",
            "Drafted tokens.",
            c.draft_tokens as f64,
        );
        metric(
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Drafted tokens kept.",
            c.accepted_tokens as f64,
        );
        metric(
            "spec_decode_num_emitted_tokens_total",
            "counter",
            "Tokens appended by speculative steps.",
            c.emitted_tokens as f64,
        );
        metric(
            "spec_decode_mean_acceptance_length",
            "gauge",
            "1 + accepted / steps.",
            c.mean_acceptance_length(),
        );
        metric(
            "spec_decode_draft_acceptance_rate",
            "gauge",
            "accepted / drafted.",
            c.draft_acceptance_rate(),
        );
        metric(
            "spec_decode_draft_seconds_total",
            "counter",
            "Time drafting.",
            c.draft_seconds,
        );
        metric(
            "spec_decode_observe_seconds_total",
            "counter",
            "Time a head proposer spent taking in the target's features after each verify.",
            c.observe_seconds,
        );
        metric(
            "spec_decode_verify_seconds_total",
            "counter",
            "Time in target verify forwards, prompt steps excluded.",
            c.verify_seconds,
        );
        metric(
            "spec_decode_prefill_verify_seconds_total",
            "counter",
            "Time in verify forwards that also processed a prompt.",
            c.prefill_verify_seconds,
        );
        metric(
            "spec_decode_accept_seconds_total",
            "counter",
            "Time in the accept rule (base rule and judges).",
            c.accept_seconds,
        );
        let _ = writeln!(out, "# HELP verdict_spec_decode_num_accepted_tokens_per_pos_total Steps whose draft at this position was kept.\n# TYPE verdict_spec_decode_num_accepted_tokens_per_pos_total counter");
        for (position, n) in c.accepted_per_position.iter().enumerate() {
            let _ = writeln!(out, "verdict_spec_decode_num_accepted_tokens_per_pos_total{{position=\"{position}\"}} {n}");
        }
        for (family, help) in [
            ("rescues", "Refusals a judge overturned."),
            ("vetoes", "Acceptances a judge overturned."),
            ("seconds", "Time in the judge."),
        ] {
            let _ = writeln!(out, "# HELP verdict_judge_{family}_total {help}\n# TYPE verdict_judge_{family}_total counter");
            for (name, j) in &c.judges {
                let value = match family {
                    "rescues" => j.rescues as f64,
                    "vetoes" => j.vetoes as f64,
                    _ => j.seconds,
                };
                let _ = writeln!(
                    out,
                    "verdict_judge_{family}_total{{judge=\"{name}\"}} {value}"
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_total_adds_every_set_and_none_makes_none() {
        assert_eq!(Counters::total(&[]), None);
        let a = Counters { steps: 3, accepted_tokens: 2, emitted_tokens: 5, accepted_per_position: vec![2], ..Counters::default() };
        let b = Counters { steps: 1, undrafted_steps: 1, emitted_tokens: 1, ..Counters::default() };
        let total = Counters::total([&a, &b, &a]).unwrap();
        assert_eq!((total.steps, total.undrafted_steps, total.accepted_tokens, total.emitted_tokens), (7, 1, 4, 11));
        assert_eq!(total.accepted_per_position, vec![4]);
        assert_eq!(Counters::total([&b]), Some(b));
    }

    fn report(drafted: usize, accepted: usize) -> StepReport {
        StepReport {
            seq_id: 0,
            drafted,
            accepted,
            emitted: accepted + 1,
            seq_len: 0,
            target_cache_len: 0,
            draft_cache_len: 0,
            finished: false,
        }
    }

    #[test]
    fn acceptance_length_and_rate_follow_the_definitions() {
        let metrics = Metrics::default();
        metrics.record_step(&report(4, 4));
        metrics.record_step(&report(4, 1));
        let c = metrics.snapshot();
        assert_eq!(c.mean_acceptance_length(), 1.0 + 5.0 / 2.0);
        assert_eq!(c.draft_acceptance_rate(), 5.0 / 8.0);
        assert_eq!(c.accepted_per_position, vec![2, 1, 1, 1]);
        assert_eq!(c.emitted_tokens, 7);
        // A proposer's prompt step drafts nothing and leaves τ alone.
        metrics.record_step(&report(0, 0));
        let c = metrics.snapshot();
        assert_eq!(c.mean_acceptance_length(), 1.0 + 5.0 / 2.0);
        assert_eq!((c.steps, c.undrafted_steps), (3, 1));
    }

    #[test]
    fn since_subtracts_an_earlier_snapshot() {
        let metrics = Metrics::default();
        metrics.record_step(&report(2, 2));
        let before = metrics.snapshot();
        metrics.record_step(&report(2, 0));
        let delta = metrics.snapshot().since(&before);
        assert_eq!((delta.steps, delta.accepted_tokens), (1, 0));
        assert_eq!(delta.accepted_per_position, vec![0, 0]);
    }

    #[test]
    fn prometheus_text_names_every_counter() {
        let metrics = Metrics::default();
        metrics.record_step(&report(3, 2));
        metrics.record_judge("fsd", true, false, Duration::from_millis(1));
        let text = metrics.render_prometheus();
        assert!(
            text.contains("verdict_spec_decode_num_accepted_tokens_total 2\n"),
            "{text}"
        );
        assert!(text
            .contains("verdict_spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 1\n"));
        assert!(text.contains("verdict_judge_rescues_total{judge=\"fsd\"} 1\n"));
    }
}
