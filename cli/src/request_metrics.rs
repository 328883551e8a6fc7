//! What `verdict serve` counts of completion requests, in vLLM's metric names: requests by
//! status and in flight, prompt and generation tokens, and histograms of end-to-end
//! latency, time to first token and time per output token.
//!
//! A non-streaming answer is read whole: its usage gives the tokens, and its first token
//! came at the end-to-end time less the engine's completion time. A stream is watched as
//! it goes: its first content event is its first token, its last event's usage its
//! tokens, and it is counted when it ends, whether it finished or its client left.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Instant,
};

use axum::{
    body::{to_bytes, Body},
    extract::{Request, State},
    http::{header, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use futures_util::StreamExt;
use serde_json::Value;

/// Seconds, cumulative per upper bound, with their count and sum.
struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(), count: AtomicU64::new(0), sum_micros: AtomicU64::new(0) }
    }

    fn observe(&self, seconds: f64) {
        for (bucket, &bound) in self.buckets.iter().zip(self.bounds) {
            if seconds <= bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add((seconds.max(0.0) * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, name: &str, out: &mut String) {
        out.push_str(&format!("# TYPE {name} histogram\n"));
        for (bucket, bound) in self.buckets.iter().zip(self.bounds) {
            out.push_str(&format!("{name}_bucket{{le=\"{bound}\"}} {}\n", bucket.load(Ordering::Relaxed)));
        }
        let count = self.count.load(Ordering::Relaxed);
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {count}\n"));
        out.push_str(&format!("{name}_sum {}\n", self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6));
        out.push_str(&format!("{name}_count {count}\n"));
    }
}

const E2E_BOUNDS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
const TTFT_BOUNDS: [f64; 10] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
const TPOT_BOUNDS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0];

/// The server's own counts, beside the engine's speculative metrics.
pub struct RequestMetrics {
    /// Completion requests answered, by status class (index 2 = 2xx … 5 = 5xx).
    by_status: [AtomicU64; 6],
    running: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    e2e: Histogram,
    ttft: Histogram,
    tpot: Histogram,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        Self {
            by_status: Default::default(),
            running: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            e2e: Histogram::new(&E2E_BOUNDS),
            ttft: Histogram::new(&TTFT_BOUNDS),
            tpot: Histogram::new(&TPOT_BOUNDS),
        }
    }
}

