use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

pub struct Order {
    pub id: u64,
}

#[distributed_lock(key = "order:{order.number}")]
async fn ship(order: &Order) -> Result<(), AppError> {
    let _ = order;
    Ok(())
}

fn main() {}
