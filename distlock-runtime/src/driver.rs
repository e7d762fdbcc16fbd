//! The manager's own background runtime.
//!
//! Every Redis round trip and every background release runs here, on one thread per manager
//! with a current-thread tokio runtime. Connections (and their reconnects) therefore live on a
//! runtime that lives exactly as long as the manager, so a manager built in one tokio runtime
//! keeps working from any other — `#[tokio::test]` makes one per test — and a guard dropped
//! outside any runtime is still released.

use std::future::Future;

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

use crate::error::LockError;

/// A handle on the background runtime; dropping it stops the thread.
#[derive(Debug)]
pub(crate) struct Driver {
    handle: Handle,
    _stop: oneshot::Sender<()>,
}

impl Driver {
    /// Starts the background thread and its runtime.
    pub(crate) fn start() -> Result<Self, LockError> {
        let (stop, stopped) = oneshot::channel::<()>();
        let (ready, handle) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("distlock-driver".into())
            .spawn(move || {
                let runtime = match Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(error) => {
                        let _ = ready.send(Err(error));
                        return;
                    }
                };
                let _ = ready.send(Ok(runtime.handle().clone()));
                // Runs until every handle on the manager is gone, then drops whatever
                // background work is left.
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(|e| LockError::Config(format!("cannot start the driver thread: {e}")))?;
        let handle = handle
            .recv()
            .map_err(|_| LockError::DriverStopped)?
            .map_err(|e| LockError::Config(format!("cannot start the driver runtime: {e}")))?;
        Ok(Self {
            handle,
            _stop: stop,
        })
    }

    /// Runs `task` on the background runtime and waits for its output from any runtime.
    ///
    /// If the caller stops waiting, the task still runs to its end.
    pub(crate) async fn run<T>(
        &self,
        task: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, LockError>
    where
        T: Send + 'static,
    {
        self.handle
            .spawn(task)
            .await
            .map_err(|_| LockError::DriverStopped)
    }

    /// The background runtime.
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Starts `task` on the background runtime without waiting for it.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        drop(self.handle.spawn(task));
    }
}
