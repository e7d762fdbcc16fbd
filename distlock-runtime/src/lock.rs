//! The request builder for one lock, and the acquire loop.

use std::fmt;
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::LockError;
use crate::backend::Attempt;
use crate::guard::{Acquired, Lease, LockGuard};
use crate::key::Keys;
use crate::manager::LockManager;
use crate::retry::Backoff;

/// A request for one lock, built by [`LockManager::lock`]; send it with
/// [`acquire`](Self::acquire) or [`try_acquire`](Self::try_acquire).
///
/// Options not set here come from the manager's defaults. They mirror the arguments of
/// `#[distributed_lock]`, by the same names.
#[must_use = "a lock request does nothing until `acquire().await` or `try_acquire().await`"]
pub struct LockRequest<'m> {
    manager: &'m LockManager,
    key: String,
    template: Option<&'static str>,
    ttl: Option<Duration>,
    retries: Option<u32>,
    retry_delay: Option<Duration>,
    wait: Option<Duration>,
    fencing: bool,
}

impl fmt::Debug for LockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .field("retries", &self.retries)
            .field("retry_delay", &self.retry_delay)
            .field("wait", &self.wait)
            .field("fencing", &self.fencing)
            .finish_non_exhaustive()
    }
}

/// A request with every option resolved and checked.
#[derive(Debug)]
struct Plan {
    keys: Keys,
    template: &'static str,
    ttl: Duration,
    retries: u32,
    backoff: Backoff,
    wait: Option<Duration>,
    fencing: bool,
}

impl<'m> LockRequest<'m> {
    pub(crate) fn new(manager: &'m LockManager, key: String) -> Self {
        Self {
            manager,
            key,
            template: None,
            ttl: None,
            retries: None,
            retry_delay: None,
            wait: None,
            fencing: false,
        }
    }

    /// The lease: how long the lock stays held if its holder stops renewing or releasing it.
    /// Must be at least 1 ms.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Extra attempts after the first when the lock is busy or Redis fails transiently.
    pub fn retries(mut self, retries: u32) -> Self {
        self.retries = Some(retries);
        self
    }

