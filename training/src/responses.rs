//! The target's responses to a prompts file: the data a head is self-distilled on. Plain
//! decoding keeps up to `batch` requests in flight (a finished one is replaced at once), at
//! the sampling the caller chooses, and every response is appended to a JSON Lines
//! checkpoint as it finishes, so a killed run loses only the requests in flight and resumes
//! with the prompts not yet answered.

use std::{
    collections::{BTreeMap, HashSet},
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use verdict::{
    config::SamplingConfig,
    engine::{generate, Engine, LoadedModels, Prompt, Scheduling},
};
use verdict_eval::prompts::PromptRecord;

/// One answered prompt.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Response {
    /// The prompt's line in the prompts file (0-based); features are kept under it.
    pub index: usize,
    pub id: String,
    pub source: String,
    pub text: String,
    pub completion_tokens: usize,
    /// `stop` when the target ended its turn, `length` when the budget cut it.
    pub finish_reason: String,
    pub seconds: f64,
}

impl Response {
    /// Whether the target ended its turn (the end-of-turn token belongs to the response).
    pub fn ended_its_turn(&self) -> bool {
        self.finish_reason == "stop"
    }
}

/// The checkpoint's responses, each index once (the first kept); a line cut short by a
/// crash is dropped, so its prompt is answered again.
pub fn load(path: &Path) -> Result<Vec<Response>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut seen = HashSet::new();
    let mut responses: Vec<Response> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Response>(l).ok())
        .filter(|r| seen.insert(r.index))
        .collect();
    responses.sort_by_key(|r| r.index);
    Ok(responses)
}

/// How responses are generated.
#[derive(Clone, Debug, Serialize)]
pub struct ResponsePlan {
    pub prompts: PathBuf,
    /// Answer only the first this many prompts (the file's sources alternate).
    pub limit: Option<usize>,
    pub sampling: SamplingConfig,
    /// Requests in flight at once.
    pub batch: usize,
}

/// Answer every prompt of `records` (up to the plan's limit) not yet in `checkpoint`.
pub fn generate_responses(models: &LoadedModels, records: &[PromptRecord], plan: &ResponsePlan, ragged_batches: bool, checkpoint: &Path) -> Result<Vec<Response>> {
    ensure!(plan.batch >= 1, "--generate-batch 0: pass at least 1");
    let wanted = plan.limit.unwrap_or(records.len()).min(records.len());
    let done: HashSet<usize> = load(checkpoint)?.into_iter().map(|r| r.index).collect();
    let pending: Vec<usize> = (0..wanted).filter(|i| !done.contains(i)).collect();
    tracing::info!(
        "responses: {} of {wanted} prompts answered, {} to go (temperature {}, up to {} tokens, {} at once) → {}",
        wanted - pending.len(),
        pending.len(),
        plan.sampling.temperature,
        plan.sampling.max_tokens,
        plan.batch,
        checkpoint.display()
    );
    if !pending.is_empty() {
        if let Some(parent) = checkpoint.parent() {
            fs::create_dir_all(parent)?;
        }
        let mut log = fs::OpenOptions::new().create(true).append(true).open(checkpoint).with_context(|| format!("cannot open {}", checkpoint.display()))?;
        let bar = indicatif::ProgressBar::new(wanted as u64).with_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} responses  {elapsed} elapsed, ETA {eta}  {msg}").unwrap(),
        );
        bar.set_position((wanted - pending.len()) as u64);
        let runtime = tokio::runtime::Runtime::new()?;
        runtime.block_on(async {
            let engine = Engine::plain(
                models,
                Scheduling {
                    max_seqs: plan.batch,
                    prefix_cache_bytes: None,
                    ragged_batches,
                },
            )
            .await;
            let mut queue = pending.into_iter();
            let mut in_flight = tokio::task::JoinSet::new();
            let mut tokens = 0usize;
            let started = std::time::Instant::now();
            let spawn = |set: &mut tokio::task::JoinSet<_>, index: usize| {
                let mistralrs = engine.mistralrs.clone();
                let prompt = Prompt::Messages(records[index].turns().into_iter().map(|t| (t.role, t.content)).collect());
                let sampling = plan.sampling.clone();
                set.spawn(async move { (index, generate(&mistralrs, &prompt, &sampling).await) });
            };
            for index in queue.by_ref().take(plan.batch) {
                spawn(&mut in_flight, index);
            }
            while let Some(joined) = in_flight.join_next().await {
                let (index, generation) = joined?;
                let record = &records[index];
                let generation = generation.with_context(|| format!("prompt {} ({})", index, record.id))?;
                let response = Response {
                    index,
                    id: record.id.clone(),
                    source: record.source.clone(),
                    text: generation.text,
                    completion_tokens: generation.completion_tokens,
                    finish_reason: generation.finish_reason,
                    seconds: generation.seconds,
                };
                writeln!(log, "{}", serde_json::to_string(&response)?)?;
                log.flush()?;
                tokens += response.completion_tokens;
                bar.inc(1);
                bar.set_message(format!("{:.1} tok/s", tokens as f64 / started.elapsed().as_secs_f64()));
                tracing::debug!("prompt {index} ({}): {} tokens, {}", response.id, response.completion_tokens, response.finish_reason);
                if let Some(next) = queue.next() {
                    spawn(&mut in_flight, next);
                }
            }
            engine.settle().await;
            anyhow::Ok(())
        })?;
        bar.finish_and_clear();
    }
    let mut responses = load(checkpoint)?;
    responses.retain(|r| r.index < wanted);
    Ok(responses)
}

/// Responses by source: (count, completion tokens), from (source, completion tokens) pairs.
pub fn per_source<'a>(responses: impl IntoIterator<Item = (&'a str, usize)>) -> BTreeMap<String, (usize, usize)> {
    let mut out: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (source, tokens) in responses {
        let entry = out.entry(source.to_string()).or_default();
        entry.0 += 1;
        entry.1 += tokens;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(index: usize, text: &str) -> String {
        serde_json::to_string(&Response {
            index,
            id: format!("p{index}"),
            source: "qa".into(),
            text: text.into(),
            completion_tokens: 3,
            finish_reason: "stop".into(),
            seconds: 1.0,
        })
        .unwrap()
    }

    #[test]
    fn a_line_cut_short_is_dropped_and_each_index_kept_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("responses.jsonl");
        let cut = &response(2, "c")[..20];
        fs::write(&path, format!("{}\n{}\n{}\n{cut}", response(1, "b"), response(0, "a"), response(1, "again"))).unwrap();
        let loaded = load(&path).unwrap();
        assert_eq!(loaded.iter().map(|r| (r.index, r.text.as_str())).collect::<Vec<_>>(), [(0, "a"), (1, "b")]);
        assert_eq!(per_source(loaded.iter().map(|r| (r.source.as_str(), r.completion_tokens)))["qa"], (2, 6));
    }
}
