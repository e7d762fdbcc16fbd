//! A node's acquire attempts: the plain `SET`, the scripts of the other kinds, a fair queue's
//! take, and a grant that waits for replicas (WAIT / WAITAOF) before it counts.

use super::*;

impl Node {
    /// One acquire attempt for the hold of `req.token` on `req.lock`.
    pub(crate) async fn acquire(&self, req: &AcquireRequest) -> RedisResult<AcquireAnswer> {
        let mut conn = self.conn().await?;
        let call = self.acquire_call(req);
        if let Some(sync) = self.pool.sync_replicas {
            return Box::pin(self.acquire_replicated(req, &call, sync)).await;
        }
        let bounds = conn.bounds();
        self.watch(answer!(self, bounds, call.run(&mut conn, &req.token)))
    }

    /// What an acquire attempt sends for the shape of `req`.
    fn acquire_call<'a>(&self, req: &'a AcquireRequest) -> AcquireCall<'a> {
        let fence = || req.fence();
        match &req.shape {
            // One native command: set if absent; the value already there tells the rest.
            Shape::Plain => AcquireCall::Set {
                set: set_if_absent(req),
                req,
            },
            Shape::Fair { queue, join } => AcquireCall::Script(self.fair_take(req, queue, *join)),
            Shape::Exclusive => AcquireCall::Script(
                scripts::Acquire {
                    lock: &req.lock,
                    fence: &fence(),
                    token: &req.token,
                    lease: req.lease,
                    fencing: req.fencing,
                    hold: &req.token,
                    reentrant: req.reentrant,
                    after_set: false,
                }
                .call(),
            ),
            Shape::Write {
                intent,
                intent_lease,
            } => AcquireCall::Script(
                scripts::WriteAcquire {
                    lock: &req.lock,
                    fence: &fence(),
                    intent,
                    token: &req.token,
                    lease: req.lease,
                    fencing: req.fencing,
                    hold: &req.token,
                    reentrant: req.reentrant,
                    intent_lease: *intent_lease,
                }
                .call(),
            ),
            Shape::Share { intent, permits } => AcquireCall::Script(
                scripts::ShareAcquire {
                    lock: &req.lock,
                    intent,
                    fence: &fence(),
                    token: &req.token,
                    lease: req.lease,
                    hold: &req.token,
                    permits: *permits,
                    fencing: req.fencing,
                }
                .call(),
            ),
        }
    }

    /// A fair request's attempt: take the lock in queue order (`join`: queue up when not
    /// granted).
    fn fair_take(
        &self,
        req: &AcquireRequest,
        queue: &FairQueue,
        join: bool,
    ) -> redis::ScriptInvocation<'static> {
        scripts::Fair {
            lock: &req.lock,
            queue: &queue.queue,
            leases: &queue.leases,
            wake: &req.wake,
            token: &req.token,
            entry: &queue.entry,
            manager_id: &self.pool.manager_id,
            unclaimed: FAIR_UNCLAIMED,
            op: scripts::FairOp::Take {
                lease: req.lease,
                entry_lease: FAIR_ENTRY_LEASE,
                join,
            },
        }
        .call(self.wakes())
    }

    /// Runs an acquire script and, after a grant, WAITs for `wanted` replicas for at most
    /// `timeout`. Both go on a connection of their own: WAIT only covers the writes of its
    /// connection, and blocks it meanwhile, so it must not be the shared one.
    async fn acquire_replicated(
        &self,
        req: &AcquireRequest,
        call: &AcquireCall<'_>,
        (wanted, timeout): (u32, Duration),
    ) -> RedisResult<AcquireAnswer> {
        if !self.route.one_server() {
            return self
                .acquire_replicated_cluster(req, call, (wanted, timeout))
                .await;
        }
        let mut conn = self.replicated_conn().await?;
        let answer = self.watch(self.bounded(call.run(&mut conn, &req.token)).await)?;
        if let AcquireAnswer::Held { .. } = answer {
            let acked = self.wait_replicas(&mut conn, wanted, timeout).await?;
            self.pool.put_back(conn);
            if acked < wanted {
                self.release(&req.hold_ids(), Duration::ZERO).await?;
                return Ok(AcquireAnswer::Unreplicated { acked, wanted });
            }
        } else {
            self.pool.put_back(conn);
        }
        Ok(answer)
    }

    /// [`acquire_replicated`](Self::acquire_replicated) on Cluster: the grant goes out on
    /// the lane of its slot's master, and the `WAIT` after it on the same connection to the
    /// same master (a command without a key follows the keyed one before it, see
    /// `cluster::Lanes`). `WAIT` counts the replicas that have every write of that connection
    /// so far, the grant among them.
    async fn acquire_replicated_cluster(
        &self,
        req: &AcquireRequest,
        call: &AcquireCall<'_>,
        (wanted, timeout): (u32, Duration),
    ) -> RedisResult<AcquireAnswer> {
        let mut conn = self.conn().await?;
        let answer = self.watch(self.bounded(call.run(&mut conn, &req.token)).await)?;
        if let AcquireAnswer::Held { .. } = answer {
            let acked = self.wait_replicas(&mut conn, wanted, timeout).await?;
            if acked < wanted {
                self.release(&req.hold_ids(), Duration::ZERO).await?;
                return Ok(AcquireAnswer::Unreplicated { acked, wanted });
            }
        }
        Ok(answer)
    }

    /// Sends `WAIT wanted timeout` (with `sync_replicas_aof`, `WAITAOF 0 wanted timeout`)
    /// on `conn` after a grant on it, and returns how many replicas acknowledged.
    pub(in crate::backend) async fn wait_replicas<C: redis::aio::ConnectionLike>(
        &self,
        conn: &mut C,
        wanted: u32,
        timeout: Duration,
    ) -> RedisResult<u32> {
        let limit = self.pool.response_timeout + timeout;
        if self.pool.sync_aof {
            let wait = redis::cmd("WAITAOF")
                .arg(0)
                .arg(wanted)
                .arg(millis(timeout))
                .to_owned();
            let acked: (i64, i64) = self.watch(bounded(limit, wait.query_async(conn)).await)?;
            return Ok(u32::try_from(acked.1).unwrap_or(0));
        }
        let wait = redis::cmd("WAIT")
            .arg(wanted)
            .arg(millis(timeout))
            .to_owned();
        let acked: i64 = self.watch(bounded(limit, wait.query_async(conn)).await)?;
        Ok(u32::try_from(acked).unwrap_or(0))
    }

    /// An idle connection of the current runtime for a grant and its WAIT, or a new one.
    pub(in crate::backend) async fn replicated_conn(&self) -> RedisResult<MultiplexedConnection> {
        let id = runtime::Handle::try_current()
            .map_err(|_| RedisError::from(io::Error::other("no tokio runtime")))?
            .id();
        if let Some(conn) = self.pool.lock_replicated().get_mut(&id).and_then(Vec::pop) {
            return Ok(conn);
        }
        // Bounded by `bounded` around each command instead: WAIT takes longer than a reply.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.pool.connect_timeout))
            .set_response_timeout(None);
        let client = self.pool.client();
        let connect = client.get_multiplexed_async_connection_with_config(&config);
        self.watch(bounded(self.pool.connect_timeout, connect).await)
    }
}

/// A plain lock's attempt: `SET lock token NX PX lease GET`.
fn set_if_absent(req: &AcquireRequest) -> Cmd {
    let mut set = command("SET", 7, req.lock.len() + req.token.len() + 32);
    set.arg(&req.lock)
        .arg(&req.token)
        .arg("NX")
        .arg("PX")
        .arg(millis(req.lease))
        .arg("GET");
    set
}
