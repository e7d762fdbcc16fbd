//! Guarded writes: the caller's own Redis commands, run on the server only while the guard's
//! owner token still holds the lock.
//!
//! A lease ends by time, so a holder that was paused (a long GC pause, a stopped VM) may wake
//! up after another owner took the lock. A write it then sends through a plain connection
//! lands anyway. A guarded write sends the check and the commands as one script
//! (`scripts/guarded_write.lua`): the server runs the commands only if every lock is still
//! held by the writer's token, and nothing can run between the check and the commands.

use std::sync::Arc;
use std::time::Duration;

use redis::{FromRedisValue, ScriptInvocation, Value};

use crate::backend::slot_of;
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::held::{Held, HoldKind};
use crate::manager::LockManager;
use crate::set::MultiGuard;

/// How long the server keeps a batch's receipt (see [`Batch::receipt`]): the time within
/// which [`LockGuard::receipt_landed`] can tell whether that batch ran.
pub const RECEIPT_TTL: Duration = Duration::from_secs(600);

/// The longest receipt id accepted, in bytes.
const MAX_RECEIPT_LEN: usize = 256;

/// The commands of one guarded write (see [`LockGuard::guarded_write`]), in order.
///
/// Each command is written as `name keys… args…`: the first arguments of a command are its
/// keys, which are declared to the server (it routes and checks scripts by their declared
/// keys). [`command`](Self::command) takes the first argument as the only key, which fits
/// most writes (`SET`, `HSET`, `INCR`, `LPUSH`, `ZADD`, `XADD`, `EXPIRE`, `DEL key`…);
/// [`command_with_keys`](Self::command_with_keys) says how many come first (`DEL a b`,
/// `SMOVE from to member`, or 0 for a command without keys). A command whose keys are
/// interleaved with other arguments (`MSET a 1 b 2`) is written as several commands.
///
/// A `redis::Cmd` or a `redis::Pipeline` converts into a batch, each command with one key.
/// A pipeline's `ignore()` and `atomic()` are not seen: every command's reply comes back,
/// and the whole batch is atomic anyway.
///
/// ```
/// use distlock_runtime::Batch;
///
/// let mut batch = Batch::new();
/// batch
///     .command(redis::cmd("SET").arg("app:{orders}:d:total").arg(42))
///     .command_with_keys(redis::cmd("DEL").arg("app:{orders}:d:a").arg("app:{orders}:d:b"), 2)
///     .receipt("order-1017");
/// assert_eq!(batch.len(), 2);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Batch {
    commands: Vec<Command>,
    receipt: Option<String>,
    /// The first command that could not be taken, and why: reported by the write.
    refused: Option<String>,
}

/// Commands whose every argument is a key.
const ALL_KEYS: &[&str] = &["DEL", "UNLINK", "EXISTS", "TOUCH", "MGET"];

/// Commands that take several keys among other arguments, or keys elsewhere than first: a
/// batch cannot tell which of their arguments are keys.
const SEVERAL_KEYS: &[&str] = &[
    "MSET",
    "MSETNX",
    "RENAME",
    "RENAMENX",
    "COPY",
    "SMOVE",
    "LMOVE",
    "BLMOVE",
    "RPOPLPUSH",
    "BRPOPLPUSH",
    "SUNIONSTORE",
    "SINTERSTORE",
    "SDIFFSTORE",
    "SUNION",
    "SINTER",
    "SDIFF",
    "SINTERCARD",
    "ZUNIONSTORE",
    "ZINTERSTORE",
    "ZDIFFSTORE",
    "ZRANGESTORE",
    "ZUNION",
    "ZINTER",
    "ZDIFF",
    "ZINTERCARD",
    "BITOP",
    "PFMERGE",
    "PFCOUNT",
    "OBJECT",
    "MEMORY",
    "GEOSEARCHSTORE",
    "GEORADIUS",
    "GEORADIUSBYMEMBER",
    "SORT",
    "SORT_RO",
    "LCS",
    "BLPOP",
    "BRPOP",
    "BZPOPMIN",
    "BZPOPMAX",
    "LMPOP",
    "BLMPOP",
    "ZMPOP",
    "BZMPOP",
    "XREAD",
    "XREADGROUP",
    "XGROUP",
    "XINFO",
    "EVAL",
    "EVALSHA",
    "EVAL_RO",
    "EVALSHA_RO",
    "FCALL",
    "FCALL_RO",
    "MIGRATE",
    "WATCH",
];

