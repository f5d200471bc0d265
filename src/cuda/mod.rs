//! CUDA engine: runs plans on the GPUs of this process with copy engines and short-lived fp32
//! reduction kernels. One process drives all local GPUs; XLA runs each device's program on its own
//! host thread and calls `execute` there with its stream (`call.stream`) and device ordinal.
//!
//! Modules: `schedule` (pure: steps -> streams, events; unit-tested), `kernels` (pure: the embedded
//! `kernels/rs_sum.cu`, launch shapes), `nvrtc` (compiling it), `driver` (checked driver calls),
//! `device` (per-device state), `multicast` (the opt-in, gated NVLink multicast all-gather; off
//! unless TIDE_MULTICAST=1 and the device supports it), `fuse` (small copies and sums as batched
//! launches, TIDE_FUSE_BYTES), `meeting` (how a call's ranks meet: the `Meeting` trait, its
//! in-process impl, the unwind and panic guards), `multiproc` (the multi-process meeting and its
//! rail), this file (the call: start/done, the one phase loop, ordering, issuing).
//!
//! # One driver
//! Every call, in-process or multi-process, synchronous or split, enters at `execute_phase`
//! (start/done, per-call in-flight slots: rules A1-A4 below) and is issued by one phase loop and
//! end of call, `run_phases` (rules 3-5 / A2-A3) under `meeting::end_call` (unwind guard, failure
//! published to the peers, leave), over a `meeting::Meeting` built after the exchange:
//! `meeting::InProcess` (`rendezvous::Session`) or `multiproc::Mailbox` (`transport::ProcessGroup`,
//! mailboxes, interprocess events, and the NCCL rail as hooks at phase start, per cross-node copy,
//! at phase and `done` records). What the two paths hand `run_phases` differs only as data
//! (`Issue`): MAIN and its side streams, local, phase and `done` events (the slot's in-process; the
//! device's, with XLA's stream or a slot's tide stream as MAIN, multi-process), whether small work
//! is fused (TIDE_FUSE_BYTES: in-process only) and the multicast grant (in-process only).
//! TIDE_COPY_BATCH applies to both.
//!
//! # Start/done: the in-process driver (`execute_phase`; rules A1-A4, modelled and each shown
//! necessary in `schedule`'s tests `start_done_*`)
//! Every in-process call, synchronous or split, runs on an *in-flight slot* of its device and op
//! (`device::Slot`): tide's own stream T (the schedule's MAIN: reductions with at most
//! TIDE_RS_MAX_CTAS CTAs, zeroing, SM copies, joins), side copy streams, its own events (`entry`,
//! `ready`, `done`, `released`, phase and local events) and, for the reduce-scatter, its own stage
//! slots. A slot belongs to one call from its start until its done (`device::SlotLease`), so two
//! calls in flight never share events or staging. At most TIDE_MAX_IN_FLIGHT (default 4) calls per
//! op and device: a start beyond that fails with an error naming the setting (it cannot wait: the
//! done that would free a slot runs later on the same thread). Memory per device: the all-gather
//! none beyond XLA's buffers; the reduce-scatter TIDE_MAX_IN_FLIGHT x TIDE_RS_STAGE_SLOTS x
//! TIDE_RS_SLOT_BYTES (default at most 4 x 3 x 32 MiB = 384 MiB; a slot's staging is allocated when
//! the slot is first used, so a program with at most 2 reduce-scatters in flight uses 192 MiB), kept.
//! - A1 (start): XLA's stream X records `entry`; T waits on it and records `ready`. So `ready`
//!   follows everything XLA enqueued before the start (the inputs' producers, the last readers of
//!   the output buffers) and everything the slot's previous call enqueued on T, even a call whose
//!   done never ran. X is not made to wait.
//! - A2: rendezvous publishing buffers and T's events; the schedule is issued with MAIN = T: every
//!   stream waits on the `ready` of each rank whose buffers it touches before its first command
//!   (side streams on their own rank's too). The schedule's previous-done wait is skipped: A1
//!   implies it. Phases as in rule 4 below, on T.
//! - A3: T (which joined the side streams) records `done`; exit barrier; T waits on every peer's
//!   `done` (they finished reading this rank's inputs) and records `released`; then every rank
//!   `leave`s the session, which returns only once all ranks did: no event of the call is recorded
//!   again (by a later call on its slot) before every wait on it has been issued.
//! - A4 (done, later on X): X waits on `released`, then the slot is freed. Done finds its start
//!   through `crate::inflight` by the buffer addresses and fails, naming the site, if they differ
//!   (never stale data). Done's operands are start's results (aliased) and start's operands again,
//!   so XLA keeps both alive until then.
//!
//! Synchronous targets are A1-A4 back to back. Edge cases: done without start fails (no record);
//! two starts of one site in flight are two records (distinct result buffers), each with its own
//! slot; a start without done keeps its slot until the next start writing the same result buffer
//! replaces its record (the dropped call still runs to completion on T; XLA's stream never waits
//! for it, so a program must not reuse its buffers before then: tide_jax always pairs them); a
//! start that fails leaves no record and makes X wait on whatever it enqueued.
//!
//! # Buffer ownership and stream rules (the multi-process path, `multiproc`)
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
//! Concurrency: the in-process driver holds a device's state lock only while it takes a slot,
//! prepares the plan and the slot's resources and records rule A1's events; the rendezvous and the
//! issuing run on copies of the slot's handles without it, so several ranks may share one device
//! (tests on one GPU). The multi-process path holds it for its whole call. XLA issues a device's
//! calls from that device's thread one at a time; if two tide calls of one device were ever issued
//! concurrently in different orders on two devices, they would fail with a rendezvous timeout, not
//! hang. On errors the rank calls `Session::fail` so peers fail fast; work already enqueued is
//! still ordered before XLA's later work (A3's error path, `released`).
//!
//! Multi-process jobs (`call.job != 0`) prepare and exchange in `multiproc` (a shared-memory
//! mailbox, peers mapped by VMM/IPC, the rail over NCCL: docs/multiprocess.md) and are issued by
//! `run_phases`; their start runs the call with a slot's tide stream as MAIN but the device's side
//! streams, events and staging (`start_multiprocess`: rules 1-5, calls serialized by the previous
//! `done`), because their staging and events are exported to other processes once per device and
//! rank, not per slot. In one process,
//! multi-node (hierarchical) plans are refused with a clear error; CUDA graph capture
//! of the call is refused (the handler must not be declared command-buffer compatible).

