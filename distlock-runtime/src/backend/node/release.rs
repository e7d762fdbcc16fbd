//! A node's releases: a hold given back (plain, shared, fair; `min_hold` kept as a marker) and
//! a hand-off's owner swap.

use super::*;

impl Node {
    /// Gives back `hold` of `token` on `lock`, keeping the key `keep` longer (min_hold) once
    /// no hold is left, and publishing on the lock's wake channel when it is free; `false`
    /// when the token did not hold the lock.
    pub(crate) async fn release(&self, ids: &HoldIds, keep: Duration) -> RedisResult<bool> {
        let HoldIds {
            lock,
            wake,
            token,
            shared,
            plain,
            fair,
            ..
        } = ids;
        if fair.is_some() {
            return Ok(Box::pin(self.release_fair(ids)).await? != FairRelease::NotHeld);
        }
        let mut conn = self.conn().await?;
        if *plain {
            return Ok(self.unlock(&mut conn, ids, keep).await?.is_some());
        }
        let call = match shared {
            true => scripts::ShareRelease {
                lock,
                wake,
                token,
                hold: token,
            }
            .call(self.wakes()),
            false => scripts::Release {
                lock,
                wake,
                token,
                hold: token,
                keep,
            }
            .call(self.wakes()),
        };
        // Boxed: the plain lock's release above carries none of this script call's state.
        let released: i64 =
            self.watch(Box::pin(self.bounded(call.invoke_async(&mut conn))).await)?;
        Ok(released == 1)
    }

    /// Releases a fair lock (to the queue's head, if one waits), and takes the owner's entry
    /// out of the queue if it is still there (a waiter giving up).
    pub(crate) async fn release_fair(&self, ids: &HoldIds) -> RedisResult<FairRelease> {
        let Some(fair) = &ids.fair else {
            return Ok(FairRelease::NotHeld);
        };
        let mut conn = self.conn().await?;
        let call = scripts::Fair {
            lock: &ids.lock,
            queue: &fair.queue,
            leases: &fair.leases,
            wake: &ids.wake,
            token: &ids.token,
            entry: &fair.entry,
            manager_id: &self.pool.manager_id,
            unclaimed: FAIR_UNCLAIMED,
            op: scripts::FairOp::Release,
        }
        .call(self.wakes());
        let bounds = conn.bounds();
        let (status, value): (i64, redis::Value) =
            self.watch(answer!(self, bounds, call.invoke_async(&mut conn)))?;
        Ok(match status {
            2 => FairRelease::Granted(redis::from_redis_value(value)?),
            1 => FairRelease::Freed,
            _ => FairRelease::NotHeld,
        })
    }

    /// Gives back a plain lock (as [`release`](Self::release)), and answers how many
    /// subscribers heard the wake-up: `None` when the token did not hold it.
    pub(crate) async fn release_plain(&self, ids: &HoldIds) -> RedisResult<Option<u64>> {
        let mut conn = self.conn().await?;
        self.unlock(&mut conn, ids, Duration::ZERO).await
    }

