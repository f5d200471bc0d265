//! The NCCL rail of the multi-process path (`multiproc` module header, "The rail"): which of a
//! plan's copies cross nodes and how this rank takes part in them (`rail_ops`), the plan rules the
//! rail relies on (`check_plan`, once per plan), the rail's communicator (`connect`, in the first
//! call that needs it), one phase's transfers as one NCCL group (`transfer`), and the liveness
//! check NCCL's polls run (`rail_alive`).

use super::{dbg_mp, RankState};
use crate::call::CallInfo;
use crate::config::Config;
use crate::cuda::driver::CUstream;
use crate::cuda::issue::address;
use crate::cuda::meeting::RankInfo;
use crate::cuda::nccl;
use crate::error::{Result, TideError};
use crate::plan::{Action, BufKind, Plan, Region};
use std::time::Duration;

/// A cross-node copy of one phase that involves this rank.
#[derive(Debug, Clone, Copy)]
pub(super) struct RailOp {
    send: bool,
    /// This rank's region (source of a send, destination of a recv).
    mine: Region,
    bytes: usize,
    /// The other end's node (its rail rank).
    peer_node: usize,
    step: usize,
}

/// The rail operations of each phase for `rank`, in plan order.
pub(super) fn rail_ops(plan: &Plan, rank: usize, g: usize) -> Vec<Vec<RailOp>> {
    plan.phases
        .iter()
        .map(|ph| {
            ph.steps
                .iter()
                .enumerate()
                .filter_map(|(k, s)| match &s.action {
                    Action::Copy { src, dst, bytes }
                        if *bytes > 0 && src.rank / g != dst.rank / g =>
                    {
                        if dst.rank == rank {
                            Some(RailOp {
                                send: false,
                                mine: *dst,
                                bytes: *bytes,
                                peer_node: src.rank / g,
                                step: k,
                            })
                        } else if src.rank == rank {
                            Some(RailOp {
                                send: true,
                                mine: *src,
                                bytes: *bytes,
                                peer_node: dst.rank / g,
                                step: k,
                            })
                        } else {
                            None
                        }
                    }
                    _ => None,
                })
                .collect()
        })
        .collect()
}


/// A region and its length in bytes.
type Span = (Region, usize);

fn overlaps(a: &Region, alen: usize, b: &Region, blen: usize) -> bool {
    a.rank == b.rank
        && a.kind == b.kind
        && a.index == b.index
        && a.offset < b.offset + blen
        && b.offset < a.offset + alen
}

