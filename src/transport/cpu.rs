//! The CPU engine across processes of one host (docs/multiprocess.md "CPU data path").
//!
//! Every plan pulls (`Plan::validate`): a step writes only its executor's memory and reads peers'
//! `Input`s and `Stage` slots, never their `Output`s. So each rank shares exactly those through its
//! data segment, and its outputs stay in XLA's buffers:
//! - data segment layout (the same on every rank, from the plan): `Input(i)` images at 64-byte
//!   aligned offsets, then the stage slots. A rank copies into its images only the byte ranges of
//!   its inputs that some *other* executor reads (for the reduce-scatter: the other ranks' slices);
//!   it reads its own inputs in place from XLA's buffers.
//! - `RankBuffers` per process: its own rank's inputs/outputs are XLA's pointers and its stages its
//!   own mapping of its segment; a peer's inputs and stages are this process's mapping of the peer's
//!   segment, its outputs null (never addressed; checked up front).
//!
//! One call: copy inputs out, announce, entry barrier, check every peer is in the same call, map
//! peers' data segments (cached), `execute_rank` (its last phase barrier is the exit barrier:
//! nobody overwrites its segment for the next call while a peer may still read it).
//!
//! Segments are per (job, group, rank, size class) and reused across calls: a rank uses its
//! smallest data segment that fits, creating a new class (`2^k` bytes) when none does; it unlinks
//! a new segment's name after the exit barrier of the call that created it, when every peer has
//! mapped it.

use super::group::{lane_name, Announcement, PhaseBarrier, ProcessGroup, Timing};
use super::rail::{self, CallRail, RankRail};
use super::shm::{segment_name, unlink_name, Created, Segment};
use crate::call::CallInfo;
use crate::engine::cpu::execute_rank_with;
use crate::engine::RankBuffers;
use crate::error::{Result, TideError};
use crate::plan::{Action, BufKind, Op, Plan};
use once_cell::sync::Lazy;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

const ALIGN: usize = 64;
/// Smallest data segment: 64 KiB.
const MIN_CLASS: u32 = 16;

fn align_up(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Where each shared buffer lives in a rank's data segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataLayout {
    pub input_offsets: Vec<usize>,
    pub stage_offsets: Vec<usize>,
    pub bytes: usize,
}

impl DataLayout {
    pub fn of(plan: &Plan) -> DataLayout {
        let mut at = 0usize;
        let input_offsets = (0..plan.layout.len())
            .map(|i| {
                let o = at;
                at += align_up(plan.input_bytes(i));
                o
            })
            .collect();
        let stage_offsets = plan
            .stage_slot_bytes
            .iter()
            .map(|&b| {
                let o = at;
                at += align_up(b);
                o
            })
            .collect();
        DataLayout {
            input_offsets,
            stage_offsets,
            bytes: at.max(ALIGN),
        }
    }
}

/// The byte ranges `[start, end)` of each of `rank`'s inputs that another executor of its node
/// reads, merged (executors on other nodes get their bytes through the rail, not shared memory).
pub fn shared_input_ranges(plan: &Plan, rank: usize) -> Vec<Vec<(usize, usize)>> {
    let g = plan.topology.gpus_per_node.max(1);
    let mut ranges: Vec<Vec<(usize, usize)>> = vec![Vec::new(); plan.layout.len()];
    let mut note = |executor: usize, r: &crate::plan::Region, bytes: usize| {
        if r.rank == rank
            && executor != rank
            && executor / g == rank / g
            && r.kind == BufKind::Input
            && bytes > 0
        {
            ranges[r.index].push((r.offset, r.offset + bytes));
        }
    };
    for phase in &plan.phases {
        for s in &phase.steps {
            match &s.action {
                Action::Copy { src, bytes, .. } => note(s.executor, src, *bytes),
                Action::CopyBlocks { .. } => {
                    for (src, bytes) in s.action.reads() {
                        note(s.executor, &src, bytes);
                    }
                }
                Action::Zero { .. } => {}
                Action::Reduce { srcs, elems, .. } => {
                    for o in srcs {
                        note(s.executor, &o.region, elems * o.dtype.size_bytes());
                    }
                }
            }
        }
    }
    for list in &mut ranges {
        list.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(list.len());
        for &(a, b) in list.iter() {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        *list = merged;
    }
    ranges
}

/// An error if some step reads another rank's `Output` (this transport does not share outputs).
fn check_pull_only(plan: &Plan) -> Result<()> {
    for (k, phase) in plan.phases.iter().enumerate() {
        for s in &phase.steps {
            let reads: Vec<&crate::plan::Region> = match &s.action {
                Action::Copy { src, .. } | Action::CopyBlocks { src, .. } => vec![src],
                Action::Zero { .. } => vec![],
                Action::Reduce { srcs, .. } => srcs.iter().map(|o| &o.region).collect(),
            };
            if let Some(r) = reads
                .iter()
                .find(|r| r.kind == BufKind::Output && r.rank != s.executor)
            {
                return Err(TideError::Internal(format!(
                    "multi-process CPU transport: phase {k}: {s} reads rank {}'s Output; only inputs and \
                     stage slots are shared between processes",
                    r.rank
                )));
            }
        }
    }
    Ok(())
}

/// FNV-1a over what the plan was built from: equal on every rank of one call.
pub fn fingerprint(plan: &Plan) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(match plan.op {
        Op::AllGather => 0,
        Op::ReduceScatter => 1,
    });
    eat(plan.layout.world as u64);
    eat(plan.topology.nodes as u64);
    eat(plan.topology.gpus_per_node as u64);
    eat(plan.layout.len() as u64);
    for p in &plan.layout.params {
        eat(p.shape.len() as u64);
        for &d in &p.shape {
            eat(d as u64);
        }
        eat(p.dtype.size_bytes() as u64);
        for b in p.dtype.name().bytes() {
            eat(b as u64);
        }
    }
    for &b in &plan.stage_slot_bytes {
        eat(b as u64);
    }
    eat(plan.phases.len() as u64);
    eat(plan.phases.iter().map(|p| p.steps.len() as u64).sum());
    h
}

