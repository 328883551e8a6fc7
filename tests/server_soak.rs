//! A soak of `verdict serve` on loopback: up to 16 clients at once mixing good requests
//! (streamed or not), malformed and over-limit ones, and clients that hang up mid-answer,
//! against a prompt-lookup speculative engine on a tiny generated target. Every good
//! request is answered with the greedy text of a quiet run, nothing gets a 5xx, resident
//! memory stays flat after warm-up, and at the end no sequence or proposer state is left.
//!
//! CI runs it for 20 s; `VERDICT_SOAK_SECONDS=300 cargo test --release -p verdict-e2e --test
//! server_soak -- --nocapture` runs it for five minutes and prints the figures.

mod common;

use std::{
    collections::BTreeMap,
    io::Read,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use common::{counter, raw_chat_request, spec};
use serde_json::{json, Value};
use verdict::{
    config::Config,
    engine::{Engine, LoadedModels, Scheduling, SpeculativeSetup},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
    tiny_model::{words, write_tiny_model, TinyArch},
};
use verdict_cli::server;

const CLIENTS: usize = 16;

fn resident_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn chat(prompt: &str, stream: bool) -> Value {
    json!({"model": "verdict", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0.0, "stream": stream})
}

/// The answer's text: a JSON completion's content, or a stream's deltas joined (which must
/// end with `[DONE]`).
fn answer_text(body: &str, stream: bool) -> String {
    if !stream {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        return v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    }
    assert!(body.contains("data: [DONE]"), "a stream ended without [DONE]: {body}");
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| l.trim() != "[DONE]")
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Send `body` over a fresh connection and hang up after the first bytes of the answer.
fn hang_up(addr: SocketAddr, body: &Value) {
    let mut stream = raw_chat_request(addr, body);
    stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let _ = stream.read(&mut [0u8; 64]);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

#[derive(Default, Debug)]
struct Tally {
    sent: BTreeMap<&'static str, u64>,
    by_status: BTreeMap<(&'static str, u16), u64>,
}

#[test]
fn a_soak_of_mixed_clients_answers_every_good_request_and_leaks_nothing() {
    let seconds: u64 = std::env::var("VERDICT_SOAK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(&spec(TinyArch::Qwen2, 31), &dir.path().join("target")).unwrap();
    let config = Config::from_toml(&format!(
        "[models]\ntarget = {:?}\n[speculative]\nproposer = \"ngram\"\nngram_min = 1\nngram_max = 3\nngram_gamma = 4\n[sampling]\ntemperature = 0.0\nmax_tokens = 24\n",
        dir.path().join("target").to_str().unwrap()
    ))
    .unwrap();
    let models = LoadedModels::load(&config).unwrap();
    let lookup = models.ngram_proposer(&config).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let metrics = Arc::new(Metrics::default());
    let (addr, _engine) = runtime.block_on(async {
        let engine = Engine::with_proposer(&models, lookup.clone(), SpeculativeSetup { gamma: 4, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: metrics.clone(), scheduling: Scheduling::from(4) }).await.unwrap();
        let mut options = server::ServeOptions::from_config(&config, true);
        options.api_key = None;
        let router = server::router(&engine, metrics.clone(), &options).await.unwrap();
        let listener = server::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { server::serve(router, listener, std::future::pending(), &options).await });
        (addr, engine)
    });
    let client = reqwest::blocking::Client::new();
    // Status 0: the connection broke (the server refuses an oversized body without reading
    // it, so the client may still be writing when the connection closes).
    let post = |client: &reqwest::blocking::Client, body: String| match client.post(format!("http://{addr}/v1/chat/completions")).header("content-type", "application/json").body(body).send() {
        Ok(response) => {
            let status = response.status().as_u16();
            (status, response.text().unwrap_or_default())
        }
        Err(e) => (0, e.to_string()),
    };

    // The quiet run: each good prompt alone.
    let prompts: Vec<String> = (0..8).map(|i| words(&[i + 1, (3 * i + 5) % 56, 7, i + 2, (5 * i) % 56])).collect();
    let quiet: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (status, body) = post(&client, chat(p, false).to_string());
            assert_eq!(status, 200, "{body}");
            answer_text(&body, false)
        })
        .collect();

    let tally = Mutex::new(Tally::default());
    let mismatches = Mutex::new(Vec::new());
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let warm = Mutex::new(None::<u64>);
    std::thread::scope(|scope| {
        for worker in 0..CLIENTS {
            let (tally, mismatches, prompts, quiet, warm) = (&tally, &mismatches, &prompts, &quiet, &warm);
            scope.spawn(move || {
                let client = reqwest::blocking::Client::new();
                let mut i = worker;
                while Instant::now() < deadline {
                    if warm.lock().unwrap().is_none() && started.elapsed() > Duration::from_secs(seconds / 4) {
                        *warm.lock().unwrap() = Some(resident_kib());
                    }
                    let p = i % prompts.len();
                    let (kind, status) = match i % 8 {
                        0..=2 => {
                            let stream = i % 2 == 0;
                            let (status, body) = post(&client, chat(&prompts[p], stream).to_string());
                            if status == 200 && answer_text(&body, stream) != quiet[p] {
                                mismatches.lock().unwrap().push((p, body));
                            }
                            ("good", status)
                        }
                        3 => {
                            let bad = [
                                json!({"messages": []}),
                                json!({"messages": [{"role": "user", "content": null}]}),
                                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}]}),
                                json!({"messages": [{"role": "robot", "content": "x"}]}),
                            ];
                            let (status, _) = post(&client, bad[i / 8 % bad.len()].to_string());
                            ("malformed", status)
                        }
                        4 => {
                            let (status, _) = post(&client, "{\"messages\": [".into());
                            ("malformed", status)
                        }
                        5 => {
                            let mut body = chat(&prompts[p], false);
                            body["max_tokens"] = json!(1_000_000_000u64);
                            let (status, _) = post(&client, body.to_string());
                            ("over-limit", status)
                        }
                        6 => {
                            let body = json!({"messages": [{"role": "user", "content": "w".repeat(2 << 20)}]});
                            let (status, _) = post(&reqwest::blocking::Client::new(), body.to_string());
                            ("over-limit", status)
                        }
                        _ => {
                            hang_up(addr, &chat(&prompts[p], i % 16 == 7));
                            // A client that hangs up comes back as often as one that waits
                            // for its answer would.
                            std::thread::sleep(Duration::from_millis(500));
                            ("abandoned", 0)
                        }
                    };
                    // Clients pace themselves; refusals come back at once.
                    std::thread::sleep(Duration::from_millis(20));
                    let mut tally = tally.lock().unwrap();
                    *tally.sent.entry(kind).or_default() += 1;
                    *tally.by_status.entry((kind, status)).or_default() += 1;
                    i += CLIENTS;
                }
            });
        }
    });
    let end = resident_kib();
    // Abandoned sequences finish or are dropped; then nothing is left.
    let settled = Instant::now();
    let metrics_page = || client.get(format!("http://{addr}/metrics")).send().unwrap().text().unwrap();
    let running = |page: &str| counter(page, "vllm:num_requests_running");
    while (lookup.live_sequences() > 0 || running(&metrics_page()) != 0.0) && settled.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("settled {:.1} s after the last client", settled.elapsed().as_secs_f64());
    let metrics_page = metrics_page();
    let tally = tally.into_inner().unwrap();
    let warm = warm.into_inner().unwrap().unwrap_or(end);
    eprintln!("soak of {seconds} s: sent {:?}; by (kind, status) {:?}; resident {warm} KiB after warm-up, {end} KiB at the end", tally.sent, tally.by_status);

    let mismatches = mismatches.into_inner().unwrap();
    assert!(mismatches.is_empty(), "{} good answers differ from the quiet run's, e.g. {:?}", mismatches.len(), mismatches.first());
    for ((kind, status), n) in &tally.by_status {
        match *kind {
            "good" => assert_eq!(*status, 200, "{n} good requests got {status}"),
            "malformed" => assert!(matches!(status, 400 | 415), "{n} malformed requests got {status}"),
            "over-limit" => assert!(matches!(status, 0 | 400 | 413), "{n} over-limit requests got {status}"),
            _ => {}
        }
    }
    assert!(tally.sent.get("good").copied().unwrap_or(0) >= CLIENTS as u64, "too few good requests: {:?}", tally.sent);
    assert!(end <= warm + warm / 5 + 32 * 1024, "resident memory grew from {warm} KiB after warm-up to {end} KiB");
    assert_eq!(lookup.live_sequences(), 0, "sequences left with proposer state");
    assert_eq!(running(&metrics_page), 0.0, "{metrics_page}");
}
