//! The CPU platform's execution of one call (docs/design.md "Rendezvous"): every device of the
//! mesh is a rank on its own XLA host thread. Each rank
//! 1. takes its sequence number for the call site within XLA's run (`rendezvous::run_seq`; first,
//!    so a rank that fails later keeps its count in step with its peers),
//! 2. validates the call and gets the plan (cached per call site),
//! 3. allocates its stage slots and joins the rendezvous `(site, group, seq)` publishing its buffer
//!    addresses (or, if 2 failed, abandons it so peers fail at once with its error),
//! 4. runs its part of the plan with the session as the barrier between phases,
//! 5. leaves through `Session::leave`, on success and on failure alike, so it never returns (and
//!    lets XLA reuse its buffers, or frees its stage slots) while a peer may still read them.

use super::op_name;
use crate::call::CallInfo;
use crate::engine::RankBuffers;
use crate::error::{Result, TideError};
use crate::layout::GroupLayout;
use crate::plan::{Op, Plan, RsOptions};
use crate::rendezvous::{run_seq, Key, Session};
use crate::topology::Topology;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::engine::cpu::{execute_rank, StageBuffers};
use crate::plan::{all_gather as plan_all_gather, reduce_scatter as plan_reduce_scatter};

/// What a plan was built from; a cached plan is reused only when all of it is equal.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PlanInputs {
    op: Op,
    topology: Topology,
    layout: GroupLayout,
    rs: RsOptions,
}

struct CachedPlan {
    inputs: PlanInputs,
    plan: Arc<Plan>,
}

/// Plans by call site. A site's layout and topology are fixed for a traced program, so the check
/// is an equality test; a different program reusing a site id just replaces the entry.
static PLANS: Lazy<Mutex<HashMap<i64, CachedPlan>>> = Lazy::new(|| Mutex::new(HashMap::new()));

fn rs_options() -> RsOptions {
    RsOptions::from_config()
}

fn plan_for(site: i64, inputs: PlanInputs) -> Result<Arc<Plan>> {
    let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = plans.get(&site) {
        if c.inputs == inputs {
            return Ok(c.plan.clone());
        }
    }
    let plan = Arc::new(match inputs.op {
        Op::AllGather => plan_all_gather(&inputs.layout, inputs.topology)?,
        Op::ReduceScatter => plan_reduce_scatter(&inputs.layout, inputs.topology, inputs.rs)?,
    });
    plans.insert(
        site,
        CachedPlan {
            inputs,
            plan: plan.clone(),
        },
    );
    Ok(plan)
}

fn timeout() -> Duration {
    crate::config::current().timeout()
}

/// `place` with XLA:CPU's stall check (`deadlock`, "Stalls") after TIDE_STALL_MS (0: none).
fn stall_checked(place: Option<crate::deadlock::Place>) -> Option<crate::deadlock::Place> {
    let ms = crate::config::current().stall_ms;
    place.map(|p| crate::deadlock::Place {
        stall_after: (ms > 0).then(|| Duration::from_millis(ms)),
        ..p
    })
}

/// What every rank publishes: its buffers, and a fingerprint of the plan it built.
type Published = (RankBuffers, u64);

/// A fingerprint of what a plan was built from (op, topology, shapes, dtypes): ranks that meet at
/// one key must agree on it, else their buffer addresses do not describe the same regions.
fn fingerprint(plan: &Plan) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    plan.op.hash(&mut h);
    plan.topology.hash(&mut h);
    plan.layout.world.hash(&mut h);
    for p in &plan.layout.params {
        p.shape.hash(&mut h);
        p.dtype.hash(&mut h);
    }
    plan.stage_slot_bytes.hash(&mut h);
    h.finish()
}

/// Everyone's buffers, once it is clear that every rank built the same plan.
fn same_plan(what: &str, key: Key, published: &[Published]) -> Result<Vec<RankBuffers>> {
    let first = published[0].1;
    let differ: Vec<usize> = published
        .iter()
        .enumerate()
        .filter(|(_, p)| p.1 != first)
        .map(|(r, _)| r)
        .collect();
    if !differ.is_empty() {
        return crate::invalid!(
            "{what} {key}: ranks {} built a different plan than rank 0 (different shapes, dtypes or \
             topology at one call site: is a site id shared by two calls?)",
            crate::error::short_list(&differ, 16)
        );
    }
    Ok(published.iter().map(|p| p.0.clone()).collect())
}

