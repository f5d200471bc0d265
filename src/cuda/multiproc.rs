//! The CUDA engine across processes (one process per GPU, or several GPUs per process), all on one
//! host today (the control plane is `transport::group`'s shared memory); cross-node plans run their
//! rail over NCCL. Selected by the FFI attribute `job` != 0 (`cuda::execute_job`).
//!
//! One driver with the in-process engine: this module prepares a call, exchanges it through the
//! mailboxes and builds a `Mailbox` (the `meeting::Meeting` of this path); `cuda::run_phases` issues
//! it and `meeting::end_call` ends it, as for in-process calls. Same ordering protocol as the
//! in-process engine (`cuda` module header, rules 1-5), with three substitutions:
//! - **Meeting**: instead of `rendezvous::Session`, the ranks of a group meet in a
//!   `transport::ProcessGroup` keyed by (job, group): an entry barrier, one barrier per phase
//!   boundary, an exit barrier; each bounded by `TIDE_TIMEOUT_S`, with failure propagation and
//!   dead-peer detection (a peer process that died is reported as "rank q (pid N) died").
//!   Calls are matched by their order in the group; the announcement carries the call count, op and
//!   a fingerprint of the plan, and a rank in another call is an error.
//! - **What is published**: each rank writes, before the entry barrier, a *mailbox* (its own
//!   shared-memory segment `/tide-{job}-g{group}-r{rank}-cu`, unlinked once every peer mapped it):
//!   the allocations holding its `Input`s and stage slots (`ipc::AllocDesc`), each buffer as
//!   (allocation, offset, bytes), and the `cuIpcGetEventHandle` handles of its `ready`, `done` and
//!   phase events (interprocess events of this module, one set per rank; recorded next to the
//!   device's own events). Peers on its node map the allocations once (`ipc::Importer`) and open
//!   the events once. Outputs are never published: plans pull, no step reads a peer's `Output`
//!   (checked once per plan).
//! - **The rail** (plans with several nodes): a `Copy` whose source and destination ranks are on
//!   different nodes is not a copy-engine copy. At the start of each phase, the rank issues on its
//!   rail stream, in one `ncclGroupStart/End`, an `ncclRecv` for every such copy it executes and an
//!   `ncclSend` for every such copy that reads its memory, in plan order; the rail stream first
//!   waits on what precedes the phase (phase 0: its `ready` and its previous `done`; later: its own
//!   and its node peers' phase events), then records a rail event. The stream the schedule put the
//!   copy on waits on that event in its place, so everything the schedule ordered after the copy
//!   (local events, the phase join into MAIN) is ordered after the transfer. MAIN waits on the rail
//!   stream before `done`. Events of ranks on other nodes are never waited on: NCCL's send/recv
//!   matching orders the transfer on both ends; inside a node the phase barriers and events do.
//!   Refused (clear error): a plan where a rail transfer's regions are touched by another step of
//!   the same phase before it (the rail is issued at phase start). These are `Mailbox`'s hooks
//!   (`phase_start`, `rail_event`, `reaches`, `phases_ended`), in this order.
//!
//! Settings: TIDE_COPY_BATCH applies here as in-process (copy-engine copies of one stream as one
//! cuMemcpyBatchAsync; its location hints, ignored for non-managed memory, name this rank's device,
//! never a peer process's ordinal, which means nothing here; cross-node copies never join a batch:
//! the rail takes their place). TIDE_FUSE_BYTES does not (no batched launches: the kernel module is loaded only for
//! plans that need kernels, and the fused kernels have not been run on imported peer memory), nor
//! does TIDE_MULTICAST (single-process only).
//!
//! Peers in this same process (a job with several GPUs per process): CUDA refuses to open a
//! process's own IPC handles, and waiting on another context's interprocess event by its raw
//! handle crashed the driver on the GPU machine, so such a peer publishes (and is used through)
//! its raw addresses and its device's own events; this rank gets peer access to its device and
//! `cuMemSetAccess` on its VMM allocations (peer access does not cover VMM memory).
//!
//! Failure: any error is published to the group (peers fail fast with the root cause, a dead peer
//! is named with its pid), the rail communicator is aborted (transfers a dead peer will never
//! match end, the stream drains), and every later call of the job fails at once.
//!
//! NCCL communicators: one per (job, group, rail = local index), created in the first call that
//! needs it; the `ncclUniqueId` is made by the rail's node-0 rank and published in its mailbox (or
//! registered beforehand by the Python bootstrap: `nccl::set_unique_id`).
//!
//! Limits: every rank of a group must be on this host (the control plane and the IPC mappings are
//! host-local), so "several nodes" means a forced topology (`TIDE_TOPOLOGY=2x1`) today; a real
//! multi-host run needs a node-local control group plus the rail, which this layout keeps apart.

use super::device::{self, DeviceState};
use super::driver::{self, check, CUevent, CUstream};
use super::ipc::{self, AllocDesc, FdChannel};
use super::nccl;
use super::schedule::Cmd;
use super::meeting::Meeting;
use super::{buffer_lists, multicast_grant, op_name, prepared_plan, Local, RankInfo, Res};
use crate::call::CallInfo;
use crate::config::Config;
use crate::error::{Result, TideError};
use crate::plan::{Action, BufKind, Op, Plan, Region};
use crate::transport::group::Announcement;
use crate::transport::shm::{segment_name, unlink_name, Created, Segment};
use crate::transport::{ProcessGroup, Timing};
use cudarc::driver::sys;
use once_cell::sync::Lazy;
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MAILBOX_BYTES: usize = 8 << 20;
const MAILBOX_MAGIC: u64 = 0x7469_6465_6375_6d62; // "tidecumb"

