//! CUDA engine: runs plans on the GPUs of this process with copy engines and short-lived fp32
//! reduction kernels. One process drives all local GPUs; XLA runs each device's program on its own
//! host thread and calls `execute` there with its stream (`call.stream`) and device ordinal.
//!
//! Modules: `schedule` (pure: steps -> streams, events; unit-tested), `kernels` (pure: the embedded
//! `kernels/rs_sum.cu`, launch shapes), `nvrtc` (compiling it), `driver` (checked driver calls),
//! `device` (per-device state), `multicast` (the opt-in, gated NVLink multicast all-gather; off
//! unless TIDE_MULTICAST=1 and the device supports it), this file (the call: rendezvous, ordering,
//! issuing).
//!
//! # Buffer ownership and stream rules (CUDA engine)
//! Buffers: `Input(i)` / `Output(i)` of every rank are XLA's, borrowed for one call; stage slots and
//! side streams are tide's, one set per device, reused by every call. Per rank and call:
//! 1. XLA's stream (MAIN) first waits on this rank's `done` event of its previous call, then records
//!    this rank's `ready` event: everything XLA enqueued before the call (writes of the inputs, last
//!    uses of the output buffers) and all of this rank's previous tide work precede `ready`.
//! 2. The rank joins the rendezvous `(site, group, seq)` publishing its buffer addresses and sizes,
//!    its stage slots and its `ready`, `done` and phase event handles (events are created once per
//!    device with CU_EVENT_DISABLE_TIMING and reused). A rank that failed before this point joins
//!    anyway with its error, so its peers fail at once rather than at the timeout.
//! 3. Each stream, before its first command in phase 0, waits on the `ready` event of every rank
//!    whose buffers it touches (side streams: their own rank's too, which follows the rank's
//!    previous `done` by rule 1; a side stream touching only peers would wait on `done` itself).
//!    So no peer buffer is read before its producer wrote it, and no output is written while XLA
//!    might still use it. Copies go on side streams (copy engines; cuMemcpyAsync on unified
//!    addresses with peer access enabled), balanced by bytes; Reduce (the `rs_sum_*` kernels, at most
//!    TIDE_RS_MAX_CTAS CTAs), Zero (cuMemsetD8Async) and SM local copies go on MAIN. Inside the rank,
//!    steps that touch overlapping bytes (one writing) are ordered by local events: a copy into a
//!    stage slot waits for the last Reduce that read the slot, a Reduce for the copies into its slots.
//! 4. Between phases: MAIN joins the side streams, records the phase event, host barrier, then each
//!    stream waits on every rank's phase event before its first command of the next phase.
//! 5. End: MAIN waits on every side stream used (so XLA's later work sees the outputs), records
//!    `done` (all of this rank's reads of peer memory are before it), then the exit barrier, then
//!    MAIN waits on every peer's `done`: peers read my inputs, and XLA must not reuse them before.
//!
//! No host synchronization with the device anywhere: only event records and stream waits.
//!
//! Why reusing events across calls is race-free: cuStreamWaitEvent captures the event's most recent
//! record at the time of the call (a wait on a later re-record is never implied). Every wait on a
//! peer's `ready`/phase event is issued after the rendezvous/barrier that follows its record, and
//! before the waiter reaches the exit barrier, which the owner must pass before it can record the
//! event again in its next call. Every wait on a peer's `done` is issued after the exit barrier
//! (so after the record) and before the waiter returns, hence before it joins the next call's
//! rendezvous, which the owner must pass before recording `done` again. Local events are recorded
//! and waited on by the one host thread that owns the device, in order, within one call.
//! Stage slots and side streams are reused safely because of the wait on the previous `done`.
//!
//! Memory (device, per GPU, allocated once and kept): the all-gather needs none beyond XLA's
//! buffers (every piece lands at its final address; the cast, if any, is XLA's, on the local shard).
//! The reduce-scatter stages peers' slices in `TIDE_RS_STAGE_SLOTS x TIDE_RS_SLOT_BYTES` bytes
//! (default 3 x 32 MiB = 96 MiB), independent of the group size and of the number of GPUs; chunks of
//! at most `slot_bytes / (P - 1)` per peer cycle through the slots. Plus events and streams.
//!
//! Concurrency: each device's state is locked for the whole call. XLA issues a device's calls from
//! that device's thread one at a time; if two tide calls of one device were ever issued
//! concurrently in different orders on two devices, they would fail with a rendezvous timeout, not
//! hang. On errors the rank calls `Session::fail` so peers fail fast; work already enqueued on side
//! streams is still joined into MAIN so XLA's stream stays ordered.
//!
//! Multi-process jobs (`call.job != 0`) go to `multiproc` (the same protocol over a shared-memory
//! mailbox, peers mapped by VMM/IPC, the rail over NCCL: docs/multiprocess.md). In one process,
//! multi-node (hierarchical) plans are refused with a clear error; CUDA graph capture
//! of the call is refused (the handler must not be declared command-buffer compatible).

pub mod device;
pub mod driver;
pub mod ipc;
pub mod kernels;
pub mod multicast;
pub mod multiproc;
pub mod nccl;
pub mod nvrtc;
pub mod schedule;

