//! The CUDA engine across processes (one process per GPU, or several GPUs per process), all on one
//! host today (the control plane is `transport::group`'s shared memory); cross-node plans run their
//! rail over NCCL. Selected by the FFI attribute `job` != 0 (`call.job`).
//!
//! Files: this one (the job's state per rank, one call from `execute` to its end, the start on a
//! slot's stream with its synchronous fallback, the release after a failure), `mailbox` (what is
//! published and read, and the `Mailbox` meeting), `rail` (the NCCL rail). One call, top to
//! bottom: `execute` (panic guard) -> `execute_inner` (the job's state, sticky failure, error
//! publication and rail abort) -> `run_call` (under the device lock: `prepare`, `mailbox::compose`,
//! `mailbox::publish`, `mailbox::read_peers`, `rail::connect`) -> `issue::run_phases` over the
//! `Mailbox`, ended by `meeting::end_call`, as for in-process calls. Same ordering protocol as the
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
//!   (allocation, offset, bytes), and how many phase points it signals. Its `ready`, `done` and
//!   phase points are not events but `signal`s: counters in the last page of its mailbox, written
//!   by its MAIN right after the device's own events and waited on by peers' streams (a dead peer's
//!   interprocess event could never be waited out; its signals are released by the survivor).
//!   Peers on its node map the allocations once (`ipc::Importer`) and register its signal page
//!   once. Outputs are never published: plans pull, no step reads a peer's `Output` (checked once
//!   per plan).
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
//! process's own IPC handles, so such a peer publishes (and is used through) its raw addresses;
//! this rank gets peer access to its device and `cuMemSetAccess` on its VMM allocations (peer
//! access does not cover VMM memory). Its points are signals as for any peer (waiting on another
//! context's interprocess event by its raw handle crashed the driver on the GPU machine).
//!
//! Failure: any error is published to the group (peers fail fast with the root cause, a dead peer
//! is named with its pid), the rail communicator is aborted (transfers a dead peer will never
//! match end, the stream drains), every later call of the job fails at once, and the rank gives
//! back the job's device memory once tide's work on the device finished (`release_after_failure`:
//! a dead peer's signals released so no stream waits on it any more, then the peer mappings that
//! would keep a dead peer's memory allocated, its export references, and the device's staging when
//! no peer that could read it is alive).
//!
//! NCCL communicators: one per (job, group, rail = local index), created in the first call that
//! needs it; the `ncclUniqueId` is made by the rail's node-0 rank and published in its mailbox (or
//! registered beforehand by the Python bootstrap: `nccl::set_unique_id`).
//!
//! Limits: every rank of a group must be on this host (the control plane and the IPC mappings are
//! host-local), so "several nodes" means a forced topology (`TIDE_TOPOLOGY=2x1`) today; a real
//! multi-host run needs a node-local control group plus the rail, which this layout keeps apart.

mod mailbox;
mod rail;

use super::device::{self, DeviceState, SlotLease};
use super::driver::{self, CUevent, CUstream};
use super::ipc::{self, FdChannel};
use super::issue::{self, Issue, Res};
use super::meeting::{self, check_peers, Local, RankInfo};
use super::nccl;
use super::prepare::{self, op_name};
use super::signal::{self, Page, Point};
use crate::call::CallInfo;
use crate::config::Config;
use crate::error::{Result, TideError};
use crate::transport::shm::{segment_name, unlink_name, Created, Segment};
use crate::transport::{ProcessGroup, Timing};
use mailbox::Mailbox;
use once_cell::sync::Lazy;
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MAILBOX_BYTES: usize = 8 << 20;

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
    /// This rank's signal page (its `ready`, `done` and phase points for peers: `signal`).
    signals: Page,
    /// Each peer's signal page as this process maps it, registered on first use.
    peer_signals: Vec<Option<Page>>,
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
    meeting::catch_panic(
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
    let result = result.map_err(|e| match e {
        // Barrier errors are already published to the peers and carry the root cause.
        TideError::Rendezvous(m) if m.contains(&what) => TideError::Rendezvous(m),
        TideError::Rendezvous(m) => TideError::Rendezvous(format!("{what}: {m}")),
        other => {
            rs.group.fail_with(format!("{what}: {other}"));
            other
        }
    });
    if result.is_err() {
        // Published first (peers fail fast), then the job's device memory is given back.
        release_after_failure(rs, call);
    }
    result
}

