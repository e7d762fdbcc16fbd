//! The spans of a request, for traces: `lock.acquire` (level `debug`) while a request asks
//! for its lock, and `lock.hold` (level `info`) from the grant to the release, a child of
//! whatever span the caller was in (an annotated function's own span, say). Their fields are
//! named for OpenTelemetry backends (`lock.key`, `lock.token`, `lock.outcome`, …); the key
//! template (`lock.template`) is the low-cardinality name to group by.

use tracing::Span;
use tracing::field::Empty;

use crate::error::LockError;
use crate::metrics::Labels;

/// The `lock.acquire` span of a request for `key` (several keys: their list).
pub(crate) fn acquire(labels: Labels, key: &dyn std::fmt::Display) -> Span {
    tracing::debug_span!(
        "lock.acquire",
        lock.template = labels.template(),
        lock.key = %key,
        lock.kind = labels.kind(),
        lock.outcome = Empty,
        lock.attempts = Empty,
    )
}

/// Records how a request ended on its `lock.acquire` span.
pub(crate) fn acquired<T>(span: &Span, result: &Result<T, LockError>) {
    let outcome = match result {
        Ok(_) => "acquired",
        Err(LockError::Busy { attempts, .. }) => {
            span.record("lock.attempts", attempts);
            "busy"
        }
        Err(LockError::ShutDown) => "shutdown",
        Err(LockError::Redis { .. }) => "error",
        Err(_) => "refused",
    };
    span.record("lock.outcome", outcome);
}

/// The `lock.hold` span of one hold, or of a set's: boxed, and only made when a subscriber
/// wants it, so that a guard carries one pointer without one.
#[derive(Debug, Default)]
pub(crate) struct HoldSpan(Option<Box<Hold>>);

#[derive(Debug)]
struct Hold {
    span: Span,
    /// Its release was asked for (rather than the guard dropped).
    released: bool,
}

/// What a hold span says about the hold.
pub(crate) struct HoldFields<'a> {
    pub(crate) labels: Labels,
    pub(crate) key: &'a dyn std::fmt::Display,
    pub(crate) token: &'a str,
    pub(crate) fence: Option<u64>,
    /// How many local passes it is from the server's grant (0: granted by the server).
    pub(crate) passes: u32,
}

impl HoldSpan {
    /// Opens the span of a hold just granted, under the caller's current span.
    pub(crate) fn start(fields: &HoldFields<'_>) -> Self {
        let span = tracing::info_span!(
            "lock.hold",
            lock.template = fields.labels.template(),
            lock.key = %fields.key,
            lock.kind = fields.labels.kind(),
            lock.token = fields.token,
            lock.fencing_token = fields.fence,
            lock.passes = fields.passes,
            lock.outcome = Empty,
        );
        if span.is_disabled() {
            return Self(None);
        }
        Self(Some(Box::new(Hold {
            span,
            released: false,
        })))
    }

    /// The hold's release was asked for: unless lost or given back at shutdown, it ends
    /// `released`, not `dropped`.
    pub(crate) fn releasing(&mut self) {
        if let Some(hold) = &mut self.0 {
            hold.released = true;
        }
    }

    /// Records how the hold ended, and closes its span: `shutdown` (given back by
    /// `LockManager::shutdown`), `lost` (the lease was lost), `released` or `dropped`.
    pub(crate) fn end(&mut self, given_back_by_shutdown: bool, lost: bool) {
        let Some(hold) = self.0.take() else {
            return;
        };
        let outcome = if given_back_by_shutdown {
            "shutdown"
        } else if lost {
            "lost"
        } else if hold.released {
            "released"
        } else {
            "dropped"
        };
        hold.span.record("lock.outcome", outcome);
    }
}
