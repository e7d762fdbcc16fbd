//! One lock: what a request's attempts send (its [`Claim`]), and the
//! release behind them when the request ends without the lock. A nested hold's rule is in
//! `nest.rs`; a guard's assembly, from what the request won, in `grant.rs`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::backend::{AcquireAnswer, AcquireRequest, HoldIds, Shape};
use crate::engine::{Attempted, Claim, Cover, Engine, Outcome};
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::held::{Held, HoldKind};
use crate::key::Keys;
use crate::kind::RequestKind;
use crate::manager::{Inner, LockManager};
use crate::release::{Known, OneHold};
use crate::request::plan::Plan;
use crate::request::{LockRequest, Single, Target};
use crate::token::new_token;

mod grant;
mod nest;

use grant::granted;
pub(crate) use grant::register_renewal;
pub(crate) use nest::{nest, outer_hold};

impl Target for Single {
    type Guard = LockGuard;

    fn acquire<'m>(
        request: LockRequest<'m, Self>,
    ) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'm {
        acquire_one(request)
    }
}

/// Takes one lock: see [`LockRequest::acquire`].
async fn acquire_one(request: LockRequest<'_>) -> Result<LockGuard, LockError> {
    let (manager, skip_holder_lookup) = (request.manager, request.options.skip_holder_lookup);
    let plan = request.into_plan()?;
    if manager.inner.holds.is_shut_down() {
        return Err(LockError::ShutDown);
    }
    let span = crate::trace::acquire(plan.metrics, &plan.keys.name);
    let (labels, timer) = (plan.metrics, crate::metrics::Timer::start());
    let asking = {
        let _entered = span.enter();
        ask(manager, plan)
    };
    let result = match asking {
        Ok(Asking::Nested(plan, held)) => nest(manager, *plan, held).instrument(span).await,
        Ok(Asking::FromServer(asking)) => {
            let taking = async {
                let result = take(manager, asking).await;
                crate::trace::acquired(&tracing::Span::current(), &result);
                result
            };
            taking.instrument(span).await
        }
        Err(error) => Err(error),
    };
    let result = match result {
        // Dropping it gives it back.
        Ok(guard) if guard.came_after_shutdown() => Err(LockError::ShutDown),
        Err(
            busy @ LockError::Busy {
                holder_token: Some(_),
                ..
            },
        ) if !skip_holder_lookup => Err(Box::pin(name_holder(manager, busy)).await),
        result => result,
    };
    crate::metrics::acquire_ended(labels, timer, &result);
    result.map(|mut guard| {
        // Here, outside the acquire span: the hold is a child of the caller's span.
        guard.start_span(labels);
        guard
    })
}

/// What a request for one lock asks of the server, once the task's own holds are looked at.
enum Asking {
    /// The task already owns the lock, and this is a nested hold of it.
    Nested(Box<Plan<Keys>>, Arc<Held>),
    /// Not held here: the lock is asked of the server.
    FromServer(Box<Prepared>),
}

/// A request for one lock ready to be sent: its plan, what each attempt sends, and the kind
/// of hold it gives.
struct Prepared {
    plan: Plan<Keys>,
    request: Arc<AcquireRequest>,
    kind: HoldKind,
}

/// Looks at the task's own holds, then shapes what the attempts send.
fn ask(manager: &LockManager, mut plan: Plan<Keys>) -> Result<Asking, LockError> {
    if let Some(held) = outer_hold(manager, plan.kind, &plan)? {
        // The task already owns the lock: counted here, checked on the server.
        return Ok(Asking::Nested(Box::new(plan), held));
    }
    let manager_id = manager.inner.waiters.manager_id();
    let token = new_token(manager_id);
    let shape = shape_of(&plan, &token, manager_id);
    let kind = plan.kind.hold_kind();
    // The lock key moves into the request (and on into the hold): nothing reads it from the
    // plan from here on.
    let wake = plan.keys.wake();
    let request = Arc::new(AcquireRequest {
        shape,
        lock: std::mem::take(&mut plan.keys.lock),
        wake,
        token,
        lease: plan.ttl,
        fencing: plan.options.fencing,
        reentrant: plan.options.reentrant,
    });
    Ok(Asking::FromServer(Box::new(Prepared {
        plan,
        request,
        kind,
    })))
}

/// Takes the lock from the server (or from a local release).
async fn take(manager: &LockManager, asking: Box<Prepared>) -> Result<LockGuard, LockError> {
    let inner = &manager.inner;
    let Prepared {
        plan,
        request,
        kind,
    } = *asking;
    let started = Instant::now();
    let engine = || {
        Engine::new(
            inner,
            &request,
            &plan,
            std::slice::from_ref(&plan.keys),
            started,
        )
    };
    if let Shape::Fair { .. } = request.shape {
        // Boxed: its state stays out of the plain path's future. A fair request waits with
        // this manager's waiters of the lock from its first attempt on: it hears every grant
        // from then on.
        let outcome = Box::pin(engine().acquire(None, true)).await?;
        return Ok(granted(manager, plan, request, kind, outcome));
    }
    // A plain lock can be handed over by a local release, in that release's round trip.
    let hand_off = matches!(request.shape, Shape::Plain) && inner.backend.capabilities().hand_off;
    // A request that may wait queues behind local waiters instead of overtaking them. Readers
    // and permit holders try first: the waiters ahead may want another kind, while this
    // request may overlap the holders (a free permit, readers inside); queueing it behind
    // them could make it wait for a lock the server would grant, even for itself.
    let shares = matches!(plan.kind, RequestKind::Read | RequestKind::Permits(_));
    let outcome = if plan.retries > 0 && !shares && inner.waiters.has_waiters(&request.wake) {
        Box::pin(engine().hand_off(hand_off).acquire(None, true)).await?
    } else {
        // Any other makes its first attempt here: most find the lock free, and their future
        // need not carry the waiting loop's state. Inline, not boxed: a box this size costs
        // the allocator's slow path on every lock (about 5 % of the client's work per lock).
        let mut cover = Cover::new(inner, &request);
        match cover.send(plan.metrics).await? {
            Attempted {
                sent,
                answer: Ok(AcquireAnswer::Held(fence)),
            } => Outcome::at_once(fence, sent, started),
            first => {
                // The loop takes over the attempt's answer, and its cover if it may have
                // been granted.
                let engine = engine().hand_off(hand_off).covering(cover);
                Box::pin(engine.acquire(Some(first), !shares)).await?
            }
        }
    };
    Ok(granted(manager, plan, request, kind, outcome))
}