use crate::call::CallInfo;
use crate::config::Config;
use crate::error::{Result, TideError};
use crate::plan::{BufKind, Op, Region};
use crate::rendezvous::{self, Key, Session};
use cudarc::driver::sys;
use device::{DeviceState, Prepared};
use driver::{check, CUevent, CUstream};
use schedule::{Cmd, CopyVia, RankEvent, SchedOptions, MAIN};
use std::sync::Arc;
use std::time::Duration;

/// What each rank publishes at the rendezvous. Event handles are carried as integers (raw CUDA
/// handles are valid in every thread of the process).
#[derive(Debug, Clone, Default)]
pub struct RankInfo {
    pub device: i64,
    /// (device address, bytes) of each input, output and stage slot.
    pub inputs: Vec<(u64, usize)>,
    pub outputs: Vec<(u64, usize)>,
    pub stages: Vec<(u64, usize)>,
    pub ready: usize,
    pub done: usize,
    pub phases: Vec<usize>,
    /// Whether this rank's multicast gate granted the NVLink multicast all-gather
    /// (`multicast::decide`); the path runs only if every rank's did.
    pub multicast: bool,
    /// Set when the rank failed before the rendezvous.
    pub error: Option<String>,
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "all_gather",
        Op::ReduceScatter => "reduce_scatter",
    }
}

/// The FFI edge's entry: `job` is the FFI attribute `job` (0: every rank of the call is in this
/// process, the in-process engine; else the multi-process job id, `multiproc`).
pub fn execute_job(call: &CallInfo, job: u64) -> Result<()> {
    if job == 0 {
        execute(call)
    } else {
        multiproc::execute(call, job)
    }
}

/// The FFI edge's entry for every target: `phase` says whether this is a whole call, its start or
/// its done (docs/design.md "Start/done").
///
/// Today start enqueues the whole collective on XLA's stream as the synchronous call does (so its
/// results are ordered before anything XLA runs later on the stream, done included) and records
/// the call in `crate::inflight`; done checks that it received the very buffers its start wrote
/// and returns the start's result. Correct, but without overlap: the asynchronous driver (tide's
/// own streams, per-call events) replaces this.
pub fn execute_phase(call: &CallInfo, job: u64, phase: crate::ffi::Phase) -> Result<()> {
    use crate::ffi::{op_code, Phase};
    use crate::inflight;
    match phase {
        Phase::Sync => execute_job(call, job),
        Phase::Start => {
            let record = inflight::Record::new(
                format!("tide {}_start site {} on device {}", op_name(call.op), call.site, call.device_ordinal),
                call.device_ordinal,
                call.outputs.iter().map(|b| b.ptr).collect(),
                call.inputs.iter().map(|b| b.ptr).collect(),
            );
            inflight::register(op_code(call.op), record.clone())?;
            let result = execute_job(call, job);
            record.finish(result.clone());
            result
        }
        Phase::Done => {
            let n = call.outputs.len();
            let what = format!("tide {}_done site {}", op_name(call.op), call.site);
            let record = inflight::take(
                &what,
                op_code(call.op),
                call.device_ordinal,
                &call.outputs.iter().map(|b| b.ptr).collect::<Vec<_>>(),
                &call.inputs[n..].iter().map(|b| b.ptr).collect::<Vec<_>>(),
            )?;
            let (tx, rx) = std::sync::mpsc::channel();
            record.on_finish(move |r| {
                let _ = tx.send(r);
            });
            rx.recv().unwrap_or_else(|_| {
                Err(TideError::Internal(format!("{what}: its start never finished")))
            })
        }
    }
}

/// Executes one collective call on XLA's stream `call.stream` of device `call.device_ordinal`.
/// Enqueues work only; never synchronizes the host with the device in the hot path. The rendezvous
/// sequence number counts this rank's calls of the site within XLA's run `call.run_id`
/// (`rendezvous::run_seq`), so one rank's failure cannot leave later runs out of step.
pub fn execute(call: &CallInfo) -> Result<()> {
    let seq = rendezvous::run_seq(call.site, call.group, call.rank, call.run_id);
    execute_with_seq(call, seq)
}

/// `execute` with the rendezvous sequence number chosen by the caller (e.g. the FFI edge's
/// `rendezvous::run_seq` from XLA's RunId, so ranks re-synchronize every run). Take it before
/// anything that can fail, on every rank.
pub fn execute_with_seq(call: &CallInfo, seq: u64) -> Result<()> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| execute_inner(call, seq))) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(TideError::Internal(format!(
                "panic in the CUDA engine (tide {} site {} rank {} device {}): {msg}",
                op_name(call.op),
                call.site,
                call.rank,
                call.device_ordinal
            )))
        }
    }
}

fn timeout(cfg: &Config) -> Duration {
    Duration::from_secs_f64(cfg.timeout_s.clamp(0.001, 1e9))
}

/// Everything of the local preparation that must stay alive through the call.
struct Local {
    prepared: Arc<Prepared>,
    info: RankInfo,
    /// This rank's multicast grant (all-gather, TIDE_MULTICAST=1 and the whole gate passed).
    mc: Option<multicast::Granted>,
}