/// The most arguments one command of a batch may have: the script's Lua stack takes about
/// 8,000 at once.
const MAX_ARGS: usize = 7_900;

/// How long the receipt a Cluster write records by itself lasts: longer than the client's
/// own resends of a request whose connection dropped.
const AUTO_RECEIPT_TTL: Duration = Duration::from_secs(60);

/// One command of a batch, split into what the script receives.
#[derive(Debug, Clone)]
struct Command {
    name: Vec<u8>,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `cmd`, whose first argument (if it has one) is its key. The commands whose every
    /// argument is a key (`DEL`, `UNLINK`, `EXISTS`, `TOUCH`, `MGET`) declare them all; a
    /// command known to take several keys among other arguments, or keys elsewhere than
    /// first (`MSET`, `RENAME`, `SMOVE`, `BITOP`, `OBJECT`…), is refused: say its keys with
    /// [`command_with_keys`](Self::command_with_keys), or split it.
    pub fn command(&mut self, cmd: &redis::Cmd) -> &mut Self {
        let args = cmd.args_iter().len();
        let name = match cmd.args_iter().next() {
            Some(redis::Arg::Simple(name)) => String::from_utf8_lossy(name).to_ascii_uppercase(),
            _ => String::new(),
        };
        if ALL_KEYS.contains(&name.as_str()) {
            return self.command_with_keys(cmd, args.saturating_sub(1));
        }
        if SEVERAL_KEYS.contains(&name.as_str()) {
            self.refused.get_or_insert(format!(
                "`{name}` takes several keys, or keys among its other arguments: add it with \
                 `command_with_keys` (its keys first), or split it into commands of one key"
            ));
            return self;
        }
        self.command_with_keys(cmd, usize::from(args > 1))
    }

    /// Adds `cmd`, whose first `keys` arguments after the command's name are keys.
    pub fn command_with_keys(&mut self, cmd: &redis::Cmd, keys: usize) -> &mut Self {
        match split(cmd, keys) {
            Ok(command) => self.commands.push(command),
            Err(reason) => {
                self.refused.get_or_insert(reason);
            }
        }
        self
    }

    /// Names this batch with `id`, chosen by the caller and unique among the batches written
    /// under this lock: the server records the id in the lock's slot (for [`RECEIPT_TTL`])
    /// when the batch runs, and refuses a second batch with the same id. If the write's
    /// future is dropped before its answer, [`LockGuard::receipt_landed`] tells whether the
    /// batch ran, and makes sure it never runs later.
    pub fn receipt(&mut self, id: impl Into<String>) -> &mut Self {
        self.receipt = Some(id.into());
        self
    }

    /// How many commands the batch has.
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    /// Whether the batch has no command.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }
}

impl From<&redis::Cmd> for Batch {
    fn from(cmd: &redis::Cmd) -> Self {
        let mut batch = Self::new();
        batch.command(cmd);
        batch
    }
}

impl From<redis::Cmd> for Batch {
    fn from(cmd: redis::Cmd) -> Self {
        Self::from(&cmd)
    }
}

impl From<&redis::Pipeline> for Batch {
    fn from(pipe: &redis::Pipeline) -> Self {
        let mut batch = Self::new();
        for cmd in pipe.cmd_iter() {
            batch.command(cmd);
        }
        batch
    }
}