/// One finished completion as the metrics see it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Finished {
    seconds: f64,
    first_token_seconds: Option<f64>,
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl RequestMetrics {
    fn record_status(&self, status: StatusCode) {
        self.by_status[(status.as_u16() / 100).min(5) as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn record(&self, done: Finished) {
        self.e2e.observe(done.seconds);
        self.prompt_tokens.fetch_add(done.prompt_tokens, Ordering::Relaxed);
        self.generation_tokens.fetch_add(done.completion_tokens, Ordering::Relaxed);
        if let Some(first) = done.first_token_seconds {
            self.ttft.observe(first);
            if done.completion_tokens > 1 {
                self.tpot.observe((done.seconds - first).max(0.0) / (done.completion_tokens - 1) as f64);
            }
        }
    }

    /// Prometheus text; `waiting`: requests the engine's scheduler holds queued, which
    /// count among the requests in flight but not as running.
    pub fn render_prometheus(&self, waiting: u64) -> String {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::from("# TYPE verdict_http_requests_total counter\n");
        for (class, label) in [(2, "2xx"), (4, "4xx"), (5, "5xx")] {
            out.push_str(&format!("verdict_http_requests_total{{status=\"{label}\"}} {}\n", load(&self.by_status[class])));
        }
        out.push_str(&format!("# TYPE vllm:request_success_total counter\nvllm:request_success_total {}\n", load(&self.by_status[2])));
        out.push_str(&format!("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n", load(&self.running).saturating_sub(waiting)));
        out.push_str(&format!("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {waiting}\n"));
        out.push_str(&format!("# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total {}\n", load(&self.prompt_tokens)));
        out.push_str(&format!("# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total {}\n", load(&self.generation_tokens)));
        self.e2e.render("vllm:e2e_request_latency_seconds", &mut out);
        self.ttft.render("vllm:time_to_first_token_seconds", &mut out);
        self.tpot.render("vllm:time_per_output_token_seconds", &mut out);
        out
    }
}

/// Tokens and engine times of an answer's `usage`.
fn usage_of(answer: &Value) -> Option<(u64, u64, Option<f64>)> {
    let usage = answer.get("usage").filter(|u| !u.is_null())?;
    let count = |k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
    Some((count("prompt_tokens"), count("completion_tokens"), usage.get("total_completion_time_sec").and_then(Value::as_f64)))
}

/// A whole JSON answer received `seconds` after its request.
fn finished_answer(body: &[u8], seconds: f64) -> Finished {
    let Some((prompt_tokens, completion_tokens, completion_seconds)) = serde_json::from_slice::<Value>(body).ok().as_ref().and_then(usage_of) else {
        return Finished { seconds, ..Finished::default() };
    };
    Finished {
        seconds,
        first_token_seconds: completion_seconds.map(|c| (seconds - c).max(0.0)).filter(|_| completion_tokens > 0),
        prompt_tokens,
        completion_tokens,
    }
}

/// One request counted as running from its arrival until it is answered, its stream ends,
/// or its client leaves: hyper then drops the request's future, and this guard with it.
struct InFlight(Arc<RequestMetrics>);

impl InFlight {
    fn new(metrics: Arc<RequestMetrics>) -> Self {
        metrics.running.fetch_add(1, Ordering::Relaxed);
        Self(metrics)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A stream under way: when its first token came, and the usage its last event carried.
struct WatchedStream {
    metrics: Arc<RequestMetrics>,
    _in_flight: InFlight,
    started: Instant,
    pending: Vec<u8>,
    done: Finished,
}

impl WatchedStream {
    fn push(&mut self, chunk: &[u8]) {
        let Some(complete) = crate::openai_conventions::complete_lines(&mut self.pending, chunk) else {
            return;
        };
        for line in complete.split(|&b| b == b'\n') {
            let Some(data) = line.strip_prefix(b"data: ") else { continue };
            let Ok(event) = serde_json::from_slice::<Value>(data.trim_ascii_end()) else { continue };
            let has_text = event.pointer("/choices/0/delta/content").or_else(|| event.pointer("/choices/0/text")).and_then(Value::as_str).is_some_and(|t| !t.is_empty());
            if has_text && self.done.first_token_seconds.is_none() {
                self.done.first_token_seconds = Some(self.started.elapsed().as_secs_f64());
            }
            if let Some((prompt, completion, _)) = usage_of(&event) {
                (self.done.prompt_tokens, self.done.completion_tokens) = (prompt, completion);
            }
        }
    }
}

/// Counted when the stream ends, finished or dropped by a client that left.
impl Drop for WatchedStream {
    fn drop(&mut self) {
        self.done.seconds = self.started.elapsed().as_secs_f64();
        self.metrics.record(self.done);
    }
}

/// Axum middleware over the completion routes.
pub async fn count_requests(State(metrics): State<Arc<RequestMetrics>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let in_flight = InFlight::new(metrics.clone());
    let response = next.run(request).await;
    metrics.record_status(response.status());
    let is_stream = response.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
    let (parts, body) = response.into_parts();
    if is_stream {
        let mut watched = WatchedStream { metrics: metrics.clone(), _in_flight: in_flight, started, pending: Vec::new(), done: Finished::default() };
        let stream = body.into_data_stream().map(move |chunk| {
            if let Ok(bytes) = &chunk {
                watched.push(bytes);
            }
            chunk
        });
        return Response::from_parts(parts, Body::from_stream(stream));
    }
    let bytes = match to_bytes(body, crate::openai_conventions::MAX_RESPONSE_BYTES).await {
        Ok(bytes) => bytes,
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    let seconds = started.elapsed().as_secs_f64();
    match parts.status.is_success() {
        true => metrics.record(finished_answer(&bytes, seconds)),
        false => metrics.e2e.observe(seconds),
    }
    drop(in_flight);
    Response::from_parts(parts, Body::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answers_usage_gives_its_tokens_and_first_token_time() {
        let body = br#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_completion_time_sec":0.5}}"#;
        let done = finished_answer(body, 2.0);
        assert_eq!(done, Finished { seconds: 2.0, first_token_seconds: Some(1.5), prompt_tokens: 12, completion_tokens: 5 });
        let metrics = RequestMetrics::default();
        metrics.record(done);
        let text = metrics.render_prometheus(0);
        assert!(text.contains("vllm:prompt_tokens_total 12\n") && text.contains("vllm:generation_tokens_total 5\n"), "{text}");
        // 0.5 s for the 4 tokens after the first.
        assert!(text.contains("vllm:time_per_output_token_seconds_sum 0.125\n"), "{text}");
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{le=\"1\"} 0\n") && text.contains("vllm:time_to_first_token_seconds_bucket{le=\"2.5\"} 1\n"), "{text}");
        assert!(text.contains("vllm:e2e_request_latency_seconds_count 1\n"), "{text}");
    }

    #[test]
    fn a_stream_is_counted_when_it_ends_with_its_first_token_and_usage() {
        let metrics = Arc::new(RequestMetrics::default());
        let in_flight = InFlight::new(metrics.clone());
        // In flight, and queued in the engine: waiting, not running.
        let text = metrics.render_prometheus(1);
        assert!(text.contains("vllm:num_requests_running 0\n") && text.contains("vllm:num_requests_waiting 1\n"), "{text}");
        let mut watched = WatchedStream { metrics: metrics.clone(), _in_flight: in_flight, started: Instant::now(), pending: Vec::new(), done: Finished::default() };
        // The role event carries no text: not the first token. Events split across chunks.
        watched.push(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"choices\":[{\"del");
        assert_eq!(watched.done.first_token_seconds, None);
        watched.push(b"ta\":{\"content\":\"Hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n");
        assert!(watched.done.first_token_seconds.is_some());
        drop(watched);
        let text = metrics.render_prometheus(0);
        assert!(text.contains("vllm:num_requests_running 0\n"), "{text}");
        assert!(text.contains("vllm:prompt_tokens_total 7\n") && text.contains("vllm:generation_tokens_total 3\n"), "{text}");
        assert!(text.contains("vllm:time_to_first_token_seconds_count 1\n") && text.contains("vllm:time_per_output_token_seconds_count 1\n"), "{text}");
    }
}