/// Plan rules this path relies on: pull-only (no step reads another rank's `Output`), and no step
/// of a phase touches a rail transfer's regions in a way that would need it ordered before the
/// transfer (the rail is issued at phase start).
pub(super) fn check_plan(plan: &Plan, g: usize) -> Result<()> {
    for (p, ph) in plan.phases.iter().enumerate() {
        let rails: Vec<(usize, Region, Region, usize)> = ph
            .steps
            .iter()
            .enumerate()
            .filter_map(|(k, s)| match &s.action {
                Action::Copy { src, dst, bytes } if *bytes > 0 && src.rank / g != dst.rank / g => {
                    Some((k, *src, *dst, *bytes))
                }
                _ => None,
            })
            .collect();
        for (k, s) in ph.steps.iter().enumerate() {
            let (reads, writes): (Vec<Span>, Vec<Span>) = match &s.action {
                Action::Copy { src, dst, bytes } => (vec![(*src, *bytes)], vec![(*dst, *bytes)]),
                Action::Zero { dst, bytes } => (vec![], vec![(*dst, *bytes)]),
                Action::CopyBlocks { .. } => (s.action.reads(), s.action.writes()),
                Action::Reduce { dst, srcs, elems } => (
                    srcs.iter()
                        .map(|o| (o.region, elems * o.dtype.size_bytes()))
                        .collect(),
                    vec![(*dst, elems * 4)],
                ),
            };
            for (r, _) in &reads {
                if r.kind == BufKind::Output && r.rank != s.executor {
                    return Err(TideError::Internal(format!(
                        "phase {p} step {k} reads rank {}'s Output; the cross-process engine shares only Inputs and stage slots",
                        r.rank
                    )));
                }
            }
            for &(rk, src, dst, bytes) in &rails {
                if rk == k {
                    continue;
                }
                let before = k < rk;
                let clash = writes
                    .iter()
                    .any(|(w, n)| overlaps(w, *n, &src, bytes) || overlaps(w, *n, &dst, bytes))
                    || (before && reads.iter().any(|(r, n)| overlaps(r, *n, &dst, bytes)));
                if clash {
                    return Err(TideError::Internal(format!(
                        "phase {p}: step {k} touches the regions of rail transfer step {rk} (rank {} -> rank {}); \
                         the cross-process engine issues the rail at phase start",
                        src.rank, dst.rank
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Between NCCL polls: fails when a member of this rank's rail (same local index, other nodes)
/// has died or this rank's group has failed. Peers are processes of this host (the control plane
/// is host-local); a pid of another pid namespace is left to the timeout.
pub(super) fn rail_alive<'a>(rs: &'a RankState, me: usize, g: usize) -> impl FnMut() -> Result<()> + 'a {
    // Only pids of this control plane mean something here (ranks of other nodes under a per-node
    // control plane may live on other hosts): NCCL's errors and the timeout cover those.
    let peers: Vec<(usize, u64)> = rs
        .group
        .members()
        .iter()
        .copied()
        .filter(|&q| q != me && q % g == me % g)
        .map(|q| (q, rs.group.pid_of(q)))
        .collect();
    move || {
        if let Some(why) = rs.group.failure() {
            return Err(TideError::Rendezvous(why));
        }
        for &(q, pid) in &peers {
            if let Some(how) = process_gone(pid) {
                return Err(rs.group.fail_with(format!(
                    "rank {q} (pid {pid}) died ({how}) while rank {me} waited for it on the NCCL rail"
                )));
            }
        }
        Ok(())
    }
}

/// `Some(how)` when process `pid` of this host no longer runs.
pub(super) fn process_gone(pid: u64) -> Option<&'static str> {
    if pid == 0 {
        return None;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(text) => {
            let state = text
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next())
                .unwrap_or("");
            if state == "Z" || state == "X" {
                Some("exited")
            } else {
                None
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("no longer exists"),
        Err(_) => None,
    }
}


/// The rail's communicator for `call` (one per (job, group, rail = local index), NCCL rank = node
/// index), created collectively by the rail's members: the `ncclUniqueId` registered beforehand
/// (`nccl::set_unique_id`), else the one the rail's node-0 rank published (`own_id` if that is
/// this rank).
pub(super) fn connect(
    rs: &RankState,
    call: &CallInfo,
    job: u64,
    cfg: &Config,
    own_id: Option<nccl::UniqueId>,
    peer_ids: &[Option<nccl::UniqueId>],
    what: &str,
) -> Result<nccl::Comm> {
    let me = call.rank;
    let g = call.topology.gpus_per_node.max(1);
    let (nodes, my_node, rail) = (call.topology.nodes, me / g, me % g);
    let members = rs.group.members();
    let id = match nccl::registered_unique_id(job, call.group, rail) {
        Some(id) => id,
        None => peer_ids
            .get(rail)
            .copied()
            .flatten()
            .or(if my_node == 0 { own_id } else { None })
            .ok_or_else(|| {
                TideError::Internal(format!(
                    "{what}: no ncclUniqueId for rail {rail}: rank {rail} (node 0 of the rail) published \
                     none{}",
                    if members.contains(&rail) {
                        ""
                    } else {
                        " it could share with this node; with a per-node control plane tide_jax \
                         registers each rail's id from the key-value store before the first call"
                    }
                ))
            })?,
    };
    let mut alive = rail_alive(rs, me, g);
    nccl::Comm::init(
        &id,
        nodes,
        my_node,
        format!("tide rail {rail} of group {} (job {job:016x})", call.group),
        Duration::from_secs_f64(cfg.timeout_s.clamp(0.001, 1e9)),
        &mut alive,
    )
}

/// Phase `p`'s rail transfers on the rail stream `stream`, in one NCCL group: an `ncclRecv` for
/// every cross-node copy this rank executes, an `ncclSend` for every one that reads its memory,
/// in plan order. The caller ordered the stream after what precedes the phase.
#[allow(clippy::too_many_arguments)]
pub(super) fn transfer(
    rs: &RankState,
    comm: &nccl::Comm,
    ops: &[RailOp],
    infos: &[RankInfo],
    stream: CUstream,
    p: usize,
    what: &str,
    g: usize,
) -> Result<()> {
    let me = rs.rank;
    dbg_mp(|| format!("rank {me} phase {p}: rail group of {} ops", ops.len()));
    comm.group_start()?;
    for op in ops {
        let addr = address(infos, &op.mine, op.bytes)?;
        let label = || format!("{what}: phase {p} step {}", op.step);
        if op.send {
            comm.send(addr, op.bytes, op.peer_node, stream as usize, label)?;
        } else {
            comm.recv(addr, op.bytes, op.peer_node, stream as usize, label)?;
        }
    }
    let mut alive = rail_alive(rs, me, g);
    comm.group_end(|| format!("{what}: phase {p}, {} transfers", ops.len()), &mut alive)?;
    dbg_mp(|| format!("rank {me} phase {p}: rail group issued"));
    Ok(())
}
