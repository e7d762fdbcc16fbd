use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

#[distributed_lock(key = "job")]
async fn job() -> Result<(), AppError> {
    let _ = __distlock_guard.key();
    Ok(())
}

fn main() {}
