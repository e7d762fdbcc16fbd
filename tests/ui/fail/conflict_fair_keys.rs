use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

#[distributed_lock(keys = ["a:{x}", "b:{x}"], fair)]
async fn job(x: u32) -> Result<(), AppError> {
    let _ = x;
    Ok(())
}

fn main() {}
