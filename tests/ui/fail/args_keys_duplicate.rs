use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

#[distributed_lock(keys = ["account:{from}", "account:{to}", "account:{from}"])]
async fn transfer(from: u64, to: u64) -> Result<(), AppError> {
    let _ = (from, to);
    Ok(())
}

fn main() {}