impl From<redis::Pipeline> for Batch {
    fn from(pipe: redis::Pipeline) -> Self {
        Self::from(&pipe)
    }
}

impl From<&mut redis::Cmd> for Batch {
    fn from(cmd: &mut redis::Cmd) -> Self {
        Self::from(&*cmd)
    }
}

impl From<&mut redis::Pipeline> for Batch {
    fn from(pipe: &mut redis::Pipeline) -> Self {
        Self::from(&*pipe)
    }
}

impl From<&Batch> for Batch {
    fn from(batch: &Batch) -> Self {
        batch.clone()
    }
}

impl From<&mut Batch> for Batch {
    fn from(batch: &mut Batch) -> Self {
        batch.clone()
    }
}

/// `cmd` as a name, `keys` keys and the other arguments.
fn split(cmd: &redis::Cmd, keys: usize) -> Result<Command, String> {
    let mut parts = Vec::with_capacity(cmd.args_iter().len());
    for arg in cmd.args_iter() {
        match arg {
            redis::Arg::Simple(bytes) => parts.push(bytes.to_vec()),
            _ => return Err("a guarded write takes only plain arguments, no cursor".to_owned()),
        }
    }
    if parts.len() > MAX_ARGS {
        return Err(format!(
            "a command of a guarded write has {} arguments, more than the {MAX_ARGS} one \
             command may have: split it",
            parts.len()
        ));
    }
    let mut parts = parts.into_iter();
    let name = parts
        .next()
        .ok_or_else(|| "a command of a guarded write has no name".to_owned())?;
    let rest: Vec<Vec<u8>> = parts.collect();
    if keys > rest.len() {
        return Err(format!(
            "`{}` has {} argument(s), fewer than the {keys} key(s) it was said to have",
            String::from_utf8_lossy(&name),
            rest.len()
        ));
    }
    let mut rest = rest;
    let args = rest.split_off(keys);
    Ok(Command {
        name,
        keys: rest,
        args,
    })
}

/// One lock a guarded write must find held: its name (for errors) and its hold.
type Guarding = (String, Arc<Held>);

/// The receipt key of `id` under the lock `lock`: in the lock's slot.
fn receipt_key(lock: &str, id: &str) -> String {
    format!("{lock}:r:{id}")
}

/// The key `name` in the slot of the lock `lock`.
fn data_key(lock: &str, name: &str) -> String {
    format!("{lock}:d:{name}")
}

/// Refuses a write the deployment or the holds cannot guard.
fn check(manager: &LockManager, holds: &[Guarding], batch: &Batch) -> Result<(), LockError> {
    let capabilities = manager.inner.backend.capabilities();
    if !capabilities.guarded_writes {
        return Err(LockError::invalid(
            "guarded write",
            "RedLock masters decide a lock only by majority, so no single server can check \
             the owner and run the commands atomically",
        ));
    }
    if let Some(reason) = &batch.refused {
        return Err(LockError::invalid("guarded write", reason.clone()));
    }
    if let Some((name, held)) = holds.iter().find(|(_, h)| h.kind != HoldKind::Exclusive) {
        let kind = if held.kind == HoldKind::Read {
            "a read lock"
        } else {
            "a semaphore permit"
        };
        return Err(LockError::invalid(
            "guarded write",
            format!(
                "`{name}` is held as {kind}, which other holders share at the same time: \
                 only an exclusive, write or fair lock (or a set of them) guards a write"
            ),
        ));
    }
    if let Some(id) = &batch.receipt
        && (id.is_empty() || id.len() > MAX_RECEIPT_LEN)
    {
        return Err(LockError::invalid(
            "receipt",
            format!("a receipt id must have 1 to {MAX_RECEIPT_LEN} bytes"),
        ));
    }
    check_own_keys(holds, batch)?;
    if capabilities.one_slot {
        check_slots(holds, batch)?;
    }
    Ok(())
}