pub mod device;
pub mod driver;
pub mod fuse;
pub mod ipc;
pub mod kernels;
pub mod meeting;
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
use meeting::Meeting;
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

impl RankInfo {
    /// What a rank publishes for a call of `plan` on device `device`: its buffers, its `ready` and
    /// `done` events and the phase events the plan needs (at least one with multicast: "pushed").
    #[allow(clippy::type_complexity)]
    pub(crate) fn published(
        device: i64,
        (inputs, outputs): (Vec<(u64, usize)>, Vec<(u64, usize)>),
        stages: Vec<(u64, usize)>,
        (ready, done, phase): (CUevent, CUevent, &[CUevent]),
        plan: &crate::plan::Plan,
        multicast: bool,
    ) -> RankInfo {
        RankInfo {
            device,
            inputs,
            outputs,
            stages,
            ready: ready as usize,
            done: done as usize,
            phases: phase
                .iter()
                .take(plan.phases.len().saturating_sub(1).max(usize::from(multicast)))
                .map(|e| *e as usize)
                .collect(),
            multicast,
            error: None,
        }
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "all_gather",
        Op::ReduceScatter => "reduce_scatter",
    }
}

/// The FFI edge's entry for a whole (synchronous) call: `job` is the FFI attribute `job` (0: every
/// rank of the call is in this process, the in-process engine; else the multi-process job id,
/// `multiproc`).
pub fn execute_job(call: &CallInfo, job: u64) -> Result<()> {
    if job == 0 {
        execute(call)
    } else {
        multiproc::execute(call, job)
    }
}

/// What a started in-process call hands to its done (through `inflight::Record`'s payload): the
/// event done makes XLA's stream wait on, and the slot, held until then.
struct Started {
    ctx: driver::CUcontext,
    released: CUevent,
    _lease: device::SlotLease,
}

// SAFETY: raw CUDA handles (a retained primary context and an event that lives for the process),
// valid in every thread of the process.
unsafe impl Send for Started {}

impl Started {
    /// The end of a start on both paths: on an error, XLA's stream is still ordered after whatever
    /// was enqueued on tide's stream (which recorded `released` after joining its side streams).
    fn finish(self, call: &CallInfo, result: Result<()>) -> Result<Started> {
        match result {
            Ok(()) => Ok(self),
            Err(e) => {
                if call.stream != 0 {
                    if let Err(j) = self.join_into(call.stream as CUstream, call.device_ordinal) {
                        log::warn!(
                            "tide: rank {} device {}: joining tide's stream after an error failed: {j}",
                            call.rank,
                            call.device_ordinal
                        );
                    }
                }
                Err(e)
            }
        }
    }

    /// Rule A4: XLA's `stream` waits on `released`.
    fn join_into(&self, stream: CUstream, device: i64) -> Result<()> {
        let _ctx = driver::CtxGuard::set(self.ctx, device)?;
        // SAFETY: XLA's stream (valid for the call) and our event.
        check(
            unsafe { sys::cuStreamWaitEvent(stream, self.released, 0) },
            "cuStreamWaitEvent",
            || format!("device {device}: XLA's stream on the call's released event"),
        )
    }
}

/// The FFI edge's entry for every target: `phase` says whether this is a whole call, its start or
/// its done (the module header, "Start/done").
///
/// In-process jobs (`job == 0`): start enqueues the whole collective on tide's streams (the
/// call's in-flight slot) ordered after everything XLA enqueued before it, and returns without
/// making XLA's stream wait; done makes XLA's stream wait on the call's `released` event (this
/// rank's results written, every peer done reading its inputs). Sync is start and done back to back.
///
/// Multi-process jobs (`start_multiprocess`): start runs the multi-process driver with a slot's
/// tide stream as its MAIN (ordered after XLA's stream by `entry`), so XLA's stream is not made to
/// wait either; done as in-process. Synchronous multi-process calls run on XLA's stream as before.
pub fn execute_phase(call: &CallInfo, job: u64, phase: crate::ffi::Phase) -> Result<()> {
    use crate::ffi::{op_code, Phase};
    use crate::inflight;
    let outputs = || call.outputs.iter().map(|b| b.ptr).collect::<Vec<_>>();
    match phase {
        Phase::Sync => execute_job(call, job),
        Phase::Start => {
            let record = inflight::Record::new(
                format!(
                    "tide {}_start site {} on device {}",
                    op_name(call.op),
                    call.site,
                    call.device_ordinal
                ),
                call.device_ordinal,
                outputs(),
                call.inputs.iter().map(|b| b.ptr).collect(),
            );
            let seq = rendezvous::run_seq(call.site, call.group, call.rank, call.run_id);
            if let Err(e) = inflight::register(op_code(call.op), record.clone()) {
                // Tell the peers at once rather than at their timeout.
                abandon(call, seq, &e);
                return Err(e);
            }
            let started = if job != 0 {
                start_multiprocess(call, job)
            } else {
                start(call, seq).map(Some)
            };
            match started {
                // The multi-process fallback ran synchronously on XLA's stream: nothing to wait on.
                Ok(None) => {
                    record.finish(Ok(()));
                    Ok(())
                }
                Ok(Some(started)) => {
                    record.set_payload(Box::new(started));
                    record.finish(Ok(()));
                    Ok(())
                }
                Err(e) => {
                    let _ = inflight::take(
                        "",
                        op_code(call.op),
                        call.device_ordinal,
                        &record.outputs,
                        &record.inputs,
                    );
                    record.finish(Err(e.clone()));
                    Err(e)
                }
            }
        }
        Phase::Done => {
            done(call, job)
        }
    }
}

