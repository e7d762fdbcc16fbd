//! A request resolved into a plan: every option against the manager's defaults, then
//! checked (the common checks, those of its kind, those of a set).

use super::*;

impl<T> LockRequest<'_, T> {
    /// Every option resolved against the manager's defaults and checked, for `keys` of
    /// `kind` (`what` names them in a lease error); the target's own checks come after.
    pub(crate) fn plan<K>(
        &self,
        kind: RequestKind,
        keys: K,
        what: &str,
    ) -> Result<Plan<K>, LockError> {
        let (manager, options) = (self.manager, self.options);
        let defaults = manager.defaults();
        let ttl = options.ttl.unwrap_or(defaults.ttl);
        check_ttl(ttl)
            .map_err(|reason| LockError::invalid("ttl", format!("the lease of {what} {reason}")))?;
        if options.fencing && !manager.inner.backend.capabilities().fencing {
            return Err(LockError::invalid(
                "fencing",
                "fencing tokens need one counter; RedLock masters count independently",
            ));
        }
        // With only a time bound, keep trying until it runs out.
        let retries = match (options.retries, options.wait) {
            (Some(retries), _) => retries,
            (None, Some(_)) => u32::MAX,
            (None, None) if defaults.wait.is_some() && defaults.retries == 0 => u32::MAX,
            (None, None) => defaults.retries,
        };
        let template = options.template.unwrap_or("<manual>");
        Ok(Plan {
            keys,
            kind,
            ttl,
            retries,
            backoff: Backoff::new(options.retry_delay.unwrap_or(defaults.retry_delay)),
            // Longer than any lease: no time bound at all.
            wait: options
                .wait
                .or(defaults.wait)
                .filter(|wait| *wait <= MAX_TTL),
            max_hold: options.max_hold.or(defaults.max_hold),
            options,
            metrics: Labels::new(template, kind),
        })
    }
}

/// A request with every option resolved and checked: `keys` are those of one lock ([`Keys`])
/// or of a set (a `Vec` of them). The flags are read from `options` as the caller set them.
#[derive(Debug, Clone)]
pub(crate) struct Plan<K> {
    pub(crate) keys: K,
    pub(crate) kind: RequestKind,
    pub(crate) ttl: Duration,
    pub(crate) retries: u32,
    pub(crate) backoff: Backoff,
    pub(crate) wait: Option<Duration>,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) options: Options,
    pub(crate) metrics: Labels,
}

impl<K> Plan<K> {
    /// The same plan, for other keys (a set's plan for one of its keys).
    pub(crate) fn with_keys<L>(&self, keys: L) -> Plan<L> {
        Plan {
            keys,
            kind: self.kind,
            ttl: self.ttl,
            retries: self.retries,
            backoff: self.backoff,
            wait: self.wait,
            max_hold: self.max_hold,
            options: self.options,
            metrics: self.metrics,
        }
    }
}

impl LockRequest<'_> {
    /// The plan of a request for one lock: the common checks, then those of its kind.
    pub(crate) fn into_plan(mut self) -> Result<Plan<Keys>, LockError> {
        let key = std::mem::take(&mut self.target.key);
        let keys = Keys::new(&self.manager.inner.prefix, key)?;
        let what = format!("`{}`", keys.name);
        let plan = self.plan(self.target.kind, keys, &what)?;
        check_kind(self.manager, &plan)?;
        check_holds(&plan.options)?;
        Ok(plan)
    }
}

/// `max_hold` and `min_hold`, when set, must be longer than zero.
fn check_holds(options: &Options) -> Result<(), LockError> {
    for (what, value) in [
        ("max_hold", options.max_hold),
        ("min_hold", options.min_hold),
    ] {
        if value.is_some_and(|v| v.is_zero()) {
            return Err(LockError::invalid(
                what,
                format!("`{what}` must be greater than zero"),
            ));
        }
    }
    Ok(())
}

/// The checks of a single lock's kind against its options and the backend.
fn check_kind(manager: &LockManager, plan: &Plan<Keys>) -> Result<(), LockError> {
    let capabilities = manager.inner.backend.capabilities();
    let (kind, options, name) = (plan.kind, &plan.options, &plan.keys.name);
    if kind != RequestKind::Exclusive && !capabilities.shared_kinds {
        return Err(LockError::invalid(
            "lock kind",
            "read-write locks and semaphores are not available with RedLock",
        ));
    }
    if options.fair {
        let refused = if kind != RequestKind::Exclusive {
            Some("fair locks are exclusive: not for read-write locks or semaphores")
        } else if options.fencing {
            Some("fair locks do not draw fencing tokens")
        } else if options.min_hold.is_some() {
            Some("fair locks do not keep a `min_hold`")
        } else if !capabilities.fair {
            Some("fair locks need one queue; RedLock masters would each keep their own")
        } else {
            None
        };
        if let Some(reason) = refused {
            return Err(LockError::invalid("fair", reason));
        }
    }
    if kind == RequestKind::Permits(0) {
        return Err(LockError::invalid(
            "permits",
            format!("semaphore `{name}` needs at least one permit"),
        ));
    }
    if options.min_hold.is_some() && matches!(kind, RequestKind::Read | RequestKind::Permits(_)) {
        return Err(LockError::invalid(
            "min_hold",
            "`min_hold` applies to exclusive and write locks, not to read locks or permits",
        ));
    }
    if let Some(min_hold) = options.min_hold.filter(|min_hold| *min_hold > plan.ttl) {
        return Err(LockError::invalid(
            "min_hold",
            format!(
                "`min_hold` ({min_hold:?}) must not be longer than the lease ({:?})",
                plan.ttl
            ),
        ));
    }
    Ok(())
}

impl MultiLockRequest<'_> {
    /// The plan of a set: its keys checked and taken once each, in the order first named.
    pub(crate) fn plan_set(&mut self) -> Result<Plan<Vec<Keys>>, LockError> {
        let mut keys: Vec<Keys> = Vec::with_capacity(self.target.keys.len());
        for name in std::mem::take(&mut self.target.keys) {
            let key = Keys::new(&self.manager.inner.prefix, name)?;
            if keys.iter().all(|k| k.lock != key.lock) {
                keys.push(key);
            }
        }
        if keys.is_empty() {
            return Err(LockError::invalid(
                "keys",
                "`lock_all` needs at least one key",
            ));
        }
        // A set never passes locally.
        self.options.server_path = true;
        let plan = self.plan(RequestKind::Exclusive, keys, "a lock set")?;
        check_holds(&plan.options)?;
        Ok(plan)
    }
}
