//! Lock names and the Redis keys derived from them.

use crate::LockError;

/// The longest key accepted, in bytes (the prefix and braces come on top).
pub const MAX_KEY_LEN: usize = 1024;

/// The Redis keys of one lock. All share the hash tag `{key}`, so they sit in one Cluster slot.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// The key as the caller named it.
    pub(crate) name: String,
    /// `prefix{key}`: the lock itself.
    pub(crate) lock: String,
}

impl Keys {
    /// Validates `name` and derives the lock's keys under `prefix`.
    pub(crate) fn new(prefix: &str, name: String) -> Result<Self, LockError> {
        validate(&name)?;
        let lock = format!("{prefix}{{{name}}}");
        Ok(Self { name, lock })
    }

    /// A companion key of this lock, `prefix{key}:suffix`, in the same slot.
    pub(crate) fn companion(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.lock)
    }
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

/// Validates a manager's key prefix: braces would change the Cluster hash tag.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), LockError> {
    if prefix.contains(['{', '}']) {
        return Err(LockError::Config(format!(
            "key prefix `{prefix}` must not contain `{{` or `}}`: distlock puts the lock key in \
             braces so that a lock's companion keys share one Cluster slot"
        )));
    }
    if prefix.len() > MAX_KEY_LEN {
        return Err(LockError::Config(format!(
            "key prefix may be at most {MAX_KEY_LEN} bytes"
        )));
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

    #[test]
    fn prefixes_with_braces_are_rejected() {
        assert!(validate_prefix("app:").is_ok());
        assert!(matches!(validate_prefix("a{b"), Err(LockError::Config(_))));
    }
}
