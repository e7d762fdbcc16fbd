//! The one duration syntax of distlock, shared by the environment (`from_env`) and the
//! `distlock` binary, and the same as the attribute's (checked there at compile time).

use std::time::Duration;

use crate::error::LockError;

/// Parses a duration as every part of distlock writes one: a whole number and a unit, `ms`,
/// `s`, `m` or `h` (`"250ms"`, `"10s"`, `"2m"`, `"1h"`; spaces around are ignored). A
/// number without a unit and zero are refused, as the attribute refuses them.
///
/// ```
/// use std::time::Duration;
/// use distlock_runtime::parse_duration;
///
/// assert_eq!(parse_duration("250ms")?, Duration::from_millis(250));
/// assert_eq!(parse_duration(" 2m ")?, Duration::from_secs(120));
/// assert!(parse_duration("30").is_err()); // which unit?
/// assert!(parse_duration("0s").is_err());
/// # Ok::<(), distlock_runtime::LockError>(())
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, LockError> {
    const HINT: &str = "expected a duration such as `10s` or `250ms` (units: `ms`, `s`, `m`, `h`)";
    let invalid = |reason: String| LockError::invalid("duration", reason);
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let scale: u64 = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "" if !number.is_empty() => {
            return Err(invalid(format!(
                "`{number}` needs a unit: write `{number}s` or `{number}ms`"
            )));
        }
        _ => return Err(invalid(format!("`{text}`: {HINT}"))),
    };
    let value: u64 = number
        .parse()
        .map_err(|_| invalid(format!("`{text}`: {HINT}")))?;
    let millis = value
        .checked_mul(scale)
        .ok_or_else(|| invalid(format!("`{text}` is too large")))?;
    if millis == 0 {
        return Err(invalid(format!("`{text}`: must be greater than zero")));
    }
    Ok(Duration::from_millis(millis))
}
