//! The duration syntax of the library and the attribute, as clap parses option values.

use std::time::Duration;

/// The duration syntax of the library and the attribute: `30s`, `500ms`, `2m`, `1h`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    distlock::parse_duration(text).map_err(|error| match error {
        distlock::LockError::InvalidInput { reason, .. } => reason,
        other => other.to_string(),
    })
}
