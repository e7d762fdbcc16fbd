//! Redis Cluster: slot-aware connections, one lane per master; every lock's keys share its
//! hash slot, so each operation goes to the master of that slot, and an operation on several
//! locks makes one call per slot.
//!
//! The `redis` crate's Cluster connection recovers as a whole: while it refreshes its slot
//! map or reconnects after one master stopped answering, every request waits, whichever
//! master it is for. So each runtime opens one connection per master (a lane) and sends each
//! key's commands on the lane of the master that owned its slot when the lanes were opened:
//! one master cut off or frozen stalls its own lane only. Each lane follows `MOVED`, `ASK`
//! and failovers by itself; after a reshard a slot's lane may lead to another master, which
//! is still correct, only less apart.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::Arc;
use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisError, RedisResult, Value};

use super::connect::ConnectOptions;

/// A client of the Redis Cluster reached through `seeds`, made with `options`, and the first
/// seed (which serves pub/sub); nothing is sent until it is used.
pub(super) fn client<'s>(
    seeds: &'s [String],
    options: &ConnectOptions,
) -> RedisResult<(&'s str, ClusterClient)> {
    let first = seeds
        .first()
        .ok_or_else(|| RedisError::from(io::Error::other("no Cluster seed given")))?;
    let builder = ClusterClient::builder(seeds.to_vec())
        .connection_timeout(options.connect_timeout)
        // A backstop only: every request is bounded by a timer of its own (the response
        // timeout, or for a WAIT after a grant that plus the WAIT's timeout).
        .response_timeout(
            options.response_timeout
                + options
                    .sync_replicas
                    .map_or(Duration::ZERO, |(_, timeout)| timeout),
        );
    let cluster = options.security.cluster(builder).build()?;
    Ok((first.as_str(), cluster))
}

/// The Cluster connections of one runtime, one lane per master (see the module's text).
#[derive(Clone)]
pub(super) struct Lanes {
    /// The connections and the slot map they were chosen by, shared by every handle (one
    /// pointer: a handle travels inside every request's future).
    map: Arc<LaneMap>,
    /// The slot of the last keyed command sent through this handle: a command without a key
    /// that follows (a `SCRIPT LOAD` after `NOSCRIPT`) goes to that slot's master.
    last_slot: Option<u16>,
}

/// One connection per master, and which of them serves each hash slot.
struct LaneMap {
    /// One connection per master, in the order the slot map listed them.
    conns: Vec<ClusterConnection>,
    /// The lane of each hash slot.
    lane_of: Box<[u8]>,
}

impl Lanes {
    /// Opens the lanes of `cluster`: one connection first, which reads the slot map, then
    /// one more per further master.
    pub(super) async fn open(cluster: &ClusterClient) -> RedisResult<Self> {
        let mut first = cluster.get_async_connection().await?;
        let slots: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut first)
            .await?;
        let mut masters: HashMap<String, u8> = HashMap::new();
        let mut lane_of = vec![0u8; 16384];
        for (start, end, master) in slot_ranges(&slots) {
            let next = u8::try_from(masters.len()).unwrap_or(u8::MAX);
            let lane = *masters.entry(master).or_insert(next);
            for slot in start..=end.min(16383) {
                lane_of[usize::from(slot)] = lane;
            }
        }
        let mut conns = vec![first];
        for _ in 1..masters.len().max(1) {
            conns.push(cluster.get_async_connection().await?);
        }
        Ok(Self {
            map: Arc::new(LaneMap {
                conns,
                lane_of: lane_of.into(),
            }),
            last_slot: None,
        })
    }

    /// The first lane's connection: for commands sent to every master.
    pub(super) fn any(&self) -> ClusterConnection {
        self.map.conns[0].clone()
    }

    /// The connection of the lane of `slot`.
    fn lane(&self, slot: u16) -> ClusterConnection {
        let map = &self.map;
        let lane = usize::from(map.lane_of[usize::from(slot)]);
        map.conns.get(lane).unwrap_or(&map.conns[0]).clone()
    }

    /// Sends `cmd` on the lane of its key's slot; a command without a key after a keyed
    /// one goes to the master of that one's slot.
    pub(super) async fn send(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match key_slot(cmd) {
            Some(slot) => {
                self.last_slot = Some(slot);
                let mut conn = self.lane(slot);
                let answer = redis::aio::ConnectionLike::req_packed_command(&mut conn, cmd).await;
                // The node this reached does not know the script (a master promoted or a slot
                // moved since it was loaded): its text, to the same node by the same key. The
                // `SCRIPT LOAD` the client would send has no key, and could reach another node.
                let unknown = match &answer {
                    Err(error) => error.kind() == NO_SCRIPT,
                    Ok(Value::ServerError(error)) => {
                        error.kind() == Some(redis::ServerErrorKind::NoScript)
                    }
                    Ok(_) => false,
                };
                match eval_of(cmd).filter(|_| unknown) {
                    Some(eval) => {
                        redis::aio::ConnectionLike::req_packed_command(&mut conn, &eval).await
                    }
                    None => answer,
                }
            }
            None => match self.last_slot {
                Some(slot) => {
                    let at = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                        Route::new(slot, SlotAddr::Master),
                    ));
                    self.lane(slot).route_command(cmd.clone(), at).await
                }
                None => redis::aio::ConnectionLike::req_packed_command(&mut self.any(), cmd).await,
            },
        }
    }

    /// Sends `pipeline` on the lane of its first command's key.
    pub(super) async fn send_pipeline(
        &mut self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let slot = pipeline.cmd_iter().find_map(key_slot);
        let mut conn = match slot {
            Some(slot) => {
                self.last_slot = Some(slot);
                self.lane(slot)
            }
            None => self.any(),
        };
        redis::aio::ConnectionLike::req_packed_commands(&mut conn, pipeline, offset, count).await
    }
}

