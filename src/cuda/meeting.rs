//! How the ranks of one CUDA call meet: the one seam between issuing a plan (`issue::run_phases`,
//! the phase loop and end of call of both paths) and the two ways ranks find each other, as the
//! CPU engine's `execute_rank_with(plan, rank, bufs, barrier, rail)` is over its `Barrier`/`Rail`.
//! Also what the ranks exchange (`RankInfo`, this rank's side of it: `Local`) and the check of
//! what peers published (`check_peers`).
//!
//! A `Meeting` is built *after* the exchange (each impl's constructor publishes this rank's
//! `RankInfo` and gathers every rank's), and then serves the call until its end:
//! - `InProcess` (this file): ranks are threads of one process meeting in a `rendezvous::Session`
//!   (values exchanged by `Session::join`, barriers, `leave` when every rank issued its waits).
//! - `multiproc::mailbox::Mailbox`: ranks in several processes meeting in a `transport::ProcessGroup`
//!   (values through shared-memory mailboxes and IPC, barriers of the group, nothing to leave:
//!   the group's exit barrier is the end), plus the hooks its NCCL rail needs.
//!
//! Contract of the hooks (`issue::run_phases` calls them at these points, on MAIN = `main`):
//! 1. `phase_start(p, main)`: before phase `p`'s first command (the rail's NCCL group).
//! 2. `rail_event(p, cmd)`: `Some(ev)` for a command whose place is taken by a wait on `ev`
//!    (a cross-node copy done by the rail); `reaches(q)`: false for a rank whose events this rank
//!    never waits on (another node: its `WaitRank`s are skipped, no wait on its `done`).
//! 3. `phase_recorded(p, main)`: right after the driver recorded phase `p`'s event on MAIN, before
//!    the phase barrier (the signal of the point for peers in other processes).
//! 4. `phases_ended(main)`: after the last phase, on success and on error (MAIN after the rail).
//! 5. `done_recorded(main)`: right after the driver recorded `done` on MAIN, before the exit barrier.
//! 6. `fail(err)`: publish the failure so peers fail fast (every path that errs after the
//!    exchange; `Mailbox` leaves it to `multiproc::execute`, which publishes after aborting
//!    the rail); `leave()`: the end of the call on every path (`end_call`).
//!
//! The ordering rules these hooks implement are the `cuda` module header's (rules 1-5, A1-A4) and
//! `schedule`'s model; the meeting adds none of its own.

use super::driver::{self, CUevent, CUstream};
use super::multicast;
use super::prepare::{op_name, Prepared};
use super::schedule::Cmd;
use super::signal::{Page, Point};
use crate::call::CallInfo;
use crate::error::{Result, TideError};
use crate::rendezvous::Session;
use std::sync::Arc;

/// What each rank publishes when the ranks meet. Event handles are carried as integers (raw CUDA
/// handles are valid in every thread of the process; a multi-process peer's are opened here).
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
    /// A peer in another process (the multi-process path): its points as `signal`s, in place of
    /// `ready`, `done` and `phases` (unused then).
    pub signals: Option<Page>,
    /// Whether this rank's multicast gate granted the NVLink multicast all-gather
    /// (`multicast::decide`); the path runs only if every rank's did.
    pub multicast: bool,
    /// Set when the rank failed before the meeting.
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
            signals: None,
            error: None,
        }
    }

    /// Makes `stream` wait on this rank's `point` (most recent record so far): its signal page when
    /// it has one, else its event.
    pub(crate) fn wait(&self, stream: CUstream, point: Point, what: impl FnOnce() -> String) -> Result<()> {
        if let Some(page) = &self.signals {
            // SAFETY: the streams tide passes are its own or XLA's for the call, live for it (as
            // for the event below).
            return unsafe { page.wait(stream, point, what) };
        }
        let ev = match point {
            Point::Ready => self.ready,
            Point::Done => self.done,
            Point::Phase(p) => match self.phases.get(p) {
                Some(&e) => e,
                None => return Err(TideError::Internal(format!("{}: no phase {p} event published", what()))),
            },
        };
        // SAFETY: an event of this process, created once for its life (`RankInfo::published`).
        unsafe { driver::stream_wait_event(stream, ev as CUevent, what) }
    }
}

/// This rank's side of a meeting, from its preparation until the end of the call.
pub(crate) struct Local {
    pub(crate) prepared: Arc<Prepared>,
    pub(crate) info: RankInfo,
    /// This rank's multicast grant (all-gather, TIDE_MULTICAST=1 and the whole gate passed).
    pub(crate) mc: Option<multicast::Granted>,
}

/// One call's meeting of its ranks, after the exchange (module header).
pub(crate) trait Meeting {
    /// What every rank published, indexed by rank.
    fn infos(&self) -> &[RankInfo];
    /// Host barrier of every rank of the meeting.
    fn barrier(&self, label: &str) -> Result<()>;
    /// Publishes this rank's failure to its peers.
    fn fail(&self, err: &TideError);
    /// The end of this rank's call (every path).
    fn leave(&self) -> Result<()>;
    /// Whether this rank orders itself by rank `q`'s events.
    fn reaches(&self, _q: usize) -> bool {
        true
    }
    fn phase_start(&self, _p: usize, _main: CUstream) -> Result<()> {
        Ok(())
    }
    fn rail_event(&self, _p: usize, _cmd: &Cmd) -> Option<CUevent> {
        None
    }
    fn phase_recorded(&self, _p: usize, _main: CUstream) -> Result<()> {
        Ok(())
    }
    fn phases_ended(&self, _main: CUstream) -> Result<()> {
        Ok(())
    }
    fn done_recorded(&self, _main: CUstream) -> Result<()> {
        Ok(())
    }
}

