use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

#[distributed_lock(key = "queue", min_hold = "1s", fair)]
async fn job() -> Result<(), AppError> {
    Ok(())
}

fn main() {}
