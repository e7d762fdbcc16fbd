//! The Lua scripts that make every state change atomic on the server.
//!
//! Each script lives in its own `.lua` file beside this module and is built once into a
//! [`redis::Script`], which runs with EVALSHA and loads itself again on NOSCRIPT (after a
//! server restart or `SCRIPT FLUSH`). Keys and values travel in KEYS/ARGV, never in the text.

use std::sync::LazyLock;

use redis::Script;

/// Take an exclusive lock: `{1, fence}` when held, `{0, pttl}` when busy.
pub(crate) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/acquire.lua")));

/// Give back an exclusive lock if the token still owns it: 1 released, 0 not held.
pub(crate) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/release.lua")));

/// Set the lease of a held lock: 1 set, 0 not held.
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/extend.lua")));

/// Every script, for loading them all when a manager connects.
pub(crate) fn all() -> [&'static Script; 3] {
    [&ACQUIRE, &RELEASE, &EXTEND]
}
