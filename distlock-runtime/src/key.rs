//! Lock names and the Redis keys derived from them.

use crate::error::LockError;

/// The longest key accepted, in bytes (the prefix and braces come on top).
pub const MAX_KEY_LEN: usize = 1024;

/// The Redis keys of one lock. All share one hash tag, so they sit in one Cluster slot.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// The key as the caller named it.
    pub(crate) name: String,
    /// `prefix{key}`: the lock itself (see [`lock_key`]).
    pub(crate) lock: String,
}

impl Keys {
    /// Validates `name` and derives the lock's keys under `prefix`.
    pub(crate) fn new(prefix: &str, name: String) -> Result<Self, LockError> {
        validate(&name)?;
        let lock = lock_key(prefix, &name);
        Ok(Self { name, lock })
    }

    /// A companion key of this lock, `<lock>:suffix`, in the same slot.
    fn companion(&self, suffix: &str) -> String {
        companion(&self.lock, suffix)
    }

    /// The per-key fencing counter.
    pub(crate) fn fence(&self) -> String {
        fence_key(&self.lock)
    }

    /// The wake channel, published on when the lock is released or granted.
    pub(crate) fn wake(&self) -> String {
        self.companion(WAKE)
    }

    /// A waiting writer's intent, which keeps new readers out.
    pub(crate) fn write_intent(&self) -> String {
        self.companion(WRITE_INTENT)
    }

    /// The timer of a `min_hold` window that a nested hold outlives.
    pub(crate) fn min_hold_timer(&self) -> String {
        self.companion(MIN_HOLD_TIMER)
    }
}

/// `<lock>:suffix`: a companion key in the lock's slot.
fn companion(lock: &str, suffix: &str) -> String {
    // Built by hand: on the path of every lock, where `format!` costs several times more.
    let mut key = String::with_capacity(lock.len() + 1 + suffix.len());
    key.push_str(lock);
    key.push(':');
    key.push_str(suffix);
    key
}

/// The fencing counter of `lock`.
pub(crate) fn fence_key(lock: &str) -> String {
    companion(lock, FENCE)
}

/// A fair lock's queue of waiters (a list, oldest first), in the lock's slot.
pub(crate) fn queue_key(lock: &str) -> String {
    companion(lock, QUEUE)
}

/// The timer of a `min_hold` window asked for by a hold nested in another (a string with a
/// PTTL), which the last release of the lock keeps the key for.
pub(crate) fn min_hold_timer_key(lock: &str) -> String {
    companion(lock, MIN_HOLD_TIMER)
}

/// The leases of a fair lock's queue entries (a sorted set by end time).
pub(crate) fn queue_leases_key(lock: &str) -> String {
    companion(lock, QUEUE_LEASES)
}

// The companion keys' suffixes; the Lua scripts receive the keys themselves.
const FENCE: &str = "fence";
const WAKE: &str = "wake";
const WRITE_INTENT: &str = "wi";
const MIN_HOLD_TIMER: &str = "mh";
const QUEUE: &str = "queue";
const QUEUE_LEASES: &str = "queue:leases";

/// The lock key of `name` under `prefix`: `prefix{name}`.
///
/// A name that contains `}` would end the hash tag early (or leave none), spreading a lock's
/// keys over several Cluster slots. Such a name is written escaped (`%` as `%25`, `}` as
/// `%7D`) and marked with `~` after the closing brace, `prefix{escaped}~`: the tag is the
/// whole escaped name, and the key can never equal a plain name's key or companion, which
/// have nothing or `:` after the brace. Names without `}` keep their plain key.
pub(crate) fn lock_key(prefix: &str, name: &str) -> String {
    if !name.contains('}') {
        let mut key = String::with_capacity(prefix.len() + name.len() + 2);
        key.push_str(prefix);
        key.push('{');
        key.push_str(name);
        key.push('}');
        return key;
    }
    let mut key = String::with_capacity(prefix.len() + name.len() + 8);
    key.push_str(prefix);
    key.push('{');
    for c in name.chars() {
        match c {
            '%' => key.push_str("%25"),
            '}' => key.push_str("%7D"),
            c => key.push(c),
        }
    }
    key.push_str("}~");
    key
}

fn validate(name: &str) -> Result<(), LockError> {
    if name.is_empty() {
        return Err(LockError::invalid("key", "a lock key must not be empty"));
    }
    if name.len() > MAX_KEY_LEN {
        return Err(LockError::invalid(
            "key",
            format!(
                "a lock key may be at most {MAX_KEY_LEN} bytes, this one is {} bytes",
                name.len()
            ),
        ));
    }
    Ok(())
}

