//! The examples people copy, run against a real server: their logic is compiled in here from
//! the example files themselves.

#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/scheduled.rs"]
mod scheduled;

#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/service.rs"]
mod service;

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::{keys, manager, shared_server, unique_prefix};

#[tokio::test]
async fn the_scheduled_job_runs_at_most_once_per_period() {
    let server = shared_server();
    let prefix = unique_prefix("scheduled");
    let periods = 3;

    let runs = scheduled::run(&server.url(), &prefix, periods)
        .await
        .unwrap();

    let runs = runs.lock().unwrap();
    let mut per_period = BTreeMap::<u32, Vec<&str>>::new();
    for (period, replica) in runs.iter() {
        per_period.entry(*period).or_default().push(replica);
    }
    assert!(!per_period.is_empty(), "nobody ran the job");
    for (period, replicas) in &per_period {
        assert_eq!(replicas.len(), 1, "period {period} ran on {replicas:?}");
    }
}

/// Sends one request and returns the status code and headers (lowercase names).
async fn post(addr: std::net::SocketAddr, path: &str) -> (u16, BTreeMap<String, String>) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("POST {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let mut lines = response.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .take_while(|line| !line.is_empty())
        .filter_map(|line| line.split_once(": "))
        .map(|(name, value)| (name.to_ascii_lowercase(), value.to_owned()))
        .collect();
    (status, headers)
}

/// Waits until `count` keys exist under `prefix`.
async fn until_keys(server: &distlock::testing::RedisServer, prefix: &str, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while keys(server, prefix).len() < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{count} locks never taken"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A service on a free port; `stop` stops it.
async fn start(
    app: service::App,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(service::serve(listener, app, async move {
        let _ = stopped.await;
    }));
    (addr, stop, served)
}

#[tokio::test]
async fn the_service_answers_busy_with_409_and_retry_after() {
    let server = shared_server();
    let prefix = unique_prefix("service-busy");
    let app = service::App {
        locks: manager(&server, &prefix).await,
        work: Duration::from_secs(2),
        grace: Duration::from_secs(5),
    };
    let (addr, stop, served) = start(app).await;

    let first = tokio::spawn(async move { post(addr, "/jobs/7").await });
    until_keys(&server, &prefix, 1).await;
    let (status, headers) = post(addr, "/jobs/7").await;
    assert_eq!(status, 409);
    assert_eq!(headers.get("retry-after").map(String::as_str), Some("2"));
    // Another job is not blocked by job 7.
    assert_eq!(post(addr, "/jobs/8").await.0, 200);
    assert_eq!(first.await.unwrap().0, 200);

    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn a_service_stopped_mid_work_leaves_no_lock_behind() {
    let server = shared_server();
    let prefix = unique_prefix("service-stop");
    let app = service::App {
        locks: manager(&server, &prefix).await,
        // Far longer than the test: the jobs are at work when the service stops.
        work: Duration::from_secs(600),
        grace: Duration::from_millis(100),
    };
    let (addr, stop, served) = start(app).await;

    let jobs: Vec<_> = (1..=3)
        .map(|id| tokio::spawn(async move { post(addr, &format!("/jobs/{id}")).await }))
        .collect();
    until_keys(&server, &prefix, 3).await;

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("the service stops once its locks are given back")
        .unwrap()
        .unwrap();

    // Every lock is gone as soon as the service has stopped, not after its lease.
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
    for job in jobs {
        assert_eq!(job.await.unwrap().0, 503);
    }
}