/// One rank's state in one (job, group), kept across calls.
struct RankState {
    group: ProcessGroup,
    rank: usize,
    world: usize,
    seq: u64,
    mailbox: Segment,
    peer_boxes: Vec<Option<Segment>>,
    chan: FdChannel,
    exporter: ipc::Exporter,
    dev: Option<DevPart>,
    /// Plans already checked (pull-only, rail issuable at phase start), by their Arc address.
    checked: HashSet<usize>,
}

/// The parts that live in the rank's device context.
struct DevPart {
    ordinal: i64,
    importer: ipc::Importer,
    ready: CUevent,
    done: CUevent,
    phases: Vec<CUevent>,
    rail_stream: CUstream,
    rail_events: Vec<CUevent>,
    rail: Option<nccl::Comm>,
}

// SAFETY: raw CUDA handles, used under the state's lock.
unsafe impl Send for RankState {}

type Key = (u64, usize, usize);
static STATES: Lazy<Mutex<HashMap<Key, Arc<Mutex<RankState>>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// Jobs whose control plane is per node (`tide_cuda_node_local`): set by `tide_jax` when the
/// processes span hosts (or `TIDE_NODE_LOCAL=1`), together with every rail's `ncclUniqueId`.
static NODE_LOCAL: Lazy<Mutex<HashSet<u64>>> = Lazy::new(|| Mutex::new(HashSet::new()));

/// Makes `job`'s control plane per node: barriers, announcements, mailboxes and events of the
/// ranks of one node only, nothing read from another node's memory; the rail's `ncclUniqueId` must
/// then be registered (`nccl::set_unique_id`) before the first call. Without it the control plane
/// spans every rank of the group, which only works on one host.
pub fn set_node_local(job: u64) {
    NODE_LOCAL
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(job);
}

/// The ranks of `rank`'s control plane: its node's (`set_node_local` jobs), else every rank.
pub fn control_members(
    job: u64,
    rank: usize,
    world: usize,
    topology: crate::topology::Topology,
) -> Vec<usize> {
    let node_local = NODE_LOCAL
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&job);
    if node_local {
        topology.node_ranks(rank).filter(|&q| q < world).collect()
    } else {
        (0..world).collect()
    }
}

/// C entry for `tide_jax`: `set_node_local(job)`.
#[no_mangle]
pub extern "C" fn tide_cuda_node_local(job: u64) {
    set_node_local(job);
}

fn state_for(
    job: u64,
    group: usize,
    rank: usize,
    world: usize,
    members: Vec<usize>,
) -> Result<Arc<Mutex<RankState>>> {
    let key = (job, group, rank);
    if let Some(s) = STATES.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(s.clone());
    }
    // Mailbox and fd socket first: a peer that sees our control block can rely on both.
    let name = segment_name(job, group, rank, "cu");
    let mailbox = match Segment::create(&name, MAILBOX_BYTES)? {
        Created::New(s) => s,
        Created::Exists => {
            // A crashed run's leftover (the control block below proves we own the rank).
            unlink_name(&name);
            match Segment::create(&name, MAILBOX_BYTES)? {
                Created::New(s) => s,
                Created::Exists => {
                    return Err(TideError::Rendezvous(format!(
                        "{name} keeps reappearing: two processes claim rank {rank}"
                    )))
                }
            }
        }
    };
    let chan = FdChannel::bind(&FdChannel::name_of(job, group, rank)).map_err(|e| {
        TideError::Rendezvous(format!(
            "rank {rank} of group {group} (job {job:016x}): {e}"
        ))
    })?;
    let mut pg =
        ProcessGroup::create_among(job, group, rank, world, members, Timing::from_config())?;
    let connected = pg.connect();
    let mut st = RankState {
        group: pg,
        rank,
        world,
        seq: 0,
        mailbox,
        peer_boxes: (0..world).map(|_| None).collect(),
        chan,
        exporter: ipc::Exporter::default(),
        dev: None,
        checked: HashSet::new(),
    };
    let result = connected.and_then(|()| {
        let members = st.group.members().to_vec();
        for q in members {
            if q == rank {
                continue;
            }
            let n = segment_name(job, group, q, "cu");
            match Segment::open(&n, MAILBOX_BYTES)? {
                Some(s) => st.peer_boxes[q] = Some(s),
                None => {
                    return Err(st.group.fail_with(format!(
                        "rank {rank}: rank {q}'s CUDA mailbox {n} is missing"
                    )))
                }
            }
        }
        st.group.barrier("CUDA mailboxes mapped")?;
        st.mailbox.unlink();
        Ok(())
    });
    let s = Arc::new(Mutex::new(st));
    // Keep the state even when connecting failed: its failure is sticky and visible to peers.
    STATES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_insert(s.clone());
    result.map(|()| s)
}

/// Runs one rank of a collective whose ranks live in several processes (`job` != 0, the same in
/// every process). Enqueues work on XLA's stream `call.stream`; never synchronizes the host with
/// the device.
pub fn execute(call: &CallInfo, job: u64) -> Result<()> {
    let what = format!(
        "tide {} call (site {}) on rank {} of group {}",
        op_name(call.op),
        call.site,
        call.rank,
        call.group
    );
    super::meeting::catch_panic(
        &|| format!("the multi-process CUDA engine ({what})"),
        || execute_inner(call, job, &what),
        |err| fail(call, job, err),
    )
}