/// Refuses a batch that touches a lock's own keys (the lock, its receipts, its fencing
/// counter, its queues): only its data keys (`key_in_slot`) are the caller's.
fn check_own_keys(holds: &[Guarding], batch: &Batch) -> Result<(), LockError> {
    for (name, held) in holds {
        let lock = held.ids.lock.as_bytes();
        let data = data_key(&held.ids.lock, "");
        let own = |key: &&Vec<u8>| {
            key.as_slice() == lock
                || (key.starts_with(lock)
                    && key.get(lock.len()) == Some(&b':')
                    && !key.starts_with(data.as_bytes()))
        };
        if let Some(key) = batch.commands.iter().flat_map(|c| &c.keys).find(own) {
            return Err(LockError::invalid(
                "key",
                format!(
                    "`{}` is one of lock `{name}`'s own keys: a guarded write may not change \
                     them (make data keys with `key_in_slot`)",
                    String::from_utf8_lossy(key)
                ),
            ));
        }
    }
    Ok(())
}

/// On Cluster: every lock and every key of the batch must share the first lock's slot.
fn check_slots(holds: &[Guarding], batch: &Batch) -> Result<(), LockError> {
    let (first, first_held) = &holds[0];
    let slot = slot_of(&first_held.ids.lock);
    if let Some((name, _)) = holds.iter().find(|(_, h)| slot_of(&h.ids.lock) != slot) {
        return Err(LockError::invalid(
            "guarded write",
            format!(
                "on Cluster a guarded write runs in one hash slot, and the locks `{first}` \
                 and `{name}` are in different ones: give the set's keys one hash tag"
            ),
        ));
    }
    let keys = batch.commands.iter().flat_map(|c| &c.keys);
    if let Some(key) = keys.into_iter().find(|key| slot_of(key) != slot) {
        return Err(LockError::invalid(
            "key",
            format!(
                "`{}` is not in the hash slot of lock `{first}`: on Cluster a guarded write \
                 runs in the lock's slot (make its keys with `key_in_slot`)",
                String::from_utf8_lossy(key)
            ),
        ));
    }
    Ok(())
}

/// The script call of a guarded write of `batch` under `holds`.
fn call(
    holds: &[Guarding],
    batch: &Batch,
    receipt_ttl: Duration,
    nonce: &str,
) -> ScriptInvocation<'static> {
    let mut call = crate::scripts::GUARDED_WRITE.prepare_invoke();
    call.arg(holds.len());
    for (_, held) in holds {
        call.key(held.ids.lock.as_str())
            .arg(held.ids.token.as_str());
    }
    match &batch.receipt {
        Some(id) => {
            call.key(receipt_key(&holds[0].1.ids.lock, id))
                .arg(crate::scripts::millis(receipt_ttl));
        }
        None => {
            call.arg(0);
        }
    }
    call.arg(nonce).arg(batch.commands.len());
    for command in &batch.commands {
        call.arg(command.keys.len())
            .arg(command.args.len())
            .arg(command.name.as_slice());
        for key in &command.keys {
            call.key(key.as_slice());
        }
        for arg in &command.args {
            call.arg(arg.as_slice());
        }
    }
    call
}

