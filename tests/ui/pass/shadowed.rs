//! The generated code only uses absolute paths: local items named like std's do not break it.
#![allow(dead_code, non_camel_case_types)]

mod core {}
mod std {}
mod distlock {}
struct Ok;
struct Err;
struct Option;
struct Duration;
struct LockManager;
struct String;
fn format() {}

#[derive(Debug)]
pub struct AppError;

impl ::std::convert::From<::distlock::LockError> for AppError {
    fn from(_: ::distlock::LockError) -> Self {
        AppError
    }
}

type Result<T> = ::std::result::Result<T, AppError>;

#[::distlock::distributed_lock(
    key = "job:{id}",
    ttl = "10s",
    retries = 2,
    retry_delay = "5ms",
    wait = "1s"
)]
async fn job(id: u32) -> Result<u32> {
    ::std::result::Result::Ok(id)
}

#[::distlock::distributed_lock(key = "skip", on_busy = "skip")]
async fn skip() -> Result<u32> {
    ::std::result::Result::Ok(1)
}

fn main() {}