fn execute_inner(call: &CallInfo, seq: u64) -> Result<()> {
    let cfg = crate::config::current();
    let cfg = &*cfg;
    let what = format!(
        "tide {} site {} group {}",
        op_name(call.op),
        call.site,
        call.group
    );
    let key = Key {
        site: call.site,
        group: call.group,
        seq,
    };
    let fail_early = |err: TideError| -> Result<()> {
        // Join anyway, publishing the error, so peers fail at once instead of at the timeout.
        let info = RankInfo {
            device: call.device_ordinal,
            error: Some(err.to_string()),
            ..Default::default()
        };
        if let Ok(s) = Session::join(&what, key, call.rank, call.world, info, timeout(cfg)) {
            s.fail(call.rank, &err);
        }
        Err(err)
    };
    if let Err(e) = driver::init() {
        return fail_early(e);
    }
    let dev = match device::get(call.device_ordinal) {
        Ok(d) => d,
        Err(e) => return fail_early(e),
    };
    let mut st = match dev.lock() {
        Ok(g) => g,
        Err(_) => {
            return fail_early(TideError::Internal(format!(
                "CUDA device {} state poisoned by an earlier panic",
                call.device_ordinal
            )))
        }
    };
    let _ctx = match driver::CtxGuard::set(st.ctx, call.device_ordinal) {
        Ok(g) => g,
        Err(e) => return fail_early(e),
    };
    let local = match prepare(call, &mut st, cfg, false) {
        Ok(l) => l,
        Err(e) => return fail_early(e),
    };
    let session = Session::join(
        &what,
        key,
        call.rank,
        call.world,
        local.info.clone(),
        timeout(cfg),
    )?;
    let _unwind = FailOnUnwind {
        session: &session,
        rank: call.rank,
    };
    let result = run(call, &mut st, &local, &session, cfg);
    if let Err(e) = &result {
        session.fail(call.rank, e);
    }
    result
}

/// Fails the session if the call unwinds (a panic caught by `execute`), so peers do not wait for
/// this rank until the timeout.
struct FailOnUnwind<'a> {
    session: &'a Session<RankInfo>,
    rank: usize,
}

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let err = TideError::Internal("panic in the CUDA engine".into());
            self.session.fail(self.rank, &err);
        }
    }
}

/// Checks the call, builds (or reuses) the plan and schedule, makes the device's resources exist,
/// and records `ready` on XLA's stream.
/// `multi_node`: hierarchical plans allowed (the cross-process path runs their rail over NCCL).
fn prepare(call: &CallInfo, st: &mut DeviceState, cfg: &Config, multi_node: bool) -> Result<Local> {
    let ord = call.device_ordinal;
    if call.stream == 0 {
        return Err(TideError::InvalidArgument(format!(
            "tide {} on device {ord}: XLA passed no CUDA stream",
            op_name(call.op)
        )));
    }
    let stream = call.stream as CUstream;
    let mut sctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: XLA's stream handle, valid for the call; valid out-pointer.
    check(
        unsafe { sys::cuStreamGetCtx(stream, &mut sctx) },
        "cuStreamGetCtx",
        || format!("XLA's stream on device {ord}"),
    )?;
    if sctx != st.ctx {
        return Err(TideError::Cuda {
            call: "cuStreamGetCtx".into(),
            detail: format!("XLA's stream on device {ord} is not in the device's primary context"),
        });
    }
    let mut cap = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: as above.
    check(
        unsafe { sys::cuStreamIsCapturing(stream, &mut cap) },
        "cuStreamIsCapturing",
        || format!("device {ord}"),
    )?;
    if cap != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(TideError::InvalidArgument(format!(
            "tide {} on device {ord}: called during CUDA graph capture; tide's collectives rendezvous on the host \
             and cannot be captured (do not mark the handler command-buffer compatible)",
            op_name(call.op)
        )));
    }
    if call.topology.nodes > 1 && !multi_node {
        return Err(TideError::InvalidTopology(format!(
            "tide {} on device {ord}: topology {} has several nodes; the CUDA engine runs single-node plans only \
             (multi-node is not supported on the CUDA engine yet)",
            op_name(call.op),
            call.topology
        )));
    }
    call.topology.check_world(call.world)?;

    // Hot path: the site's prepared plan, if the call's buffers still have its shapes (checked
    // against the cached layout without building a new one).
    let settings = device::PlanSettings::of(call.op, cfg);
    let cached = st
        .prepared
        .get(&(call.site, call.op))
        .filter(|p| {
            p.rank == call.rank
                && p.topology == call.topology
                && p.settings == settings
                && same_shapes(&p.layout, call)
        })
        .cloned();
    let prepared = match cached {
        Some(p) => p,
        None => {
            let layout = call.layout()?;
            let plan = match call.op {
                Op::AllGather => crate::plan::all_gather(&layout, call.topology)?,
                Op::ReduceScatter => crate::plan::reduce_scatter(
                    &layout,
                    call.topology,
                    crate::plan::RsOptions {
                        stage_slots: cfg.rs_stage_slots,
                        slot_bytes: cfg.rs_slot_bytes,
                    },
                )?,
            };
            plan.validate()?;
            let schedule = schedule::build(
                &plan,
                call.rank,
                &SchedOptions::new(settings.streams, settings.local_copy),
            )?;
            let p = Arc::new(Prepared {
                op: call.op,
                rank: call.rank,
                topology: call.topology,
                layout,
                plan,
                schedule,
                settings,
            });
            st.prepared.insert((call.site, call.op), p.clone());
            p
        }
    };
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
    // NVLink multicast: off unless asked for; then the whole gate (multicast module header), the
    // device attribute query last. No multicast call is made here.
    let mc = if call.op == Op::AllGather && cfg.multicast {
        let shard_bytes: Vec<usize> = plan.layout.params.iter().map(|p| p.shard_bytes).collect();
        let dev = st.dev;
        let d = multicast::decide(
            &multicast::GateInputs {
                requested: cfg.multicast,
                env_denial: multicast::env_denial(&|k| std::env::var(k).ok()),
                nodes: call.topology.nodes,
                world: call.world,
                shard_bytes: &shard_bytes,
            },
            &mut || multicast::device_supports(dev, ord),
        );
        multicast::log_once(ord, call.site, &d);
        d.granted()
    } else {
        None
    };
    if mc.is_some() {
        st.ensure_side_streams(1)?;
        st.ensure_phase_events(1)?;
    }

    let n = plan.layout.len();
    let mut inputs = Vec::with_capacity(n);
    let mut outputs = Vec::with_capacity(n);
    for i in 0..n {
        for (list, view, bytes, role) in [
            (&mut inputs, &call.inputs[i], plan.input_bytes(i), "operand"),
            (
                &mut outputs,
                &call.outputs[i],
                plan.output_bytes(i),
                "result",
            ),
        ] {
            if view.ptr == 0 && bytes > 0 {
                return Err(TideError::InvalidArgument(format!(
                    "tide {} on rank {}: {}: {role} buffer is null",
                    op_name(call.op),
                    call.rank,
                    plan.layout.params[i].describe()
                )));
            }
            list.push((view.ptr as u64, bytes));
        }
    }

    // Rule 1: order after this rank's previous call, then mark the inputs ready.
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

    let info = RankInfo {
        device: ord,
        inputs,
        outputs,
        stages,
        ready: st.ready as usize,
        done: st.done as usize,
        phases: st
            .phase
            .iter()
            .take(
                plan.phases
                    .len()
                    .saturating_sub(1)
                    .max(usize::from(mc.is_some())),
            )
            .map(|e| *e as usize)
            .collect(),
        multicast: mc.is_some(),
        error: None,
    };
    Ok(Local { prepared, info, mc })
}

