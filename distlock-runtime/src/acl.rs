//! The least privilege a Redis ACL user of distlock needs: [`LockManager::acl_rules`].

use crate::inspect::glob_escape;
use crate::manager::LockManager;

/// Every command distlock sends, directly or from its scripts (which run as the same user).
///
/// `info` is optional: without it a RedLock master's restart cannot be noticed and the
/// eviction policy cannot be checked (both are then said once in the log). `wait` is used by
/// `sync_replicas` only, `cluster|slots` by Cluster only; `ssubscribe`, `sunsubscribe`,
/// `spublish` and `hello` (for the RESP3 connections sharded pub/sub takes) by a Cluster with
/// sharded pub/sub, `command|info` to find out whether it has it.
const COMMANDS: &[&str] = &[
    "script|load",
    "evalsha",
    // a script the server lost (a restart, a flush, a node that joined) is sent with `EVAL`
    "eval",
    "subscribe",
    "unsubscribe",
    "ssubscribe",
    "sunsubscribe",
    "hello",
    "command|info",
    "wait",
    "cluster|slots",
    "client|setname",
    "info",
    // called by the scripts, and by `is_held`
    "del",
    "exists",
    "get",
    "hdel",
    "hexists",
    "hget",
    "hgetall",
    "hincrby",
    "hkeys",
    "hmget",
    "hset",
    "hsetnx",
    "incr",
    "pexpire",
    "pttl",
    "publish",
    "spublish",
    "set",
    "time",
    "type",
];

impl LockManager {
    /// The `ACL SETUSER` rules for a user that may do everything distlock does under key
    /// prefix `prefix`, and nothing else: its commands, its keys (`~prefix*`, and
    /// `~distlock-manager:prefix*` where its managers register who they are) and its pub/sub
    /// channels (`&prefix*`).
    ///
    /// ```
    /// let rules = distlock_runtime::LockManager::acl_rules("myapp:lock:");
    /// assert!(rules.starts_with("resetkeys ~myapp:lock:* resetchannels &myapp:lock:* -@all +"));
    /// // ACL SETUSER locker on >password <rules>
    /// ```
    pub fn acl_rules(prefix: &str) -> String {
        let pattern = glob_escape(prefix);
        let mut rules = format!("resetkeys ~{pattern}* resetchannels &{pattern}* -@all");
        for command in COMMANDS {
            rules.push_str(" +");
            rules.push_str(command);
        }
        // The managers' registrations (who they are), next to the prefix.
        rules.push_str(" ~");
        rules.push_str(crate::identity::REGISTRATIONS);
        rules.push_str(&pattern);
        rules.push('*');
        rules
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_is_a_literal_pattern() {
        let rules = LockManager::acl_rules("a*b?:");
        assert!(
            rules.starts_with(r"resetkeys ~a\*b\?:* resetchannels &a\*b\?:* -@all +script|load")
        );
    }
}