    /// Gives back a plain lock (string form): with the server's native compare-and-delete
    /// and the wake-up sent together, or with the `unlock.lua` script (also for `min_hold`,
    /// which leaves a marker behind). `None` when the token did not hold it; otherwise how
    /// many subscribers heard the wake-up.
    async fn unlock(
        &self,
        conn: &mut Conn,
        ids: &HoldIds,
        keep: Duration,
    ) -> RedisResult<Option<u64>> {
        let message = &*self.pool.manager_id;
        let delete = match self.delete() {
            // One script: compare, delete (or leave the ownerless `min_hold` marker, which
            // only the script can), publish.
            NativeDelete::Script => return self.unlock_script(conn, ids, keep, message).await,
            _ if !keep.is_zero() => return self.unlock_script(conn, ids, keep, message).await,
            NativeDelete::DelIfEq => {
                let mut delete = command("DELIFEQ", 2, ids.lock.len() + ids.token.len());
                delete.arg(&ids.lock).arg(&ids.token);
                delete
            }
            NativeDelete::DelEx => {
                let mut delete = command("DELEX", 3, ids.lock.len() + ids.token.len() + 4);
                delete.arg(&ids.lock).arg("IFEQ").arg(&ids.token);
                delete
            }
        };
        // Both go out back to back on the multiplexed connection: one round trip. The wake-up
        // is sent whatever the delete finds; a waiter woken for nothing finds the lock busy
        // and waits again.
        let mut publish = command(self.wakes().command(), 2, ids.wake.len() + message.len());
        publish.arg(&ids.wake).arg(message);
        let mut both = redis::pipe();
        both.add_command(delete).add_command(publish);
        let answers = answer!(self, conn.bounds(), conn.query_each(&both));
        let count = |value: redis::Value| -> RedisResult<i64> {
            Ok(redis::from_redis_value(value.extract_error()?)?)
        };
        let (deleted, heard) = match answers {
            Ok(answers) => {
                let mut answers = answers.into_iter();
                let deleted = answers.next().map_or_else(
                    || Err(io::Error::other("no answer to the compare-and-delete").into()),
                    count,
                );
                let heard = answers.next().map(count).and_then(Result::ok).unwrap_or(0);
                (deleted, u64::try_from(heard).unwrap_or(0))
            }
            Err(error) => (Err(error), 0),
        };
        match deleted {
            Ok(deleted) => Ok((deleted == 1).then_some(heard)),
            // Another kind's hash at the key: not this owner's lock.
            Err(error) if error.code() == Some("WRONGTYPE") => Ok(None),
            // A user whose ACL does not list the native command: the script from now on.
            Err(error) if denied(&error) => {
                tracing::info!(
                    "the native compare-and-delete is denied by the ACL; using a script"
                );
                *self.pool.delete.lock().unwrap_or_else(|e| e.into_inner()) = NativeDelete::Script;
                Box::pin(self.unlock(conn, ids, keep)).await
            }
            Err(error) => self.watch(Err(error)),
        }
    }

    /// Gives back a plain lock with `unlock.lua`: compare, delete (or leave the `min_hold`
    /// marker for `keep`), and publish `message`.
    async fn unlock_script(
        &self,
        conn: &mut Conn,
        ids: &HoldIds,
        keep: Duration,
        message: &str,
    ) -> RedisResult<Option<u64>> {
        let call = scripts::Unlock {
            lock: &ids.lock,
            wake: &ids.wake,
            token: &ids.token,
            keep,
            message,
        };
        let bounds = conn.bounds();
        let command = call.command(self.wakes());
        let answer = answer!(self, bounds, conn.query::<i64>(&command));
        let released = match answer {
            // The server lost its scripts (a restart, `SCRIPT FLUSH`): the same call with the
            // script's text, which the server keeps for the next one. Boxed, as rare: its
            // state stays out of every release's future.
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let again = call.eval_command(self.wakes());
                Box::pin(async { answer!(self, bounds, conn.query::<i64>(&again)) }).await
            }
            answer => answer,
        };
        let released = self.watch(released)?;
        Ok(u64::try_from(released - 1).ok())
    }

    /// Passes the plain lock `hand_off.lock` from `hand_off.token` to the owner
    /// `hand_off.next` with `hand_off.lease`, if the token still owns it: with a conditional
    /// `SET … IFEQ` where the server has one (it came with the native compare-and-delete),
    /// with `handoff.lua` otherwise. `false` when it did not own it.
    pub(crate) async fn hand_off(&self, hand_off: &scripts::HandOff<'_>) -> RedisResult<bool> {
        let mut conn = self.conn().await?;
        let bounds = conn.bounds();
        if self.delete() == NativeDelete::Script {
            let call = hand_off.call();
            let swapped: i64 = self.watch(answer!(self, bounds, call.invoke_async(&mut conn)))?;
            return Ok(swapped == 1);
        }
        let swap = redis::cmd("SET")
            .arg(hand_off.lock)
            .arg(hand_off.next)
            .arg("IFEQ")
            .arg(hand_off.token)
            .arg("PX")
            .arg(millis(hand_off.lease))
            .to_owned();
        match answer!(self, bounds, swap.query_async::<Option<String>>(&mut conn)) {
            Ok(swapped) => Ok(swapped.is_some()),
            // Another kind's hash at the key: not this owner's lock.
            Err(error) if error.code() == Some("WRONGTYPE") => Ok(false),
            Err(error) => self.watch(Err(error)),
        }
    }
}