/// Ranks as threads of this process, meeting in a `rendezvous::Session`.
pub(crate) struct InProcess {
    pub(crate) session: Arc<Session<RankInfo>>,
    pub(crate) rank: usize,
}

impl Meeting for InProcess {
    fn infos(&self) -> &[RankInfo] {
        self.session.values()
    }
    fn barrier(&self, label: &str) -> Result<()> {
        self.session.barrier(self.rank, label)
    }
    fn fail(&self, err: &TideError) {
        self.session.fail(self.rank, err)
    }
    // Every rank leaves only after every rank issued its waits on this call's events, so no
    // event is recorded again (by a later call on its slot) before all its waits are issued.
    fn leave(&self) -> Result<()> {
        self.session.leave(self.rank)
    }
}

/// Fails the meeting (and leaves it) if the call unwinds (a panic caught by `catch_panic`), so
/// peers do not wait for this rank until the timeout.
pub(crate) struct FailOnUnwind<'a>(pub(crate) &'a dyn Meeting);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let err = TideError::Internal("panic in the CUDA engine".into());
            self.0.fail(&err);
            let _ = self.0.leave();
        }
    }
}

/// The end of a call after its exchange, on both paths: runs `body` (the phases) under the unwind
/// guard, publishes its error to the peers, then leaves the meeting; the first error wins.
pub(crate) fn end_call(meeting: &dyn Meeting, body: impl FnOnce() -> Result<()>) -> Result<()> {
    let result = {
        let _unwind = FailOnUnwind(meeting);
        body()
    };
    if let Err(e) = &result {
        meeting.fail(e);
    }
    let left = meeting.leave();
    result.and(left)
}

/// The panic guard of both paths: runs `f`, turning a panic into an error naming `what`, handed
/// to `on_panic` first (the multi-process path publishes it to its group).
pub(crate) fn catch_panic<T>(
    what: &dyn Fn() -> String,
    f: impl FnOnce() -> Result<T>,
    on_panic: impl FnOnce(&TideError),
) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            let err = TideError::Internal(format!("panic in {}: {msg}", what()));
            on_panic(&err);
            Err(err)
        }
    }
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
        let events = info.ready != 0 && info.done != 0 && info.phases.len() + 1 >= plan.phases.len();
        if !events && info.signals.is_none() {
            return mismatch("missing events".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A meeting that records what the driver's end of call did with it.
    #[derive(Default)]
    struct Log {
        events: RefCell<Vec<String>>,
        leave_fails: bool,
    }

    impl Meeting for Log {
        fn infos(&self) -> &[RankInfo] {
            &[]
        }
        fn barrier(&self, label: &str) -> Result<()> {
            self.events.borrow_mut().push(format!("barrier {label}"));
            Ok(())
        }
        fn fail(&self, err: &TideError) {
            self.events.borrow_mut().push(format!("fail {err}"));
        }
        fn leave(&self) -> Result<()> {
            self.events.borrow_mut().push("leave".into());
            if self.leave_fails {
                return Err(TideError::Rendezvous("leave failed".into()));
            }
            Ok(())
        }
    }

    #[test]
    fn end_call_leaves_on_every_path_and_publishes_errors() {
        let m = Log::default();
        assert!(end_call(&m, || m.barrier("exit")).is_ok());
        assert_eq!(*m.events.borrow(), ["barrier exit", "leave"]);

        let m = Log::default();
        let e = end_call(&m, || Err(TideError::Internal("boom".into()))).unwrap_err();
        assert!(e.to_string().contains("boom"), "{e}");
        let ev = m.events.borrow();
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert!(ev[0].starts_with("fail") && ev[0].contains("boom"), "{ev:?}");
        assert_eq!(ev[1], "leave");

        // The body's error wins over the leave's; a failed leave alone is the call's error.
        let m = Log {
            leave_fails: true,
            ..Default::default()
        };
        let e = end_call(&m, || Err(TideError::Internal("first".into()))).unwrap_err();
        assert!(e.to_string().contains("first"), "{e}");
        let m = Log {
            leave_fails: true,
            ..Default::default()
        };
        let e = end_call(&m, || Ok(())).unwrap_err();
        assert!(e.to_string().contains("leave failed"), "{e}");
    }

    #[test]
    fn a_panic_fails_and_leaves_the_meeting_and_becomes_an_error() {
        let m = Log::default();
        let published = RefCell::new(None);
        let r: Result<()> = catch_panic(
            &|| "the test engine".into(),
            || end_call(&m, || panic!("kaboom")),
            |e| *published.borrow_mut() = Some(e.to_string()),
        );
        let e = r.unwrap_err().to_string();
        assert!(e.contains("panic in the test engine: kaboom"), "{e}");
        assert_eq!(published.borrow().as_deref(), Some(e.as_str()));
        let ev = m.events.borrow();
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert!(ev[0].starts_with("fail") && ev[0].contains("panic"), "{ev:?}");
        assert_eq!(ev[1], "leave");
    }
}