fn class_for(bytes: usize) -> u32 {
    let bits = usize::BITS - bytes.saturating_sub(1).leading_zeros();
    bits.max(MIN_CLASS)
}

/// Options of the transport (tests shorten the timeouts).
#[derive(Debug, Clone, Copy)]
pub struct ShmOptions {
    pub timing: Timing,
}

impl ShmOptions {
    pub fn from_config() -> ShmOptions {
        ShmOptions {
            timing: Timing::from_config(),
        }
    }
}

/// One rank's state in one job and group, kept across calls.
struct RankState {
    /// The control plane of this rank's node (every rank when there is one node), in this lane.
    group: Arc<ProcessGroup>,
    /// The link to ranks on other nodes (plans with several nodes).
    rail: RankRail,
    /// The topology the group was created for (its control plane is one node of it).
    topology: crate::topology::Topology,
    seq: u64,
    /// This rank's data segments by size class.
    own: BTreeMap<u32, Segment>,
    /// Peers' data segments, mapped here, by (rank, class).
    peer: HashMap<(usize, u32), Segment>,
}

/// (job, group, call site, rank): every call site is a lane of its own (its own control plane,
/// data segments and rail streams), because XLA:CPU may run independent calls of one program
/// concurrently, in different orders on different ranks; calls of one site are sequential.
/// Every lane's control plane of (job, group, rank) in this process, so a failure in one lane
/// fails them all (without taking a lane's state lock, which a blocked call may hold).
type LaneKey = (u64, usize, usize);
static LANES: Lazy<Mutex<HashMap<LaneKey, Vec<Arc<ProcessGroup>>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

fn register_lane(job: u64, group: usize, rank: usize, pg: &Arc<ProcessGroup>) {
    LANES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry((job, group, rank))
        .or_default()
        .push(pg.clone());
}

/// Records `msg` as the failure of every lane of (job, group, rank) in this process (the first
/// failure of each sticks) and closes the rank's rail streams not taken yet: peers in any lane fail
/// fast instead of waiting for a call that will never come.
fn fail_all_lanes(job: u64, group: usize, rank: usize, msg: &str) {
    let lanes = LANES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(job, group, rank))
        .cloned()
        .unwrap_or_default();
    for pg in lanes {
        pg.fail_with(msg.to_string());
    }
    rail::fail_rank(job, group, rank);
    // Processes on other nodes: a notice, so a peer waiting for this rank in a call it never
    // reaches fails now rather than at the timeout.
    rail::broadcast_failure(job, group, rank, msg);
}

type StateKey = (u64, usize, i64, usize);
static STATES: Lazy<Mutex<HashMap<StateKey, Arc<Mutex<RankState>>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "tide all_gather",
        Op::ReduceScatter => "tide reduce_scatter",
    }
}

