//! What OpenAI clients expect of a server and mistral.rs's routes leave out: a completion
//! request that the engine could not serve is refused before it reaches a batch, with a 400
//! naming the field (out-of-range sampling values, empty or non-text messages, unknown roles,
//! limits exceeded, features a speculative engine does not support), one for a model this
//! server does not serve with a 404; fields a request omits take the config's `[sampling]`
//! values; and every response (streamed or not) names the served model, where mistral.rs
//! writes its pipeline's description ("Speculative: tgt = …").
//!
//! Nothing a request names is fetched or read: image, audio and file parts, and web search
//! options, are refused (the served models read text).

use axum::{
    body::{to_bytes, Body, Bytes},
    extract::{Request, State},
    http::{header::CONTENT_TYPE, Method, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
    Json,
};
use futures_util::StreamExt;
use serde_json::{json, Value};

/// Model names a request may ask for: the served id, and mistral.rs's `default`.
const DEFAULT_MODEL: &str = "default";

/// Largest response body read back for naming the served model.
pub const MAX_RESPONSE_BYTES: usize = 256 << 20;

/// OpenAI's bound on `top_logprobs`.
const MAX_TOP_LOGPROBS: u64 = 20;

/// What a request may ask of this server, and what it gets when it asks nothing.
#[derive(Clone, Debug)]
pub struct RequestPolicy {
    /// The model id responses name.
    pub served: String,
    pub max_request_bytes: usize,
    pub max_tokens_limit: usize,
    pub max_stop_sequences: usize,
    /// The engine verifies drafts: grammars are refused.
    pub speculative: bool,
    /// `[sampling]`: the values of fields a request omits.
    pub defaults: verdict::config::SamplingConfig,
}

impl RequestPolicy {
    /// The policy `config` sets for an engine that is speculative or not.
    pub fn from_config(config: &verdict::config::Config, served: &str, speculative: bool) -> Self {
        Self {
            served: served.to_string(),
            max_request_bytes: config.server.max_request_bytes,
            max_tokens_limit: config.server.max_tokens_limit,
            max_stop_sequences: config.server.max_stop_sequences,
            speculative,
            defaults: config.sampling.clone(),
        }
    }

    /// A policy with the defaults of an empty config (tests).
    pub fn lenient(served: &str) -> Self {
        let config = verdict::config::ServerConfig::default();
        Self {
            served: served.to_string(),
            max_request_bytes: config.max_request_bytes,
            max_tokens_limit: config.max_tokens_limit,
            max_stop_sequences: config.max_stop_sequences,
            speculative: true,
            defaults: verdict::config::SamplingConfig::default(),
        }
    }
}

/// Why a request is refused: HTTP status, the offending field, a message naming the value.
#[derive(Debug, PartialEq)]
pub struct Refusal {
    pub status: StatusCode,
    pub param: String,
    pub message: String,
}

fn bad(param: impl Into<String>, message: impl Into<String>) -> Refusal {
    Refusal {
        status: StatusCode::BAD_REQUEST,
        param: param.into(),
        message: message.into(),
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let code = match self.status {
            StatusCode::NOT_FOUND => "model_not_found",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            _ => "invalid_value",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": code,
        }});
        (self.status, Json(body)).into_response()
    }
}

/// Which completion route a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Chat,
    Text,
}

/// Checks a chat or text completion request's model and sampling values only.
pub fn check_request(body: &Value, served: &str) -> Result<(), Refusal> {
    check_model(body, served)?;
    check_sampling(body, &RequestPolicy::lenient(served))
}

fn check_model(body: &Value, served: &str) -> Result<(), Refusal> {
    if let Some(model) = body.get("model").and_then(Value::as_str) {
        if model != served && model != DEFAULT_MODEL {
            return Err(Refusal {
                status: StatusCode::NOT_FOUND,
                param: "model".into(),
                message: format!("the model `{model}` does not exist: this server serves `{served}`"),
            });
        }
    }
    Ok(())
}