/// Whether `call`'s buffers have exactly the shapes and dtypes of `layout` (what `call.layout()`
/// would rebuild and validate): the full parameter on one side, the dim-0 shard on the other.
fn same_shapes(layout: &crate::layout::GroupLayout, call: &CallInfo) -> bool {
    let n = layout.params.len();
    if layout.world != call.world || call.inputs.len() != n || call.outputs.len() != n {
        return false;
    }
    layout.params.iter().enumerate().all(|(i, p)| {
        let (full, shard, shard_dtype) = match call.op {
            Op::AllGather => (&call.outputs[i], &call.inputs[i], p.dtype),
            Op::ReduceScatter => (&call.inputs[i], &call.outputs[i], crate::layout::DType::F32),
        };
        full.dims == p.shape
            && full.dtype == p.dtype
            && shard.dtype == shard_dtype
            && shard.dims.first() == Some(&p.shard_rows)
            && shard.dims.iter().skip(1).eq(p.shape.iter().skip(1))
    })
}

/// Checks what the peers published against this rank's plan.
fn check_peers(call: &CallInfo, prepared: &Prepared, infos: &[RankInfo]) -> Result<()> {
    let plan = &prepared.plan;
    if infos.len() != call.world {
        return Err(TideError::Internal(format!(
            "rendezvous returned {} ranks, world is {}",
            infos.len(),
            call.world
        )));
    }
    for (q, info) in infos.iter().enumerate() {
        if let Some(e) = &info.error {
            return Err(TideError::Rendezvous(format!(
                "rank {q} (device {}) failed: {e}",
                info.device
            )));
        }
    }
    for (q, info) in infos.iter().enumerate() {
        let n = plan.layout.len();
        let mismatch = |what: String| {
            Err(TideError::InvalidArgument(format!(
                "tide {} site {}: rank {q} (device {}) disagrees with rank {}: {what}; every rank must call with the same \
                 parameter group",
                op_name(call.op),
                call.site,
                info.device,
                call.rank
            )))
        };
        if info.inputs.len() != n || info.outputs.len() != n {
            return mismatch(format!(
                "{} operands / {} results, expected {n}",
                info.inputs.len(),
                info.outputs.len()
            ));
        }
        for i in 0..n {
            if info.inputs[i].1 != plan.input_bytes(i) || info.outputs[i].1 != plan.output_bytes(i)
            {
                return mismatch(format!(
                    "{}: buffer sizes differ",
                    plan.layout.params[i].describe()
                ));
            }
        }
        if info.stages.len() < plan.stage_slot_bytes.len()
            || info
                .stages
                .iter()
                .zip(&plan.stage_slot_bytes)
                .any(|(s, &b)| s.1 < b)
        {
            return mismatch("stage slots differ (TIDE_RS_* settings must match)".into());
        }
        if info.ready == 0 || info.done == 0 || info.phases.len() + 1 < plan.phases.len() {
            return mismatch("missing events".into());
        }
    }
    Ok(())
}