/// Records `err` as this rank's failure in `job` so its peers fail fast with it (for an error the
/// caller hit before `execute`, e.g. a bad operand at the FFI edge). Without a connected state yet,
/// publishes the failure in a fresh control block that peers see when they connect (kept for the
/// life of the process: the group is unusable after a failure anyway).
pub fn fail(call: &CallInfo, job: u64, err: &TideError) {
    let msg = format!(
        "tide {} (site {}) on rank {}: {err}",
        op_name(call.op),
        call.site,
        call.rank
    );
    let s = STATES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(job, call.group, call.rank))
        .cloned();
    match s {
        Some(s) => {
            s.lock()
                .unwrap_or_else(|e| e.into_inner())
                .group
                .fail_with(msg);
        }
        None => {
            let members = control_members(job, call.rank, call.world, call.topology);
            if let Ok(pg) = ProcessGroup::create_among(
                job,
                call.group,
                call.rank,
                call.world,
                members,
                Timing::from_config(),
            ) {
                pg.fail_with(msg);
                Box::leak(Box::new(pg));
            }
        }
    }
}

fn execute_inner(call: &CallInfo, job: u64, what_base: &str) -> Result<()> {
    if job == 0 {
        return Err(TideError::Internal(format!(
            "{what_base}: multi-process CUDA path called with job 0"
        )));
    }
    if call.rank >= call.world {
        return crate::invalid!("{what_base}: rank outside world size {}", call.world);
    }
    let members = control_members(job, call.rank, call.world, call.topology);
    let state = state_for(job, call.group, call.rank, call.world, members)?;
    let mut guard = state.lock().unwrap_or_else(|e| e.into_inner());
    let rs = &mut *guard;
    if rs.world != call.world {
        return Err(rs.group.fail_with(format!(
            "{what_base}: world size {} but this group has {}",
            call.world, rs.world
        )));
    }
    if let Some(why) = rs.group.failure() {
        return Err(TideError::Rendezvous(format!(
            "{what_base}: an earlier tide call of this job failed, the group is unusable: {why}"
        )));
    }
    let seq = rs.seq;
    rs.seq += 1;
    let what = format!("{what_base}, call {seq}");
    let result = run_call(rs, call, job, seq, &what);
    if result.is_err() {
        // The group is unusable from now on; end rail transfers a dead or failed peer will never
        // match, so this rank's streams do not block forever.
        if let Some(comm) = rs.dev.as_mut().and_then(|d| d.rail.take()) {
            dbg_mp(|| {
                format!(
                    "rank {} aborting the rail after: {:?}",
                    call.rank,
                    result.as_ref().err()
                )
            });
            comm.abort();
            dbg_mp(|| format!("rank {} aborted the rail", call.rank));
        }
    }
    result.map_err(|e| match e {
        // Barrier errors are already published to the peers and carry the root cause.
        TideError::Rendezvous(m) if m.contains(&what) => TideError::Rendezvous(m),
        TideError::Rendezvous(m) => TideError::Rendezvous(format!("{what}: {m}")),
        other => {
            rs.group.fail_with(format!("{what}: {other}"));
            other
        }
    })
}

/// Everything a peer published for one call.
#[derive(Debug)]
struct Mail {
    device: i64,
    pid: u64,
    allocs: Vec<AllocDesc>,
    ready: [u8; 64],
    done: [u8; 64],
    phases: Vec<[u8; 64]>,
    /// The raw CUevent values of ready, done and the phases (for peers in the same process, which
    /// cannot open this process's IPC handles).
    raw_events: Vec<u64>,
    /// (allocation index, offset, bytes)
    inputs: Vec<(usize, u64, usize)>,
    stages: Vec<(usize, u64, usize)>,
    nccl_id: Option<nccl::UniqueId>,
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

impl Default for Mail {
    fn default() -> Mail {
        Mail {
            device: 0,
            pid: 0,
            allocs: Vec::new(),
            ready: [0; 64],
            done: [0; 64],
            phases: Vec::new(),
            raw_events: Vec::new(),
            inputs: Vec::new(),
            stages: Vec::new(),
            nccl_id: None,
        }
    }
}

impl Mail {
    fn encode(&self, seq: u64) -> Vec<u8> {
        let mut o = Vec::with_capacity(1024);
        for v in [
            0, // total length, patched below
            MAILBOX_MAGIC,
            seq,
            self.device as u64,
            self.pid,
            self.allocs.len() as u64,
            self.phases.len() as u64,
            self.inputs.len() as u64,
            self.stages.len() as u64,
            self.nccl_id.is_some() as u64,
        ] {
            put(&mut o, v);
        }
        for a in &self.allocs {
            a.encode(&mut o);
        }
        o.extend_from_slice(&self.ready);
        o.extend_from_slice(&self.done);
        for p in &self.phases {
            o.extend_from_slice(p);
        }
        for i in 0..2 + self.phases.len() {
            put(&mut o, self.raw_events.get(i).copied().unwrap_or(0));
        }
        for &(a, off, b) in self.inputs.iter().chain(&self.stages) {
            put(&mut o, a as u64);
            put(&mut o, off);
            put(&mut o, b as u64);
        }
        if let Some(id) = &self.nccl_id {
            o.extend_from_slice(id);
        }
        let n = o.len() as u64;
        o[..8].copy_from_slice(&n.to_le_bytes());
        o
    }

