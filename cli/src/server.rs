//! `verdict serve`: mistral.rs's OpenAI-compatible server plus Prometheus `/metrics`.

use std::{future::{Future, IntoFuture}, net::SocketAddr, sync::Arc};

use anyhow::{Context, Result};
use axum::{http::header::CONTENT_TYPE, routing::get, Router};
use mistralrs_server_core::mistralrs_server_router_builder::MistralRsServerRouterBuilder;
use tokio::net::TcpListener;

use crate::openai_conventions;
use verdict::{
    engine::{Engine, MODEL_ID},
    metrics::Metrics,
};

/// The OpenAI routes of mistral.rs for `engine`, held to OpenAI's conventions (requests
/// checked, responses naming the served model), and `/metrics` rendering `metrics`.
pub async fn router(engine: &Engine, metrics: Arc<Metrics>) -> Result<Router> {
    let router = MistralRsServerRouterBuilder::new()
        .with_mistralrs(engine.mistralrs.clone())
        .build()
        .await?;
    Ok(router
        .layer(axum::middleware::from_fn_with_state(
            MODEL_ID.to_string(),
            openai_conventions::enforce,
        ))
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(CONTENT_TYPE, "text/plain; version=0.0.4")],
                        metrics.render_prometheus(),
                    )
                }
            }),
        ))
}

pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// Serve `router` on `listener` until `stop` completes (e.g. [`stop_signal`]). Requests in
/// flight are not waited for: a stopped server drops them, as a killed one did.
pub async fn serve(router: Router, listener: TcpListener, stop: impl Future<Output = ()>) -> Result<()> {
    tracing::info!(
        "serving on http://{} (OpenAI routes under /v1, metrics at /metrics)",
        listener.local_addr()?
    );
    tokio::select! {
        served = axum::serve(listener, router).into_future() => served?,
        () = stop => tracing::info!("stopping"),
    }
    Ok(())
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
        let serving = tokio::spawn(serve(Router::new(), listener, async {
            let _ = told.await;
        }));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!serving.is_finished(), "it serves until told");
        tell.send(()).unwrap();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), serving).await;
        assert!(ended.expect("it stops within 10 s").unwrap().is_ok());
    }
}