fn run(
    call: &CallInfo,
    st: &mut DeviceState,
    local: &Local,
    session: &Session<RankInfo>,
    cfg: &Config,
) -> Result<()> {
    let infos = session.values();
    let prepared = &local.prepared;
    check_peers(call, prepared, infos)?;
    for (q, info) in infos.iter().enumerate() {
        if q != call.rank {
            st.ensure_peer(info.device)?;
        }
    }
    let main = call.stream as CUstream;
    let sched = &prepared.schedule;
    let nphases = sched.phases.len();
    let mut issued_side = false;
    // Optional batching of consecutive copy-engine copies per stream (TIDE_COPY_BATCH).
    let batching = cfg.copy_batch && driver::init().map(|v| v >= 13000).unwrap_or(false);
    let mut pending: Vec<Vec<BatchCopy>> = vec![Vec::new(); st.side.len() + 1];
    // The multicast all-gather only if every rank granted it (all see the same published values).
    let mc = local.mc.filter(|_| infos.iter().all(|i| i.multicast));
    let res = (|| -> Result<()> {
        if let Some(g) = mc {
            issued_side = true;
            return issue_multicast(call, st, prepared, infos, session, g, main, cfg);
        }
        for (p, phase) in sched.phases.iter().enumerate() {
            for cmd in &phase.cmds {
                let s = cmd.stream();
                if s != MAIN {
                    issued_side = true;
                }
                if batching {
                    if let Cmd::Copy {
                        src,
                        dst,
                        bytes,
                        via: CopyVia::CopyEngine,
                        ..
                    } = cmd
                    {
                        let c = BatchCopy {
                            dst: address(infos, dst, *bytes)?,
                            src: address(infos, src, *bytes)?,
                            bytes: *bytes,
                            dst_dev: infos[dst.rank].device,
                            src_dev: infos[src.rank].device,
                        };
                        pending
                            .get_mut(s)
                            .ok_or_else(|| TideError::Internal(format!("stream {s} out of range")))?
                            .push(c);
                        continue;
                    }
                    flush_batch(call, st, main, s, &mut pending)?;
                }
                issue(call, st, infos, prepared, main, p, cmd, cfg)?;
            }
            for s in 0..pending.len() {
                flush_batch(call, st, main, s, &mut pending)?;
            }
            if p + 1 < nphases {
                let ev = st.phase[p];
                // SAFETY: valid event and stream; context current.
                check(
                    unsafe { sys::cuEventRecord(ev, main) },
                    "cuEventRecord",
                    || {
                        format!(
                            "rank {} device {}: phase {p} event",
                            call.rank, call.device_ordinal
                        )
                    },
                )?;
                session.barrier(call.rank, &format!("phase {p} ({})", phase.name))?;
            }
        }
        Ok(())
    })();
    if let Err(e) = res {
        // Keep XLA's stream ordered after whatever was enqueued on the side streams.
        if issued_side {
            let ev = st.pool.get(sched.events).copied();
            for &s in &st.side {
                if let Err(j) = record_wait(ev, s, main) {
                    log::warn!(
                        "tide: rank {}: joining side streams after an error failed: {j}",
                        call.rank
                    );
                }
            }
        }
        return Err(e);
    }
    // Rule 5.
    // SAFETY: valid event and stream.
    check(
        unsafe { sys::cuEventRecord(st.done, main) },
        "cuEventRecord",
        || {
            format!(
                "rank {} device {}: done event",
                call.rank, call.device_ordinal
            )
        },
    )?;
    session.barrier(call.rank, "exit")?;
    for (q, info) in infos.iter().enumerate() {
        if q != call.rank {
            // SAFETY: the peer's done event, recorded before the exit barrier; valid for the process.
            check(
                unsafe { sys::cuStreamWaitEvent(main, info.done as CUevent, 0) },
                "cuStreamWaitEvent",
                || {
                    format!(
                        "rank {} device {}: on rank {q}'s done event",
                        call.rank, call.device_ordinal
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// The NVLink multicast all-gather (see the `multicast` module header): set up the (site, group)
/// buffer once, collectively; store this rank's shards to the multicast address on MAIN; "pushed"
/// event and barrier; fan out every rank's rows from the local backing to the outputs on side
/// stream 1; MAIN joins it. Only reachable with a `Granted` from every rank.
#[allow(clippy::too_many_arguments)]
fn issue_multicast(
    call: &CallInfo,
    st: &mut DeviceState,
    prepared: &Prepared,
    infos: &[RankInfo],
    session: &Session<RankInfo>,
    g: multicast::Granted,
    main: CUstream,
    cfg: &Config,
) -> Result<()> {
    let ord = call.device_ordinal;
    let rank = call.rank;
    let mp = multicast::plan(&prepared.layout, rank);
    let shared = multicast::shared(call.site, call.group, mp.bytes);
    // Every rank reads `complete` after the same barrier, so all agree on whether to set up.
    session.barrier(rank, "multicast check")?;
    if !shared.complete() {
        if rank == 0 {
            shared.set_handle(multicast::create(g, call.world, mp.bytes, ord)?);
        }
        session.barrier(rank, "multicast created")?;
        let (handle, size) = shared.handle()?;
        multicast::add_device(g, handle, st.dev, ord)?;
        session.barrier(rank, "multicast devices added")?;
        shared.set_rank(rank, multicast::bind_and_map(g, handle, size, ord)?);
        session.barrier(rank, "multicast bound")?;
        if rank == 0 {
            shared.mark_complete();
        }
    }
    let mine = shared.rank(rank)?;
    let f = multicast::kernel(g, ord, st.cc)?;
    let me = &infos[rank];
    for s in &mp.stores {
        let (src, bytes) = me.inputs[s.param];
        if bytes < s.bytes || s.mc_offset + s.bytes > mine.size {
            return Err(TideError::Internal(format!(
                "multicast store of param {} out of bounds",
                s.param
            )));
        }
        multicast::launch_store(
            g,
            f,
            main,
            mine.mc + s.mc_offset as u64,
            src,
            s.bytes,
            cfg.rs_max_ctas,
        )?;
    }
    let pushed = *st
        .phase
        .first()
        .ok_or_else(|| TideError::Internal("no pushed event".into()))?;
    // SAFETY: valid event and stream; context current.
    check(
        unsafe { sys::cuEventRecord(pushed, main) },
        "cuEventRecord",
        || format!("rank {rank} device {ord}: multicast pushed event"),
    )?;
    session.barrier(rank, "multicast pushed")?;
    let side = stream_of(st, main, 1)?;
    for (q, info) in infos.iter().enumerate() {
        let ev = *info.phases.first().ok_or_else(|| {
            TideError::Internal(format!("rank {q} published no multicast pushed event"))
        })?;
        // SAFETY: rank q's pushed event, recorded before the barrier above.
        check(
            unsafe { sys::cuStreamWaitEvent(side, ev as CUevent, 0) },
            "cuStreamWaitEvent",
            || format!("rank {rank} device {ord}: on rank {q}'s multicast pushed event"),
        )?;
    }
    for fan in &mp.fanout {
        let (out, out_bytes) = me.outputs[fan.param];
        if fan.out_offset + fan.bytes > out_bytes || fan.backing_offset + fan.bytes > mine.size {
            return Err(TideError::Internal(format!(
                "multicast fan-out of param {} from rank {} out of bounds",
                fan.param, fan.src_rank
            )));
        }
        // SAFETY: ranges checked above; both on this device.
        check(
            unsafe {
                sys::cuMemcpyAsync(
                    out + fan.out_offset as u64,
                    mine.uc + fan.backing_offset as u64,
                    fan.bytes,
                    side,
                )
            },
            "cuMemcpyAsync",
            || format!("rank {rank} device {ord}: multicast fan-out"),
        )?;
    }
    let join = *st
        .pool
        .first()
        .ok_or_else(|| TideError::Internal("no local event".into()))?;
    // SAFETY: valid handles.
    unsafe {
        check(sys::cuEventRecord(join, side), "cuEventRecord", || {
            format!("rank {rank} device {ord}: multicast join")
        })?;
        check(
            sys::cuStreamWaitEvent(main, join, 0),
            "cuStreamWaitEvent",
            || format!("rank {rank} device {ord}: multicast join"),
        )
    }
}

/// A copy-engine copy waiting to be issued in a batch.
#[derive(Debug, Clone, Copy)]
struct BatchCopy {
    dst: u64,
    src: u64,
    bytes: usize,
    dst_dev: i64,
    src_dev: i64,
}

/// Whether the driver exports cuMemcpyBatchAsync_v2 (CUDA 12.8+ drivers); older drivers get one
/// cuMemcpyAsync per copy instead of failing (cudarc's lazy loader would panic on the call).
fn batch_copy_supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        // SAFETY: only looks the symbol up; the library is the one the engine already loaded.
        std::panic::catch_unwind(|| unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2\0")
                .is_ok()
        })
        .unwrap_or(false)
    })
}

/// Issues the copies pending on stream `s`: one cuMemcpyAsync, or one cuMemcpyBatchAsync for
/// several (source order: stream; hints: the devices holding source and destination).
fn flush_batch(
    call: &CallInfo,
    st: &DeviceState,
    main: CUstream,
    s: usize,
    pending: &mut [Vec<BatchCopy>],
) -> Result<()> {
    let Some(list) = pending.get_mut(s) else {
        return Ok(());
    };
    if list.is_empty() {
        return Ok(());
    }
    let copies = std::mem::take(list);
    let stream = stream_of(st, main, s)?;
    let what = || {
        format!(
            "rank {} device {}: {} copies on stream {s}, {} bytes",
            call.rank,
            call.device_ordinal,
            copies.len(),
            copies.iter().map(|c| c.bytes).sum::<usize>()
        )
    };
    if copies.len() == 1 || !batch_copy_supported() {
        for c in &copies {
            // SAFETY: addresses bounds-checked by `address`; ordering per the module header.
            check(
                unsafe { sys::cuMemcpyAsync(c.dst, c.src, c.bytes, stream) },
                "cuMemcpyAsync",
                what,
            )?;
        }
        return Ok(());
    }
    let loc = |dev: i64| sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev as i32,
    };
    let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.dst).collect();
    let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.src).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.bytes).collect();
    let mut attrs: Vec<sys::CUmemcpyAttributes> = copies
        .iter()
        .map(|c| sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: loc(c.src_dev),
            dstLocHint: loc(c.dst_dev),
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        })
        .collect();
    let mut idxs: Vec<usize> = (0..copies.len()).collect();
    // SAFETY: five arrays of `copies.len()` entries, alive across the call; addresses checked.
    check(
        unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                attrs.as_mut_ptr(),
                idxs.as_mut_ptr(),
                copies.len(),
                stream,
            )
        },
        "cuMemcpyBatchAsync",
        what,
    )
}