/// A busy error whose holder the server named gets the holder's identity, read from its
/// manager's registration (once per manager). Reading it is best effort: the error stays as
/// it was if Redis does not answer.
async fn name_holder(manager: &LockManager, error: LockError) -> LockError {
    match error {
        LockError::Busy {
            key,
            attempts,
            waited,
            holder_token: Some(token),
            holder: None,
        } => {
            let holder = crate::identity::resolve(manager, &token)
                .await
                .map(Box::new);
            if let Some(holder) = &holder {
                tracing::debug!(%holder, holder_token = %token, "busy");
            }
            LockError::Busy {
                key,
                attempts,
                waited,
                holder_token: Some(token),
                holder,
            }
        }
        error => error,
    }
}

impl Claim for Arc<AcquireRequest> {
    type Fences = u64;

    async fn send(&self, inner: &Inner) -> Result<redis::RedisResult<AcquireAnswer>, LockError> {
        let attempt = self.clone();
        inner
            .on_runtime(move |backend| async move { backend.acquire(&attempt).await })
            .await
    }

    fn fair(&self) -> bool {
        matches!(self.shape, Shape::Fair { .. })
    }

    fn token(&self) -> &str {
        &self.token
    }

    fn wake(&self, _: usize) -> &str {
        &self.wake
    }

    fn release_behind(&self, inner: &Arc<Inner>, intent: Option<String>) {
        // The intent is taken back after the release, on the same connection, so that the
        // unanswered attempt cannot set it again after.
        let (ids, owner) = (Arc::new(self.hold_ids()), inner.clone());
        crate::engine::send_behind(inner, move || {
            let (inner, ids, intent) = (owner.clone(), ids.clone(), intent.clone());
            async move {
                let given = OneHold::new(ids.clone(), None);
                inner
                    .releaser()
                    .give_back(given, Known::default())
                    .await
                    .answer()?;
                if let Some(intent) = intent {
                    withdraw_intent(inner, ids, intent).await;
                }
                Ok(())
            }
        });
    }

    async fn give_back(&self, inner: &Inner) -> Option<bool> {
        let (given, releaser) = (
            OneHold::new(Arc::new(self.hold_ids()), None),
            inner.releaser(),
        );
        let outcome = inner
            .on_runtime(move |_| releaser.give_back(given, Known::default()))
            .await;
        outcome.ok()?.answer().ok()
    }

    fn intent(&self) -> Option<&str> {
        match &self.shape {
            Shape::Write {
                intent,
                intent_lease,
            } if !intent_lease.is_zero() => Some(intent),
            _ => None,
        }
    }

    fn withdraw_intent(&self, inner: &Arc<Inner>, intent: String) {
        let ids = Arc::new(self.hold_ids());
        let withdraw = withdraw_intent(inner.clone(), ids, intent);
        inner.driver.spawn(withdraw);
    }
}

/// Takes back the write intent `intent` of the writer `ids` (which gave up without the
/// lock), if it is still that writer's, and wakes the readers it kept out.
pub(crate) async fn withdraw_intent(inner: Arc<Inner>, ids: Arc<HoldIds>, intent: String) {
    match inner
        .backend
        .withdraw_intent(&intent, &ids.wake, &ids.token)
        .await
    {
        Ok(true) => inner.waiters.released(&ids.wake),
        Ok(false) => {}
        Err(error) => {
            tracing::debug!(%error, "a write intent could not be taken back; it expires");
        }
    }
}

/// The script shape of a first (or shared) hold of the plan's kind for `token`.
fn shape_of(plan: &Plan<Keys>, token: &str, manager_id: &str) -> Shape {
    let intent = || plan.keys.write_intent();
    match plan.kind {
        // Checked by `plan`: exclusive, without fencing or min_hold.
        RequestKind::Exclusive if plan.options.fair => Shape::Fair {
            queue: crate::backend::FairQueue::new(&plan.keys.lock, manager_id, plan.ttl, token),
            join: plan.retries > 0,
        },
        // The string form: one native command each way.
        RequestKind::Exclusive if !plan.options.fencing && plan.options.min_hold.is_none() => {
            Shape::Plain
        }
        RequestKind::Exclusive => Shape::Exclusive,
        RequestKind::Write => {
            // Keeps new readers out between this writer's attempts, no longer.
            let between = plan
                .backoff
                .ceiling()
                .saturating_mul(2)
                .max(Duration::from_secs(1));
            Shape::Write {
                intent: intent(),
                // A writer that will not try again leaves no intent behind.
                intent_lease: if plan.retries == 0 {
                    Duration::ZERO
                } else {
                    between.min(plan.ttl)
                },
            }
        }
        RequestKind::Read => Shape::Share {
            intent: intent(),
            permits: None,
        },
        RequestKind::Permits(permits) => Shape::Share {
            intent: intent(),
            permits: Some(permits),
        },
    }
}
