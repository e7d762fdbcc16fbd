//! An HTTP service (axum) that locks the resource each request works on, and gives every
//! lock back when it is stopped.
//!
//! Run it with `cargo run --example service`, then in another terminal:
//!
//! ```text
//! curl -i -X POST localhost:3000/jobs/7 &    # works on job 7 for a few seconds
//! curl -i -X POST localhost:3000/jobs/7      # 409 Conflict, Retry-After: 5
//! ```
//!
//! Ctrl-C (or SIGTERM) stops it: no new requests are accepted, requests at work get a grace
//! period to finish, then `LockManager::shutdown` gives back every lock still held (those
//! requests answer 503), so other replicas can take the jobs at once instead of waiting for
//! the leases to run out. It uses the Redis at `REDIS_URL` if set; otherwise it starts a
//! throwaway `redis-server` (which must be on `PATH`). `PORT` picks the port (default 3000).

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};
use tokio::net::TcpListener;

/// What the handlers share.
#[derive(Clone, Debug)]
pub struct App {
    /// The service's lock manager.
    pub locks: LockManager,
    /// How long one job takes.
    pub work: Duration,
    /// After a stop, how long requests at work may take to finish before their locks are
    /// given back.
    pub grace: Duration,
}

/// Works on job `id` while holding its lock; the watchdog keeps the lease for as long as the
/// work takes, and the body stops if the lock is lost (or given back by a shutdown).
#[distributed_lock(key = "job:{id}", ttl = "10s", watchdog, manager = app.locks)]
async fn work_on(app: &App, id: u64) -> Result<String, LockError> {
    tokio::time::sleep(app.work).await; // the work
    Ok(format!("job {id} done\n"))
}

async fn job(State(app): State<App>, Path(id): Path<u64>) -> Response {
    match work_on(&app, id).await {
        Ok(done) => done.into_response(),
        // Someone (this replica or another) is working on it: come back later.
        Err(LockError::Busy { .. }) => {
            let retry_after = app.work.as_secs().max(1).to_string();
            let headers = [(header::RETRY_AFTER, retry_after)];
            (StatusCode::CONFLICT, headers, "job is being worked on\n").into_response()
        }
        Err(LockError::ShutDown | LockError::Lost { .. }) => {
            (StatusCode::SERVICE_UNAVAILABLE, "stopping; try again\n").into_response()
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{error}\n")).into_response(),
    }
}

/// Serves `app` on `listener` until `stop` completes, then stops gracefully: see the top of
/// this file.
pub async fn serve(
    listener: TcpListener,
    app: App,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (locks, grace) = (app.locks.clone(), app.grace);
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let router = Router::new().route("/jobs/{id}", post(job)).with_state(app);
    let server = axum::serve(listener, router).with_graceful_shutdown(async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|stopped| *stopped).await;
    });
    let mut server = std::pin::pin!(server.into_future());
    tokio::select! {
        served = &mut server => return served,
        () = stop => {}
    }
    // Stop accepting; requests at work have `grace` to finish.
    let _ = stopping.send(true);
    if let Ok(served) = tokio::time::timeout(grace, &mut server).await {
        locks.shutdown().await;
        return served;
    }
    // Give back every lock still held: the handlers holding them stop and answer 503.
    locks.shutdown().await;
    server.await
}

/// Ctrl-C, or SIGTERM on Unix.
async fn stop_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => drop(term.recv().await),
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = RedisServer::start()?;
            (server.url(), Some(server))
        }
    };
    let locks = LockManager::builder()
        .redis_url(&url)
        .key_prefix("service:lock:")
        .build()
        .await?;
    let app = App {
        locks,
        work: Duration::from_secs(5),
        grace: Duration::from_secs(2),
    };
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".to_owned());
    let listener = TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, app, stop_signal()).await?;
    println!("stopped; every lock given back");
    Ok(())
}
