//! `verdict serve`: the OpenAI completion routes of mistral.rs behind Verdict's own router,
//! plus `/v1/models`, `/health` and Prometheus `/metrics`.
//!
//! Only those routes exist: mistral.rs's management routes (unload, reload, re-ISQ, tune,
//! system info and doctor), its responses, embeddings, image and speech routes are not
//! served. Requests are checked before they reach the engine ([`openai_conventions`]);
//! an API key guards every route but `/health`; cross-origin browser calls are refused
//! unless their origins are listed; a server bound to loopback answers loopback host names
//! only (so no web page can reach it through DNS rebinding), and completion requests must
//! be sent as JSON (so no page can post one without the browser asking first).
//! Connections are capped and must send their headers and bodies in time; on SIGTERM the
//! server stops accepting, lets requests in flight finish within a grace period, and ends.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use axum::{
    extract::{Request, State},
    http::{header, HeaderValue, Method, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto::Builder, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use mistralrs_core::MistralRs;
use mistralrs_server_core::{chat_completion::chatcompletions, completions::completions};
use serde_json::json;
use tokio::net::TcpListener;

use crate::{
    openai_conventions::{self, RequestPolicy},
    request_metrics::{self, RequestMetrics},
};
use verdict::{
    config::Config,
    engine::{Engine, MODEL_ID},
    metrics::Metrics,
};

/// How the server admits clients, from `[server]` (and `$VERDICT_API_KEY`).
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub policy: RequestPolicy,
    pub api_key: Option<String>,
    pub cors_origins: Vec<String>,
    pub request_read: Duration,
    pub idle: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
    /// Bound to a loopback address: only loopback `Host` names are answered.
    pub loopback_hosts_only: bool,
}

impl ServeOptions {
    pub fn from_config(config: &Config, speculative: bool) -> Self {
        let s = &config.server;
        Self {
            policy: RequestPolicy::from_config(config, MODEL_ID, speculative),
            api_key: std::env::var("VERDICT_API_KEY").ok().filter(|k| !k.is_empty()).or_else(|| s.api_key.clone()),
            cors_origins: s.cors_origins.clone(),
            request_read: Duration::from_secs(s.request_read_seconds),
            idle: Duration::from_secs(s.idle_seconds),
            max_connections: s.max_connections,
            shutdown_grace: Duration::from_secs(s.shutdown_grace_seconds),
            loopback_hosts_only: s.host.is_loopback(),
        }
    }

    /// The defaults of an empty `[server]` (tests).
    pub fn defaults(speculative: bool) -> Self {
        let config = Config::from_toml("[models]\ntarget = \"t.gguf\"\n[speculative]\nenabled = false\n").expect("a minimal config");
        let mut options = Self::from_config(&config, speculative);
        options.api_key = None;
        options
    }
}

