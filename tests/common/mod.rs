//! Tiny random-weight target/draft pairs written to a temp folder, and configs for them.
#![allow(dead_code)]

use std::{path::Path, sync::Arc};

use mistralrs_core::MistralRs;
use verdict::{
    config::{Config, SamplingConfig},
    engine::{generate, Prompt},
    tiny_model::{words, write_tiny_model, write_tiny_model_perturbed, TinyArch, TinySpec},
};

/// Writes `target/` and a perturbed `draft/` (noise relative to each weight's scale).
pub fn tiny_pair(dir: &Path, spec: &TinySpec, draft_noise: f32) {
    write_tiny_model(spec, &dir.join("target")).unwrap();
    write_tiny_model_perturbed(
        spec,
        &dir.join("draft"),
        Some((spec.seed + 1000, draft_noise)),
    )
    .unwrap();
}

pub fn config(dir: &Path, gamma: usize, base_rule: &str, max_tokens: usize) -> Config {
    Config::from_toml(&format!(
        "[models]\ntarget = {:?}\ndraft = {:?}\n[speculative]\ngamma = {gamma}\nbase_rule = {base_rule:?}\n[sampling]\ntemperature = 0.0\nmax_tokens = {max_tokens}\n",
        dir.join("target").to_str().unwrap(),
        dir.join("draft").to_str().unwrap(),
    ))
    .unwrap()
}

pub fn spec(arch: TinyArch, seed: u64) -> TinySpec {
    TinySpec::new(arch, seed)
}

pub fn prompts() -> Vec<String> {
    vec![words(&[1, 2, 3]), words(&[10, 4, 4, 7, 30]), words(&[5])]
}
pub mod scripted;

/// The texts of `prompts` sent to one engine at once, in the prompts' order.
pub async fn answer_concurrently(mistralrs: &Arc<MistralRs>, prompts: &[String], sampling: &SamplingConfig) -> Vec<String> {
    let mut set = tokio::task::JoinSet::new();
    for (i, p) in prompts.iter().enumerate() {
        let (mistralrs, prompt, sampling) = (mistralrs.clone(), Prompt::Text(p.clone()), sampling.clone());
        set.spawn(async move { (i, generate(&mistralrs, &prompt, &sampling).await.unwrap().text) });
    }
    let mut texts = vec![String::new(); prompts.len()];
    while let Some(joined) = set.join_next().await {
        let (i, text) = joined.unwrap();
        texts[i] = text;
    }
    texts
}

/// The value of a Prometheus counter or gauge on a /metrics page.
pub fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
        .parse()
        .unwrap()
}

/// A chat completion sent by hand over a fresh connection, so a test can read at its own
/// pace or hang up; the server closes the connection after the answer.
pub fn raw_chat_request(addr: std::net::SocketAddr, body: &serde_json::Value) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let text = body.to_string();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    stream
}

/// Read a streamed answer until two events have arrived (it is under way); what was read.
pub fn read_two_events(mut stream: &std::net::TcpStream) -> Vec<u8> {
    use std::io::Read;
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    while String::from_utf8_lossy(&received).matches("data: ").count() < 2 {
        let n = stream.read(&mut buffer).unwrap();
        assert!(n > 0, "the server closed the stream: {}", String::from_utf8_lossy(&received));
        received.extend_from_slice(&buffer[..n]);
    }
    received
}