fn check_sampling(body: &Value, policy: &RequestPolicy) -> Result<(), Refusal> {
    let number = |param: &'static str, ok: &dyn Fn(f64) -> bool, range: &str| -> Result<(), Refusal> {
        match body.get(param) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if v.as_f64().is_some_and(ok) => Ok(()),
            Some(v) => Err(bad(param, format!("`{param}` = {v} is invalid: it must be {range}"))),
        }
    };
    let whole = |x: f64| x.fract() == 0.0;
    let limit = policy.max_tokens_limit as f64;
    let tokens_range = format!("a whole number from 1 to {} (server.max_tokens_limit)", policy.max_tokens_limit);
    number("temperature", &|t| (0.0..=2.0).contains(&t), "a number from 0 to 2")?;
    number("top_p", &|p| p > 0.0 && p <= 1.0, "a number above 0, at most 1")?;
    number("min_p", &|p| (0.0..=1.0).contains(&p), "a number from 0 to 1")?;
    number("top_k", &|k| whole(k) && k >= 0.0, "a whole number of at least 0")?;
    number("max_tokens", &|n| whole(n) && n >= 1.0 && n <= limit, &tokens_range)?;
    number("max_completion_tokens", &|n| whole(n) && n >= 1.0 && n <= limit, &tokens_range)?;
    number("n", &|n| n == 1.0, "1: this server returns one choice a request")?;
    number("best_of", &|n| n == 1.0, "1: this server returns one choice a request")?;
    number("presence_penalty", &|p| (-2.0..=2.0).contains(&p), "a number from -2 to 2")?;
    number("frequency_penalty", &|p| (-2.0..=2.0).contains(&p), "a number from -2 to 2")?;
    number("top_logprobs", &|n| whole(n) && (0.0..=MAX_TOP_LOGPROBS as f64).contains(&n), "a whole number from 0 to 20")?;
    let asks_logprobs = match body.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        // The text completion API's `logprobs` is a count.
        Some(v) if v.as_u64().is_some_and(|n| n <= 5) => v.as_u64() != Some(0),
        Some(v) => return Err(bad("logprobs", format!("`logprobs` = {v} is invalid: true or false (a count from 0 to 5 for text completions)"))),
    };
    if body.get("top_logprobs").is_some_and(|v| !v.is_null()) && !asks_logprobs {
        return Err(bad("top_logprobs", "`top_logprobs` needs `logprobs`: true"));
    }
    match body.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => return Err(bad("stop", "an empty stop string would stop at once")),
        Some(Value::String(_)) => {}
        Some(Value::Array(stops)) => {
            if stops.len() > policy.max_stop_sequences {
                return Err(bad("stop", format!("{} stop sequences: at most {} (server.max_stop_sequences)", stops.len(), policy.max_stop_sequences)));
            }
            if let Some(i) = stops.iter().position(|s| s.as_str().is_none_or(str::is_empty)) {
                return Err(bad(format!("stop[{i}]"), format!("stop[{i}] = {} is not a non-empty string", stops[i])));
            }
        }
        Some(v) => return Err(bad("stop", format!("`stop` = {v} is not a string or a list of strings"))),
    }
    Ok(())
}

/// Fields whose features this server does not offer: refused rather than ignored.
const REFUSED_FIELDS: [(&str, &str); 7] = [
    ("logit_bias", "`logit_bias` is not applied by the engine (mistral.rs 0.8.1's sampler ignores it): refused rather than ignored"),
    ("web_search_options", "web search is not offered: nothing a request names is fetched"),
    ("tools", "tool calling is not offered by this server"),
    ("tool_choice", "tool calling is not offered by this server"),
    ("functions", "function calling is not offered by this server"),
    ("suffix", "`suffix` (insertion) is not offered by this server"),
    ("dry_multiplier", "DRY sampling is not offered by this server"),
];