    /// The base delay between attempts; it doubles per attempt (up to 32×) with full jitter.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = Some(delay);
        self
    }

    /// An upper bound on the total time spent trying. Without `retries`, the request keeps
    /// trying until this much time has passed; with both, whichever ends first.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Draw a fencing token: a per-key number that grows with every acquisition, for storage
    /// that must reject writes from a holder whose lease has ended. See
    /// [`LockGuard::fencing_token`]. The counter stays in Redis after release.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    #[doc(hidden)]
    /// The key template this request was formatted from, as a low-cardinality tracing label.
    pub fn template(mut self, template: &'static str) -> Self {
        self.template = Some(template);
        self
    }

    /// Takes the lock, retrying within the request's bounds.
    ///
    /// Errors: [`LockError::Busy`] when another owner kept it for all attempts (or for the
    /// whole `wait`); [`LockError::Redis`] when the last attempt could not reach Redis;
    /// [`LockError::InvalidInput`] for a bad key or ttl, before anything is sent.
    ///
    /// Cancel-safe: if this future is dropped while an attempt is in flight, a release for
    /// that attempt's token is sent right behind it, so no lock is left behind.
    pub async fn acquire(self) -> Result<LockGuard, LockError> {
        let plan = self.plan()?;
        let span =
            tracing::debug_span!("lock.acquire", template = plan.template, key = %plan.keys.name);
        acquire(self.manager, plan).instrument(span).await
    }

    /// Makes exactly one attempt: `Ok(None)` when another owner holds the lock.
    pub async fn try_acquire(self) -> Result<Option<LockGuard>, LockError> {
        match self.retries(0).wait(Duration::ZERO).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(LockError::Busy { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn plan(&self) -> Result<Plan, LockError> {
        let defaults = self.manager.defaults();
        let keys = Keys::new(&self.manager.inner.prefix, self.key.clone())?;
        let ttl = self.ttl.unwrap_or(defaults.ttl);
        if ttl < Duration::from_millis(1) {
            return Err(LockError::invalid(
                "ttl",
                format!(
                    "the lease of `{}` must be at least 1ms, got {ttl:?}",
                    keys.name
                ),
            ));
        }
        let wait = self.wait.or(defaults.wait);
        // With only a time bound, keep trying until it runs out.
        let retries = match (self.retries, self.wait) {
            (Some(retries), _) => retries,
            (None, Some(_)) => u32::MAX,
            (None, None) if defaults.wait.is_some() && defaults.retries == 0 => u32::MAX,
            (None, None) => defaults.retries,
        };
        Ok(Plan {
            keys,
            template: self.template.unwrap_or("<manual>"),
            ttl,
            retries,
            backoff: Backoff::new(self.retry_delay.unwrap_or(defaults.retry_delay)),
            wait,
            fencing: self.fencing,
        })
    }
}

async fn acquire(manager: &LockManager, plan: Plan) -> Result<LockGuard, LockError> {
    let inner = &manager.inner;
    let token = uuid::Uuid::new_v4().simple().to_string();
    let fence_key = plan.keys.companion("fence");
    let started = Instant::now();
    let deadline = plan.wait.map(|wait| started + wait);
    let mut in_flight = InFlight {
        manager,
        lock: &plan.keys.lock,
        token: &token,
        maybe_held: false,
    };
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let sent = Instant::now();
        in_flight.maybe_held = true;
        let backend = inner.backend.clone();
        let (lock, fence, owner) = (plan.keys.lock.clone(), fence_key.clone(), token.clone());
        let (ttl, fencing) = (plan.ttl, plan.fencing);
        let outcome = inner
            .driver
            .run(async move { backend.acquire(&lock, &fence, &owner, ttl, fencing).await })
            .await?;
        let (holder_ttl, failure) = match outcome {
            Ok(Attempt::Held { fence }) => {
                in_flight.maybe_held = false;
                drop(in_flight);
                let acquired = Acquired {
                    attempts,
                    waited: started.elapsed(),
                };
                tracing::debug!(attempts, waited = ?acquired.waited, "acquired");
                let lease = Lease::new(sent, plan.ttl);
                let fence = plan.fencing.then_some(fence);
                return Ok(LockGuard::new(
                    manager.clone(),
                    plan.keys,
                    token,
                    fence,
                    lease,
                    acquired,
                ));
            }
            Ok(Attempt::Busy { holder_ttl }) => {
                in_flight.maybe_held = false;
                (holder_ttl, None)
            }
            // A lost reply may hide a granted lock: the next attempt resends the same token,
            // which the script recognises; `in_flight` releases it if none follows.
            Err(error) if is_transient(&error) => {
                tracing::debug!(attempts, %error, "acquire attempt failed");
                (None, Some(error))
            }
            Err(error) => return Err(LockError::redis(&plan.keys.name, error)),
        };
        let mut delay = plan.backoff.delay(attempts, holder_ttl);
        let left = deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
        if attempts > plan.retries || left == Some(Duration::ZERO) {
            // The last word decides: a failure to reach Redis is not reported as "busy".
            return Err(match failure {
                Some(error) => LockError::redis(&plan.keys.name, error),
                None => LockError::Busy {
                    key: plan.keys.name.clone(),
                    attempts,
                    waited: started.elapsed(),
                },
            });
        }
        if let Some(left) = left {
            delay = delay.min(left);
        }
        inner.driver.run(tokio::time::sleep(delay)).await?;
    }
}

/// Errors after which the same attempt may succeed if sent again.
fn is_transient(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
}

/// An attempt whose answer has not arrived: if the request is dropped here, the token may hold
/// the lock on the server, so a release is sent behind it on the same connection.
struct InFlight<'a> {
    manager: &'a LockManager,
    lock: &'a str,
    token: &'a str,
    maybe_held: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.maybe_held {
            crate::guard::release_in_background(
                self.manager,
                self.lock.to_owned(),
                self.token.to_owned(),
            );
        }
    }
}
