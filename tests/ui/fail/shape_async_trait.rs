use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

use std::future::Future;
use std::pin::Pin;

pub struct Worker;

// What `#[async_trait]` leaves for attributes below it to see.
impl Worker {
    #[distributed_lock(key = "job")]
    fn work<'a>(&'a self) -> Pin<Box<dyn Future<Output = Result<(), AppError>> + Send + 'a>> {
        Box::pin(async move { Ok(()) })
    }
}

fn main() {}