/// Penalties and their neutral values. The accept rules judge drafts against the target's
/// own distribution, so a penalty would be silently dropped on a speculative engine.
const PENALTIES: [(&str, f64); 3] = [("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)];

fn check_no_penalties(body: &Value) -> Result<(), Refusal> {
    for (field, neutral) in PENALTIES {
        match body.get(field) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_f64() == Some(neutral) => {}
            Some(v) => {
                return Err(bad(field, format!("`{field}` = {v} is not applied by this speculative engine's accept rule, so it would be ignored; a plain engine (`speculative.enabled = false`) applies it")));
            }
        }
    }
    Ok(())
}

const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Chat messages: a non-empty list of known roles, each with text (a string or text
/// parts); any other part (an image, audio, a file, a URL) is refused, never fetched.
fn check_messages(body: &Value) -> Result<(), Refusal> {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return Err(bad("messages", "`messages` must be a list of chat messages"));
    };
    if messages.is_empty() {
        return Err(bad("messages", "`messages` is empty: give at least one message"));
    }
    for (i, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        if !ROLES.contains(&role) {
            return Err(bad(format!("messages[{i}].role"), format!("messages[{i}].role = {} is not one of system, user, assistant", message.get("role").unwrap_or(&Value::Null))));
        }
        match message.get("content") {
            Some(Value::String(text)) if !text.trim().is_empty() => {}
            Some(Value::Array(parts)) if !parts.is_empty() => {
                for (j, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                    if kind != "text" {
                        return Err(bad(
                            format!("messages[{i}].content[{j}].type"),
                            format!("messages[{i}].content[{j}] is a {kind:?} part: this model reads text only, and nothing a request names is fetched or read"),
                        ));
                    }
                    if part.get("text").and_then(Value::as_str).is_none_or(|t| t.is_empty()) {
                        return Err(bad(format!("messages[{i}].content[{j}].text"), format!("messages[{i}].content[{j}] has no text")));
                    }
                }
            }
            other => {
                return Err(bad(format!("messages[{i}].content"), format!("messages[{i}].content = {} is empty or not text", other.unwrap_or(&Value::Null))));
            }
        }
    }
    Ok(())
}

/// Check a completion request for `route`, then give it the config's sampling values
/// for the fields it omits.
pub fn prepare_request(body: &mut Value, route: Route, policy: &RequestPolicy) -> Result<(), Refusal> {
    if !body.is_object() {
        return Err(bad("body", "the request body must be a JSON object"));
    }
    check_model(body, &policy.served)?;
    check_sampling(body, policy)?;
    for (field, why) in REFUSED_FIELDS {
        if body.get(field).is_some_and(|v| !v.is_null()) {
            return Err(bad(field, why));
        }
    }
    let constrains = ["grammar", "json_schema", "regex"].into_iter().find(|f| body.get(*f).is_some_and(|v| !v.is_null())).or_else(|| {
        body.get("response_format").filter(|f| !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text")).map(|_| "response_format")
    });
    if let (Some(field), true) = (constrains, policy.speculative) {
        return Err(bad(field, format!("`{field}` constrains decoding, which this speculative engine does not do yet: the accept rule would not respect it")));
    }
    if policy.speculative {
        check_no_penalties(body)?;
    }
    match route {
        Route::Chat => check_messages(body)?,
        Route::Text => match body.get("prompt") {
            Some(Value::String(p)) if !p.is_empty() => {}
            other => return Err(bad("prompt", format!("`prompt` = {} must be a non-empty string", other.unwrap_or(&Value::Null)))),
        },
    }
    let object = body.as_object_mut().expect("checked above");
    let defaults = &policy.defaults;
    let mut default = |field: &str, value: Option<Value>| {
        if let Some(value) = value {
            if object.get(field).is_none_or(Value::is_null) {
                object.insert(field.to_string(), value);
            }
        }
    };
    default("temperature", Some(json!(defaults.temperature)));
    default("top_p", defaults.top_p.map(|p| json!(p)));
    default("top_k", defaults.top_k.map(|k| json!(k)));
    if object.get("max_completion_tokens").is_none_or(Value::is_null) {
        let max = defaults.max_tokens.min(policy.max_tokens_limit);
        if object.get("max_tokens").is_none_or(Value::is_null) {
            object.insert("max_tokens".into(), json!(max));
        }
    }
    Ok(())
}

/// `object["model"] = served` in a JSON object's text; other text is returned as it was.
fn with_served_model(text: &[u8], served: &str) -> Option<Vec<u8>> {
    let mut value: Value = serde_json::from_slice(text).ok()?;
    let object = value.as_object_mut()?;
    if !object.contains_key("model") {
        return None;
    }
    object.insert("model".into(), Value::String(served.into()));
    serde_json::to_vec(&value).ok()
}

/// Rewrites the `model` of every complete `data: {…}` line of a server-sent event stream,
/// holding back a line split between chunks until its end arrives.
struct EventRewriter {
    served: String,
    pending: Vec<u8>,
}

impl EventRewriter {
    fn push(&mut self, chunk: &[u8]) -> Bytes {
        let Some(complete) = complete_lines(&mut self.pending, chunk) else {
            return Bytes::new();
        };
        let mut out = Vec::with_capacity(complete.len());
        for line in complete.split_inclusive(|&b| b == b'\n') {
            let data = line.strip_prefix(b"data: ").map(<[u8]>::trim_ascii_end);
            let rewritten = data.and_then(|json| with_served_model(json, &self.served)).or_else(|| data.and_then(error_event));
            match rewritten {
                Some(rewritten) => {
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(&rewritten);
                    out.extend_from_slice(&line[line.trim_ascii_end().len()..]);
                }
                None => out.extend_from_slice(line),
            }
        }
        Bytes::from(out)
    }
}

/// Server-sent events arrive in chunks that may cut a line: `chunk` joins what `pending`
/// held, and the lines now complete are returned (none yet: `None`), the rest kept.
pub(crate) fn complete_lines(pending: &mut Vec<u8>, chunk: &[u8]) -> Option<Vec<u8>> {
    pending.extend_from_slice(chunk);
    let last_newline = pending.iter().rposition(|&b| b == b'\n')?;
    let rest = pending.split_off(last_newline + 1);
    Some(std::mem::replace(pending, rest))
}

/// An event whose data is neither JSON nor `[DONE]` is an error mistral.rs sent as bare
/// text: it becomes OpenAI's error object, so clients see an error, not a broken chunk.
fn error_event(data: &[u8]) -> Option<Vec<u8>> {
    if data == b"[DONE]" || serde_json::from_slice::<Value>(data).is_ok() {
        return None;
    }
    let message = String::from_utf8_lossy(data);
    Some(serde_json::to_vec(&json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})).expect("a JSON value serialises"))
}

