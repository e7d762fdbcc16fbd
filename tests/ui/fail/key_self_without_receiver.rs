use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

#[distributed_lock(key = "order:{self.id}")]
async fn ship(id: u64) -> Result<(), AppError> {
    let _ = id;
    Ok(())
}

fn main() {}
