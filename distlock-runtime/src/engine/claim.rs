//! What the engine asks of a request: its claim on its locks ([`Claim`]), and one attempt
//! sent ([`Attempted`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::AcquireAnswer;
use crate::error::LockError;
use crate::manager::Inner;

/// A request's claim on its locks, one lock or a set: what each attempt sends, what the
/// engine needs to know of it, and how what the attempts may hold is given back (or a
/// writer's intent withdrawn) when the request ends without the lock.
pub(crate) trait Claim: Sync {
    /// What a granted attempt brings: the fencing token (tokens, for a set).
    type Fences: Send + 'static;

    /// Several locks: the queue to follow is that of the lock found busy, known only from a
    /// busy answer; and a set takes no turns in a cohort's sit-out.
    const SET: bool = false;

    /// Sends one attempt.
    fn send(
        &self,
        inner: &Inner,
    ) -> impl Future<Output = Result<redis::RedisResult<AcquireAnswer<Self::Fences>>, LockError>> + Send;

    /// The owner token the attempts carry.
    fn token(&self) -> &str;

    /// The wake channel of lock `at` (for a set, the one found busy).
    fn wake(&self, at: usize) -> &str;

    /// A fair lock: the first attempt that is turned away keeps a place in the server's
    /// queue, which a release may grant the lock to until the request leaves it.
    fn fair(&self) -> bool {
        false
    }

    /// Gives back, right behind the last attempt, what an attempt whose answer never came may
    /// hold, then takes back `intent`.
    fn release_behind(&self, inner: &Arc<Inner>, intent: Option<String>);

    /// Gives back what the attempts may hold, now: `Some` when Redis answered (`true`: there
    /// was something to give back).
    fn give_back(&self, inner: &Inner) -> impl Future<Output = Option<bool>> + Send;

    /// The intent a refused attempt leaves to keep new readers out (a writer's), if any.
    fn intent(&self) -> Option<&str> {
        None
    }

    /// Takes back the intent this request left, from the manager's runtime.
    fn withdraw_intent(&self, _inner: &Arc<Inner>, _intent: String) {}
}

/// One attempt sent: when (its lease began then, if it was granted), and the answer.
pub(crate) struct Attempted<F> {
    pub(crate) sent: Instant,
    pub(crate) answer: redis::RedisResult<AcquireAnswer<F>>,
}