/// What the engine refused before scheduling (mistral.rs answers 422: a prompt longer than
/// the context, or `max_tokens` beyond the context it leaves), as a 400 naming the field.
fn engine_refusal(body: &[u8], route: Route) -> Refusal {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("message").or_else(|| v.pointer("/error/message")).and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let param = match (message.starts_with("`max_tokens`"), route) {
        (true, _) => "max_tokens",
        (false, Route::Chat) => "messages",
        (false, Route::Text) => "prompt",
    };
    bad(param, message)
}

fn completion_route(request: &Request) -> Option<Route> {
    let path = request.uri().path();
    match (request.method() == Method::POST, path) {
        (true, "/v1/chat/completions") => Some(Route::Chat),
        (true, "/v1/completions") => Some(Route::Text),
        _ => None,
    }
}

/// Axum middleware over the completion routes: checks each request (and fills its
/// defaults) before it reaches the engine, and names the served model in the response.
pub async fn enforce(State(policy): State<std::sync::Arc<RequestPolicy>>, request: Request, next: Next) -> Response {
    let Some(route) = completion_route(&request) else {
        return next.run(request).await;
    };
    let served = policy.served.clone();
    let (mut parts, body) = request.into_parts();
    let bytes = match to_bytes(body, policy.max_request_bytes).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return Refusal {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                param: "body".into(),
                message: format!("the request body is over {} bytes (server.max_request_bytes)", policy.max_request_bytes),
            }
            .into_response()
        }
    };
    let mut value = match serde_json::from_slice::<Value>(&bytes) {
        Ok(value) => value,
        Err(e) => return bad("body", format!("the request body is not JSON: {e}")).into_response(),
    };
    if let Err(refusal) = prepare_request(&mut value, route, &policy) {
        tracing::info!("refused a request: {}", refusal.message);
        return refusal.into_response();
    }
    let bytes = Bytes::from(serde_json::to_vec(&value).expect("a JSON value serialises"));
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let response = next.run(Request::from_parts(parts, Body::from(bytes))).await;
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let (mut parts, body) = response.into_parts();
    if content_type.starts_with("application/json") {
        let Ok(bytes) = to_bytes(body, MAX_RESPONSE_BYTES).await else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        if parts.status == StatusCode::UNPROCESSABLE_ENTITY {
            return engine_refusal(&bytes, route).into_response();
        }
        let rewritten = with_served_model(&bytes, &served).map_or(bytes, Bytes::from);
        parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        Response::from_parts(parts, Body::from(rewritten))
    } else if content_type.starts_with("text/event-stream") {
        let mut rewriter = EventRewriter { served, pending: Vec::new() };
        let stream = body.into_data_stream().map(move |chunk| chunk.map(|c| rewriter.push(&c)));
        Response::from_parts(parts, Body::from_stream(stream))
    } else {
        Response::from_parts(parts, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_values_are_refused_naming_the_field() {
        let ok = json!({"model": "verdict", "temperature": 0.0, "max_tokens": 5, "top_p": 1.0});
        assert_eq!(check_request(&ok, "verdict"), Ok(()));
        assert_eq!(check_request(&json!({"model": "default"}), "verdict"), Ok(()));
        for (body, param) in [
            (json!({"temperature": -0.5}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_tokens": 2.5}), "max_tokens"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"n": 0}), "n"),
            (json!({"n": 2}), "n"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"max_tokens": 1_000_000_000u64}), "max_tokens"),
            (json!({"stop": ""}), "stop"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"stop": ["a", ""]}), "stop[1]"),
            (json!({"top_logprobs": 25, "logprobs": true}), "top_logprobs"),
            (json!({"top_logprobs": 3}), "top_logprobs"),
            (json!({"frequency_penalty": 3}), "frequency_penalty"),
        ] {
            let refusal = check_request(&body, "verdict").unwrap_err();
            assert_eq!((refusal.status, refusal.param.as_str()), (StatusCode::BAD_REQUEST, param), "{body}");
            assert!(refusal.message.contains(param), "{}", refusal.message);
        }
        let refusal = check_request(&json!({"model": "gpt-4o"}), "verdict").unwrap_err();
        assert_eq!(refusal.status, StatusCode::NOT_FOUND);
        assert!(refusal.message.contains("gpt-4o") && refusal.message.contains("verdict"), "{}", refusal.message);
    }

    fn chat(messages: Value) -> Value {
        json!({"model": "verdict", "messages": messages})
    }

    #[test]
    fn bad_messages_are_refused_naming_the_message() {
        let policy = RequestPolicy::lenient("verdict");
        for (mut body, param) in [
            (chat(json!([])), "messages"),
            (json!({"model": "verdict"}), "messages"),
            (chat(json!([{"role": "user", "content": null}])), "messages[0].content"),
            (chat(json!([{"role": "user", "content": "  "}])), "messages[0].content"),
            (chat(json!([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])), "messages[1].role"),
            (chat(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}])), "messages[0].content[0].type"),
            (chat(json!([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}])), "messages[0].content[1].type"),
            (json!({"messages": [{"role": "user", "content": "a"}], "web_search_options": {}}), "web_search_options"),
            (json!({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}), "response_format"),
            (json!({"messages": [{"role": "user", "content": "a"}], "grammar": {"type": "regex", "value": "a+"}}), "grammar"),
            (json!({"messages": [{"role": "user", "content": "a"}], "tools": []}), "tools"),
            (json!({"messages": [{"role": "user", "content": "a"}], "logit_bias": {"5": 10}}), "logit_bias"),
            (json!({"messages": [{"role": "user", "content": "a"}], "frequency_penalty": 0.5}), "frequency_penalty"),
            (json!({"messages": [{"role": "user", "content": "a"}], "repetition_penalty": 1.2}), "repetition_penalty"),
        ] {
            let refusal = prepare_request(&mut body, Route::Chat, &policy).unwrap_err();
            assert_eq!((refusal.status, refusal.param.as_str()), (StatusCode::BAD_REQUEST, param), "{body}: {}", refusal.message);
        }
        let mut text = json!({"prompt": ""});
        assert_eq!(prepare_request(&mut text, Route::Text, &policy).unwrap_err().param, "prompt");
        // A non-speculative engine may constrain decoding.
        let plain = RequestPolicy { speculative: false, ..policy };
        let mut body = json!({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}});
        assert_eq!(prepare_request(&mut body, Route::Chat, &plain), Ok(()));
        // Penalties: applied by a plain engine; neutral values pass a speculative one.
        let mut body = json!({"messages": [{"role": "user", "content": "a"}], "presence_penalty": 0.7});
        assert_eq!(prepare_request(&mut body, Route::Chat, &plain), Ok(()));
        let mut body = json!({"messages": [{"role": "user", "content": "a"}], "presence_penalty": 0, "repetition_penalty": 1.0});
        assert_eq!(prepare_request(&mut body, Route::Chat, &RequestPolicy::lenient("verdict")), Ok(()));
    }

    #[test]
    fn omitted_fields_take_the_configs_sampling_and_given_ones_stay() {
        let policy = RequestPolicy {
            defaults: verdict::config::SamplingConfig { temperature: 0.3, top_k: Some(5), top_p: Some(0.9), max_tokens: 77 },
            ..RequestPolicy::lenient("verdict")
        };
        let mut body = chat(json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]));
        prepare_request(&mut body, Route::Chat, &policy).unwrap();
        assert_eq!((body["temperature"].clone(), body["top_p"].clone(), body["top_k"].clone(), body["max_tokens"].clone()), (json!(0.3), json!(0.9), json!(5), json!(77)));
        let mut given = json!({"messages": [{"role": "user", "content": "a"}], "temperature": 0.0, "max_completion_tokens": 9});
        prepare_request(&mut given, Route::Chat, &policy).unwrap();
        assert_eq!(given["temperature"], json!(0.0));
        assert!(given.get("max_tokens").is_none(), "{given}");
    }

    #[test]
    fn streamed_events_split_across_chunks_name_the_served_model() {
        let mut rewriter = EventRewriter { served: "verdict".into(), pending: Vec::new() };
        let events = "data: {\"model\":\"Speculative: tgt\",\"x\":1}\n\ndata: {\"model\":\"m\"}\n\ndata: [DONE]\n\n";
        let (a, b) = events.split_at(20);
        let mut out = rewriter.push(a.as_bytes()).to_vec();
        out.extend_from_slice(&rewriter.push(b.as_bytes()));
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "data: {\"model\":\"verdict\",\"x\":1}\n\ndata: {\"model\":\"verdict\"}\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn an_error_sent_as_bare_text_in_a_stream_becomes_an_error_event() {
        let mut rewriter = EventRewriter { served: "verdict".into(), pending: Vec::new() };
        let out = rewriter.push(b"data: {\"model\":\"m\"}\n\ndata: the model failed: out of memory\n\ndata: [DONE]\n\n");
        let events: Vec<&str> = std::str::from_utf8(&out).unwrap().lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(events.len(), 3, "{events:?}");
        let error: Value = serde_json::from_str(events[1]).unwrap();
        assert_eq!(error["error"]["message"], "the model failed: out of memory");
        assert_eq!(error["error"]["type"], "server_error");
        assert_eq!(events[2], "[DONE]");
    }

    #[test]
    fn engine_refusals_name_the_field() {
        let long = engine_refusal(br#"{"message":"Prompt sequence length is greater than 512"}"#, Route::Chat);
        assert_eq!((long.status, long.param.as_str()), (StatusCode::BAD_REQUEST, "messages"));
        assert_eq!(engine_refusal(br#"{"message":"Prompt sequence length is greater than 512"}"#, Route::Text).param, "prompt");
        let max = engine_refusal(br#"{"message":"`max_tokens` = 600 does not fit: the prompt holds 9 of the model's 512 context tokens, leaving 503"}"#, Route::Chat);
        assert_eq!(max.param, "max_tokens");
        assert!(max.message.contains("leaving 503"), "{}", max.message);
    }
}