/// Runs `batch` under `holds` and reads its replies as `T`.
async fn write<T: FromRedisValue>(
    manager: &LockManager,
    holds: Vec<Guarding>,
    batch: Batch,
) -> Result<T, LockError> {
    if holds.is_empty() {
        return Err(LockError::invalid("guarded write", "no lock guards it"));
    }
    check(manager, &holds, &batch)?;
    let first = holds[0].0.clone();
    // Each call records its own nonce in its receipt. On Cluster a call always has one: the
    // Cluster client sends a request again when its connection dropped, and the receipt makes
    // that resend run nothing.
    let nonce = crate::token::new_token(manager.inner.waiters.manager_id());
    let mut batch = batch;
    let receipt_ttl = match &batch.receipt {
        Some(_) => RECEIPT_TTL,
        None if manager.inner.backend.capabilities().one_slot => {
            batch.receipt = Some(format!("call:{nonce}"));
            AUTO_RECEIPT_TTL
        }
        None => RECEIPT_TTL,
    };
    // Never passed on locally from now on (see `Held::wrote`).
    for (_, held) in &holds {
        held.wrote.store(true, std::sync::atomic::Ordering::Release);
    }
    let call = call(&holds, &batch, receipt_ttl, &nonce);
    let answer = manager
        .inner
        .on_runtime(move |backend| async move { backend.nodes()[0].invoke::<Value>(&call).await })
        .await?
        .map_err(|e| LockError::redis(&first, e))?;
    let redis_error = |e: redis::ParsingError| LockError::redis(&first, e.into());
    let (status, detail): (i64, Value) =
        FromRedisValue::from_redis_value(answer).map_err(redis_error)?;
    match status {
        1 => T::from_redis_value(detail).map_err(redis_error),
        0 => {
            let at = usize::try_from(i64::from_redis_value(detail).map_err(redis_error)?)
                .unwrap_or(1)
                .clamp(1, holds.len());
            let (name, held) = &holds[at - 1];
            held.lease.mark_lost();
            Err(LockError::Lost { key: name.clone() })
        }
        _ if String::from_redis_value(detail.clone()).is_ok_and(|state| state == nonce) => {
            // This call's own batch ran, and the reply was lost; the resend ran nothing.
            Err(LockError::redis(
                &first,
                redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "the batch ran, but its reply was lost (the resend ran nothing)",
                )),
            ))
        }
        _ => Err(LockError::invalid(
            "receipt",
            format!(
                "receipt `{}` of lock `{first}` was already used (a batch with it ran, or \
                 `receipt_landed` withdrew it): nothing ran",
                batch.receipt.unwrap_or_default()
            ),
        )),
    }
}

/// Whether the batch with receipt `id` under the lock of `held` ran; if it did not, it
/// never will (the receipt is taken as withdrawn).
async fn landed(
    manager: &LockManager,
    name: &str,
    held: &Held,
    id: &str,
) -> Result<bool, LockError> {
    if !manager.inner.backend.capabilities().guarded_writes {
        return Err(LockError::invalid(
            "guarded write",
            "RedLock runs no guarded writes, so no receipt was recorded",
        ));
    }
    let key = receipt_key(&held.ids.lock, id);
    let withdraw = redis::cmd("SET")
        .arg(&key)
        .arg("0")
        .arg("NX")
        .arg("PX")
        .arg(crate::scripts::millis(RECEIPT_TTL))
        .to_owned();
    let get = redis::cmd("GET").arg(&key).to_owned();
    manager
        .inner
        .on_runtime(move |backend| async move {
            let node = &backend.nodes()[0];
            if node.query::<Option<String>>(&withdraw).await?.is_some() {
                // Withdrawn now: the batch had not run, and its script, if it still comes,
                // finds the receipt and runs nothing.
                return Ok(false);
            }
            // A nonce: the batch of that call ran; "0": withdrawn before it could.
            let state = node.query::<Option<String>>(&get).await?;
            Ok(state.is_some_and(|state| state != "0"))
        })
        .await?
        .map_err(|e: redis::RedisError| LockError::redis(name, e))
}

