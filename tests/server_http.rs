//! `verdict serve` over real HTTP on loopback: chat completions, streaming, concurrent
//! requests and /metrics, on a tiny generated target/draft pair.

mod common;

use std::{
    io::{Read, Write},
    net::SocketAddr,
    path::Path,
    sync::Arc,
};

use common::{config, spec, tiny_pair};
use serde_json::{json, Value};
use verdict::{
    engine::{Engine, LoadedModels},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
    tiny_model::{words, TinyArch},
};
use verdict_cli::server;

fn chat_body(prompt: &str, stream: bool) -> Value {
    json!({
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 10,
        "temperature": 0.0,
        "stream": stream,
    })
}

fn post(client: &reqwest::blocking::Client, addr: SocketAddr, body: &Value) -> (u16, String) {
    let response = client
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .unwrap();
    let status = response.status().as_u16();
    let mut text = String::new();
    response.take(1 << 20).read_to_string(&mut text).unwrap();
    (status, text)
}

fn content(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn server_answers_chat_streaming_concurrent_requests_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), 4);
    let addr = server.addr;
    let client = reqwest::blocking::Client::new();
    check_openai_conventions(&client, addr);

    let prompts: Vec<String> = (0..3).map(|i| words(&[i + 1, 2 * i + 3, 7])).collect();
    let sequential: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (status, body) = post(&client, addr, &chat_body(p, false));
            assert_eq!(status, 200, "{body}");
            content(&body)
        })
        .collect();
    assert!(
        sequential.iter().all(|c| !c.trim().is_empty()),
        "{sequential:?}"
    );

    // Streaming: server-sent events whose deltas add up to the same greedy answer.
    let (status, stream) = post(&client, addr, &chat_body(&prompts[0], true));
    assert_eq!(status, 200, "{stream}");
    let mut streamed = String::new();
    for line in stream.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line.trim() == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(line).unwrap();
        streamed.push_str(
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or(""),
        );
    }
    assert!(stream.contains("data: [DONE]"), "{stream}");
    assert_eq!(streamed.trim(), sequential[0].trim());

    // Concurrent requests: each gets its own answer, the same as when sent alone.
    let concurrent: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let client = client.clone();
                scope.spawn(move || {
                    let (status, body) = post(&client, addr, &chat_body(p, false));
                    assert_eq!(status, 200, "{body}");
                    content(&body)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(concurrent, sequential);

    let metrics_text = server.metrics(&client);
    let steps = counter(&metrics_text, "verdict_spec_decode_num_steps_total");
    assert!(steps >= 7.0, "{metrics_text}");
    assert!(
        metrics_text.contains("verdict_spec_decode_mean_acceptance_length "),
        "{metrics_text}"
    );
}

/// `verdict serve` over a tiny generated target/draft pair (lossless, γ 3), on a loopback
/// port, with its runtime and engine kept alive as long as the value.
struct TestServer {
    addr: SocketAddr,
    _engine: Engine,
    _runtime: tokio::runtime::Runtime,
}

impl TestServer {
    /// `max_seqs`: sequences the scheduler runs at once.
    fn start(dir: &Path, max_seqs: usize) -> Self {
        tiny_pair(dir, &spec(TinyArch::Qwen2, 31), 0.2);
        let config = config(dir, 3, "exact", 16);
        let models = LoadedModels::load(&config).unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let metrics = Arc::new(Metrics::default());
        let (addr, engine) = runtime.block_on(async {
            let engine = Engine::speculative(
                &models,
                3,
                JudgeStack::lossless(BaseRule::Exact),
                0,
                metrics.clone(),
                max_seqs,
            )
            .await
            .unwrap();
            let router = server::router(&engine, metrics.clone()).await.unwrap();
            let listener = server::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(server::serve(router, listener, std::future::pending()));
            (addr, engine)
        });
        Self {
            addr,
            _engine: engine,
            _runtime: runtime,
        }
    }

    /// The /metrics page.
    fn metrics(&self, client: &reqwest::blocking::Client) -> String {
        client
            .get(format!("http://{}/metrics", self.addr))
            .send()
            .unwrap()
            .text()
            .unwrap()
    }
}

/// The value of a Prometheus counter or gauge on a /metrics page.
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
        .parse()
        .unwrap()
}

