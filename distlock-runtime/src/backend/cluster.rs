//! Redis Cluster: one slot-aware connection per runtime; every lock's keys share its hash
//! slot, so each operation goes to the master of that slot, and an operation on several locks
//! makes one call per slot.

use std::collections::BTreeMap;
use std::io;

use redis::cluster::ClusterClient;
use redis::{RedisError, RedisResult};

use super::pool::ConnectOptions;

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
        .response_timeout(options.response_timeout);
    let cluster = options.security.cluster(builder).build()?;
    Ok((first.as_str(), cluster))
}

/// The Cluster hash slot of `key`: CRC16 (XMODEM) of its hash tag (or of the whole key
/// without one), modulo 16384. (`redis::cluster_routing::Slot` does not expose its number,
/// and the global order needs one.)
pub(crate) fn slot_of(key: impl AsRef<[u8]>) -> u16 {
    let key = key.as_ref();
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