    fn decode(b: &[u8], seq: u64) -> std::result::Result<Mail, String> {
        let mut pos = 0usize;
        let mut take = |n: usize| -> std::result::Result<&[u8], String> {
            let s = b
                .get(pos..pos + n)
                .ok_or_else(|| format!("truncated at byte {pos}"))?;
            pos += n;
            Ok(s)
        };
        let mut u = || -> std::result::Result<u64, String> {
            Ok(u64::from_le_bytes(take(8)?.try_into().unwrap()))
        };
        let _len = u()?;
        if u()? != MAILBOX_MAGIC {
            return Err("bad magic".into());
        }
        let their_seq = u()?;
        if their_seq != seq {
            return Err(format!("it holds call {their_seq}, not {seq}"));
        }
        let device = u()? as i64;
        let pid = u()?;
        let (na, np, ni, ns, has_id) = (
            u()? as usize,
            u()? as usize,
            u()? as usize,
            u()? as usize,
            u()? != 0,
        );
        let mut m = Mail {
            device,
            pid,
            ..Default::default()
        };
        for _ in 0..na {
            m.allocs
                .push(AllocDesc::decode(take(AllocDesc::WIRE_BYTES)?).ok_or("bad allocation")?);
        }
        m.ready.copy_from_slice(take(64)?);
        m.done.copy_from_slice(take(64)?);
        for _ in 0..np {
            let mut h = [0u8; 64];
            h.copy_from_slice(take(64)?);
            m.phases.push(h);
        }
        for _ in 0..2 + np {
            let t = take(8)?;
            m.raw_events.push(u64::from_le_bytes(t.try_into().unwrap()));
        }
        for k in 0..ni + ns {
            let t = take(24)?;
            let g = |i: usize| u64::from_le_bytes(t[i * 8..i * 8 + 8].try_into().unwrap());
            let e = (g(0) as usize, g(1), g(2) as usize);
            if e.0 >= na {
                return Err(format!("buffer {k} names allocation {} of {na}", e.0));
            }
            if k < ni {
                m.inputs.push(e);
            } else {
                m.stages.push(e);
            }
        }
        if has_id {
            let mut id = [0u8; 128];
            id.copy_from_slice(take(128)?);
            m.nccl_id = Some(id);
        }
        Ok(m)
    }
}

/// The device-wide preparation of this path: `call.stream` is MAIN (XLA's stream, or a slot's
/// tide stream on a start: `cuda::start_multiprocess`); it waits on this rank's previous `done`
/// and records `ready` (the `cuda` header's rule 1).
fn prepare(call: &CallInfo, st: &mut DeviceState, cfg: &Config, multi_node: bool) -> Result<Local> {
    let ord = call.device_ordinal;
    let stream = call.stream as CUstream;
    let prepared = prepared_plan(call, st, cfg, multi_node)?;
    let plan = &prepared.plan;
    let sched = &prepared.schedule;
    st.ensure_side_streams(sched.side_streams)?;
    // One more than the schedule needs: the last is the error path's join event.
    st.ensure_events(sched.events + 1)?;
    st.ensure_phase_events(plan.phases.len().saturating_sub(1))?;
    let stages = st.ensure_stage(
        &plan.stage_slot_bytes,
        cfg.rs_stage_slots.saturating_mul(cfg.rs_slot_bytes),
    )?;
    if sched.needs_kernels {
        st.ensure_module()?;
    }
    let mc = multicast_grant(call, st, plan, cfg);
    if mc.is_some() {
        st.ensure_side_streams(1)?;
        st.ensure_phase_events(1)?;
    }
    let (inputs, outputs) = buffer_lists(call, plan)?;
    // SAFETY: XLA's stream and our events are valid; the context is current.
    check(
        unsafe { sys::cuStreamWaitEvent(stream, st.done, 0) },
        "cuStreamWaitEvent",
        || format!("device {ord}: XLA's stream on the previous call's done event"),
    )?;
    // SAFETY: as above.
    check(
        unsafe { sys::cuEventRecord(st.ready, stream) },
        "cuEventRecord",
        || format!("device {ord}: ready event"),
    )?;
    let info = RankInfo::published(ord, (inputs, outputs), stages, (st.ready, st.done, &st.phase), plan, mc.is_some());
    Ok(Local { prepared, info, mc })
}

/// A cross-node copy of one phase that involves this rank.
#[derive(Debug, Clone, Copy)]
struct RailOp {
    send: bool,
    /// This rank's region (source of a send, destination of a recv).
    mine: Region,
    bytes: usize,
    /// The other end's node (its rail rank).
    peer_node: usize,
    step: usize,
}

/// The rail operations of each phase for `rank`, in plan order.
fn rail_ops(plan: &Plan, rank: usize, g: usize) -> Vec<Vec<RailOp>> {
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

/// Debug trace to stderr under TIDE_DEBUG_MP=1 (`config`; the setting of the call now running).
fn dbg_mp(f: impl FnOnce() -> String) {
    if crate::config::current().debug_mp {
        eprintln!("tide-mp: {}", f());
    }
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
fn check_plan(plan: &Plan, g: usize) -> Result<()> {
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

fn run_call(rs: &mut RankState, call: &CallInfo, job: u64, seq: u64, what: &str) -> Result<()> {
    let ord = call.device_ordinal;
    let me = call.rank;
    driver::init()?;
    let dev = device::get(ord)?;
    let mut st = dev.lock().map_err(|_| {
        TideError::Internal(format!(
            "CUDA device {ord} state poisoned by an earlier panic"
        ))
    })?;
    let _ctx = driver::CtxGuard::set(st.ctx, ord)?;
    ensure_dev(rs, ord)?;
    let cfg = crate::config::current();
    let local = prepare(call, &mut st, &cfg, true)?;
    let prepared = local.prepared.clone();
    let plan = &prepared.plan;
    let g = call.topology.gpus_per_node.max(1);
    let nodes = call.topology.nodes;
    let my_node = me / g;
    let stream = call.stream as CUstream;
    let nphases = prepared.schedule.phases.len();
    let pkey = Arc::as_ptr(&prepared) as usize;
    if !rs.checked.contains(&pkey) {
        check_plan(plan, g)?;
        rs.checked.insert(pkey);
    }
    {
        let d = rs.dev.as_mut().expect("device part");
        while d.phases.len() + 1 < nphases.max(1) {
            let e = ipc::ipc_event(ord, "phase")?;
            d.phases.push(e);
        }
        while d.rail_events.len() < nphases {
            let mut e: CUevent = std::ptr::null_mut();
            // SAFETY: context current; valid out-pointer.
            check(
                unsafe {
                    sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
                },
                "cuEventCreate",
                || format!("device {ord}, rail event"),
            )?;
            d.rail_events.push(e);
        }
        // Rule 1 for peers in other processes: the interprocess twin of `ready`, right after it.
        // SAFETY: valid event and stream.
        check(
            unsafe { sys::cuEventRecord(d.ready, stream) },
            "cuEventRecord",
            || format!("rank {me} device {ord}: ready (interprocess)"),
        )?;
    }

    // The mailbox.
    let my_pid = std::process::id() as u64;
    let mut mail = Mail {
        device: ord,
        pid: my_pid,
        ..Default::default()
    };
    let mut alloc_index: HashMap<(u64, u64), usize> = HashMap::new();
    let mut describe = |rs: &mut RankState,
                        mail: &mut Mail,
                        ptr: u64,
                        bytes: usize,
                        label: String|
     -> Result<(usize, u64, usize)> {
        if bytes == 0 || ptr == 0 {
            return Ok((0, 0, 0));
        }
        let (a, off) = rs
            .exporter
            .describe(ptr, &|| format!("rank {me} device {ord}, {label}"))?;
        let idx = *alloc_index.entry((a.base, a.gen)).or_insert_with(|| {
            mail.allocs.push(a);
            mail.allocs.len() - 1
        });
        Ok((idx, off, bytes))
    };
    for (i, &(p, b)) in local.info.inputs.iter().enumerate() {
        let e = describe(rs, &mut mail, p, b, format!("operand {i}"))?;
        mail.inputs.push(e);
    }
    for (i, &(p, b)) in local.info.stages.iter().enumerate() {
        let e = describe(rs, &mut mail, p, b, format!("stage slot {i}"))?;
        mail.stages.push(e);
    }
    if mail.allocs.is_empty() {
        // Keep index 0 valid for empty buffers.
        mail.allocs.push(AllocDesc {
            base: 0,
            size: 0,
            gen: 0,
            kind: ipc::KIND_LEGACY,
            legacy: [0; 64],
        });
        for e in mail.inputs.iter_mut().chain(mail.stages.iter_mut()) {
            e.0 = 0;
        }
    }
    {
        let d = rs.dev.as_ref().expect("device part");
        let (ready, done, phases) = (d.ready, d.done, d.phases.clone());
        let who = |w: &'static str| move || format!("rank {me} device {ord}: {w} event");
        mail.ready = rs.exporter.event_handle(ready as usize, &who("ready"))?;
        mail.done = rs.exporter.event_handle(done as usize, &who("done"))?;
        // For peers in this process: the device's own (non-interprocess) events, recorded at the
        // same points. (Waiting on another context's interprocess event by its raw handle, without
        // cuIpcOpenEventHandle, crashed the driver on the GPU machine.)
        mail.raw_events = vec![st.ready as u64, st.done as u64];
        for (k, e) in phases.iter().take(nphases.saturating_sub(1)).enumerate() {
            mail.phases
                .push(rs.exporter.event_handle(*e as usize, &who("phase"))?);
            mail.raw_events.push(st.phase[k] as u64);
        }
    }
    let need_rail = nodes > 1 && rs.dev.as_ref().map(|d| d.rail.is_none()).unwrap_or(true);
    let rail = me % g;
    if need_rail && my_node == 0 && nccl::registered_unique_id(job, call.group, rail).is_none() {
        mail.nccl_id = Some(nccl::unique_id()?);
    }
    let bytes = mail.encode(seq);
    if bytes.len() > MAILBOX_BYTES {
        return crate::invalid!(
            "{what}: {} bytes to publish exceed the CUDA mailbox ({MAILBOX_BYTES} bytes)",
            bytes.len()
        );
    }
    // SAFETY: the mailbox is MAILBOX_BYTES long and only this rank writes it; peers read it after
    // the entry barrier (Release/Acquire) and are done before they pass our exit barrier.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), rs.mailbox.as_ptr(), bytes.len()) };
    // File descriptors of new VMM exports to the peers of this node (they map our memory).
    for q in
        (0..call.world).filter(|&q| q != me && q / g == my_node && rs.group.pid_of(q) != my_pid)
    {
        let addr = FdChannel::name_of(job, call.group, q);
        rs.exporter.send_new(&rs.chan, me, q, &addr, &mail.allocs)?;
    }
    let fp = crate::transport::cpu::fingerprint(plan);
    let op = match call.op {
        Op::AllGather => 0,
        Op::ReduceScatter => 1,
    };
    rs.group.announce(Announcement {
        seq,
        op,
        site: call.site,
        fingerprint: fp,
        data_class: 0,
    });
    rs.group.barrier(&format!("entry of {what}"))?;
    let members = rs.group.members().to_vec();
    for q in members.iter().copied().filter(|&q| q != me) {
        let a = rs.group.announcement(q);
        if a.seq != seq || a.op != op || a.fingerprint != fp {
            return Err(rs.group.fail_with(format!(
                "{what}: rank {q} (pid {}) is in a different call (its call {}, op {}, site {}, plan {:016x}; ours: call {seq}, \
                 op {op}, plan {fp:016x}): every process must issue the same tide calls in the same order",
                rs.group.pid_of(q),
                a.seq,
                a.op,
                a.site,
                a.fingerprint
            )));
        }
    }

    // Peers: read their mailboxes, map what this node reads, open their events.
    let wait_fd = Duration::from_secs_f64(cfg.timeout_s.clamp(0.001, 30.0));
    let mut infos: Vec<RankInfo> = Vec::with_capacity(call.world);
    let mut peer_ids: Vec<Option<nccl::UniqueId>> = vec![None; call.world];
    #[allow(clippy::needless_range_loop)] // q indexes infos, peer_ids and the mailboxes
    for q in 0..call.world {
        if q == me {
            // Own events: the device's (ready, done, phases), as the in-process engine uses them.
            infos.push(local.info.clone());
            continue;
        }
        if !members.contains(&q) {
            // Another node under a per-node control plane: reached only through the rail, never
            // addressed (its copies are NCCL transfers on this rank's own buffers).
            infos.push(RankInfo {
                device: -1,
                ..Default::default()
            });
            continue;
        }
        let pid = rs.group.pid_of(q);
        let seg = rs.peer_boxes[q]
            .as_ref()
            .ok_or_else(|| TideError::Internal(format!("rank {q}'s mailbox not mapped")))?;
        // SAFETY: a mapping of MAILBOX_BYTES; the peer wrote it before the entry barrier.
        let raw = unsafe { std::slice::from_raw_parts(seg.as_ptr(), MAILBOX_BYTES) };
        let len = (u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize).min(MAILBOX_BYTES);
        let m = Mail::decode(&raw[..len], seq).map_err(|e| {
            TideError::Rendezvous(format!(
                "{what}: rank {q}'s (pid {pid}) mailbox is unreadable: {e}"
            ))
        })?;
        peer_ids[q] = m.nccl_id;
        if q / g != my_node {
            infos.push(RankInfo {
                device: m.device,
                ..Default::default()
            });
            continue;
        }
        let n = plan.layout.len();
        if m.inputs.len() != n
            || m.stages.len() < plan.stage_slot_bytes.len()
            || m.phases.len() + 1 < nphases
        {
            return Err(rs.group.fail_with(format!(
                "{what}: rank {q} (pid {pid}) published {} operands, {} stage slots, {} phase events; this plan has {n}, {}, {} \
                 (TIDE_RS_* settings must match)",
                m.inputs.len(),
                m.stages.len(),
                m.phases.len(),
                plan.stage_slot_bytes.len(),
                nphases.saturating_sub(1)
            )));
        }
        // A peer in this process: its addresses and events are valid here as they are (and CUDA
        // refuses to open a process's own IPC handles); peer access as in the in-process engine.
        let same = m.pid == my_pid;
        if same {
            st.ensure_peer(m.device)?;
        }
        let d = rs.dev.as_mut().expect("device part");
        let mut bases = vec![None; m.allocs.len()];
        let mut addr = |idx: usize, off: u64, bytes: usize| -> Result<(u64, usize)> {
            if bytes == 0 {
                return Ok((0, 0));
            }
            let a = &m.allocs[idx];
            if off + bytes as u64 > a.size {
                return Err(TideError::Rendezvous(format!(
                    "{what}: rank {q} (pid {pid}) published a buffer at offset {off} + {bytes} bytes past its allocation of {} bytes",
                    a.size
                )));
            }
            let base = match bases[idx] {
                Some(b) => b,
                None if same => {
                    d.importer.grant_local(me, q, a)?;
                    bases[idx] = Some(a.base);
                    a.base
                }
                None => {
                    let b = d.importer.map(me, q, pid, a, &rs.chan, wait_fd)?;
                    bases[idx] = Some(b);
                    b
                }
            };
            Ok((base + off, bytes))
        };
        let mut info = RankInfo {
            device: m.device,
            ..Default::default()
        };
        for (i, &(a, off, b)) in m.inputs.iter().enumerate() {
            if b != plan.input_bytes(i) {
                return Err(rs.group.fail_with(format!(
                    "{what}: rank {q} (pid {pid}): {}: operand of {b} bytes, expected {}; every rank must call with the same group",
                    plan.layout.params[i].describe(),
                    plan.input_bytes(i)
                )));
            }
            info.inputs.push(addr(a, off, b)?);
        }
        for &(a, off, b) in &m.stages {
            info.stages.push(addr(a, off, b)?);
        }
        if same {
            info.ready = m.raw_events[0] as usize;
            info.done = m.raw_events[1] as usize;
            info.phases = m.raw_events[2..]
                .iter()
                .take(nphases.saturating_sub(1))
                .map(|&e| e as usize)
                .collect();
        } else {
            info.ready = d.importer.event(me, q, pid, &m.ready, "ready")? as usize;
            info.done = d.importer.event(me, q, pid, &m.done, "done")? as usize;
            for h in m.phases.iter().take(nphases.saturating_sub(1)) {
                info.phases
                    .push(d.importer.event(me, q, pid, h, "phase")? as usize);
            }
        }
        infos.push(info);
    }

    // The rail communicator, created once, in the first call that needs it, by every member.
    if need_rail {
        let id = match nccl::registered_unique_id(job, call.group, rail) {
            Some(id) => id,
            None => peer_ids
                .get(rail)
                .copied()
                .flatten()
                .or(if my_node == 0 { mail.nccl_id } else { None })
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
        let comm = nccl::Comm::init(
            &id,
            nodes,
            my_node,
            format!("tide rail {rail} of group {} (job {job:016x})", call.group),
            Duration::from_secs_f64(cfg.timeout_s.clamp(0.001, 1e9)),
            &mut alive,
        );
        drop(alive);
        rs.dev.as_mut().expect("device part").rail = Some(comm?);
    }

    let d = rs.dev.as_ref().expect("device part");
    let main = call.stream as CUstream;
    let meeting = Mailbox {
        rs,
        d,
        infos,
        rails: if nodes > 1 {
            rail_ops(plan, me, g)
        } else {
            vec![Vec::new(); nphases]
        },
        ready: st.ready,
        done: st.done,
        phase: &st.phase,
        what,
        g,
        ord,
        last_rail: Cell::new(None),
    };
    // The device-wide resources with `main` as MAIN (rule 1: it waited on the previous `done`);
    // no batched launches (the module is loaded only for plans that need kernels).
    let io = super::Issue {
        res: Res::device(&st, main),
        phase: &st.phase,
        done: st.done,
        fuse: false,
        multicast: None,
        peer_hints: false,
    };
    super::meeting::end_call(&meeting, || {
        super::check_peers(call, &prepared, &meeting, false)?;
        super::run_phases(call, &io, &meeting, &prepared, &cfg)
    })
}

/// Between NCCL polls: fails when a member of this rank's rail (same local index, other nodes)
/// has died or this rank's group has failed. Peers are processes of this host (the control plane
/// is host-local); a pid of another pid namespace is left to the timeout.
fn rail_alive<'a>(rs: &'a RankState, me: usize, g: usize) -> impl FnMut() -> Result<()> + 'a {
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
fn process_gone(pid: u64) -> Option<&'static str> {
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

fn ensure_dev(rs: &mut RankState, ord: i64) -> Result<()> {
    if let Some(d) = &rs.dev {
        if d.ordinal != ord {
            return crate::invalid!(
                "rank {} of this group ran on CUDA device {} and now on {ord}; a rank's device must not change",
                rs.rank,
                d.ordinal
            );
        }
        return Ok(());
    }
    let ready = ipc::ipc_event(ord, "ready")?;
    let done = ipc::ipc_event(ord, "done")?;
    let mut rail_stream: CUstream = std::ptr::null_mut();
    // SAFETY: context current; valid out-pointer.
    check(
        unsafe {
            sys::cuStreamCreate(
                &mut rail_stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        },
        "cuStreamCreate",
        || format!("device {ord}, rail stream"),
    )?;
    rs.dev = Some(DevPart {
        ordinal: ord,
        importer: ipc::Importer::new(ord),
        ready,
        done,
        phases: Vec::new(),
        rail_stream,
        rail_events: Vec::new(),
        rail: None,
    });
    Ok(())
}

/// The multi-process meeting of one call (`meeting` module header): the group's barriers, the
/// values read from the mailboxes, and the rail's hooks. Built by `run_call` after the entry
/// barrier and the mailbox exchange; the group's exit barrier ends the call (nothing to leave:
/// peers' mailboxes are read before it, and a mailbox is rewritten only after the next entry).
struct Mailbox<'a> {
    rs: &'a RankState,
    d: &'a DevPart,
    infos: Vec<RankInfo>,
    /// The rail operations of each phase (empty on one node).
    rails: Vec<Vec<RailOp>>,
    /// The device's own `ready`, `done` and phase events (the rail stream waits on them).
    ready: CUevent,
    done: CUevent,
    phase: &'a [CUevent],
    what: &'a str,
    g: usize,
    ord: i64,
    /// The last phase whose rail transfers were issued.
    last_rail: Cell<Option<usize>>,
}

impl Mailbox<'_> {
    fn wait(&self, s: CUstream, ev: usize, label: &dyn Fn() -> String) -> Result<()> {
        let (me, ord) = (self.rs.rank, self.ord);
        // SAFETY: an event of this process or opened from a peer, valid for the process.
        check(
            unsafe { sys::cuStreamWaitEvent(s, ev as CUevent, 0) },
            "cuStreamWaitEvent",
            || format!("rank {me} device {ord}: {}", label()),
        )
    }
    fn record(&self, ev: CUevent, main: CUstream, label: &dyn Fn() -> String) -> Result<()> {
        let (me, ord) = (self.rs.rank, self.ord);
        // SAFETY: valid event and stream.
        check(
            unsafe { sys::cuEventRecord(ev, main) },
            "cuEventRecord",
            || format!("rank {me} device {ord}: {}", label()),
        )
    }
}

impl Meeting for Mailbox<'_> {
    fn infos(&self) -> &[RankInfo] {
        &self.infos
    }
    fn barrier(&self, label: &str) -> Result<()> {
        self.rs.group.barrier(&format!("{label} of {}", self.what))
    }
    /// Nothing here: `execute_inner` publishes every error of the call (also those before the
    /// meeting existed) after it aborted the rail: the order this path always had, kept as it is
    /// (the rail cannot be tested on one GPU); `execute`'s panic guard publishes a panic with its
    /// message.
    fn fail(&self, _err: &TideError) {}
    fn leave(&self) -> Result<()> {
        Ok(())
    }
    /// Ranks of this node (events of other nodes are never waited on: the module header's rail).
    fn reaches(&self, q: usize) -> bool {
        q / self.g == self.rs.rank / self.g
    }
    /// The rail (module header): the phase's NCCL group on the rail stream, after what precedes
    /// the phase, then the phase's rail event.
    fn phase_start(&self, p: usize, _main: CUstream) -> Result<()> {
        let ops = self.rails.get(p).map(|v| v.as_slice()).unwrap_or(&[]);
        if ops.is_empty() {
            return Ok(());
        }
        let (me, g, d, what) = (self.rs.rank, self.g, self.d, self.what);
        let comm = d
            .rail
            .as_ref()
            .ok_or_else(|| TideError::Internal("rail communicator missing".into()))?;
        let rsx = d.rail_stream;
        if p == 0 {
            self.wait(rsx, self.ready as usize, &|| "rail stream on ready".into())?;
            self.wait(rsx, self.done as usize, &|| {
                "rail stream on the previous done".into()
            })?;
        } else {
            self.wait(rsx, self.phase[p - 1] as usize, &|| {
                format!("rail stream on phase {}", p - 1)
            })?;
            for q in (0..self.infos.len()).filter(|&q| q != me && q / g == me / g) {
                self.wait(rsx, self.infos[q].phases[p - 1], &|| {
                    format!("rail stream on rank {q}'s phase {}", p - 1)
                })?;
            }
        }
        dbg_mp(|| format!("rank {me} phase {p}: rail group of {} ops", ops.len()));
        comm.group_start()?;
        for op in ops {
            let addr = super::address(&self.infos, &op.mine, op.bytes)?;
            let label = || format!("{what}: phase {p} step {}", op.step);
            if op.send {
                comm.send(addr, op.bytes, op.peer_node, rsx as usize, label)?;
            } else {
                comm.recv(addr, op.bytes, op.peer_node, rsx as usize, label)?;
            }
        }
        let mut alive = rail_alive(self.rs, me, g);
        comm.group_end(
            || format!("{what}: phase {p}, {} transfers", ops.len()),
            &mut alive,
        )?;
        dbg_mp(|| format!("rank {me} phase {p}: rail group issued"));
        self.record(d.rail_events[p], rsx, &|| format!("rail event of phase {p}"))?;
        self.last_rail.set(Some(p));
        Ok(())
    }
    /// A copy between nodes: the stream waits on the phase's rail event in its place.
    fn rail_event(&self, p: usize, cmd: &Cmd) -> Option<CUevent> {
        match cmd {
            Cmd::Copy { src, dst, .. } if src.rank / self.g != dst.rank / self.g => {
                Some(self.d.rail_events[p])
            }
            _ => None,
        }
    }
    fn phase_recorded(&self, p: usize, main: CUstream) -> Result<()> {
        self.record(self.d.phases[p], main, &|| format!("phase {p} event"))
    }
    /// MAIN after every rail transfer (sends read our inputs; XLA may reuse them after the call).
    fn phases_ended(&self, main: CUstream) -> Result<()> {
        match self.last_rail.get() {
            Some(p) => self.wait(main, self.d.rail_events[p] as usize, &|| {
                "XLA's stream on the rail".into()
            }),
            None => Ok(()),
        }
    }
    /// Rule 1's interprocess twin of `done`, right after it.
    fn done_recorded(&self, main: CUstream) -> Result<()> {
        self.record(self.d.done, main, &|| "done event".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mailbox_roundtrip() {
        let m = Mail {
            device: 3,
            pid: 4242,
            allocs: vec![AllocDesc {
                base: 0x1000,
                size: 1 << 20,
                gen: 2,
                kind: ipc::KIND_VMM,
                legacy: [1; 64],
            }],
            ready: [5; 64],
            done: [6; 64],
            phases: vec![[7; 64], [8; 64]],
            raw_events: vec![11, 12, 13, 14],
            inputs: vec![(0, 64, 100), (0, 256, 0)],
            stages: vec![(0, 4096, 65536)],
            nccl_id: Some([9; 128]),
        };
        let b = m.encode(17);
        let d = Mail::decode(&b, 17).unwrap();
        assert_eq!(
            (
                d.device,
                d.pid,
                d.allocs.clone(),
                d.ready,
                d.done,
                d.phases.clone(),
                d.raw_events.clone()
            ),
            (
                3,
                4242,
                m.allocs.clone(),
                m.ready,
                m.done,
                m.phases.clone(),
                m.raw_events.clone()
            )
        );
        assert_eq!(
            (d.inputs.clone(), d.stages.clone(), d.nccl_id),
            (m.inputs.clone(), m.stages.clone(), m.nccl_id)
        );
        assert!(Mail::decode(&b, 18).is_err());
        assert!(Mail::decode(&b[..b.len() - 1], 17).is_err());
    }
}
