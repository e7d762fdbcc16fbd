//! Which kind of lock a request asks for: the vocabulary the request, the engine and the
//! metrics share.

use crate::held::HoldKind;

/// Which kind of lock a request asks for. A granted request holds it as a [`HoldKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestKind {
    /// An exclusive lock.
    Exclusive,
    /// The read side of a read-write lock.
    Read,
    /// The write side of a read-write lock.
    Write,
    /// One permit of a semaphore of this many.
    Permits(u32),
}

impl RequestKind {
    /// How a grant of this request is held: the write side of a read-write lock as an
    /// exclusive lock, one permit of any semaphore as a permit.
    pub(crate) fn hold_kind(self) -> HoldKind {
        match self {
            Self::Exclusive | Self::Write => HoldKind::Exclusive,
            Self::Read => HoldKind::Read,
            Self::Permits(_) => HoldKind::Permit,
        }
    }
}
