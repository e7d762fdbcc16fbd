use distlock::{distributed_lock, LockError};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

pub struct Config {
    pub url: String,
}

#[distributed_lock(key = "job", manager = config)]
async fn job(config: &Config) -> Result<(), AppError> {
    let _ = config;
    Ok(())
}

fn main() {}
