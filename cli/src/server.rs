//! `verdict serve`: mistral.rs's OpenAI-compatible server plus Prometheus `/metrics`.

use std::{net::SocketAddr, sync::Arc};

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

/// Serve `router` on `listener` until the process ends.
pub async fn serve(router: Router, listener: TcpListener) -> Result<()> {
    tracing::info!(
        "serving on http://{} (OpenAI routes under /v1, metrics at /metrics)",
        listener.local_addr()?
    );
    axum::serve(listener, router).await?;
    Ok(())
}