/// Best effort on the error path: `to` waits on everything enqueued so far on `from`.
fn record_wait(ev: Option<CUevent>, from: CUstream, to: CUstream) -> Result<()> {
    let ev = ev.ok_or_else(|| TideError::Internal("no event".into()))?;
    // SAFETY: valid handles; errors are ignored by the caller.
    unsafe {
        check(sys::cuEventRecord(ev, from), "cuEventRecord", String::new)?;
        check(
            sys::cuStreamWaitEvent(to, ev, 0),
            "cuStreamWaitEvent",
            String::new,
        )
    }
}

fn stream_of(st: &DeviceState, main: CUstream, s: usize) -> Result<CUstream> {
    if s == MAIN {
        Ok(main)
    } else {
        st.side
            .get(s - 1)
            .copied()
            .ok_or_else(|| TideError::Internal(format!("side stream {s} not created")))
    }
}

/// The device address of `len` bytes at `r`, bounds-checked against what its rank published.
fn address(infos: &[RankInfo], r: &Region, len: usize) -> Result<u64> {
    let info = infos.get(r.rank).ok_or_else(|| {
        TideError::Internal(format!("region {r:?} names a rank outside the group"))
    })?;
    let list = match r.kind {
        BufKind::Input => &info.inputs,
        BufKind::Output => &info.outputs,
        BufKind::Stage => &info.stages,
    };
    let (base, bytes) = *list.get(r.index).ok_or_else(|| {
        TideError::Internal(format!("region {r:?}: no such buffer on rank {}", r.rank))
    })?;
    match r.offset.checked_add(len) {
        Some(end) if end <= bytes => Ok(base + r.offset as u64),
        _ => Err(TideError::Internal(format!(
            "region {r:?} + {len} bytes is outside its buffer of {bytes} bytes on rank {}",
            r.rank
        ))),
    }
}

