use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

pub struct Unrelated;

#[distributed_lock(key = "job")]
async fn job() -> Result<(), Unrelated> {
    Ok(())
}

fn main() {}