/// The start of a multi-process call: the synchronous multi-process driver (`multiproc`, its own
/// rules 1-5) run with a slot's tide stream T as its MAIN instead of XLA's stream X: X records
/// `entry`, T waits on it, the whole call is enqueued on T (its rule 1 waits on the device's
/// previous `done`, so calls stay serialized on the device's shared side streams and staging), and
/// T records `released` after rule 5's waits on every peer's `done`. Done makes X wait on it, as
/// in-process. When no slot can be had (TIDE_MAX_IN_FLIGHT, or a CUDA error before the call), the
/// call runs synchronously on X instead (`Ok(None)`): skipping it would leave this rank's peers out
/// of step.
fn start_multiprocess(call: &CallInfo, job: u64) -> Result<Option<Started>> {
    let ord = call.device_ordinal;
    let prepared = (|| -> Result<_> {
        if call.stream == 0 {
            return Err(TideError::InvalidArgument(format!("device {ord}: XLA passed no CUDA stream")));
        }
        let cfg = crate::config::current();
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
            check(sys::cuEventRecord(s.entry, x), "cuEventRecord", || format!("device {ord}: entry event"))?;
            check(sys::cuStreamWaitEvent(s.tide, s.entry, 0), "cuStreamWaitEvent", || {
                format!("device {ord}: tide's stream on the entry event")
            })?;
        }
        Ok((st.ctx, s.tide, s.released, lease))
    })();
    let (ctx, tide, released, lease) = match prepared {
        Ok(p) => p,
        Err(e) => {
            log::warn!("tide: multi-process start on device {ord} runs synchronously: {e}");
            return multiproc::execute(call, job).map(|()| None);
        }
    };
    let mut on_tide = call.clone();
    on_tide.stream = tide as usize;
    let result = multiproc::execute(&on_tide, job);
    let started = Started {
        ctx,
        released,
        _lease: lease,
    };
    let recorded = driver::CtxGuard::set(ctx, ord).and_then(|_g| {
        // SAFETY: the slot's stream and event; context current.
        check(unsafe { sys::cuEventRecord(released, tide) }, "cuEventRecord", || {
            format!("device {ord}: released event")
        })
    });
    started.finish(call, result.and(recorded)).map(Some)
}

/// Done (rule A4): finds the call by its buffers, returns its start's error if it failed, else
/// makes XLA's stream wait on the call's `released` event and frees its slot.
fn done(call: &CallInfo, job: u64) -> Result<()> {
    use crate::ffi::op_code;
    use crate::inflight;
    let outputs = || call.outputs.iter().map(|b| b.ptr).collect::<Vec<_>>();
    let n = call.outputs.len();
    let what = format!("tide {}_done site {}", op_name(call.op), call.site);
    if call.inputs.len() != 2 * n {
        return Err(TideError::InvalidArgument(format!(
            "{what}: expected {} operands (start's {n} results, then its {n} operands), got {}",
            2 * n,
            call.inputs.len()
        )));
    }
    let record = inflight::take(
        &what,
        op_code(call.op),
        call.device_ordinal,
        &outputs(),
        &call.inputs[n..].iter().map(|b| b.ptr).collect::<Vec<_>>(),
    )?;
    // A CUDA start finishes before it returns, so the result is there at once; the bound
    // only guards against a start that never finished (never a hang).
    let (tx, rx) = std::sync::mpsc::channel();
    record.on_finish(move |r| {
        let _ = tx.send(r);
    });
    let wait = timeout(&crate::config::current());
    rx.recv_timeout(wait).unwrap_or_else(|_| {
        Err(TideError::Internal(format!(
            "{what}: its start did not finish within {wait:?}"
        )))
    })?;
    match record.take_payload() {
        // A multi-process start that ran synchronously on XLA's stream.
        None if job != 0 => Ok(()),
        None => Err(TideError::Internal(format!(
            "{what}: its start left nothing to wait on"
        ))),
        Some(p) => {
            let started = p.downcast::<Started>().map_err(|_| {
                TideError::Internal(format!("{what}: its start left foreign data"))
            })?;
            if call.stream == 0 {
                return Err(TideError::InvalidArgument(format!(
                    "{what} on device {}: XLA passed no CUDA stream",
                    call.device_ordinal
                )));
            }
            // The lease (the slot) is freed when `started` drops, after the wait.
            started.join_into(call.stream as CUstream, call.device_ordinal)
        }
    }
}

/// Executes one whole collective call ordered on XLA's stream `call.stream` of device
/// `call.device_ordinal`: start and done back to back. Enqueues work only; never synchronizes the
/// host with the device. The rendezvous sequence number counts this rank's calls of the site
/// within XLA's run `call.run_id` (`rendezvous::run_seq`), so one rank's failure cannot leave
/// later runs out of step.
pub fn execute(call: &CallInfo) -> Result<()> {
    let seq = rendezvous::run_seq(call.site, call.group, call.rank, call.run_id);
    execute_with_seq(call, seq)
}