/// A reduce-scatter into slices (`CallInfo::at`) on CPU: reads the slice index (host memory) and
/// points each result at its slice, so the CPU engine runs the plain call on it. A call without
/// `at` is returned as it is.
///
/// # Safety
/// `at.index_ptr` must be the address of a live int32 (XLA's operand of the call).
pub unsafe fn resolve_at(mut info: CallInfo) -> Result<CallInfo> {
    let Some(at) = info.at.take() else {
        return Ok(info);
    };
    // SAFETY: per the contract above.
    let index = unsafe { std::ptr::read_unaligned(at.index_ptr as *const i32) };
    let slice = at.slice(index);
    let what = format!("tide reduce_scatter_into site {} on device {}", info.site, info.device_ordinal);
    for (i, b) in info.outputs.iter_mut().enumerate() {
        let bytes = b.dims[1..]
            .iter()
            .try_fold(b.dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
            .and_then(|s| s.checked_mul(slice))
            .filter(|&off| off <= crate::call::MAX_BUFFER_BYTES)
            .ok_or_else(|| TideError::InvalidArgument(format!("{what}: buffer {i} of shape {:?} is too large", b.dims)))?;
        b.ptr += bytes;
        b.dims.remove(0);
    }
    Ok(info)
}

/// The casting all-gather on CPU (`crate::cast`): reads the slice index (host memory), rounds this
/// rank's slice of each fp32 operand into a bf16 shard of its own (padding rows zero) and points the
/// call's operands at them, so the CPU engine runs the plain all-gather. The shards must outlive the
/// call. A call without `cast` is returned as it is, with none.
///
/// # Safety
/// `cast.index_ptr` must be the address of a live int32 and every `cast.srcs[i]` of a live fp32
/// buffer of its dims (XLA's operands of the call).
pub unsafe fn cast_shards(mut info: CallInfo) -> Result<(CallInfo, Vec<Vec<u16>>)> {
    let Some(cast) = info.cast.clone() else {
        return Ok((info, Vec::new()));
    };
    let layout = info.layout()?;
    // SAFETY: per the contract above.
    let index = unsafe { std::ptr::read_unaligned(cast.index_ptr as *const i32) };
    let slice = crate::call::OutputAt { index_ptr: cast.index_ptr, count: cast.count }.slice(index);
    let mut shards = Vec::with_capacity(layout.len());
    for ((p, src), view) in layout.params.iter().zip(&cast.srcs).zip(info.inputs.iter_mut()) {
        let mut shard = vec![0u16; p.shard_rows * p.row_elems];
        let elems = crate::cast::own_rows(p, info.rank).1;
        // SAFETY: `src` holds `count` slices of `slice_stride` bytes (checked by `cast::views`);
        // slice < count; elems <= the shard's elements.
        let from = unsafe {
            std::slice::from_raw_parts((src.ptr + slice * crate::cast::slice_stride(p)) as *const f32, elems)
        };
        crate::cast::round_into(&mut shard[..elems], from);
        view.ptr = shard.as_ptr() as usize;
        shards.push(shard);
    }
    Ok((info, shards))
}

/// Runs `call` as one rank of a CPU collective in XLA's run `run_id`. Returns once every rank of
/// the call is done with this rank's buffers.
pub fn execute(call: &CallInfo, run_id: i64) -> Result<()> {
    execute_seq(call, run_seq(call.site, call.group, call.rank, run_id))
}

/// `execute` with the rendezvous sequence number already taken (`rendezvous::run_seq`, in the
/// order XLA invoked the handler: the asynchronous handler takes it on XLA's thread, then runs
/// this on a tide worker thread).
pub fn execute_seq(call: &CallInfo, seq: u64) -> Result<()> {
    let what = format!("{} site {}", op_name(call.op), call.site);
    let key = Key {
        site: call.site,
        group: call.group,
        seq,
    };
    let (rank, world) = (call.rank, call.world);

    // Under catch_unwind too, so that even a panic here abandons the key and peers fail fast.
    let prepared = catch_unwind(AssertUnwindSafe(|| -> Result<(Arc<Plan>, StageBuffers)> {
        let layout = call.layout()?;
        let inputs = PlanInputs {
            op: call.op,
            topology: call.topology,
            layout,
            rs: rs_options(),
        };
        let plan = plan_for(call.site, inputs)?;
        let stages = StageBuffers::new(&plan)?;
        Ok((plan, stages))
    }))
    .unwrap_or_else(|payload| {
        Err(TideError::Internal(format!(
            "{what} on rank {rank}: panic while preparing the call: {}",
            super::panic_message(&*payload)
        )))
    });
    let (plan, stages) = match prepared {
        Ok(p) => p,
        Err(err) => {
            Session::<Published>::abandon(&what, key, rank, world, &err, timeout());
            return Err(err);
        }
    };

    let mine = RankBuffers {
        inputs: call.inputs.iter().map(|b| b.ptr).collect(),
        outputs: call.outputs.iter().map(|b| b.ptr).collect(),
        stages: stages.addrs(),
    };
    let session = Session::join_at(
        &what,
        key,
        rank,
        world,
        (mine, fingerprint(&plan)),
        timeout(),
        stall_checked(call.place("cpu", crate::deadlock::CONFIRM_AFTER_CPU)).as_ref(),
    )?;

    // same_plan first: every rank reaches the same verdict from the same values.
    let run = same_plan(&what, key, session.values())
        .and_then(|bufs| session.check().map(|()| bufs))
        .and_then(|bufs| {
            catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: every rank published the addresses of XLA's live buffers for this call
                // (checked against the layout by `call.layout()`, and all ranks built the same plan)
                // and of its own stage slots, which stay alive until every rank has left the session.
                unsafe { execute_rank(&plan, rank, &bufs, &*session) }
            }))
            .unwrap_or_else(|payload| {
                Err(TideError::Internal(format!(
                    "{what} on rank {rank}: panic in the CPU engine: {}",
                    super::panic_message(&*payload)
                )))
            })
        });
    if let Err(err) = &run {
        session.fail(rank, err); // no-op if the session had already failed
    }
    let left = session.leave(rank);
    if !session.all_left() {
        // A peer did not leave in time: it may still read our stage slots; never free them.
        std::mem::forget(stages);
    }
    run.and(left)
}