/// Starts of multi-process calls that found no in-flight slot (or failed before the call) and ran
/// synchronously on XLA's stream instead (`start`), since the process started.
static SYNC_FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// How many multi-process starts ran synchronously (`start`'s fallback), for tests and logs.
pub fn sync_fallbacks() -> u64 {
    SYNC_FALLBACKS.load(Ordering::Relaxed)
}

/// The start of a multi-process call: the synchronous multi-process driver (`execute`, its own
/// rules 1-5) run with a slot's tide stream T as its MAIN instead of XLA's stream X: X records
/// `entry`, T waits on it, the whole call is enqueued on T (its rule 1 waits on the device's
/// previous `done`, so calls stay serialized on the device's shared side streams and staging), and
/// T records `released` after rule 5's waits on every peer's `done`. Done makes X wait on it, as
/// in-process. When no slot can be had (TIDE_MAX_IN_FLIGHT, or a CUDA error before the call), the
/// call runs synchronously on X instead (`Ok(None)`): skipping it would leave this rank's peers out
/// of step.
pub(crate) fn start(call: &CallInfo) -> Result<Option<SlotLease>> {
    let (ord, job) = (call.device_ordinal, call.job);
    let prepared = (|| -> Result<_> {
        if call.stream == 0 {
            return Err(TideError::InvalidArgument(format!("device {ord}: XLA passed no CUDA stream")));
        }
        let cfg = crate::config::for_call(call.urgent);
        driver::init()?;
        let dev = device::get(ord)?;
        let mut st = dev
            .lock()
            .map_err(|_| TideError::Internal(format!("CUDA device {ord} state poisoned by an earlier panic")))?;
        let _g = driver::CtxGuard::set(st.ctx, ord)?;
        let (slot, lease) = st.acquire_slot(call.op, cfg.max_in_flight)?;
        let s = st.slot(call.op, slot)?;
        let x = call.stream as CUstream;
        // SAFETY: XLA's stream, the slot's stream and event; context current.
        unsafe {
            driver::event_record(s.entry, x, || format!("device {ord}: entry event"))?;
            driver::stream_wait_event(s.tide, s.entry, || format!("device {ord}: tide's stream on the entry event"))?;
        }
        Ok((st.ctx, s.tide, s.released, lease))
    })();
    let (ctx, tide, released, lease) = match prepared {
        Ok(p) => p,
        Err(e) => {
            log::warn!("tide: multi-process start on device {ord} runs synchronously: {e}");
            SYNC_FALLBACKS.fetch_add(1, Ordering::Relaxed);
            return execute(call, job).map(|()| None);
        }
    };
    let mut on_tide = call.clone();
    on_tide.stream = tide as usize;
    let result = execute(&on_tide, job);
    let recorded = driver::CtxGuard::set(ctx, ord).and_then(|_g| {
        // SAFETY: the slot's stream and event; context current.
        unsafe { driver::event_record(released, tide, || format!("device {ord}: released event")) }
    });
    lease.end_start(call, result.and(recorded)).map(Some)
}

/// How long a failed rank waits for the device to finish what tide enqueued before it gives the
/// job's memory back (`release_after_failure`).
const RELEASE_WAIT: Duration = Duration::from_secs(1);

