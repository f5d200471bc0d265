//! The in-process path of a call (`call.job == 0`: every rank is a device of this process, on its
//! own XLA host thread): rules A1-A3 of the `cuda` module header on an in-flight slot.
//!
//! One call, top to bottom: `start` (panic guard) -> `start_on_slot`: under the device lock,
//! `device::DeviceState::acquire_slot` and `prepare_slot` (the plan, the slot's resources, rule
//! A1's events), then copies of the slot's handles (`SlotHandles`) so the meeting and the issuing
//! run without the lock -> `rendezvous::Session::join` (`meeting::InProcess`) -> `meeting::end_call`
//! over `run_slot` (the peers checked, `issue::run_phases` with MAIN = the slot's tide stream,
//! `released`). It returns the slot's `SlotLease`, which the done (`start_done`) makes XLA's
//! stream wait on. A rank that fails before the meeting still joins it with its error
//! (`abandon`), so its peers fail at once, not at the timeout.

use super::device::{self, DeviceState, SlotLease};
use super::driver::{self, CUevent, CUstream};
use super::issue::{self, Issue, Res};
use super::meeting::{self, check_peers, Local, Meeting, RankInfo};
use super::prepare::{self, op_name};
use crate::call::CallInfo;
use crate::config::Config;
use crate::error::{Result, TideError};
use crate::rendezvous::{Key, Session};
use std::sync::{Arc, MutexGuard};

/// The start of an in-process call, with the panic guard: returns what its done needs. `seq` is
/// the rendezvous sequence number, taken by the caller before anything that can fail.
pub(crate) fn start(call: &CallInfo, seq: u64) -> Result<SlotLease> {
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
        || start_on_slot(call, seq),
        |_| {},
    )
}

/// Joins `call`'s rendezvous with `err` so its peers fail at once (a rank failing before it could
/// take part).
pub(crate) fn abandon(call: &CallInfo, seq: u64, err: &TideError) {
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
    if let Ok(s) = Session::join(&what, key, call.rank, call.world, info, cfg.timeout()) {
        s.fail(call.rank, err);
        let _ = s.leave(call.rank);
    }
}

/// Copies of what a call issues with, taken under the device lock, so the rendezvous and the
/// issuing run without it (several ranks may share one device: tests on one GPU).
struct SlotHandles {
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

fn start_on_slot(call: &CallInfo, seq: u64) -> Result<SlotLease> {
    on_slot(
        call,
        &|err| abandon(call, seq, err),
        |local, cfg| {
            let what = format!("tide {} site {} group {}", op_name(call.op), call.site, call.group);
            let key = Key {
                site: call.site,
                group: call.group,
                seq,
            };
            let place = call.place("cuda", crate::deadlock::CONFIRM_AFTER_CUDA);
            let session = Session::join_at(
                &what,
                key,
                call.rank,
                call.world,
                local.info.clone(),
                cfg.timeout(),
                place.as_ref(),
            )?;
            Ok(meeting::InProcess {
                session,
                rank: call.rank,
            })
        },
    )
}

/// A call on an in-flight slot of its device, its ranks meeting through `meet` (given this rank's
/// published side once the slot is prepared; `fail_early` tells the peers of a failure before
/// that): under the device lock the slot, the plan, the slot's resources and rule A1; then,
/// without it, the meeting and `run_slot`. Returns the slot's lease (`start_done`).
pub(crate) fn on_slot<M: Meeting>(
    call: &CallInfo,
    fail_early: &dyn Fn(&TideError),
    meet: impl FnOnce(&Local, &Config) -> Result<M>,
) -> Result<SlotLease> {
    let cfg = crate::config::for_call(call.urgent);
    let cfg = &*cfg;
    let fail_early = |err: TideError| -> Result<SlotLease> {
        fail_early(&err);
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
    let meeting = meet(&local, cfg)?;
    let result = meeting::end_call(&meeting, || run_slot(call, &lock_dev, &h, &local, &meeting, cfg));
    lease.end_start(call, result)
}

/// The in-process preparation of a call in in-flight slot `slot`: the slot's resources, then rule
/// A1: XLA's stream records `entry`, the slot's tide stream waits on it and records `ready`.
fn prepare_slot(call: &CallInfo, st: &mut DeviceState, cfg: &Config, slot: usize) -> Result<Local> {
    let ord = call.device_ordinal;
    let stream = call.stream as CUstream;
    prepare::check_call(call, st.ctx, false)?;
    let prepared = st.plans.get(call, cfg)?;
    let plan = &prepared.plan;
    let sched = &prepared.schedule;
    // (a reduce-scatter into slices zeroes padding rows with a kernel too: `issue`)
    if sched.needs_kernels || call.at.is_some() || cfg.fuse_bytes > 0 {
        st.ensure_module()?;
    }
    let mc = prepare::multicast_grant(call, st.dev, plan, cfg);
    let (inputs, outputs) = prepare::buffer_lists(call, plan)?;
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
    // Rule A1. SAFETY: XLA's stream (checked by check_call), the slot's stream and events.
    unsafe {
        driver::event_record(s.entry, stream, || format!("device {ord}: entry event on XLA's stream"))?;
        driver::stream_wait_event(s.tide, s.entry, || format!("device {ord}: tide's stream on the entry event"))?;
        driver::event_record(s.ready, s.tide, || format!("device {ord}: ready event"))?;
    }
    let info = RankInfo::published(ord, (inputs, outputs), stages, (s.ready, s.done, &s.phase), plan, mc.is_some());
    Ok(Local { prepared, info, mc })
}

/// Issues a started call on its in-flight slot (the module header, rules A2-A3): checks the
/// peers, then `run_phases` with MAIN = the slot's tide stream, then `released` on tide's stream,
/// also on the error path (after `run_phases` joined the side streams into it), so XLA's stream
/// can be ordered after everything enqueued.
fn run_slot<'d>(
    call: &CallInfo,
    lock_dev: &dyn Fn() -> Result<MutexGuard<'d, DeviceState>>,
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
        res: Res {
            module: sl.module.as_deref(),
            main: sl.tide,
            side: &sl.side,
            pool: &sl.pool,
            prev_done: None,
        },
        phase: &sl.phase,
        done: sl.done,
        fuse: true,
        multicast,
        peer_hints: true,
    };
    let res_ok = issue::run_phases(call, &io, meeting, prepared, cfg);
    // SAFETY: valid event and stream.
    let recorded = unsafe {
        driver::event_record(sl.released, io.res.main, || {
            format!("rank {} device {}: released event", call.rank, call.device_ordinal)
        })
    };
    res_ok.and(recorded)
}