fn state_for(
    job: u64,
    group: usize,
    site: i64,
    rank: usize,
    plan: &Plan,
    opts: &ShmOptions,
) -> Result<Arc<Mutex<RankState>>> {
    let world = plan.world();
    let key = (job, group, site, rank);
    let states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = states.get(&key) {
        return Ok(s.clone());
    }
    // Connect outside the registry lock: other ranks of this process connect concurrently.
    drop(states);
    let members: Vec<usize> = plan.topology.node_ranks(rank).collect();
    let mut pg = ProcessGroup::create_lane(job, group, site, rank, world, members, opts.timing)?;
    let connected = pg.connect();
    let pg = Arc::new(pg);
    register_lane(job, group, rank, &pg);
    let state = Arc::new(Mutex::new(RankState {
        group: pg,
        rail: RankRail::new(job, group, site, rank, plan.topology.gpus_per_node),
        topology: plan.topology,
        seq: 0,
        own: BTreeMap::new(),
        peer: HashMap::new(),
    }));
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    // Keep the state even when connecting failed: its failure is sticky and visible to peers.
    let s = states.entry(key).or_insert(state).clone();
    connected.map(|()| s)
}

/// Runs `call` (one rank of a collective whose ranks live in several processes of this host) on
/// the CPU engine through shared memory. `job` identifies the job (non-zero, the same in every
/// process; `tide_jax` agrees on it through JAX's key-value store). Returns when every rank is
/// done with this rank's shared buffers; outputs are written into `call.outputs` (XLA's buffers).
pub fn run_cpu_multiprocess(call: &CallInfo, plan: &Plan, job: u64) -> Result<()> {
    run_cpu_multiprocess_with(call, plan, job, &ShmOptions::from_config())
}

/// `run_cpu_multiprocess` with explicit options.
pub fn run_cpu_multiprocess_with(
    call: &CallInfo,
    plan: &Plan,
    job: u64,
    opts: &ShmOptions,
) -> Result<()> {
    let what_base = op_name(call.op);
    if job == 0 {
        return Err(TideError::Internal(format!(
            "{what_base}: multi-process transport called with job id 0"
        )));
    }
    let (rank, world) = (call.rank, call.world);
    if plan.world() != world || rank >= world || plan.op != call.op {
        return Err(TideError::Internal(format!(
            "{what_base} on rank {rank}: plan for {:?} over {} ranks does not match the call (world {world})",
            plan.op,
            plan.world()
        )));
    }
    let n = plan.layout.len();
    if call.inputs.len() != n || call.outputs.len() != n {
        return crate::invalid!(
            "{what_base} on rank {rank}: {} operands / {} results for a group of {n} parameters",
            call.inputs.len(),
            call.outputs.len()
        );
    }
    let state = state_for(job, call.group, call.site, rank, plan, opts)?;
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    let st = &mut *st;
    if st.topology != plan.topology {
        return crate::invalid!(
            "{what_base} on rank {rank}: group {} of this job was first called with topology {}, now {}; \
             one job keeps one topology per group",
            call.group,
            st.topology,
            plan.topology
        );
    }
    if let Some(why) = st.group.failure() {
        return Err(TideError::Rendezvous(format!(
            "{what_base} on rank {rank}: an earlier tide call of this job failed, the group is unusable: {why}"
        )));
    }
    let seq = st.seq;
    st.seq += 1;
    let what = format!("{what_base} call {seq} (site {}) on rank {rank}", call.site);
    let result = run_call(st, call, plan, job, seq, &what).map_err(|e| match e {
        // Rail errors: tell this node's peers (the rail told the other nodes by closing).
        TideError::Rendezvous(m) if st.group.failure().is_none() => {
            st.group.fail_with(if m.contains(&what) {
                m
            } else {
                format!("{what}: {m}")
            })
        }
        // Barrier errors are already published to the peers and carry the root cause.
        TideError::Rendezvous(m) if m.contains(&what) => TideError::Rendezvous(m),
        TideError::Rendezvous(m) => TideError::Rendezvous(format!("{what}: {m}")),
        // Anything else: tell the peers (they fail fast with it), return it as it is.
        other => {
            st.group.fail_with(format!("{what}: {other}"));
            other
        }
    });
    if let Err(e) = &result {
        // The job is unusable for this rank: fail its other lanes (call sites) too.
        fail_all_lanes(
            job,
            call.group,
            rank,
            &st.group.failure().unwrap_or_else(|| e.to_string()),
        );
    }
    result
}