/// After a failure the job is unusable (every later call fails at once), so this rank gives back
/// the device memory it holds for it, once the device finished everything tide enqueued there
/// (the device's side streams, the rail stream, this call's MAIN, the device's last `done`):
/// the peers' allocations it mapped (the mappings pin their memory, also a dead peer's), its
/// references on its own exported allocations, and, when no peer that could still read it is
/// alive, the device's stage buffers (a later call of another job makes new ones). Bounded by
/// `RELEASE_WAIT`: work still running then (a stream waiting on a peer that will never record)
/// keeps everything allocated, with a warning; memory is never freed under pending work. Waits on
/// a dead peer's points are ended first (its signal page released), so they never hold it.
fn release_after_failure(rs: &mut RankState, call: &CallInfo) {
    let (ord, me) = (call.device_ordinal, call.rank);
    let Some(d) = rs.dev.as_mut() else {
        return;
    };
    let Ok(dev) = device::get(ord) else {
        return;
    };
    let mut st = dev.lock().unwrap_or_else(|e| e.into_inner());
    let Ok(_ctx) = driver::CtxGuard::set(st.ctx, ord) else {
        return;
    };
    let mut streams: Vec<CUstream> = st.side.clone();
    streams.push(d.rail_stream);
    if call.stream != 0 {
        streams.push(call.stream as CUstream);
    }
    // A dead peer's stream will never reach the points this rank's streams wait on: end those
    // waits (`signal::Page::release`), so the device can drain.
    for &q in rs.group.members().iter().filter(|&&q| q != me) {
        if let Some(page) = d.peer_signals.get(q).copied().flatten() {
            if rail::process_gone(rs.group.pid_of(q)).is_some() {
                page.release();
            }
        }
    }
    let drained = device::drain(&streams, &[st.done], RELEASE_WAIT, &|| format!("rank {me} device {ord}"));
    match drained {
        Ok(true) => {}
        Ok(false) => {
            log::warn!(
                "tide: rank {me} device {ord}: the device did not finish tide's work within {RELEASE_WAIT:?} after the                  failure; the job's device memory stays allocated"
            );
            return;
        }
        Err(e) => {
            log::warn!("tide: rank {me} device {ord}: cannot tell whether tide's work finished ({e}); the job's memory stays allocated");
            return;
        }
    }
    let mapped = d.importer.release_all(me);
    let exported = rs.exporter.release_all(me);
    let peers_alive = rs
        .group
        .members()
        .iter()
        .filter(|&&q| q != me)
        .any(|&q| rail::process_gone(rs.group.pid_of(q)).is_none());
    let staging = if peers_alive { 0 } else { st.release_stage() };
    log::info!(
        "tide: rank {me} device {ord}: after the failure gave back {mapped} bytes of peer mappings, {exported} exported          allocations and {staging} bytes of staging{}",
        if peers_alive { " (staging kept: a peer that may still read it is alive)" } else { "" }
    );
}

/// The device-wide preparation of this path: `call.stream` is MAIN (XLA's stream, or a slot's
/// tide stream on a start: `start`); it waits on this rank's previous `done` and records `ready`
/// (the `cuda` header's rule 1).
fn prepare(call: &CallInfo, st: &mut DeviceState, cfg: &Config, multi_node: bool) -> Result<Local> {
    let ord = call.device_ordinal;
    let stream = call.stream as CUstream;
    prepare::check_call(call, st.ctx, multi_node)?;
    let prepared = st.plans.get(call, cfg)?;
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
    // (a reduce-scatter into slices zeroes padding rows with a kernel too: `issue`)
    if sched.needs_kernels || call.at.is_some() {
        st.ensure_module()?;
    }
    let mc = prepare::multicast_grant(call, st.dev, plan, cfg);
    if mc.is_some() {
        st.ensure_side_streams(1)?;
        st.ensure_phase_events(1)?;
    }
    let (inputs, outputs) = prepare::buffer_lists(call, plan)?;
    // SAFETY: XLA's stream and our events are valid; the context is current.
    unsafe {
        driver::stream_wait_event(stream, st.done, || {
            format!("device {ord}: XLA's stream on the previous call's done event")
        })?;
        driver::event_record(st.ready, stream, || format!("device {ord}: ready event"))?;
    }
    let info = RankInfo::published(ord, (inputs, outputs), stages, (st.ready, st.done, &st.phase), plan, mc.is_some());
    Ok(Local { prepared, info, mc })
}

/// Debug trace to stderr under TIDE_DEBUG_MP=1 (`config`; the setting of the call now running).
fn dbg_mp(f: impl FnOnce() -> String) {
    if crate::config::current().debug_mp {
        eprintln!("tide-mp: {}", f());
    }
}

