//! Every receiver kind, trait-impl methods (native async fn in traits) and generics.
use std::fmt::Display;
use std::sync::Arc;

use distlock::{LockError, LockManager, distributed_lock};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

pub struct Service {
    pub locks: LockManager,
    pub name: String,
}

impl Service {
    #[distributed_lock(key = "by-ref:{self.name}", manager = self.locks)]
    pub async fn by_ref(&self) -> Result<usize, AppError> {
        Ok(self.name.len())
    }

    #[distributed_lock(key = "by-mut:{self.name}", manager = self.locks)]
    pub async fn by_mut(&mut self, suffix: &str) -> Result<(), AppError> {
        self.name.push_str(suffix);
        Ok(())
    }

    #[distributed_lock(key = "by-value:{self.name}", manager = self.locks)]
    pub async fn by_value(self) -> Result<String, AppError> {
        Ok(self.name)
    }

    #[distributed_lock(key = "boxed:{self.name}", manager = self.locks)]
    pub async fn boxed(self: Box<Self>) -> Result<String, AppError> {
        Ok(self.name)
    }

    #[distributed_lock(key = "arc:{self.name}", manager = self.locks)]
    pub async fn arc(self: Arc<Self>) -> Result<String, AppError> {
        Ok(self.name.clone())
    }

    #[distributed_lock(key = "static:{id}", manager = locks)]
    pub async fn associated(locks: &LockManager, id: u32) -> Result<u32, AppError> {
        Ok(id)
    }

    #[distributed_lock(key = "generic:{item}", manager = self.locks)]
    pub async fn generic<'a, T>(&'a self, item: T) -> Result<&'a str, AppError>
    where
        T: Display + Send + 'a,
    {
        let _ = item;
        Ok(&self.name)
    }
}

#[allow(async_fn_in_trait)]
pub trait Worker {
    fn work(&self, id: u64) -> impl std::future::Future<Output = Result<u64, AppError>> + Send;
    async fn work_local(&self, id: u64) -> Result<u64, AppError>;
}

impl Worker for Service {
    #[distributed_lock(key = "work:{id}", manager = self.locks)]
    async fn work(&self, id: u64) -> Result<u64, AppError> {
        Ok(id)
    }

    #[distributed_lock(key = "work-local:{id}", manager = &self.locks, ttl = "1s")]
    async fn work_local(&self, id: u64) -> Result<u64, AppError> {
        Ok(id + 1)
    }
}

fn main() {}
