//! Exit codes: what each one means, and which error gives which.
//!
//! `run` and `lead` pass their command's exit code through, so their own codes keep clear of
//! what programs commonly return: the `sysexits.h` values where one fits (as `flock -E 75`
//! does for a busy lock), 111 for a lost lease, and the shell's 126, 127 and 128 + N.

use distlock::LockError;

/// Not held, no leader, nothing removed (`show`, `release`, `leader`).
pub(crate) const NONE: u8 = 1;
/// Bad usage: an unknown option, a missing argument.
pub(crate) const USAGE: u8 = 2;
/// Redis could not be reached, or answered with an error (`EX_UNAVAILABLE`).
pub(crate) const UNREACHABLE: u8 = 69;
/// Something that should not happen: the manager stopped under us (`EX_SOFTWARE`).
pub(crate) const SOFTWARE: u8 = 70;
/// The lock is held by someone else: `run` skipped or gave up (`EX_TEMPFAIL`).
pub(crate) const BUSY: u8 = 75;
/// The environment or an option was refused: a bad URL, key, ttl, or kind of lock for this
/// deployment (`EX_CONFIG`).
pub(crate) const CONFIG: u8 = 78;
/// The lease (or leadership) was lost, or could not be renewed in time, while the command
/// ran: it was stopped before the lease could end.
pub(crate) const LOST: u8 = 111;
/// The command was found but could not be started.
pub(crate) const CANNOT_RUN: u8 = 126;
/// The command was not found.
pub(crate) const NOT_FOUND: u8 = 127;

/// The table `--help` shows.
pub(crate) const TABLE: &str = "\
Exit codes:
  0        done (list, show, release, watch, leader)
  1        show: not held; release: nothing removed; leader: nobody leads
  2        bad usage
  69       could not reach Redis (or it answered with an error)
  70       internal error
  75       busy: run skipped the command or gave up waiting (the holder is named on stderr)
  78       bad configuration: environment, URL, key or option refused
  111      the lease or leadership was lost (or not renewed in time) while the command ran;
           it was stopped
  126      the command could not be started
  127      the command was not found
  128+N    run/lead got signal N before the command started
  other    run/lead: the command's own exit code (128+N when it died of signal N)";

/// The code for an error of the library.
pub(crate) fn of(error: &LockError) -> u8 {
    match error {
        LockError::Busy { .. } => BUSY,
        LockError::Lost { .. } => LOST,
        LockError::Redis { .. } | LockError::NotReplicated { .. } => UNREACHABLE,
        // `build` reports a server it cannot connect to as a configuration error (the URL may
        // be wrong), with this message; for the shell it is Redis out of reach.
        LockError::Config(message) if message.starts_with("cannot connect to ") => UNREACHABLE,
        LockError::Config(_)
        | LockError::InvalidInput { .. }
        | LockError::PermitsMismatch { .. } => CONFIG,
        _ => SOFTWARE,
    }
}
