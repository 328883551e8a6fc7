//! What OpenAI clients expect of a server and mistral.rs's routes leave out: a completion
//! request with an out-of-range sampling value is refused with a 400 naming the field, one
//! for a model this server does not serve with a 404, and every response (streamed or not)
//! names the served model, where mistral.rs writes its pipeline's description
//! ("Speculative: tgt = …").

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

/// Largest request body read for checking (a long prompt is a few hundred KB).
const MAX_BODY_BYTES: usize = 64 << 20;

/// Why a request is refused: HTTP status, the offending field, a message naming the value.
#[derive(Debug, PartialEq)]
pub struct Refusal {
    pub status: StatusCode,
    pub param: &'static str,
    pub message: String,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let code = if self.status == StatusCode::NOT_FOUND { "model_not_found" } else { "invalid_value" };
        let body = json!({"error": {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": code,
        }});
        (self.status, Json(body)).into_response()
    }
}

/// Checks a chat or text completion request's model and sampling values.
pub fn check_request(body: &Value, served: &str) -> Result<(), Refusal> {
    if let Some(model) = body.get("model").and_then(Value::as_str) {
        if model != served && model != DEFAULT_MODEL {
            return Err(Refusal {
                status: StatusCode::NOT_FOUND,
                param: "model",
                message: format!("the model `{model}` does not exist: this server serves `{served}`"),
            });
        }
    }
    let number = |param: &'static str, ok: &dyn Fn(f64) -> bool, range: &str| -> Result<(), Refusal> {
        match body.get(param) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if v.as_f64().is_some_and(ok) => Ok(()),
            Some(v) => Err(Refusal {
                status: StatusCode::BAD_REQUEST,
                param,
                message: format!("`{param}` = {v} is invalid: it must be {range}"),
            }),
        }
    };
    let whole = |x: f64| x.fract() == 0.0;
    number("temperature", &|t| (0.0..=2.0).contains(&t), "a number from 0 to 2")?;
    number("top_p", &|p| p > 0.0 && p <= 1.0, "a number above 0, at most 1")?;
    number("max_tokens", &|n| whole(n) && n >= 1.0, "a whole number of at least 1")?;
    number("max_completion_tokens", &|n| whole(n) && n >= 1.0, "a whole number of at least 1")?;
    number("n", &|n| whole(n) && n >= 1.0, "a whole number of at least 1")?;
    number("presence_penalty", &|p| (-2.0..=2.0).contains(&p), "a number from -2 to 2")?;
    number("frequency_penalty", &|p| (-2.0..=2.0).contains(&p), "a number from -2 to 2")?;
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
        self.pending.extend_from_slice(chunk);
        let Some(last_newline) = self.pending.iter().rposition(|&b| b == b'\n') else {
            return Bytes::new();
        };
        let rest = self.pending.split_off(last_newline + 1);
        let complete = std::mem::replace(&mut self.pending, rest);
        let mut out = Vec::with_capacity(complete.len());
        for line in complete.split_inclusive(|&b| b == b'\n') {
            match line.strip_prefix(b"data: ").and_then(|json| with_served_model(json.trim_ascii_end(), &self.served)) {
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

fn is_completion(request: &Request) -> bool {
    let path = request.uri().path();
    request.method() == Method::POST && (path.ends_with("/chat/completions") || path.ends_with("/completions"))
}

/// Axum middleware over mistral.rs's routes: checks completion requests, and names the
/// served model in their responses.
pub async fn enforce(State(served): State<String>, request: Request, next: Next) -> Response {
    if !is_completion(&request) {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let bytes = match to_bytes(body, MAX_BODY_BYTES).await {
        Ok(bytes) => bytes,
        Err(e) => return (StatusCode::PAYLOAD_TOO_LARGE, format!("request body: {e}")).into_response(),
    };
    // Malformed JSON is left to mistral.rs, which reports it.
    if let Ok(value) = serde_json::from_slice::<Value>(&bytes) {
        if let Err(refusal) = check_request(&value, &served) {
            tracing::info!("refused a request: {}", refusal.message);
            return refusal.into_response();
        }
    }
    let response = next.run(Request::from_parts(parts, Body::from(bytes))).await;
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let (mut parts, body) = response.into_parts();
    if content_type.starts_with("application/json") {
        let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
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
            (json!({"frequency_penalty": 3}), "frequency_penalty"),
        ] {
            let refusal = check_request(&body, "verdict").unwrap_err();
            assert_eq!((refusal.status, refusal.param), (StatusCode::BAD_REQUEST, param), "{body}");
            assert!(refusal.message.contains(param), "{}", refusal.message);
        }
        let refusal = check_request(&json!({"model": "gpt-4o"}), "verdict").unwrap_err();
        assert_eq!(refusal.status, StatusCode::NOT_FOUND);
        assert!(refusal.message.contains("gpt-4o") && refusal.message.contains("verdict"), "{}", refusal.message);
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
}