/// `execute` with the rendezvous sequence number chosen by the caller. Take it before anything
/// that can fail, on every rank.
pub fn execute_with_seq(call: &CallInfo, seq: u64) -> Result<()> {
    let started = start(call, seq)?;
    if call.stream == 0 {
        return Err(TideError::Internal("no stream".into()));
    }
    started.join_into(call.stream as CUstream, call.device_ordinal)
}

/// Joins `call`'s rendezvous with `err` so its peers fail at once (a rank failing before it could
/// take part).
fn abandon(call: &CallInfo, seq: u64, err: &TideError) {
    let cfg = crate::config::current();
    let info = RankInfo {
        device: call.device_ordinal,
        error: Some(err.to_string()),
        ..Default::default()
    };
    let key = Key {
        site: call.site,
        group: call.group,
        seq,
    };
    let what = format!("tide {} site {} group {}", op_name(call.op), call.site, call.group);
    if let Ok(s) = Session::join(&what, key, call.rank, call.world, info, timeout(&cfg)) {
        s.fail(call.rank, err);
        let _ = s.leave(call.rank);
    }
}

/// The start of an in-process call, with the panic guard: returns what its done needs.
fn start(call: &CallInfo, seq: u64) -> Result<Started> {
    meeting::catch_panic(
        &|| {
            format!(
                "the CUDA engine (tide {} site {} rank {} device {})",
                op_name(call.op),
                call.site,
                call.rank,
                call.device_ordinal
            )
        },
        || start_inner(call, seq),
        |_| {},
    )
}

fn timeout(cfg: &Config) -> Duration {
    Duration::from_secs_f64(cfg.timeout_s.clamp(0.001, 1e9))
}

/// Everything of the local preparation that must stay alive through the call.
pub(crate) struct Local {
    pub(crate) prepared: Arc<Prepared>,
    pub(crate) info: RankInfo,
    /// This rank's multicast grant (all-gather, TIDE_MULTICAST=1 and the whole gate passed).
    pub(crate) mc: Option<multicast::Granted>,
}

/// Copies of what a call issues with, taken under the device lock, so the rendezvous and the
/// issuing run without it (several ranks may share one device: tests on one GPU).
struct SlotHandles {
    ctx: driver::CUcontext,
    dev: driver::CUdevice,
    cc: (i32, i32),
    module: Option<Arc<device::Module>>,
    tide: CUstream,
    side: Vec<CUstream>,
    pool: Vec<CUevent>,
    phase: Vec<CUevent>,
    done: CUevent,
    released: CUevent,
}

impl SlotHandles {
    fn of(st: &DeviceState, slot: &device::Slot) -> SlotHandles {
        SlotHandles {
            ctx: st.ctx,
            dev: st.dev,
            cc: st.cc,
            module: st.module.clone(),
            tide: slot.tide,
            side: slot.side.clone(),
            pool: slot.pool.clone(),
            phase: slot.phase.clone(),
            done: slot.done,
            released: slot.released,
        }
    }
}

fn start_inner(call: &CallInfo, seq: u64) -> Result<Started> {
    let cfg = crate::config::current();
    let cfg = &*cfg;
    let fail_early = |err: TideError| -> Result<Started> {
        abandon(call, seq, &err);
        Err(err)
    };
    if let Err(e) = driver::init() {
        return fail_early(e);
    }
    let dev = match device::get(call.device_ordinal) {
        Ok(d) => d,
        Err(e) => return fail_early(e),
    };
    let lock_dev = || {
        dev.lock().map_err(|_| {
            TideError::Internal(format!(
                "CUDA device {} state poisoned by an earlier panic",
                call.device_ordinal
            ))
        })
    };
    // Under the device lock: the slot, the plan, the slot's resources, rule A1.
    let prepared = (|| -> Result<_> {
        let mut st = lock_dev()?;
        let ctx = driver::CtxGuard::set(st.ctx, call.device_ordinal)?;
        let (slot, lease) = st.acquire_slot(call.op, cfg.max_in_flight)?;
        let local = prepare_slot(call, &mut st, cfg, slot)?;
        let handles = SlotHandles::of(&st, st.slot(call.op, slot)?);
        Ok((ctx, lease, local, handles))
    })();
    let (_ctx, lease, local, h) = match prepared {
        Ok(p) => p,
        Err(e) => return fail_early(e),
    };
    let what = format!("tide {} site {} group {}", op_name(call.op), call.site, call.group);
    let key = Key {
        site: call.site,
        group: call.group,
        seq,
    };
    let session = Session::join(&what, key, call.rank, call.world, local.info.clone(), timeout(cfg))?;
    let meeting = meeting::InProcess {
        session,
        rank: call.rank,
    };
    let result = meeting::end_call(&meeting, || run_slot(call, &lock_dev, &h, &local, &meeting, cfg));
    let started = Started {
        ctx: h.ctx,
        released: h.released,
        _lease: lease,
    };
    started.finish(call, result)
}

/// Checks XLA's stream and the call's topology, and returns the site's prepared plan and schedule
/// (cached per site; rebuilt when the call's shapes, rank, topology or settings change).
/// `multi_node`: hierarchical plans allowed (the cross-process path runs their rail over NCCL).
pub(crate) fn prepared_plan(call: &CallInfo, st: &mut DeviceState, cfg: &Config, multi_node: bool) -> Result<Arc<Prepared>> {
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
        .get(&(call.site, call.op, call.rank))
        .filter(|p| {
            p.rank == call.rank
                && p.topology == call.topology
                && p.settings == settings
                && same_shapes(&p.layout, call)
        })
        .cloned();
    if let Some(p) = cached {
        return Ok(p);
    }
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
    st.prepared.insert((call.site, call.op, call.rank), p.clone());
    Ok(p)
}