/// Runs `call` as one rank of a CPU collective whose ranks live in several processes of this host
/// (attribute `job` != 0; docs/multiprocess.md): the plan as in `execute`, the data path and the
/// barriers through `crate::transport` (shared memory) instead of the in-process rendezvous.
pub fn execute_multiprocess(call: &CallInfo, job: u64) -> Result<()> {
    let what = format!("{} site {}", op_name(call.op), call.site);
    let rank = call.rank;
    let prepared = catch_unwind(AssertUnwindSafe(|| -> Result<Arc<Plan>> {
        let layout = call.layout()?;
        let inputs = PlanInputs {
            op: call.op,
            topology: call.topology,
            layout,
            rs: rs_options(),
        };
        plan_for(call.site, inputs)
    }))
    .unwrap_or_else(|payload| {
        Err(TideError::Internal(format!(
            "{what} on rank {rank}: panic while preparing the call: {}",
            super::panic_message(&*payload)
        )))
    });
    let plan = match prepared {
        Ok(p) => p,
        Err(err) => {
            crate::transport::fail_cpu_multiprocess(call, job, &err);
            return Err(err);
        }
    };
    catch_unwind(AssertUnwindSafe(|| {
        crate::transport::run_cpu_multiprocess(call, &plan, job)
    }))
    .unwrap_or_else(|payload| {
        let err = TideError::Internal(format!(
            "{what} on rank {rank}: panic in the multi-process CPU path: {}",
            super::panic_message(&*payload)
        ));
        crate::transport::fail_cpu_multiprocess(call, job, &err);
        Err(err)
    })
}

/// Tickets of the multi-process lanes (one lane per call-site instruction, `transport::cpu`):
/// calls of one lane must run in the order XLA issued them on every rank, since the lane matches
/// calls by order. A synchronous call of one instruction never overlaps the next one, but started
/// calls can (a start in iteration i+1 of a loop before iteration i's done). So each call takes a
/// ticket on XLA's thread, in issue order, and its worker runs the call when the lane serves it.
#[derive(Default)]
struct Lane {
    next: u64,
    serving: u64,
}

type LaneKey = (u64, usize, i64, usize);
static LANES: Lazy<(Mutex<HashMap<LaneKey, Lane>>, std::sync::Condvar)> =
    Lazy::new(|| (Mutex::new(HashMap::new()), std::sync::Condvar::new()));

fn lane_key(call: &CallInfo) -> LaneKey {
    (call.job, call.group, call.site, call.rank)
}

/// Takes the next ticket of `call`'s lane (on XLA's thread, in issue order).
pub fn lane_ticket(call: &CallInfo) -> u64 {
    let mut lanes = LANES.0.lock().unwrap_or_else(|p| p.into_inner());
    let lane = lanes.entry(lane_key(call)).or_default();
    let t = lane.next;
    lane.next += 1;
    t
}

/// Advances the lane past `ticket` when dropped: on every path, panics included.
struct Served(LaneKey);

impl Drop for Served {
    fn drop(&mut self) {
        let mut lanes = LANES.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lane) = lanes.get_mut(&self.0) {
            lane.serving += 1;
        }
        LANES.1.notify_all();
    }
}

/// `execute_multiprocess` once the lane serves `ticket` (after every earlier call of the lane).
pub fn execute_multiprocess_ticket(call: &CallInfo, job: u64, ticket: u64) -> Result<()> {
    let key = lane_key(call);
    {
        let mut lanes = LANES.0.lock().unwrap_or_else(|p| p.into_inner());
        while lanes.get(&key).is_some_and(|l| l.serving < ticket) {
            lanes = LANES.1.wait(lanes).unwrap_or_else(|p| p.into_inner());
        }
    }
    let _served = Served(key);
    execute_multiprocess(call, job)
}