/// A streaming client that reads its first chunks and hangs up: the server must stop
/// decoding for it. With one sequence at a time, a request sent after the hang-up runs only
/// once the abandoned one is gone, so the tokens decoded meanwhile say whether it was freed
/// or ran to its end.
#[test]
fn a_client_that_hangs_up_mid_stream_frees_its_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), 1);
    let client = reqwest::blocking::Client::new();
    let emitted = || counter(&server.metrics(&client), "verdict_spec_decode_num_emitted_tokens_total");
    // A prompt whose greedy answer runs long (a random model ends most answers soon), read
    // to its end: how long the abandoned request would run.
    let (mut long, whole) = (1..=40)
        .find_map(|first| {
            let mut body = chat_body(&words(&[first, 3, 1, 4]), false);
            body["max_tokens"] = json!(LONG_ANSWER_TOKENS);
            let before = emitted();
            let (status, text) = post(&client, server.addr, &body);
            assert_eq!(status, 200, "{text}");
            let whole = emitted() - before;
            (whole >= LONG_ANSWER_TOKENS as f64 * 0.8).then_some((body, whole))
        })
        .expect("no prompt of the tiny model answers at length: the test needs a long answer");

    let before = emitted();
    long["stream"] = json!(true);
    let mut stream = std::net::TcpStream::connect(server.addr).unwrap();
    let body = long.to_string();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        server.addr,
        body.len()
    )
    .unwrap();
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    while String::from_utf8_lossy(&received).matches("data: ").count() < 2 {
        let n = stream.read(&mut buffer).unwrap();
        assert!(n > 0, "the server closed the stream: {}", String::from_utf8_lossy(&received));
        received.extend_from_slice(&buffer[..n]);
    }
    stream.shutdown(std::net::Shutdown::Both).unwrap();
    drop(stream);

    let (status, body) = post(&client, server.addr, &chat_body(&words(&[2, 7]), false));
    assert_eq!(status, 200, "{body}");
    let after_hang_up = emitted() - before;
    assert!(
        after_hang_up < whole / 2.0,
        "{after_hang_up} tokens decoded after the hang-up and the next request; the abandoned answer alone is {whole}"
    );
}

/// Tokens asked of the abandoned request: its whole answer takes ≈ 100 verify steps.
const LONG_ANSWER_TOKENS: usize = 400;

/// What OpenAI clients expect: responses name the served model (streamed or not), an
/// out-of-range sampling value is a 400 naming the field, an unknown model a 404.
fn check_openai_conventions(client: &reqwest::blocking::Client, addr: SocketAddr) {
    let prompt = words(&[4, 5, 6]);
    let (status, body) = post(client, addr, &chat_body(&prompt, false));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["model"], "verdict", "{body}");
    let (status, stream) = post(client, addr, &chat_body(&prompt, true));
    assert_eq!(status, 200, "{stream}");
    let chunks: Vec<Value> = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| l.trim() != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!chunks.is_empty() && chunks.iter().all(|c| c["model"] == "verdict"), "{stream}");
    for (field, value) in [("temperature", json!(-1.0)), ("max_tokens", json!(0)), ("top_p", json!(1.5))] {
        let mut body = chat_body(&prompt, false);
        body[field] = value;
        let (status, text) = post(client, addr, &body);
        assert_eq!(status, 400, "{field}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["param"], field, "{text}");
    }
    let mut body = chat_body(&prompt, false);
    body["model"] = json!("gpt-4o");
    let (status, text) = post(client, addr, &body);
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("gpt-4o") && text.contains("verdict"), "{text}");
}