/// One call of this rank, top to bottom (the module header's protocol): under the device lock,
/// rule 1 on MAIN (`prepare`), this rank's ready signal (`DevPart::prepare_call`), its
/// mailbox composed and published (entry barrier), the peers' read and mapped, the rail's
/// communicator on first need; then `issue::run_phases` over the `Mailbox` meeting, ended by
/// `meeting::end_call`.
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
    let cfg = crate::config::for_call(call.urgent);
    let local = prepare(call, &mut st, &cfg, true)?;
    let prepared = local.prepared.clone();
    let plan = &prepared.plan;
    let g = call.topology.gpus_per_node.max(1);
    let nodes = call.topology.nodes;
    let nphases = prepared.schedule.phases.len();
    let pkey = Arc::as_ptr(&prepared) as usize;
    if !rs.checked.contains(&pkey) {
        rail::check_plan(plan, g)?;
        rs.checked.insert(pkey);
    }
    let d = rs.dev.as_mut().expect("device part");
    d.prepare_call(ord, me, nphases, call.stream as CUstream)?;

    let need_rail = nodes > 1 && d.rail.is_none();
    let make_id = need_rail && me / g == 0 && nccl::registered_unique_id(job, call.group, me % g).is_none();
    let mail = mailbox::compose(rs, call, &local, nphases, make_id)?;
    mailbox::publish(rs, call, job, seq, what, &mail, plan, g)?;
    let wait_fd = Duration::from_secs_f64(cfg.timeout_s.clamp(0.001, 30.0));
    let (infos, peer_ids) = mailbox::read_peers(rs, &mut st, call, seq, what, &local, plan, nphases, wait_fd)?;
    // The rail communicator, created once, in the first call that needs it, by every member.
    if need_rail {
        let comm = rail::connect(rs, call, job, &cfg, mail.nccl_id, &peer_ids, what)?;
        rs.dev.as_mut().expect("device part").rail = Some(comm);
    }

    let d = rs.dev.as_ref().expect("device part");
    let meeting = Mailbox {
        rs,
        d,
        infos,
        rails: if nodes > 1 {
            rail::rail_ops(plan, me, g)
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
    let io = Issue {
        res: Res {
            module: st.module.as_deref(),
            main: call.stream as CUstream,
            side: &st.side,
            pool: &st.pool,
            prev_done: Some(st.done),
        },
        phase: &st.phase,
        done: st.done,
        fuse: false,
        multicast: None,
        peer_hints: false,
    };
    meeting::end_call(&meeting, || {
        check_peers(call, &prepared, &meeting, false)?;
        issue::run_phases(call, &io, &meeting, &prepared, &cfg)
    })
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
    let own = signal_page(&rs.mailbox, &|| format!("rank {} device {ord}", rs.rank))?;
    // Context current.
    let rail_stream = driver::stream_create(|| format!("device {ord}, rail stream"))?;
    rs.dev = Some(DevPart {
        ordinal: ord,
        importer: ipc::Importer::new(ord),
        signals: own,
        peer_signals: vec![None; rs.world],
        rail_stream,
        rail_events: Vec::new(),
        rail: None,
    });
    Ok(())
}

/// The signal page of a rank's mailbox `seg` (its last page: `signal`), registered in this process.
fn signal_page(seg: &Segment, what: &dyn Fn() -> String) -> Result<Page> {
    // SAFETY: a mailbox mapping of MAILBOX_BYTES (page-aligned), kept while the job's state lives
    // (the process's life); `mailbox::publish` never writes its last page.
    unsafe { Page::register(seg.as_ptr().add(MAILBOX_BYTES - signal::PAGE_BYTES), what) }
}

impl DevPart {
    /// This rank's per-call resources for a plan of `nphases` phases (rail events, created once and
    /// kept), then rule 1 for peers in other processes: this rank's `ready` signal, enqueued on
    /// MAIN (`stream`) right after the device's `ready` event.
    fn prepare_call(&mut self, ord: i64, me: usize, nphases: usize, stream: CUstream) -> Result<()> {
        // Every phase point must fit the signal page (a clear error before anything is enqueued).
        Point::Phase(nphases.saturating_sub(2)).slot()?;
        while self.rail_events.len() < nphases {
            // Context current.
            let e = driver::event_create(|| format!("device {ord}, rail event"))?;
            self.rail_events.push(e);
        }
        // SAFETY: STREAM is XLA's stream of this call, live for the call.
        unsafe { self.signals.record(stream, Point::Ready, || format!("rank {me} device {ord}: ready signal")) }
    }

    /// Peer `q`'s signal page: the tail of its mailbox `seg` as this process maps it, registered on
    /// first use.
    fn peer_page(&mut self, q: usize, seg: &Segment) -> Result<Page> {
        if let Some(p) = self.peer_signals.get(q).copied().flatten() {
            return Ok(p);
        }
        let ord = self.ordinal;
        let page = signal_page(seg, &|| format!("device {ord}: rank {q}'s mailbox"))?;
        if let Some(slot) = self.peer_signals.get_mut(q) {
            *slot = Some(page);
        }
        Ok(page)
    }
}