/// The `(first, last, master address)` of each range in a `CLUSTER SLOTS` answer.
pub(super) fn slot_ranges(slots: &Value) -> Vec<(u16, u16, String)> {
    let Value::Array(ranges) = slots else {
        return Vec::new();
    };
    let number = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok(),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    ranges
        .iter()
        .filter_map(|range| {
            let Value::Array(range) = range else {
                return None;
            };
            let (start, end) = (number(range.first()?)?, number(range.get(1)?)?);
            let Value::Array(master) = range.get(2)? else {
                return None;
            };
            let host = text(master.first()?)?;
            let port = match master.get(1)? {
                Value::Int(p) => *p,
                _ => return None,
            };
            Some((start, end, format!("{host}:{port}")))
        })
        .collect()
}

/// The slot of the key `cmd` acts on: its first argument, or for a script call
/// (`EVALSHA`, `EVAL`, `FCALL`) its first declared key; `None` without a key.
const NO_SCRIPT: redis::ErrorKind = redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);

/// `cmd`, an `EVALSHA` of a script this process made, as the `EVAL` of its text.
fn eval_of(cmd: &Cmd) -> Option<Cmd> {
    let mut args = cmd.args_iter().map(|arg| match arg {
        redis::Arg::Simple(bytes) => bytes,
        _ => &[][..],
    });
    if !args.next()?.eq_ignore_ascii_case(b"EVALSHA") {
        return None;
    }
    let mut eval = redis::cmd("EVAL");
    eval.arg(crate::scripts::source_of(args.next()?)?);
    for arg in args {
        eval.arg(arg);
    }
    Some(eval)
}

fn key_slot(cmd: &Cmd) -> Option<u16> {
    let args: Vec<&[u8]> = cmd
        .args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => bytes,
            _ => &[][..],
        })
        .collect();
    let name = args.first()?.to_ascii_uppercase();
    let key = match name.as_slice() {
        b"EVALSHA" | b"EVAL" | b"FCALL" | b"EVALSHA_RO" | b"EVAL_RO" => {
            let keys: usize = std::str::from_utf8(args.get(2)?).ok()?.parse().ok()?;
            if keys == 0 {
                return None;
            }
            args.get(3)?
        }
        b"SCRIPT" | b"PING" | b"CLUSTER" | b"INFO" | b"WAIT" | b"WAITAOF" | b"CLIENT" | b"SCAN"
        | b"TIME" | b"FUNCTION" | b"HELLO" => return None,
        _ => args.get(1)?,
    };
    Some(slot_of_bytes(key))
}

/// The Cluster hash slot of `key`: CRC16 (XMODEM) of its hash tag (or of the whole key
/// without one), modulo 16384. (`redis::cluster_routing::Slot` does not expose its number,
/// and the global order needs one.)
pub(crate) fn slot_of(key: impl AsRef<[u8]>) -> u16 {
    slot_of_bytes(key.as_ref())
}

/// [`slot_of`] for a key given as bytes.
fn slot_of_bytes(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let close = key[open..].iter().position(|&b| b == b'}')?;
            Some(&key[open + 1..open + close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in tag {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// The locks of `keys` grouped by hash slot, slots in ascending order, each group sorted by
/// key: the one order every client takes them in.
pub(super) fn by_slot<'a>(keys: impl Iterator<Item = &'a str>) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<u16, Vec<(&str, usize)>> = BTreeMap::new();
    for (at, key) in keys.enumerate() {
        groups.entry(slot_of(key)).or_default().push((key, at));
    }
    groups
        .into_values()
        .map(|mut group| {
            group.sort_unstable();
            group.into_iter().map(|(_, at)| at).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::cluster_routing::Slot;

    #[test]
    fn slots_are_the_ones_redis_computes() {
        for key in [
            "p:{a}",
            "p:{order:42}",
            "p:{a{b}",
            "p:{}x",
            "plain",
            "p:{a%7Db}~",
            "{x}:fence",
        ] {
            assert_eq!(Slot::new(slot_of(key)), Some(Slot::for_key(key)), "{key}");
        }
        // A known value: CLUSTER KEYSLOT foo = 12182.
        assert_eq!(slot_of("foo"), 12182);
    }

    #[test]
    fn slots_come_in_one_global_order() {
        let keys = ["p:{b}", "p:{a}", "p:{c}", "p:{a}x"];
        let groups = by_slot(keys.iter().copied());
        let slots: Vec<u16> = groups.iter().map(|g| slot_of(keys[g[0]])).collect();
        assert!(slots.windows(2).all(|w| w[0] < w[1]), "{slots:?}");
        // The same set listed in another order gives the same sequence of keys.
        let reversed: Vec<&str> = keys.iter().rev().copied().collect();
        let again = by_slot(reversed.iter().copied());
        let names = |groups: &[Vec<usize>], keys: &[&str]| -> Vec<String> {
            groups
                .iter()
                .flatten()
                .map(|&i| keys[i].to_owned())
                .collect()
        };
        assert_eq!(names(&groups, &keys), names(&again, &reversed));
    }
}