/// NVLink multicast: off unless asked for; then the whole gate (multicast module header), the
/// device attribute query last. No multicast call is made here.
pub(crate) fn multicast_grant(call: &CallInfo, st: &DeviceState, plan: &crate::plan::Plan, cfg: &Config) -> Option<multicast::Granted> {
    if call.op != Op::AllGather || !cfg.multicast {
        return None;
    }
    let shard_bytes: Vec<usize> = plan.layout.params.iter().map(|p| p.shard_bytes).collect();
    let dev = st.dev;
    let ord = call.device_ordinal;
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
}

/// (address, bytes) of each operand and result, null buffers refused.
#[allow(clippy::type_complexity)]
pub(crate) fn buffer_lists(call: &CallInfo, plan: &crate::plan::Plan) -> Result<(Vec<(u64, usize)>, Vec<(u64, usize)>)> {
    let n = plan.layout.len();
    let mut inputs = Vec::with_capacity(n);
    let mut outputs = Vec::with_capacity(n);
    for i in 0..n {
        for (list, view, bytes, role) in [
            (&mut inputs, &call.inputs[i], plan.input_bytes(i), "operand"),
            (&mut outputs, &call.outputs[i], plan.output_bytes(i), "result"),
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
    Ok((inputs, outputs))
}

/// The in-process preparation of a call in in-flight slot `slot`: the slot's resources, then rule
/// A1: XLA's stream records `entry`, the slot's tide stream waits on it and records `ready`.
fn prepare_slot(call: &CallInfo, st: &mut DeviceState, cfg: &Config, slot: usize) -> Result<Local> {
    let ord = call.device_ordinal;
    let stream = call.stream as CUstream;
    let prepared = prepared_plan(call, st, cfg, false)?;
    let plan = &prepared.plan;
    let sched = &prepared.schedule;
    if sched.needs_kernels || cfg.fuse_bytes > 0 {
        st.ensure_module()?;
    }
    let mc = multicast_grant(call, st, plan, cfg);
    let (inputs, outputs) = buffer_lists(call, plan)?;
    let s = st.slot_mut(call.op, slot)?;
    s.ensure_side_streams(ord, sched.side_streams.max(usize::from(mc.is_some())))?;
    // The schedule's local events, then one join event per side stream (error path, multicast).
    s.ensure_events(ord, sched.events + s.side.len().max(1))?;
    s.ensure_phase_events(
        ord,
        plan.phases.len().saturating_sub(1).max(usize::from(mc.is_some())),
    )?;
    let stages = s.ensure_stage(
        ord,
        &plan.stage_slot_bytes,
        cfg.rs_stage_slots.saturating_mul(cfg.rs_slot_bytes),
    )?;
    // Rule A1. SAFETY: XLA's stream (checked by prepared_plan), the slot's stream and events.
    unsafe {
        check(sys::cuEventRecord(s.entry, stream), "cuEventRecord", || {
            format!("device {ord}: entry event on XLA's stream")
        })?;
        check(sys::cuStreamWaitEvent(s.tide, s.entry, 0), "cuStreamWaitEvent", || {
            format!("device {ord}: tide's stream on the entry event")
        })?;
        check(sys::cuEventRecord(s.ready, s.tide), "cuEventRecord", || {
            format!("device {ord}: ready event")
        })?;
    }
    let info = RankInfo::published(ord, (inputs, outputs), stages, (s.ready, s.done, &s.phase), plan, mc.is_some());
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

/// Checks what the peers published against this rank's plan, on both paths: every rank of
/// `meeting` that it `reaches` (the multi-process path reads ranks of other nodes only through the
/// rail); their outputs only where `outputs_published` (multi-process peers publish none: plans
/// pull). The multi-process path checks the mailboxes' contents before mapping them as well.
pub(crate) fn check_peers(
    call: &CallInfo,
    prepared: &Prepared,
    meeting: &dyn Meeting,
    outputs_published: bool,
) -> Result<()> {
    let infos = meeting.infos();
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
    for (q, info) in infos.iter().enumerate().filter(|(q, _)| meeting.reaches(*q)) {
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
        if info.inputs.len() != n || (outputs_published && info.outputs.len() != n) {
            return mismatch(format!(
                "{} operands / {} results, expected {n}",
                info.inputs.len(),
                info.outputs.len()
            ));
        }
        for i in 0..n {
            if info.inputs[i].1 != plan.input_bytes(i)
                || (outputs_published && info.outputs[i].1 != plan.output_bytes(i))
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

/// Issues a started call on its in-flight slot (the module header, rules A2-A3): checks the
/// peers, then `run_phases` with MAIN = the slot's tide stream, then `released` on tide's stream,
/// also on the error path (after `run_phases` joined the side streams into it), so XLA's stream
/// can be ordered after everything enqueued.
fn run_slot<'d>(
    call: &CallInfo,
    lock_dev: &dyn Fn() -> Result<std::sync::MutexGuard<'d, DeviceState>>,
    sl: &SlotHandles,
    local: &Local,
    meeting: &dyn Meeting,
    cfg: &Config,
) -> Result<()> {
    let infos = meeting.infos();
    let prepared = &local.prepared;
    check_peers(call, prepared, meeting, true)?;
    if infos.iter().any(|i| i.device != call.device_ordinal) {
        let mut st = lock_dev()?;
        for info in infos {
            st.ensure_peer(info.device)?;
        }
    }
    // The multicast all-gather only if every rank granted it (all see the same published values).
    let multicast = local
        .mc
        .filter(|_| infos.iter().all(|i| i.multicast))
        .map(|g| (sl.dev, sl.cc, g));
    let io = Issue {
        res: Res::slot(sl),
        phase: &sl.phase,
        done: sl.done,
        fuse: true,
        multicast,
        peer_hints: true,
    };
    let res_ok = run_phases(call, &io, meeting, prepared, cfg);
    // SAFETY: valid event and stream.
    let recorded = check(unsafe { sys::cuEventRecord(sl.released, io.res.main) }, "cuEventRecord", || {
        format!("rank {} device {}: released event", call.rank, call.device_ordinal)
    });
    res_ok.and(recorded)
}

/// What `run_phases` issues with besides the schedule: the streams and local events (`res`), the
/// events it records on MAIN at each phase boundary (`phase`) and at the end (`done`), whether
/// small copies and sums may go as batched launches (`fuse`, with TIDE_FUSE_BYTES), the NVLink
/// multicast grant of every rank (device, compute capability, grant), and the batched copies' hints.
pub(crate) struct Issue<'a> {
    pub res: Res<'a>,
    pub phase: &'a [CUevent],
    pub done: CUevent,
    pub fuse: bool,
    pub multicast: Option<(driver::CUdevice, (i32, i32), multicast::Granted)>,
    /// Whether batched copies name the devices of their ranks as location hints (in-process), or
    /// this rank's device (multi-process: a peer's ordinal is its own process's numbering; the
    /// hints are ignored for non-managed memory, but must still name a device of this process).
    pub peer_hints: bool,
}

/// The one phase loop and end of call of both paths (rules 3-5 / A2-A3), over `meeting`
/// (`meeting` module header, hooks 1-5): each phase's commands on their streams (`meeting`'s rail
/// copies replaced by waits on its rail event, waits on ranks it does not reach skipped), phase
/// event and barrier between phases; then `done` on MAIN, the exit barrier, and MAIN waits on
/// every reached peer's `done`. Work is collected per stream and issued together: consecutive
/// copy-engine copies as one cuMemcpyBatchAsync (TIDE_COPY_BATCH; CUDA 13 drivers); small copies
/// and sums as batched kernel launches (TIDE_FUSE_BYTES, `fuse`, when `io.fuse`). A stream's
/// pending work is issued before any other command on it. On an error after work was enqueued,
/// MAIN still joins every side stream, so an event recorded on MAIN afterwards (`released`, or
/// XLA's stream itself on the synchronous multi-process path) marks the end of all of it.
pub(crate) fn run_phases(
    call: &CallInfo,
    io: &Issue,
    meeting: &dyn Meeting,
    prepared: &Prepared,
    cfg: &Config,
) -> Result<()> {
    let infos = meeting.infos();
    let res = &io.res;
    let main = res.main;
    let sched = &prepared.schedule;
    let nphases = sched.phases.len();
    let (rank, ord) = (call.rank, call.device_ordinal);
    let fusing = io.fuse && cfg.fuse_bytes > 0 && res.module.is_some();
    let batching = fusing || (cfg.copy_batch && driver::init().map(|v| v >= 13000).unwrap_or(false));
    let mut pending: Vec<Vec<fuse::PendingCopy>> = vec![Vec::new(); res.side.len() + 1];
    let mut sums: Vec<fuse::SumSeg> = Vec::new();
    let phases_ok = (|| -> Result<()> {
        if let Some((dev, cc, g)) = io.multicast {
            let pushed = *io
                .phase
                .first()
                .ok_or_else(|| TideError::Internal("no pushed event".into()))?;
            return issue_multicast(call, dev, cc, res, pushed, prepared, infos, meeting, g, cfg);
        }
        let flush_sums = |sums: &mut Vec<fuse::SumSeg>| -> Result<()> {
            if sums.is_empty() {
                return Ok(());
            }
            let m = res.module.ok_or_else(|| TideError::Internal("kernel module not loaded".into()))?;
            let r = fuse::issue_sums(m, main, sums, cfg.rs_max_ctas, &|| {
                format!("tide {} site {} rank {rank} device {ord}: batched sums", op_name(call.op), call.site)
            });
            sums.clear();
            r
        };
        for (p, phase) in sched.phases.iter().enumerate() {
            meeting.phase_start(p, main)?;
            for cmd in &phase.cmds {
                let s = cmd.stream();
                if let Cmd::WaitRank { rank: q, .. } = cmd {
                    if !meeting.reaches(*q) {
                        continue;
                    }
                }
                let rail = meeting.rail_event(p, cmd);
                if fusing && s == MAIN && rail.is_none() {
                    if let Cmd::Reduce { dst, srcs, elems, .. } = cmd {
                        if let Some(seg) = sum_segment(infos, dst, srcs, *elems, cfg)? {
                            flush_batch(call, res, MAIN, &mut pending, cfg, fusing)?;
                            if !fuse::sum_joins(&sums, &seg, fuse::sum_batch_limit(cfg.rs_max_ctas)) {
                                flush_sums(&mut sums)?;
                            }
                            sums.push(seg);
                            continue;
                        }
                    }
                }
                if s == MAIN {
                    flush_sums(&mut sums)?;
                }
                if batching {
                    if let (Cmd::Copy { src, dst, bytes, via, .. }, None) = (cmd, rail) {
                        // Copy-engine copies join any batch; SM copies only batched launches.
                        if *via == CopyVia::CopyEngine || (fusing && *bytes < cfg.fuse_bytes) {
                            let c = fuse::PendingCopy {
                                dst: address(infos, dst, *bytes)?,
                                src: address(infos, src, *bytes)?,
                                bytes: *bytes,
                                dst_dev: if io.peer_hints { infos[dst.rank].device } else { ord },
                                src_dev: if io.peer_hints { infos[src.rank].device } else { ord },
                            };
                            let list = pending
                                .get(s)
                                .ok_or_else(|| TideError::Internal(format!("stream {s} out of range")))?;
                            if !fuse::copy_joins(list, &c) {
                                flush_batch(call, res, s, &mut pending, cfg, fusing)?;
                            }
                            pending[s].push(c);
                            continue;
                        }
                    }
                    flush_batch(call, res, s, &mut pending, cfg, fusing)?;
                }
                match rail {
                    Some(ev) => {
                        let sx = stream_of(res, s)?;
                        // SAFETY: the meeting's rail event, recorded at this phase's start.
                        check(unsafe { sys::cuStreamWaitEvent(sx, ev, 0) }, "cuStreamWaitEvent", || {
                            format!("rank {rank} device {ord}: stream {s} on the rail transfers of phase {p}")
                        })?;
                    }
                    None => issue(call, res, infos, prepared, p, cmd, cfg)?,
                }
            }
            flush_sums(&mut sums)?;
            for s in 0..pending.len() {
                flush_batch(call, res, s, &mut pending, cfg, fusing)?;
            }
            if p + 1 < nphases {
                let ev = *io
                    .phase
                    .get(p)
                    .ok_or_else(|| TideError::Internal(format!("phase event {p} not created")))?;
                // SAFETY: valid event and stream; context current.
                check(unsafe { sys::cuEventRecord(ev, main) }, "cuEventRecord", || {
                    format!("rank {rank} device {ord}: phase {p} event")
                })?;
                meeting.phase_recorded(p, main)?;
                meeting.barrier(&format!("phase {p} ({})", phase.name))?;
            }
        }
        Ok(())
    })();
    let ended = meeting.phases_ended(main);
    let res_ok = phases_ok.and(ended).and_then(|()| {
        // Rule 5 / A3: done (this rank's reads of peers' memory are before it: the schedule joined
        // the side streams into MAIN), exit barrier, every peer's done.
        // SAFETY: valid event and stream.
        check(unsafe { sys::cuEventRecord(io.done, main) }, "cuEventRecord", || {
            format!("rank {rank} device {ord}: done event")
        })?;
        meeting.done_recorded(main)?;
        meeting.barrier("exit")?;
        for (q, info) in infos.iter().enumerate() {
            if q != rank && meeting.reaches(q) {
                // SAFETY: the peer's done event, recorded before the exit barrier; it is not
                // recorded again before this rank left the meeting (the module header).
                check(
                    unsafe { sys::cuStreamWaitEvent(main, info.done as CUevent, 0) },
                    "cuStreamWaitEvent",
                    || format!("rank {rank} device {ord}: on rank {q}'s done event"),
                )?;
            }
        }
        Ok(())
    });
    if res_ok.is_err() {
        // MAIN joins every side stream (one join event per side stream where there are enough).
        for (k, &s) in res.side.iter().enumerate() {
            let ev = res.pool.get(sched.events + k).or(res.pool.get(sched.events)).copied();
            if let Err(j) = record_wait(ev, s, main) {
                log::warn!("tide: rank {rank}: joining side streams after an error failed: {j}");
            }
        }
    }
    res_ok
}

/// The NVLink multicast all-gather (see the `multicast` module header): set up the (site, group)
/// buffer once, collectively; store this rank's shards to the multicast address on MAIN; "pushed"
/// event and barrier; fan out every rank's rows from the local backing to the outputs on side
/// stream 1; MAIN joins it. Only reachable with a `Granted` from every rank.
#[allow(clippy::too_many_arguments)]
fn issue_multicast(
    call: &CallInfo,
    dev: driver::CUdevice,
    cc: (i32, i32),
    res: &Res,
    pushed: CUevent,
    prepared: &Prepared,
    infos: &[RankInfo],
    meeting: &dyn Meeting,
    g: multicast::Granted,
    cfg: &Config,
) -> Result<()> {
    let main = res.main;
    let ord = call.device_ordinal;
    let rank = call.rank;
    let mp = multicast::plan(&prepared.layout, rank);
    let shared = multicast::shared(call.site, call.group, mp.bytes);
    // Every rank reads `complete` after the same barrier, so all agree on whether to set up.
    meeting.barrier("multicast check")?;
    if !shared.complete() {
        if rank == 0 {
            shared.set_handle(multicast::create(g, call.world, mp.bytes, ord)?);
        }
        meeting.barrier("multicast created")?;
        let (handle, size) = shared.handle()?;
        multicast::add_device(g, handle, dev, ord)?;
        meeting.barrier("multicast devices added")?;
        shared.set_rank(rank, multicast::bind_and_map(g, handle, size, ord)?);
        meeting.barrier("multicast bound")?;
        if rank == 0 {
            shared.mark_complete();
        }
    }
    let mine = shared.rank(rank)?;
    let f = multicast::kernel(g, ord, cc)?;
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
    // SAFETY: valid event and stream; context current.
    check(
        unsafe { sys::cuEventRecord(pushed, main) },
        "cuEventRecord",
        || format!("rank {rank} device {ord}: multicast pushed event"),
    )?;
    meeting.barrier("multicast pushed")?;
    let side = stream_of(res, 1)?;
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
    let join = *res
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
    res: &Res,
    s: usize,
    pending: &mut [Vec<fuse::PendingCopy>],
    cfg: &Config,
    fusing: bool,
) -> Result<()> {
    let Some(list) = pending.get_mut(s) else {
        return Ok(());
    };
    if list.is_empty() {
        return Ok(());
    }
    let mut copies = std::mem::take(list);
    let stream = stream_of(res, s)?;
    // Small copies as batched launches (TIDE_FUSE_BYTES): all of them on MAIN (SM copies), two or
    // more on a copy stream (one small copy stays on the copy engine). Pairwise independent
    // (`fuse::copy_joins`), so they may run in any order.
    if let Some(m) = res.module.filter(|_| fusing) {
        let small = copies.iter().filter(|c| c.bytes < cfg.fuse_bytes).count();
        if small > 0 && (s == MAIN || small >= 2) {
            let (fused, rest): (Vec<_>, Vec<_>) = copies.into_iter().partition(|c| c.bytes < cfg.fuse_bytes);
            fuse::issue_copies(m, stream, &fused, cfg.rs_max_ctas, &|| {
                format!("rank {} device {}: batched copies on stream {s}", call.rank, call.device_ordinal)
            })?;
            copies = rest;
        }
    }
    if copies.is_empty() {
        return Ok(());
    }
    if s == MAIN {
        return Err(TideError::Internal(format!(
            "rank {}: {} large SM copies pending on tide's stream",
            call.rank,
            copies.len()
        )));
    }
    let api_batch = cfg.copy_batch && driver::init().map(|v| v >= 13000).unwrap_or(false);
    let what = || {
        format!(
            "rank {} device {}: {} copies on stream {s}, {} bytes",
            call.rank,
            call.device_ordinal,
            copies.len(),
            copies.iter().map(|c| c.bytes).sum::<usize>()
        )
    };
    if copies.len() == 1 || !api_batch || !batch_copy_supported() {
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

/// A Reduce as one batched-sum segment, if it qualifies (TIDE_FUSE_BYTES): one launch's worth of
/// sources (at most `kernels::MAX_SRCS` of one dtype), output smaller than TIDE_FUSE_BYTES. Ranges
/// are bounds-checked here.
fn sum_segment(
    infos: &[RankInfo],
    dst: &Region,
    srcs: &[crate::plan::Operand],
    elems: usize,
    cfg: &Config,
) -> Result<Option<fuse::SumSeg>> {
    if elems.saturating_mul(4) >= cfg.fuse_bytes
        || srcs.is_empty()
        || srcs.len() > kernels::MAX_SRCS
        || srcs.iter().any(|o| o.dtype != srcs[0].dtype)
    {
        return Ok(None);
    }
    let dtype = srcs[0].dtype;
    kernels::sum_kernel(dtype)?;
    let da = address(infos, dst, elems * 4)?;
    let mut p = [0u64; kernels::MAX_SRCS];
    for (k, o) in srcs.iter().enumerate() {
        p[k] = address(infos, &o.region, elems * o.dtype.size_bytes())?;
    }
    let vectorized = kernels::sum_vectorized(da, &p[..srcs.len()]);
    Ok(Some(fuse::SumSeg {
        dtype,
        dst: da,
        srcs: p,
        nsrc: srcs.len(),
        elems: elems as u64,
        accumulate: false,
        mode: kernels::sum_mode(vectorized),
    }))
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

/// The streams and events one call issues on: the schedule's MAIN (`main`: tide's stream of the
/// call's in-flight slot; XLA's stream on the multi-process path), its side streams and local
/// events, and the kernel module.
pub(crate) struct Res<'a> {
    pub module: Option<&'a device::Module>,
    pub main: CUstream,
    pub side: &'a [CUstream],
    pub pool: &'a [CUevent],
    /// The event `Cmd::WaitOwnPrevDone` waits on; `None` skips those waits (the start/done
    /// driver: implied by rule A1, `ready` is recorded on the slot's own tide stream).
    pub prev_done: Option<CUevent>,
}

impl<'a> Res<'a> {
    /// The device-wide resources with XLA's stream as MAIN (the multi-process path).
    pub(crate) fn device(st: &'a DeviceState, main: CUstream) -> Res<'a> {
        Res {
            module: st.module.as_deref(),
            main,
            side: &st.side,
            pool: &st.pool,
            prev_done: Some(st.done),
        }
    }

    /// An in-flight slot's resources (the start/done driver).
    fn slot(h: &'a SlotHandles) -> Res<'a> {
        Res {
            module: h.module.as_deref(),
            main: h.tide,
            side: &h.side,
            pool: &h.pool,
            prev_done: None,
        }
    }
}

pub(crate) fn stream_of(res: &Res, s: usize) -> Result<CUstream> {
    if s == MAIN {
        Ok(res.main)
    } else {
        res.side
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
pub(crate) fn issue(
    call: &CallInfo,
    res: &Res,
    infos: &[RankInfo],
    prepared: &Prepared,
    phase: usize,
    cmd: &Cmd,
    cfg: &Config,
) -> Result<()> {
    let ord = call.device_ordinal;
    let rank = call.rank;
    let s = stream_of(res, cmd.stream())?;
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
            let Some(done) = res.prev_done else {
                return Ok(());
            };
            // SAFETY: our own event.
            check(
                unsafe { sys::cuStreamWaitEvent(s, done, 0) },
                "cuStreamWaitEvent",
                || format!("rank {rank} device {ord}: side stream on the previous done event"),
            )
        }
        Cmd::Record { event, .. } => {
            let ev = *res
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
            let ev = *res
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
                    let m = res
                        .module
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
            let m = res
                .module
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
                let mode = kernels::sum_mode(vectorized);
                let grid = kernels::grid(
                    kernels::sum_units(*elems as u64, vectorized),
                    cfg.rs_max_ctas,
                );
                let f = m.sum(l.dtype)?;
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
                            0,
                            s,
                            params.as_mut_ptr(),
                            std::ptr::null_mut(),
                        )
                    },
                    "cuLaunchKernel(rs_sum)",
                    || {
                        format!(
                            "{}, {} {} sources from {}, {elems} elements, grid {grid}",
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