/// The router for `engine`: completion routes checked by `options`, the model list, health
/// and metrics, behind the access checks.
pub async fn router(engine: &Engine, metrics: Arc<Metrics>, options: &ServeOptions) -> Result<Router> {
    let counters = Arc::new(RequestMetrics::default());
    let policy = Arc::new(options.policy.clone());
    let completions_routes = Router::new()
        .route("/v1/chat/completions", post(chatcompletions))
        .route("/v1/completions", post(completions))
        .with_state(engine.mistralrs.clone())
        .layer(axum::middleware::from_fn_with_state(policy, openai_conventions::enforce))
        .layer(axum::middleware::from_fn_with_state(counters.clone(), request_metrics::count_requests));
    let mistralrs = engine.mistralrs.clone();
    let engine_for_metrics = engine.mistralrs.clone();
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let router = Router::new()
        .merge(completions_routes)
        .route(
            "/v1/models",
            get(move || async move { Json(json!({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": created, "owned_by": "local"}]})) }),
        )
        .route(
            "/health",
            get(move || {
                let mistralrs = mistralrs.clone();
                async move {
                    // The engine thread holds the channel's receiving end while it runs.
                    match mistralrs.get_sender(None) {
                        Ok(sender) if !sender.is_closed() => (StatusCode::OK, "OK"),
                        _ => (StatusCode::SERVICE_UNAVAILABLE, "the engine thread has stopped"),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let (metrics, counters) = (metrics.clone(), counters.clone());
                let waiting = queued_requests(&engine_for_metrics);
                async move {
                    let mut text = metrics.render_prometheus();
                    text.push_str(&counters.render_prometheus(waiting));
                    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
                }
            }),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, Json(json!({"error": {"message": "no such route on this server", "type": "invalid_request_error", "code": "not_found"}}))) })
        .layer(axum::middleware::from_fn_with_state(Arc::new(Access::from(options)), admit));
    Ok(match cors_layer(&options.cors_origins)? {
        Some(cors) => router.layer(cors),
        None => router,
    })
}

/// Requests queued in the engine's scheduler, not yet running (a count the patched
/// mistral.rs logger keeps).
fn queued_requests(mistralrs: &MistralRs) -> u64 {
    mistralrs.get_logger(None).map_or(0, |logger| logger.scheduler_counts().1 as u64)
}

/// CORS for the listed origins; none listed: no CORS headers, so browsers refuse pages of
/// other origins.
fn cors_layer(origins: &[String]) -> Result<Option<tower_http::cors::CorsLayer>> {
    if origins.is_empty() {
        return Ok(None);
    }
    let parsed = origins
        .iter()
        .map(|o| HeaderValue::from_str(o).with_context(|| format!("server.cors_origins: {o:?} is not an origin")))
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(
        tower_http::cors::CorsLayer::new()
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::CONTENT_TYPE, header::AUTHORIZATION])
            .allow_origin(parsed),
    ))
}

/// Who may use the server.
struct Access {
    api_key: Option<String>,
    /// Bound to loopback: only loopback host names are answered.
    loopback_hosts_only: bool,
}

impl From<&ServeOptions> for Access {
    fn from(options: &ServeOptions) -> Self {
        Self {
            api_key: options.api_key.clone(),
            loopback_hosts_only: options.loopback_hosts_only,
        }
    }
}

fn refuse(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": "invalid_request_error", "code": code}}))).into_response()
}

/// A `Host` naming this machine's loopback (with any port).
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    matches!(name, "localhost" | "::1") || name.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// Equal in time whatever the first difference (a key is not guessed byte by byte).
fn same_secret(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len() && given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

async fn admit(State(access): State<Arc<Access>>, request: Request, next: Next) -> Response {
    if access.loopback_hosts_only {
        if let Some(host) = request.headers().get(header::HOST) {
            if !host.to_str().is_ok_and(is_loopback_host) {
                return refuse(StatusCode::MISDIRECTED_REQUEST, "host_not_served", "this server answers loopback host names only (localhost, 127.0.0.1, [::1])");
            }
        }
    }
    if request.uri().path() != "/health" {
        if let Some(key) = &access.api_key {
            let given = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
                return refuse(StatusCode::UNAUTHORIZED, "invalid_api_key", "a valid `Authorization: Bearer <key>` is required");
            }
        }
    }
    if request.method() == Method::POST {
        let json = request.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("application/json"));
        if !json {
            return refuse(StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_content_type", "send the request as `Content-Type: application/json`");
        }
    }
    next.run(request).await
}

pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// Serve `router` on `listener` until `stop` completes (e.g. [`stop_signal`]): at most
/// `options.max_connections` at once, each sending its headers within `request_read` and
/// idle no longer than `idle`; then requests in flight get `shutdown_grace` to finish.
pub async fn serve(router: Router, listener: TcpListener, stop: impl Future<Output = ()>, options: &ServeOptions) -> Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(
        "serving on http://{addr} (OpenAI routes under /v1, metrics at /metrics){}",
        if options.api_key.is_some() { ", API key required" } else { "" }
    );
    if !addr.ip().is_loopback() && options.api_key.is_none() {
        tracing::warn!("serving on {addr}, beyond loopback, with no API key: anyone who reaches it may use it (set server.api_key or VERDICT_API_KEY)");
    }
    let slots = Arc::new(tokio::sync::Semaphore::new(options.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(options.request_read)
        .keep_alive(true);
    tokio::pin!(stop);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut stop => break,
        };
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!("accepting a connection failed: {e}");
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let service = TowerToHyperService::new(router.clone());
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(IdleTimeout::new(stream, options.idle)), service).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
            drop(slot);
        });
    }
    // Closed now, so new connections are refused instead of queueing unanswered.
    drop(listener);
    tracing::info!("stopping: no new connections; requests in flight have {} s to finish", options.shutdown_grace.as_secs());
    if tokio::time::timeout(options.shutdown_grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("requests still in flight after {} s were dropped", options.shutdown_grace.as_secs());
    }
    Ok(())
}

/// A connection that fails its reads once nothing has arrived or left for `idle`, so an
/// idle or stalled client frees its slot.
struct IdleTimeout {
    stream: tokio::net::TcpStream,
    idle: Duration,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl IdleTimeout {
    fn new(stream: tokio::net::TcpStream, idle: Duration) -> Self {
        Self { stream, idle, deadline: Box::pin(tokio::time::sleep(idle)) }
    }

    fn touched(&mut self) {
        self.deadline.as_mut().reset(tokio::time::Instant::now() + self.idle);
    }
}

impl tokio::io::AsyncRead for IdleTimeout {
    fn poll_read(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        match std::pin::Pin::new(&mut self.stream).poll_read(cx, buf) {
            std::task::Poll::Ready(result) => {
                if buf.filled().len() > before {
                    self.touched();
                }
                std::task::Poll::Ready(result)
            }
            std::task::Poll::Pending => match self.deadline.as_mut().poll(cx) {
                std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connection idle"))),
                std::task::Poll::Pending => std::task::Poll::Pending,
            },
        }
    }
}

impl tokio::io::AsyncWrite for IdleTimeout {
    fn poll_write(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        let written = std::pin::Pin::new(&mut self.stream).poll_write(cx, buf);
        if matches!(written, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.touched();
        }
        written
    }

    fn poll_flush(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Ctrl-C, or SIGTERM on Unix (what `kill` and service managers send).
pub async fn stop_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn serving_ends_when_told_to_stop() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let (tell, told) = tokio::sync::oneshot::channel::<()>();
        let options = ServeOptions::defaults(false);
        let serving = tokio::spawn(async move {
            serve(Router::new(), listener, async {
                let _ = told.await;
            }, &options)
            .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!serving.is_finished(), "it serves until told");
        tell.send(()).unwrap();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), serving).await;
        assert!(ended.expect("it stops within 10 s").unwrap().is_ok());
    }

    #[test]
    fn loopback_host_names_with_or_without_ports() {
        for host in ["localhost", "localhost:8080", "127.0.0.1:80", "127.1.2.3", "[::1]:8080", "[::1]"] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in ["evil.example", "evil.example:8080", "10.0.0.1", "localhost.evil.example", "[fe80::1]:80"] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn keys_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abd", b"abc") && !same_secret(b"ab", b"abc") && !same_secret(b"", b"abc"));
    }
}