fn run_call(
    st: &mut RankState,
    call: &CallInfo,
    plan: &Plan,
    job: u64,
    seq: u64,
    what: &str,
) -> Result<()> {
    let (rank, group) = (call.rank, call.group);
    check_pull_only(plan)?;
    let data = DataLayout::of(plan);

    // This rank's data segment: the smallest that fits, or a new size class.
    let mut created: Option<u32> = None;
    let class = match st.own.range(class_for(data.bytes)..).next() {
        Some((&c, _)) => c,
        None => {
            let c = class_for(data.bytes);
            let name = segment_name(job, group, rank, &lane_name(call.site, &format!("d{c}")));
            let seg = match Segment::create(&name, 1usize << c)? {
                Created::New(s) => s,
                Created::Exists => {
                    // Left by a crashed earlier run of this job id; the control block proved we own the rank.
                    unlink_name(&name);
                    match Segment::create(&name, 1usize << c)? {
                        Created::New(s) => s,
                        Created::Exists => {
                            return Err(TideError::Rendezvous(format!("{name} keeps reappearing")))
                        }
                    }
                }
            };
            st.own.insert(c, seg);
            created = Some(c);
            c
        }
    };
    let result = run_in_segment(st, call, plan, &data, class, seq, what, job);
    if let Some(c) = created {
        // After the exit barrier every peer has mapped it (or the call failed anyway).
        if let Some(seg) = st.own.get_mut(&c) {
            seg.unlink();
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn run_in_segment(
    st: &mut RankState,
    call: &CallInfo,
    plan: &Plan,
    data: &DataLayout,
    class: u32,
    seq: u64,
    what: &str,
    job: u64,
) -> Result<()> {
    let (rank, world, group) = (call.rank, call.world, call.group);
    let base = st.own[&class].as_ptr() as usize;

    // Copy out what peers read of our inputs.
    for (i, ranges) in shared_input_ranges(plan, rank).iter().enumerate() {
        let src = call.inputs[i].ptr;
        if src == 0 && !ranges.is_empty() {
            return crate::invalid!("{what}: operand {i} has a null buffer");
        }
        for &(a, b) in ranges {
            // SAFETY: [a, b) lies within input i (validated plan; call checked against the layout
            // by the caller) and within our segment's image of it (DataLayout::of).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (src + a) as *const u8,
                    (base + data.input_offsets[i] + a) as *mut u8,
                    b - a,
                )
            };
        }
    }

    let mine = Announcement {
        seq,
        op: match plan.op {
            Op::AllGather => 0,
            Op::ReduceScatter => 1,
        },
        site: call.site,
        fingerprint: fingerprint(plan),
        data_class: class as u64,
    };
    st.group.announce(mine);
    st.group.barrier(&format!("entry of {what}"))?;

    // Everyone of this node in the same call? Then map their data segments. Ranks on other nodes
    // are never addressed (their copies come through the rail).
    let members = st.group.members().to_vec();
    let mut bufs: Vec<RankBuffers> = Vec::with_capacity(world);
    for q in 0..world {
        if !members.contains(&q) {
            bufs.push(RankBuffers {
                inputs: vec![0; plan.layout.len()],
                outputs: vec![0; plan.layout.len()],
                stages: vec![0; plan.stage_slot_bytes.len()],
            });
            continue;
        }
        if q == rank {
            bufs.push(RankBuffers {
                inputs: call.inputs.iter().map(|b| b.ptr).collect(),
                outputs: call.outputs.iter().map(|b| b.ptr).collect(),
                stages: data.stage_offsets.iter().map(|o| base + o).collect(),
            });
            continue;
        }
        let theirs = st.group.announcement(q);
        if theirs.seq != mine.seq || theirs.op != mine.op || theirs.fingerprint != mine.fingerprint
        {
            return Err(st.group.fail_with(format!(
                "{what}: rank {q} (pid {}) is in a different call: its call {} is a {} (site {}, plan {:016x}), ours \
                 is call {} (plan {:016x}); every process must run the same program, and run a call site's \
                 calls in the same order (across processes calls meet in launch order: launch tide programs \
                 from one thread per process; tide_jax.dispatch_lock orders the threads of one process only)",
                st.group.pid_of(q),
                theirs.seq,
                if theirs.op == 0 { "tide all_gather" } else { "tide reduce_scatter" },
                theirs.site,
                theirs.fingerprint,
                mine.seq,
                mine.fingerprint
            )));
        }
        let c = theirs.data_class as u32;
        let key = (q, c);
        if !st.peer.contains_key(&key) {
            let name = segment_name(job, group, q, &lane_name(call.site, &format!("d{c}")));
            let seg = Segment::open(&name, data.bytes)?.ok_or_else(|| {
                st.group.fail_with(format!(
                    "{what}: rank {q}'s data segment {name} is missing or smaller than {} bytes",
                    data.bytes
                ))
            })?;
            st.peer.insert(key, seg);
        }
        let peer_base = st.peer[&key].as_ptr() as usize;
        bufs.push(RankBuffers {
            inputs: data.input_offsets.iter().map(|o| peer_base + o).collect(),
            outputs: vec![0; plan.layout.len()],
            stages: data.stage_offsets.iter().map(|o| peer_base + o).collect(),
        });
    }

    let barrier = PhaseBarrier {
        group: &st.group,
        what,
    };
    let transfers = if plan.topology.nodes > 1 {
        rail::transfers(plan)?
    } else {
        Vec::new()
    };
    let result = if transfers.is_empty() {
        // SAFETY: our inputs/outputs are XLA's live buffers of the planned sizes (checked by the
        // caller against the layout); peers' inputs and everyone's stages are mappings at least
        // `data.bytes` long laid out by `DataLayout::of` of the same plan (fingerprints agree).
        // Peers' outputs are null and never addressed (`check_pull_only`). Nothing else touches
        // the shared areas until every rank passed the plan's last barrier.
        unsafe { execute_rank_with(plan, rank, &bufs, &barrier, None) }
    } else {
        let own = bufs[rank].clone();
        let addr = |r: &crate::plan::Region| -> Result<usize> {
            let list = match r.kind {
                BufKind::Input => &own.inputs,
                BufKind::Output => &own.outputs,
                BufKind::Stage => &own.stages,
            };
            match list.get(r.index) {
                Some(&b) if b != 0 => Ok(b + r.offset),
                _ => Err(TideError::Internal(format!(
                    "{what}: rail source {r:?} has no buffer"
                ))),
            }
        };
        let mut rail = CallRail::open(
            &mut st.rail,
            &st.group,
            st.group.timing(),
            transfers,
            &addr,
            seq,
            fingerprint(plan),
            what,
        )?;
        // SAFETY: as above; in addition, ranks on other nodes are never addressed: their copies
        // are received through the rail (`is_remote`), and `transfers` refused any other access.
        let r = unsafe { execute_rank_with(plan, rank, &bufs, &barrier, Some(&mut rail)) };
        rail.finish(&r);
        r
    };
    result?;
    if plan.phases.is_empty() {
        st.group.barrier(&format!("exit of {what}"))?;
    }
    Ok(())
}

/// Records `err` as this rank's failure in `job` (for a call that failed before it could run,
/// e.g. a bad operand), so its peers fail fast with it instead of timing out.
pub fn fail_cpu_multiprocess(call: &CallInfo, job: u64, err: &TideError) {
    let key = (job, call.group, call.site, call.rank);
    let existing = STATES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .cloned();
    let msg = format!(
        "{} (site {}) on rank {}: {err}",
        op_name(call.op),
        call.site,
        call.rank
    );
    if existing.is_none() {
        // This lane is not connected yet: publish the failure in a fresh control block; peers of
        // this node see it when they map it. Kept (and unlinked at exit) so they can.
        let members: Vec<usize> = call.topology.node_ranks(call.rank).collect();
        if let Ok(pg) = ProcessGroup::create_lane(
            job,
            call.group,
            call.site,
            call.rank,
            call.world,
            members,
            Timing::from_config(),
        ) {
            let pg = Arc::new(pg);
            register_lane(job, call.group, call.rank, &pg);
            let mut rail = RankRail::new(
                job,
                call.group,
                call.site,
                call.rank,
                call.topology.gpus_per_node,
            );
            rail.abort(&msg, None);
            let state = RankState {
                group: pg,
                rail,
                topology: call.topology,
                seq: 0,
                own: BTreeMap::new(),
                peer: HashMap::new(),
            };
            STATES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, Arc::new(Mutex::new(state)));
        }
    }
    // Every lane of this rank fails with it (peers in any call fail fast); streams of this rank
    // to other nodes not taken yet are closed (they read end-of-stream at once).
    fail_all_lanes(job, call.group, call.rank, &msg);
    if let Some(s) = existing {
        // The lane's own rail: error frames and shutdown. Its lock is free (calls of one site are
        // sequential and this one never started).
        s.lock()
            .unwrap_or_else(|e| e.into_inner())
            .rail
            .abort(&msg, None);
    }
}
