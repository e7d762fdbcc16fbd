//! Durations written as string literals: `"250ms"`, `"10s"`, `"5m"`, `"1h"`.

use syn::LitStr;

const HINT: &str =
    "expected a duration such as `\"10s\"` or `\"250ms\"` (units: `ms`, `s`, `m`, `h`)";

/// A duration argument: the literal (for spans) and its value in milliseconds.
#[derive(Clone)]
pub(crate) struct DurationArg {
    pub(crate) lit: LitStr,
    pub(crate) millis: u64,
}

/// Parses `lit` as a positive duration with a unit.
pub(crate) fn parse(name: &str, lit: LitStr) -> syn::Result<DurationArg> {
    let text = lit.value();
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
            let message =
                format!("`{name}` needs a unit: write `\"{number}s\"` or `\"{number}ms\"`");
            return Err(syn::Error::new(lit.span(), message));
        }
        other => {
            let message = if number.is_empty() {
                format!("invalid `{name}` {text:?}: {HINT}")
            } else {
                format!("unknown unit `{other}` in `{name}`: {HINT}")
            };
            return Err(syn::Error::new(lit.span(), message));
        }
    };
    let value: u64 = number
        .parse()
        .map_err(|_| syn::Error::new(lit.span(), format!("invalid `{name}` {text:?}: {HINT}")))?;
    let millis = value
        .checked_mul(scale)
        .ok_or_else(|| syn::Error::new(lit.span(), format!("`{name}` is too large")))?;
    if millis == 0 {
        let message = format!("`{name}` must be greater than zero");
        return Err(syn::Error::new(lit.span(), message));
    }
    Ok(DurationArg { lit, millis })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn millis(text: &str) -> syn::Result<u64> {
        parse("ttl", LitStr::new(text, proc_macro2::Span::call_site())).map(|d| d.millis)
    }

    #[test]
    fn units() {
        assert_eq!(millis("250ms").unwrap(), 250);
        assert_eq!(millis("10s").unwrap(), 10_000);
        assert_eq!(millis("5m").unwrap(), 300_000);
        assert_eq!(millis("1h").unwrap(), 3_600_000);
        assert_eq!(millis(" 3 s ").unwrap(), 3_000);
    }

    #[test]
    fn mistakes_say_how_to_fix_them() {
        assert!(millis("10").unwrap_err().to_string().contains("`\"10s\"`"));
        assert!(
            millis("10 sec")
                .unwrap_err()
                .to_string()
                .contains("unknown unit `sec`")
        );
        assert!(
            millis("0s")
                .unwrap_err()
                .to_string()
                .contains("greater than zero")
        );
        assert!(millis("s").is_err());
        assert!(millis("").is_err());
        assert!(millis("1.5s").is_err());
        assert!(millis("99999999999999999999h").is_err());
        assert!(
            millis("9999999999999999h")
                .unwrap_err()
                .to_string()
                .contains("too large")
        );
    }
}
