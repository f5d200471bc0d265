//! One rank's share of a world-P call on one GPU, its peers emulated by buffers of the same device
//! (benchmarks and tests: issue #22 measures what tide's reduce-scatter and all-gather issue at
//! P = 2..8 beside a GEMM, with one GPU).
//!
//! `execute_emulated(call, peers)` runs rank `call.rank` of a world-`call.world` call exactly as
//! the in-process path does (`inprocess::on_slot`: an in-flight slot, rule A1, the plan and this
//! rank's schedule, `issue::run_phases`, `released`, then XLA's stream `call.stream` waits on it),
//! except that the ranks do not meet: `Emulated` hands the issuer every peer's buffers as given,
//! its barriers return at once, and no peer is *reached* (its events are never waited on, as a
//! multi-process rank never waits on ranks of other nodes). So this rank's copies read the
//! peers' inputs and its reductions sum them, on this rank's streams, in the plan's order: the
//! same commands, launches and bytes as at world P; only the peers' own work is absent.
//!
//! Contract: every peer buffer is device memory of `call`'s device that stays valid, and is not
//! written by anything else, until the call's work is complete (ordered before `call.stream`'s
//! later work, like the call's own buffers). Peers' outputs and stage slots default to this rank's
//! (a pulling plan never touches them).

use super::device::SlotLease;
use super::driver::CUstream;
use super::inprocess;
use super::meeting::{Meeting, RankInfo};
use crate::call::CallInfo;
use crate::error::{Result, TideError};

/// The buffers of one emulated peer, as (device address, bytes), in the call's parameter order.
#[derive(Debug, Clone, Default)]
pub struct EmulatedPeer {
    pub inputs: Vec<(u64, usize)>,
    /// Empty: this rank's outputs (never touched by a pulling plan).
    pub outputs: Vec<(u64, usize)>,
}

/// A meeting of one real rank and emulated peers (module header).
struct Emulated {
    infos: Vec<RankInfo>,
    rank: usize,
}

impl Meeting for Emulated {
    fn infos(&self) -> &[RankInfo] {
        &self.infos
    }
    fn barrier(&self, _label: &str) -> Result<()> {
        Ok(())
    }
    fn fail(&self, _err: &TideError) {}
    fn leave(&self) -> Result<()> {
        Ok(())
    }
    fn reaches(&self, q: usize) -> bool {
        q == self.rank
    }
}

/// Runs rank `call.rank` of `call` with `peers` (one per other rank, in rank order) emulating the
/// other ranks (module header); XLA's stream `call.stream` then waits for the work. Never
/// synchronizes the host with the device.
pub fn execute_emulated(call: &CallInfo, peers: &[EmulatedPeer]) -> Result<()> {
    if call.job != 0 || peers.len() + 1 != call.world || call.rank >= call.world {
        return Err(TideError::InvalidArgument(format!(
            "emulated call: rank {} of world {} (job {}) needs {} emulated peers, got {}",
            call.rank,
            call.world,
            call.job,
            call.world.saturating_sub(1),
            peers.len()
        )));
    }
    let lease: SlotLease = inprocess::on_slot(call, &|_| {}, |local, _cfg| {
        let mut infos = Vec::with_capacity(call.world);
        let mut given = peers.iter();
        for q in 0..call.world {
            if q == call.rank {
                infos.push(local.info.clone());
                continue;
            }
            let p = given.next().ok_or_else(|| TideError::Internal("emulated peers ran out".into()))?;
            if p.inputs.len() != local.info.inputs.len() {
                return Err(TideError::InvalidArgument(format!(
                    "emulated peer {q}: {} inputs, the call has {}",
                    p.inputs.len(),
                    local.info.inputs.len()
                )));
            }
            for (i, (&(_, want), &(ptr, got))) in local.info.inputs.iter().zip(&p.inputs).enumerate() {
                if got < want || ptr == 0 {
                    return Err(TideError::InvalidArgument(format!(
                        "emulated peer {q}: input {i} is {got} bytes at {ptr:#x}, the plan reads {want}"
                    )));
                }
            }
            infos.push(RankInfo {
                inputs: p.inputs.clone(),
                outputs: if p.outputs.is_empty() { local.info.outputs.clone() } else { p.outputs.clone() },
                ..local.info.clone()
            });
        }
        Ok(Emulated { infos, rank: call.rank })
    })?;
    if call.stream == 0 {
        return Err(TideError::Internal("emulated call without a stream".into()));
    }
    // SAFETY: the caller's stream of the call's device.
    unsafe { lease.join_into(call.stream as CUstream) }
}
