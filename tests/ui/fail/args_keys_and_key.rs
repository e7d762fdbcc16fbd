use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

#[distributed_lock(key = "account:{from}", keys = ["account:{from}", "account:{to}"])]
async fn transfer(from: u64, to: u64) -> Result<(), AppError> {
    let _ = (from, to);
    Ok(())
}

fn main() {}
