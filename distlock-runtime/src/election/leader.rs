//! Who leads an election ([`LeaderInfo`]), and a change of leader ([`LeaderChange`]).

use std::fmt;
use std::time::SystemTime;

use crate::holder::HolderIdentity;

/// Who leads an election, from [`Election::leader`](super::Election::leader) and [`Observer`](super::Observer).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaderInfo {
    /// The leader's term (see [`Leadership::term`](super::Leadership::term)).
    pub term: u64,
    /// The leader's owner token.
    pub token: String,
    /// Who the leader is, when its manager's registration is there to read.
    pub identity: Option<HolderIdentity>,
    /// When it became leader (its own wall clock), when it said so.
    pub since: Option<SystemTime>,
}

impl fmt::Display for LeaderInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.identity {
            Some(identity) => write!(f, "term {}: {identity}", self.term),
            None => write!(f, "term {}: {} (unknown or gone)", self.term, self.token),
        }
    }
}

/// A change of an election's leader, from [`Observer::next`](super::Observer::next).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaderChange {
    /// This process leads now (the first event when one leads as observing starts).
    Leader(LeaderInfo),
    /// Nobody leads: the leader resigned (or nobody led as observing started).
    NoLeader,
}
