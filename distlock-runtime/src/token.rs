//! Owner tokens: one per acquisition from the server, unique anywhere; the holds nested in
//! it and the local passes of a cohort's run carry the same token.

use std::sync::atomic::{AtomicU64, Ordering};

/// A new owner token: 128 bits in hex, the manager's id (64 bits drawn at random when it was
/// built, which also names its registration: see `identity`) and 64 counting the tokens this
/// process made, so that no two owners anywhere share one. Drawn without a system call per
/// lock.
pub(crate) fn new_token(manager_id: &str) -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut token = Vec::with_capacity(32);
    token.extend_from_slice(manager_id.as_bytes());
    token.extend_from_slice(&hex(COUNT.fetch_add(1, Ordering::Relaxed)));
    String::from_utf8(token).expect("hex digits are ASCII")
}

/// `n` as 16 hex digits, most significant first (as `{:016x}` would write them).
fn hex(n: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    for (at, digit) in digits.iter_mut().enumerate() {
        *digit = HEX[(n >> (4 * (15 - at))) as usize & 0xf];
    }
    digits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_32_hex_digits_and_never_repeat() {
        let (a, b) = (new_token("0123456789abcdef"), new_token("0123456789abcdef"));
        for token in [&a, &b] {
            assert_eq!(token.len(), 32, "{token}");
            assert!(
                token
                    .bytes()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
        }
        // One process part, then a count that moved on.
        assert_eq!(a[..16], b[..16]);
        let count = |t: &str| u64::from_str_radix(&t[16..], 16).unwrap();
        assert!(count(&b) > count(&a));
        assert_eq!(
            a[..16],
            format!("{:016x}", u64::from_str_radix(&a[..16], 16).unwrap())
        );
    }
}
