use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

pub struct Receipt;

#[distributed_lock(key = "job", on_busy = "skip")]
async fn job() -> Result<Receipt, AppError> {
    Ok(Receipt)
}

fn main() {}
