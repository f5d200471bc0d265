//! In-process rendezvous: the ranks of one collective call, each on its own host thread (XLA runs
//! each local device's program on its own thread), meet, exchange a value, and pass barriers.
//! See docs/design.md "Rendezvous". API fixed here; the implementation is the FFI work's.

use crate::engine::Barrier;
use crate::error::{Result, TideError};
use std::sync::Arc;
use std::time::Duration;

/// Identifies one execution of one call site by one group of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub site: i64,
    pub group: usize,
    pub seq: u64,
}

/// The n-th execution (from 0) of `site` by `rank` of `group`: every rank counts its own, so the
/// counts agree across ranks of an SPMD program.
pub fn next_seq(_site: i64, _group: usize, _rank: usize) -> u64 {
    todo!("rendezvous::next_seq")
}

/// One meeting of `world` ranks. Values are indexed by rank.
pub struct Session<T> {
    _values: Vec<T>,
}

impl<T: Clone + Send + Sync + 'static> Session<T> {
    /// Publishes `value` for `rank` and waits (at most `timeout`) until all `world` ranks have.
    /// `what` names the call in errors ("tide all_gather site 3").
    pub fn join(
        _what: &str,
        _key: Key,
        _rank: usize,
        _world: usize,
        _value: T,
        _timeout: Duration,
    ) -> Result<Arc<Session<T>>> {
        Err(TideError::Internal("rendezvous not implemented yet".into()))
    }
    /// Everyone's values, indexed by rank.
    pub fn values(&self) -> &[T] {
        &self._values
    }
    /// Barrier `label` over all ranks; fails if a peer failed or did not arrive within the timeout.
    pub fn barrier(&self, _rank: usize, _label: &str) -> Result<()> {
        todo!("rendezvous barrier")
    }
    /// Marks this session failed by `rank` with `err`, so peers waiting in it fail fast with it.
    pub fn fail(&self, _rank: usize, _err: &TideError) {
        todo!("rendezvous fail")
    }
}

impl<T: Clone + Send + Sync + 'static> Barrier for Session<T> {
    fn wait(&self, rank: usize, phase: usize) -> Result<()> {
        self.barrier(rank, &format!("phase {phase}"))
    }
}