/// "phase 0 step 12, param 3 (name, shape) on rank 1" for error messages.
fn step_ctx(call: &CallInfo, prepared: &Prepared, phase: usize, step: usize, r: &Region) -> String {
    let param = match r.kind {
        BufKind::Input | BufKind::Output => prepared
            .layout
            .params
            .get(r.index)
            .map(|p| format!(", {}", p.describe()))
            .unwrap_or_default(),
        BufKind::Stage => format!(", stage slot {}", r.index),
    };
    format!(
        "tide {} site {} rank {} device {}: phase {phase} step {step}{param}, {:?} of rank {}",
        op_name(call.op),
        call.site,
        call.rank,
        call.device_ordinal,
        r.kind,
        r.rank
    )
}

#[allow(clippy::too_many_arguments)]
fn issue(
    call: &CallInfo,
    st: &DeviceState,
    infos: &[RankInfo],
    prepared: &Prepared,
    main: CUstream,
    phase: usize,
    cmd: &Cmd,
    cfg: &Config,
) -> Result<()> {
    let ord = call.device_ordinal;
    let rank = call.rank;
    let s = stream_of(st, main, cmd.stream())?;
    match cmd {
        Cmd::WaitRank { rank: q, event, .. } => {
            let info = &infos[*q];
            let ev = match event {
                RankEvent::Ready => info.ready,
                RankEvent::Phase(p) => *info.phases.get(*p).ok_or_else(|| {
                    TideError::Internal(format!("rank {q} published no phase {p} event"))
                })?,
            };
            // SAFETY: a peer's event handle, created once for the life of the process.
            check(
                unsafe { sys::cuStreamWaitEvent(s, ev as CUevent, 0) },
                "cuStreamWaitEvent",
                || format!("rank {rank} device {ord}: on rank {q}'s {event:?} event"),
            )
        }
        Cmd::WaitOwnPrevDone { .. } => {
            // SAFETY: our own event.
            check(
                unsafe { sys::cuStreamWaitEvent(s, st.done, 0) },
                "cuStreamWaitEvent",
                || format!("rank {rank} device {ord}: side stream on the previous done event"),
            )
        }
        Cmd::Record { event, .. } => {
            let ev = *st
                .pool
                .get(*event)
                .ok_or_else(|| TideError::Internal(format!("local event {event} not created")))?;
            // SAFETY: valid event and stream.
            check(
                unsafe { sys::cuEventRecord(ev, s) },
                "cuEventRecord",
                || format!("rank {rank} device {ord}: local event {event}"),
            )
        }
        Cmd::Wait { event, .. } => {
            let ev = *st
                .pool
                .get(*event)
                .ok_or_else(|| TideError::Internal(format!("local event {event} not created")))?;
            // SAFETY: valid event and stream.
            check(
                unsafe { sys::cuStreamWaitEvent(s, ev, 0) },
                "cuStreamWaitEvent",
                || format!("rank {rank} device {ord}: local event {event}"),
            )
        }
        Cmd::Copy {
            step,
            src,
            dst,
            bytes,
            via,
            ..
        } => {
            let sa = address(infos, src, *bytes)?;
            let da = address(infos, dst, *bytes)?;
            match via {
                CopyVia::CopyEngine => {
                    // SAFETY: both ranges bounds-checked against the buffers their ranks published;
                    // peer access enabled; ordering per the module header.
                    check(
                        unsafe { sys::cuMemcpyAsync(da, sa, *bytes, s) },
                        "cuMemcpyAsync",
                        || {
                            format!(
                                "{} -> {:?} of rank {}, {bytes} bytes",
                                step_ctx(call, prepared, phase, *step, src),
                                dst.kind,
                                dst.rank
                            )
                        },
                    )
                }
                CopyVia::Sm => {
                    let m = st
                        .module
                        .as_ref()
                        .ok_or_else(|| TideError::Internal("kernel module not loaded".into()))?;
                    let width = kernels::copy_width(da, sa);
                    let grid =
                        kernels::grid((*bytes as u64).div_ceil(width as u64), cfg.rs_max_ctas);
                    let (mut d, mut sp, mut n, mut w) = (da, sa, *bytes as u64, width);
                    let mut params: [*mut std::ffi::c_void; 4] = [
                        &mut d as *mut u64 as *mut _,
                        &mut sp as *mut u64 as *mut _,
                        &mut n as *mut u64 as *mut _,
                        &mut w as *mut i32 as *mut _,
                    ];
                    // SAFETY: params match tide_copy(void*, const void*, unsigned long long, int) and
                    // live across the call (the driver copies them at launch); ranges bounds-checked.
                    check(
                        unsafe {
                            sys::cuLaunchKernel(
                                m.copy,
                                grid,
                                1,
                                1,
                                kernels::THREADS,
                                1,
                                1,
                                0,
                                s,
                                params.as_mut_ptr(),
                                std::ptr::null_mut(),
                            )
                        },
                        "cuLaunchKernel(tide_copy)",
                        || {
                            format!(
                                "{}, {bytes} bytes, grid {grid}",
                                step_ctx(call, prepared, phase, *step, src)
                            )
                        },
                    )
                }
            }
        }
        Cmd::Zero {
            step, dst, bytes, ..
        } => {
            let da = address(infos, dst, *bytes)?;
            // SAFETY: range bounds-checked; the buffer is this rank's output.
            check(
                unsafe { sys::cuMemsetD8Async(da, 0, *bytes, s) },
                "cuMemsetD8Async",
                || {
                    format!(
                        "{}, {bytes} bytes",
                        step_ctx(call, prepared, phase, *step, dst)
                    )
                },
            )
        }
        Cmd::Reduce {
            step,
            dst,
            srcs,
            elems,
            ..
        } => {
            let m = st
                .module
                .as_ref()
                .ok_or_else(|| TideError::Internal("kernel module not loaded".into()))?;
            let da = address(infos, dst, elems * 4)?;
            let dtypes: Vec<_> = srcs.iter().map(|o| o.dtype).collect();
            for l in kernels::sum_launches(&dtypes)? {
                let mut ptrs = kernels::SrcPtrs {
                    p: [0; kernels::MAX_SRCS],
                };
                for k in 0..l.count {
                    let o = &srcs[l.first + k];
                    ptrs.p[k] = address(infos, &o.region, elems * o.dtype.size_bytes())?;
                }
                let vectorized = kernels::sum_vectorized(da, &ptrs.p[..l.count]);
                let mode = kernels::sum_mode(
                    vectorized,
                    l.dtype,
                    cfg.rs_kernel == crate::config::RsKernel::St,
                );
                let mut grid = kernels::grid(
                    kernels::sum_units_mode(*elems as u64, l.dtype, mode),
                    cfg.rs_max_ctas,
                );
                let mut f = m.sum(l.dtype)?;
                let mut smem = 0u32;
                if cfg.rs_kernel == crate::config::RsKernel::Bulk {
                    match m.sum_bulk(l.dtype) {
                        Some(b) => {
                            if kernels::bulk_eligible(vectorized, l.count, *elems as u64, l.dtype) {
                                f = b;
                                smem = kernels::bulk_smem(l.count);
                                grid = kernels::bulk_tiles(*elems as u64, l.dtype)
                                    .clamp(1, cfg.rs_max_ctas.max(1) as u64)
                                    as u32;
                            }
                        }
                        None => {
                            static WARNED: std::sync::Once = std::sync::Once::new();
                            WARNED.call_once(|| {
                                log::warn!(
                                    "tide: TIDE_RS_KERNEL=bulk unavailable ({}); using the ld kernel",
                                    m.bulk_why
                                )
                            });
                        }
                    }
                }
                let mut d = da;
                let mut nsrc = l.count as i32;
                let mut n = *elems as u64;
                let mut acc = l.accumulate as i32;
                let mut vec = mode;
                let mut params: [*mut std::ffi::c_void; 6] = [
                    &mut d as *mut u64 as *mut _,
                    &mut ptrs as *mut kernels::SrcPtrs as *mut _,
                    &mut nsrc as *mut i32 as *mut _,
                    &mut n as *mut u64 as *mut _,
                    &mut acc as *mut i32 as *mut _,
                    &mut vec as *mut i32 as *mut _,
                ];
                // SAFETY: params match rs_sum_*(float*, TideSrcs, int, unsigned long long, int, int)
                // (TideSrcs = SrcPtrs, repr(C)); all ranges bounds-checked; sources are local or
                // peer memory with access enabled.
                check(
                    unsafe {
                        sys::cuLaunchKernel(
                            f,
                            grid,
                            1,
                            1,
                            kernels::THREADS,
                            1,
                            1,
                            smem,
                            s,
                            params.as_mut_ptr(),
                            std::ptr::null_mut(),
                        )
                    },
                    "cuLaunchKernel(rs_sum)",
                    || {
                        format!(
                            "{}, {} {} sources from {}, {elems} elements, grid {grid}, smem {smem}",
                            step_ctx(call, prepared, phase, *step, dst),
                            l.count,
                            l.dtype.name(),
                            l.first
                        )
                    },
                )?;
            }
            Ok(())
        }
    }
}