/// Checks a manager's key prefix: braces would change the Cluster hash tag. The reason, on
/// failure, follows the name of the setting (`key prefix`, or an environment variable).
pub(crate) fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.contains(['{', '}']) {
        return Err(format!(
            "`{prefix}` must not contain `{{` or `}}`: distlock puts the lock key in braces so \
             that a lock's companion keys share one Cluster slot"
        ));
    }
    if prefix.len() > MAX_KEY_LEN {
        return Err(format!("may be at most {MAX_KEY_LEN} bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let keys = Keys::new("app:", "order:42".into()).unwrap();
        assert_eq!(keys.lock, "app:{order:42}");
        assert_eq!(keys.companion("fence"), "app:{order:42}:fence");
    }

    #[test]
    fn empty_and_oversized_keys_are_errors() {
        assert!(matches!(
            Keys::new("p:", String::new()),
            Err(LockError::InvalidInput { what: "key", .. })
        ));
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(
            Keys::new("p:", long),
            Err(LockError::InvalidInput { what: "key", .. })
        ));
        assert!(Keys::new("p:", "k".repeat(MAX_KEY_LEN)).is_ok());
    }

    /// The hash tag Redis Cluster hashes for `key`: the bytes between the first `{` and the
    /// first `}` after it, when there are any.
    fn hash_tag(key: &str) -> Option<&str> {
        let open = key.find('{')?;
        let close = key[open + 1..].find('}')?;
        Some(&key[open + 1..open + 1 + close]).filter(|tag| !tag.is_empty())
    }

    /// Every key a lock may write, as the request code derives them.
    fn all_keys(keys: &Keys) -> Vec<String> {
        let mut all = vec![keys.lock.clone()];
        all.extend(["fence", "wake", "wi", "mh"].map(|s| keys.companion(s)));
        all
    }

    #[test]
    fn names_with_closing_braces_keep_one_slot() {
        for name in ["}", "}x", "a}b", "{}", "{a}", "x{", "}{", "a}:fence", "%7D"] {
            let keys = Keys::new("p:", name.into()).unwrap();
            let tag = hash_tag(&keys.lock).map(str::to_owned);
            assert!(tag.is_some(), "{name:?}: no hash tag in {}", keys.lock);
            for key in all_keys(&keys) {
                assert_eq!(hash_tag(&key).map(str::to_owned), tag, "{name:?}: {key}");
                let slot = redis::cluster_routing::Slot::for_key(&key);
                assert_eq!(slot, redis::cluster_routing::Slot::for_key(&keys.lock));
            }
        }
    }

    #[test]
    fn escaped_names_never_meet_plain_ones() {
        let pairs = [
            ("a}b", "a%7Db"),
            ("}", "%7D"),
            ("%}", "%25%7D"),
            ("a}:wake", "a"),
        ];
        for (braced, plain) in pairs {
            let braced = all_keys(&Keys::new("p:", braced.into()).unwrap());
            let plain = all_keys(&Keys::new("p:", plain.into()).unwrap());
            assert!(
                braced.iter().all(|k| !plain.contains(k)),
                "{braced:?} {plain:?}"
            );
        }
    }

    #[test]
    fn plain_names_keep_their_keys() {
        let keys = Keys::new("app:", "a{b%".into()).unwrap();
        assert_eq!(keys.lock, "app:{a{b%}");
        assert_eq!(keys.companion("wake"), "app:{a{b%}:wake");
        assert_eq!(lock_key("app:", "a{b%"), keys.lock);
        let keys = Keys::new("app:", "a}b%".into()).unwrap();
        assert_eq!(keys.lock, "app:{a%7Db%25}~");
        assert_eq!(lock_key("app:", "a}b%"), keys.lock);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn name() -> impl Strategy<Value = String> {
            // Mostly the characters that matter, sometimes anything.
            prop_oneof![
                proptest::collection::vec(
                    prop_oneof![
                        Just('{'),
                        Just('}'),
                        Just('%'),
                        Just('~'),
                        Just(':'),
                        Just('7'),
                        Just('D'),
                        Just('a'),
                    ],
                    0..12,
                )
                .prop_map(|chars| chars.into_iter().collect()),
                any::<String>(),
            ]
        }

        fn prefix() -> impl Strategy<Value = String> {
            any::<String>().prop_map(|p| p.replace(['{', '}'], ""))
        }

        proptest! {
            #[test]
            fn every_name_is_refused_or_keeps_one_slot(prefix in prefix(), name in name()) {
                match Keys::new(&prefix, name.clone()) {
                    Err(error) => {
                        let refused = matches!(error, LockError::InvalidInput { what: "key", .. });
                        prop_assert!(refused, "{}", error);
                    }
                    Ok(keys) => {
                        let tag = hash_tag(&keys.lock);
                        prop_assert!(tag.is_some(), "no hash tag in {:?}", keys.lock);
                        let slot = redis::cluster_routing::Slot::for_key(&keys.lock);
                        for key in all_keys(&keys) {
                            prop_assert_eq!(hash_tag(&key), tag);
                            prop_assert_eq!(redis::cluster_routing::Slot::for_key(&key), slot);
                        }
                        if !name.contains('}') {
                            prop_assert_eq!(keys.lock, format!("{prefix}{{{name}}}"));
                        }
                    }
                }
            }

            #[test]
            fn distinct_names_never_share_a_key(prefix in prefix(), a in name(), b in name()) {
                prop_assume!(a != b);
                if let (Ok(a), Ok(b)) = (Keys::new(&prefix, a), Keys::new(&prefix, b)) {
                    let (a, b) = (all_keys(&a), all_keys(&b));
                    prop_assert!(a.iter().all(|k| !b.contains(k)), "{:?} and {:?}", a, b);
                }
            }
        }
    }

    #[test]
    fn prefixes_with_braces_are_rejected() {
        assert!(check_prefix("app:").is_ok());
        assert!(check_prefix("a{b").is_err());
        assert!(check_prefix(&"p".repeat(MAX_KEY_LEN + 1)).is_err());
    }
}