impl LockGuard {
    /// Runs `batch` (a `redis::Cmd`, a `redis::Pipeline` or a [`Batch`]) atomically on the
    /// server, only if this guard's owner token still holds the lock, in one round trip;
    /// the replies come back as `T` (one reply per command, in order: a tuple, a `Vec`…).
    ///
    /// If the lock is no longer held (its lease expired, another owner took it, it was
    /// released by force) nothing runs and the answer is [`LockError::Lost`]. The batch's
    /// keys belong in the lock's hash slot: make them with [`key_in_slot`](Self::key_in_slot).
    /// On Cluster a key in another slot is refused before anything is sent; with RedLock
    /// every guarded write is refused ([`LockError::InvalidInput`]), and so is one from a
    /// read lock or a semaphore permit, whose holders overlap.
    ///
    /// To stamp what it writes with the fencing token, pass
    /// [`fencing_token`](Self::fencing_token) as an argument: the batch runs only while this
    /// hold is the lock's, so the stamp is the current holder's. A command that fails on the
    /// server fails the call ([`LockError::Redis`]); the commands before it stay done, as in
    /// `MULTI`/`EXEC`.
    ///
    /// If the future is dropped before the answer, the batch ran or it did not; give the
    /// batch a [`receipt`](Batch::receipt) and ask [`receipt_landed`](Self::receipt_landed).
    ///
    /// ```no_run
    /// # async fn run(guard: distlock_runtime::LockGuard) -> Result<(), distlock_runtime::LockError> {
    /// let balance = guard.key_in_slot("balance");
    /// let mut pipe = redis::pipe();
    /// pipe.cmd("INCRBY").arg(&balance).arg(10)
    ///     .cmd("SET").arg(guard.key_in_slot("stamp")).arg(guard.fencing_token().unwrap_or(0));
    /// let (total, _): (i64, String) = guard.guarded_write(&pipe).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn guarded_write<T: FromRedisValue>(
        &self,
        batch: impl Into<Batch>,
    ) -> Result<T, LockError> {
        let holds = vec![(self.key().to_owned(), self.held().clone())];
        write(self.manager(), holds, batch.into()).await
    }

    /// Whether the guarded write with receipt `id` (see [`Batch::receipt`]) ran: `true` when
    /// it did; `false` when it had not, and then it never will (the receipt is withdrawn, so
    /// the batch, if it still reaches the server, runs nothing). Answers within
    /// [`RECEIPT_TTL`] of the write.
    pub async fn receipt_landed(&self, id: &str) -> Result<bool, LockError> {
        landed(self.manager(), self.key(), self.held(), id).await
    }

    /// The Redis key `name` in this lock's hash slot, `<lock key>:d:<name>`: where guarded
    /// writes keep their data, so that they work on Cluster.
    pub fn key_in_slot(&self, name: &str) -> String {
        data_key(&self.held().ids.lock, name)
    }
}

impl MultiGuard {
    /// Runs `batch` atomically on the server only if this owner still holds every lock of
    /// the set, in one round trip; otherwise nothing runs and the answer is
    /// [`LockError::Lost`] naming a lock that was lost. As [`LockGuard::guarded_write`]; on
    /// Cluster the set's keys (and the batch's) must share one hash slot.
    pub async fn guarded_write<T: FromRedisValue>(
        &self,
        batch: impl Into<Batch>,
    ) -> Result<T, LockError> {
        let (manager, holds) = self.write_holds();
        write(manager, holds, batch.into()).await
    }

    /// Whether the guarded write with receipt `id` ran; see [`LockGuard::receipt_landed`].
    pub async fn receipt_landed(&self, id: &str) -> Result<bool, LockError> {
        let (manager, holds) = self.write_holds();
        let (name, held) = holds
            .first()
            .ok_or_else(|| LockError::invalid("guarded write", "the set holds no lock"))?;
        landed(manager, name, held, id).await
    }

    /// The Redis key `name` in the hash slot of the set's lock `key`; see
    /// [`LockGuard::key_in_slot`]. [`LockError::InvalidInput`] when `key` is not in the set.
    pub fn key_in_slot(&self, key: &str, name: &str) -> Result<String, LockError> {
        let (_, holds) = self.write_holds();
        holds
            .iter()
            .find(|(held_name, _)| held_name == key)
            .map(|(_, held)| data_key(&held.ids.lock, name))
            .ok_or_else(|| LockError::invalid("key", format!("`{key}` is not a key of this set")))
    }
}
