//! Deadlocks between programs interleaved across devices, found in milliseconds instead of after
//! `TIDE_TIMEOUT_S` (docs/design.md "Interleaved programs").
//!
//! The hazard: every XLA device runs the programs launched on it one at a time, in launch order.
//! Two Python threads that launch two tide programs A and B at once can enqueue them in different
//! orders on different devices: device 7 runs A first, device 1 runs B first. A's call on device 7
//! then waits for device 1, which waits in B's call for device 7: nobody can move, and each call
//! would only fail at the timeout, blaming a rank that "did not arrive".
//!
//! The model (what this module assumes, and why a cycle is a deadlock): a rank waiting at a
//! rendezvous `join` registers here after `REGISTER_AFTER` with its device, its run (XLA's RunId of
//! the launch) and its session. A device with waiting calls, all of one run R, is *held* by R: it
//! cannot start another run before R ends, and R cannot end on it while one of its calls waits.
//! Edge X -> Y: a waiting call on X (run R) misses the rank on device Y, and Y is held by a run R'
//! other than R. Then X waits for Y to finish R' first. A cycle of edges through the checking
//! device is a deadlock: around the cycle every device waits for the next, which cannot move
//! (only a failure or the timeout could end it). The same run on both ends of an edge is never an
//! edge: the calls of one SPMD program agree in order on every device.
//!
//! Every snapshot is taken under `WAITERS`, and a waiter deregisters under it before its `join`
//! returns, so an edge read from a session that is still incomplete stays true while the cycle
//! lasts. A cycle is acted on only when checks over `Place::confirm_after` keep finding the same
//! waiters in it (`CONFIRM_AFTER_CUDA`, `CONFIRM_AFTER_CPU`: a guard against a runtime that does not
//! hold devices as modelled). Then every session of the cycle fails with one message naming the
//! programs, devices and the fix, and the cycle's runs are recorded as failed: their other calls,
//! waiting or still to come, fail at once (the run cannot succeed on every device any more), so the
//! process is usable at once.
//!
//! Where the model holds: XLA:GPU (a device's programs in launch order). XLA:CPU gang-schedules
//! multi-device launches, so this cycle does not normally arise there.
//!
//! # Stalls (XLA:CPU)
//! XLA:CPU's own deadlock is different (read in XLA's PjRt CPU client as pinned by jax 0.10.2):
//! a multi-device launch hands each device's part to the client's launch pool (PJRT_NPROC, else
//! NPROC, else the core count, at least the device count), where the part first takes one of its
//! device's 32 admission slots (blocking that pool thread while none is free) and then holds the
//! thread until the part ends; every launch waits for the whole previous launch (one global
//! order). Threads launching without waiting for results fill the slots, their parts block pool
//! threads in admission, and the launch at the head of the order cannot get a thread for some
//! device: that device never starts the program, no tide call of the run ever reaches it, none
//! waits there, and nothing computes. Failing the run's waiting calls frees their threads and
//! slots, and XLA moves on. A pool of at least devices x (launching threads + 1) avoids it. For a place with `stall_after` (the CPU engine, TIDE_STALL_MS), a waiter whose session
//! misses such a device, while the whole process used less than `IDLE_CPU_FRACTION` of a core over
//! a full `stall_after`, fails the run with a message naming the stall and the fix. The evidence is
//! circumstantial (tide cannot see XLA's queues), so each part is required: a device that started
//! the run (any of its calls arrived: `arrived`) is computing or skipped the call, never a stall;
//! a device with a waiting tide call is a cycle's business; a busy process is computing. What
//! remains and is not a stall: a device idling for `stall_after` in a host callback before its
//! first tide call of the run, or a program that skips every tide call on a device (a `cond` not
//! every device takes); the message names both, TIDE_STALL_MS raises or turns off the check. Where none of this
//! applies the timeout's message says that no tide call waits on the missing device (`absent_hint`).
//!
//! Lock order: `WAITERS`, then a session's state (through `Waitable`), then `STARTED`, then
//! `FAILED_RUNS`; `CPU_SAMPLE` is a leaf. Nothing here is held while a caller holds a session's
//! state.
//!
//! Calls without a run id (0) or without the devices of their ranks (multi-process calls, engine
//! tests) are not checked: they keep the timeout.

use crate::rendezvous::Key;
use once_cell::sync::Lazy;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a rank waits at a `join` before it registers (most meetings complete sooner).
pub const REGISTER_AFTER: Duration = Duration::from_millis(5);
/// How often a registered waiter looks for a cycle.
pub const CHECK_EVERY: Duration = Duration::from_millis(10);
/// How long one cycle (the same waiters) must be seen before it is broken, by engine. XLA:GPU runs
/// a device's programs one at a time, in launch order, so there a cycle is a deadlock at once and
/// the margin only absorbs a racing check. XLA:CPU starts a device's executions on events (its
/// launches are chained through the client, not queued per device), so a device can start a second
/// program while a first still computes there, and a cycle of waits could still resolve: the
/// longer margin is for that, still well inside the second a user waits.
pub const CONFIRM_AFTER_CUDA: Duration = Duration::from_millis(50);
pub const CONFIRM_AFTER_CPU: Duration = Duration::from_millis(400);
#[cfg(test)]
const CONFIRM_AFTER: Duration = CONFIRM_AFTER_CPU;
/// Runs remembered as failed (their later calls fail at once).
const FAILED_RUNS_KEPT: usize = 64;
/// Runs whose devices are remembered (`arrived`); far more than the runs in flight at once.
const STARTED_KEPT: usize = 1024;
/// A process that used less CPU than this fraction of one core over a window is idle (a stall).
pub const IDLE_CPU_FRACTION: f64 = 0.1;

/// Where a rank's call runs: what the deadlock check knows of it.
#[derive(Debug, Clone)]
pub struct Place {
    /// Which engine's devices (ordinals of different platforms are different devices).
    pub engine: &'static str,
    /// XLA's RunId of the launch; 0 (unknown) turns the check off for this call.
    pub run: i64,
    /// The device (XLA ordinal) of each rank of the call's group, by rank.
    pub devices: Arc<[i64]>,
    /// How long a cycle through this call must last before it is broken (`CONFIRM_AFTER_*`).
    pub confirm_after: Duration,
    /// XLA:CPU only: how long an idle process waits for a device that never started the run
    /// before the run fails as stalled (module header, "Stalls"); None: never.
    pub stall_after: Option<Duration>,
}

impl Place {
    fn checked(&self) -> bool {
        self.run != 0 && !self.devices.is_empty()
    }
}

/// (engine, run) -> devices on which a call of the run arrived, oldest runs first out.
struct Started {
    devices: HashMap<(&'static str, i64), Vec<i64>>,
    order: VecDeque<(&'static str, i64)>,
}

static STARTED: Lazy<Mutex<Started>> = Lazy::new(|| {
    Mutex::new(Started {
        devices: HashMap::new(),
        order: VecDeque::new(),
    })
});

/// Notes that `rank`'s call of `place`'s run arrived (its device started the run). Only for places
/// checked for stalls (the CPU engine); one short lock per call.
pub fn arrived(place: &Place, rank: usize) {
    if place.stall_after.is_none() || !place.checked() {
        return;
    }
    let Some(&device) = place.devices.get(rank) else { return };
    let key = (place.engine, place.run);
    let mut st = lock(&STARTED);
    if let Some(v) = st.devices.get_mut(&key) {
        if !v.contains(&device) {
            v.push(device);
        }
        return;
    }
    if st.order.len() == STARTED_KEPT {
        if let Some(old) = st.order.pop_front() {
            st.devices.remove(&old);
        }
    }
    st.order.push_back(key);
    st.devices.insert(key, vec![device]);
}

fn started_on(engine: &'static str, run: i64, device: i64) -> bool {
    lock(&STARTED)
        .devices
        .get(&(engine, run))
        .is_some_and(|v| v.contains(&device))
}

/// CPU time used by the whole process so far.
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; CLOCK_PROCESS_CPUTIME_ID exists on every Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The newest sample of (wall, process CPU time), shared by every waiter: at most one
/// `clock_gettime` per `CHECK_EVERY` for the whole process. `CLOCK_PROCESS_CPUTIME_ID` sums over
/// every thread, so sampling it per waiter cost O(waiters x threads) and made the process itself
/// look busy (seen in the Python suite: about 690 threads and 10-20 waiters kept the process near
/// 10 % of a core, which delayed the stall check by up to 13 s). A leaf lock.
static CPU_SAMPLE: Lazy<Mutex<Option<(Instant, Duration)>>> = Lazy::new(|| Mutex::new(None));

fn cpu_sample() -> (Instant, Duration) {
    let mut s = lock(&CPU_SAMPLE);
    let now = Instant::now();
    match *s {
        Some(sample) if now.duration_since(sample.0) < CHECK_EVERY => sample,
        _ => {
            let sample = (now, process_cpu_time());
            *s = Some(sample);
            sample
        }
    }
}

/// What the check needs of a rendezvous session (implemented by `rendezvous::Session`).
pub trait Waitable: Send + Sync {
    /// Ranks not yet arrived; empty once the meeting completed or failed.
    fn absent(&self) -> Vec<usize>;
    /// Fails the session with `msg` (every waiter returns it; late arrivals too).
    fn break_with(&self, msg: &str);
}

struct Waiter {
    id: u64,
    place: Place,
    rank: usize,
    what: String,
    key: Key,
    session: Arc<dyn Waitable>,
    /// The waiter ids of the cycle this waiter saw at its last check, and since when.
    suspect: Option<(Vec<u64>, Instant)>,
}

static WAITERS: Lazy<Mutex<Vec<Waiter>>> = Lazy::new(|| Mutex::new(Vec::new()));
static FAILED_RUNS: Lazy<Mutex<VecDeque<(i64, String)>>> = Lazy::new(|| Mutex::new(VecDeque::new()));
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Whether any run was ever failed by a break: every checked `join` asks `failed_run`, and this
/// keeps that to one atomic load (no lock) in a process that never had one.
static ANY_FAILED_RUN: AtomicBool = AtomicBool::new(false);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The message of a run that a broken deadlock failed, if `place`'s run is one.
pub fn failed_run(place: &Place) -> Option<String> {
    if !place.checked() || !ANY_FAILED_RUN.load(Ordering::Acquire) {
        return None;
    }
    lock(&FAILED_RUNS)
        .iter()
        .find(|(run, _)| *run == place.run)
        .map(|(_, msg)| msg.clone())
}

/// What a join timeout adds when none of the missing ranks' devices waits in a tide call: the
/// rank may still be computing, or never have started this program, held back inside XLA by a
/// program launched at the same time from another thread (which tide cannot see).
pub fn absent_hint(place: &Place, absent: &[usize]) -> Option<String> {
    if !place.checked() {
        return None;
    }
    let devices: Vec<i64> = absent.iter().filter_map(|&r| place.devices.get(r).copied()).collect();
    let waiters = lock(&WAITERS);
    let busy = waiters
        .iter()
        .any(|w| w.place.engine == place.engine && devices.contains(&w.place.devices[w.rank]));
    if busy || devices.is_empty() {
        return None;
    }
    // Devices where an earlier call of this run arrived (CPU places only) ran the program: they
    // are computing, or skip this call; the others may never have started it.
    let (ran, unseen): (Vec<i64>, Vec<i64>) =
        devices.iter().partition(|&&d| started_on(place.engine, place.run, d));
    let list = |v: &[i64]| crate::error::short_list(v, 8).trim_matches(|c| c == '[' || c == ']').to_string();
    let mut parts = Vec::new();
    if !ran.is_empty() {
        parts.push(format!(
            "device {} reached earlier tide calls of this program but not this one: it is still \
             computing, or the program skips this call there (a tide call under a `cond` or \
             `switch` that not every device takes)",
            list(&ran)
        ));
    }
    if !unseen.is_empty() {
        parts.push(format!(
            "no tide call waits on device {}: it is still computing, or it never started this \
             program; programs launched at the same time from several threads can hold each other \
             back inside XLA, where tide cannot see it: launch them under \
             `tide_jax.dispatch_lock(mesh)`",
            list(&unseen)
        ));
    }
    Some(format!(" ({})", parts.join("; ")))
}

/// Number of registered waiters (tests and diagnostics).
pub fn waiting() -> usize {
    lock(&WAITERS).len()
}

/// One rank's wait at a `join`: registered on its first `check`, deregistered when dropped.
/// Drop it only while holding no session's state (lock order).
pub struct Watch {
    id: u64,
    place: Place,
    rank: usize,
    what: String,
    key: Key,
    session: Arc<dyn Waitable>,
    registered: bool,
    /// Samples of (wall, process CPU time) at this wait's checks, the oldest the start of the
    /// sliding window of the last `stall_after` (`stall`).
    samples: VecDeque<(Instant, Duration)>,
    /// When the watch was made (`REGISTER_AFTER` into the wait).
    created: Instant,
}

impl Watch {
    /// A watch for `rank`'s wait in `session` (`what` and `key` name the call), or None when
    /// `place` cannot be checked.
    pub fn new(
        place: Option<&Place>,
        rank: usize,
        what: &str,
        key: Key,
        session: Arc<dyn Waitable>,
    ) -> Option<Watch> {
        let place = place.filter(|p| p.checked() && rank < p.devices.len())?;
        Some(Watch {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            place: place.clone(),
            rank,
            what: what.to_string(),
            key,
            session,
            registered: false,
            samples: VecDeque::new(),
            created: Instant::now(),
        })
    }

    /// Registers this wait (first call) and looks for a cycle through its device. Returns the
    /// error message when this wait must end: a deadlock broken (every session of the cycle,
    /// this one included, failed with it) or this run failed by an earlier break (this session
    /// failed with that message).
    pub fn check(&mut self) -> Option<String> {
        if let Some(msg) = failed_run(&self.place) {
            self.session.break_with(&msg);
            return Some(msg);
        }
        let mut waiters = lock(&WAITERS);
        if !self.registered {
            waiters.push(Waiter {
                id: self.id,
                place: self.place.clone(),
                rank: self.rank,
                what: self.what.clone(),
                key: self.key,
                session: self.session.clone(),
                suspect: None,
            });
            self.registered = true;
        }
        let cycle = find_cycle(&waiters, self.id);
        let me = waiters.iter().position(|w| w.id == self.id)?;
        let Some(cycle) = cycle else {
            waiters[me].suspect = None;
            return self.stall(&waiters);
        };
        let ids: Vec<u64> = cycle.iter().map(|e| waiters[e.waiter].id).collect();
        match &waiters[me].suspect {
            Some((seen, since)) if *seen == ids => {
                if since.elapsed() < self.place.confirm_after {
                    return None;
                }
            }
            _ => {
                waiters[me].suspect = Some((ids, Instant::now()));
                return None;
            }
        }
        let msg = describe(&waiters, &cycle);
        // Every session of the cycle, and every other waiting call of its runs.
        let runs: Vec<i64> = cycle.iter().map(|e| waiters[e.waiter].place.run).collect();
        fail_runs(&waiters, &runs, &msg);
        Some(msg)
    }

    /// The stall check (module header, "Stalls"), with `WAITERS` held: the run fails when the
    /// process was idle over the last `stall_after` of this wait (a sliding window over the
    /// checks' samples) and the session misses a device that never started the run and has no
    /// tide call waiting.
    fn stall(&mut self, waiters: &[Waiter]) -> Option<String> {
        let after = self.place.stall_after?;
        let (now, cpu) = cpu_sample();
        if self.samples.back().is_some_and(|&(t, _)| t >= now) {
            return None; // no newer sample since this waiter's last check
        }
        self.samples.push_back((now, cpu));
        // Keep the newest sample at least `after` old as the window's start.
        while self.samples.len() >= 2 && now.duration_since(self.samples[1].0) >= after {
            self.samples.pop_front();
        }
        let (since, cpu0) = self.samples[0];
        let wall = now.duration_since(since);
        if wall < after {
            return None;
        }
        let used = cpu.saturating_sub(cpu0).as_secs_f64() / wall.as_secs_f64();
        if used >= IDLE_CPU_FRACTION {
            return None;
        }
        let engine = self.place.engine;
        let never: Vec<i64> = self
            .session
            .absent()
            .into_iter()
            .filter_map(|r| self.place.devices.get(r).copied())
            .filter(|&d| {
                !waiters.iter().any(|w| w.place.engine == engine && w.place.devices[w.rank] == d)
                    && !started_on(engine, self.place.run, d)
            })
            .collect();
        if never.is_empty() {
            return None;
        }
        let msg = describe_stall(self, &never, wall, used);
        fail_runs(waiters, &[self.place.run], &msg);
        Some(msg)
    }
}

/// Records `runs` as failed with `msg` (their later calls fail at once) and breaks every waiting
/// session of them.
fn fail_runs(waiters: &[Waiter], runs: &[i64], msg: &str) {
    {
        let mut failed = lock(&FAILED_RUNS);
        for &run in runs {
            if !failed.iter().any(|(r, _)| *r == run) {
                if failed.len() == FAILED_RUNS_KEPT {
                    failed.pop_front();
                }
                failed.push_back((run, msg.to_string()));
            }
        }
        ANY_FAILED_RUN.store(true, Ordering::Release);
    }
    for w in waiters.iter().filter(|w| runs.contains(&w.place.run)) {
        w.session.break_with(msg);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if self.registered {
            lock(&WAITERS).retain(|w| w.id != self.id);
        }
    }
}

/// One edge of a cycle: `waiter` (index into the waiters) misses the rank on device `to`.
struct Edge {
    waiter: usize,
    to: i64,
}

/// A cycle of edges through the device of waiter `me`, if there is one.
fn find_cycle(waiters: &[Waiter], me: u64) -> Option<Vec<Edge>> {
    let mine = waiters.iter().find(|w| w.id == me)?;
    let engine = mine.place.engine;
    let device_of = |w: &Waiter| w.place.devices[w.rank];
    // Devices of this engine with waiting calls (indices into `waiters`), and the run holding
    // each (None: calls of several runs wait there, which the model does not explain: no edge
    // into or out of it).
    let mut on: HashMap<i64, Vec<usize>> = HashMap::new();
    let mut held: HashMap<i64, Option<i64>> = HashMap::new();
    for (i, w) in waiters.iter().enumerate().filter(|(_, w)| w.place.engine == engine) {
        let run = w.place.run;
        on.entry(device_of(w)).or_default().push(i);
        held.entry(device_of(w))
            .and_modify(|h| {
                if *h != Some(run) {
                    *h = None
                }
            })
            .or_insert(Some(run));
    }
    // Out-edges of a device, computed when the search first reaches it (each reads the sessions of
    // that device's waiters): (waiter index, device it misses) where that device is held by
    // another run.
    let mut out: HashMap<i64, Vec<Edge>> = HashMap::new();
    let edges_of = |from: i64, out: &mut HashMap<i64, Vec<Edge>>| {
        out.entry(from).or_insert_with(|| {
            let Some(Some(run)) = held.get(&from).copied() else {
                return Vec::new();
            };
            let mut edges = Vec::new();
            for &i in on.get(&from).map(Vec::as_slice).unwrap_or(&[]) {
                let w = &waiters[i];
                for r in w.session.absent() {
                    let Some(&to) = w.place.devices.get(r) else { continue };
                    if matches!(held.get(&to), Some(Some(other)) if *other != run) {
                        edges.push(Edge { waiter: i, to });
                    }
                }
            }
            edges
        });
    };
    // Depth-first from this device back to it.
    let start = device_of(mine);
    let mut path: Vec<Edge> = Vec::new();
    let mut visited: Vec<i64> = vec![start];
    let mut stack: Vec<(i64, usize)> = vec![(start, 0)];
    while let Some(top) = stack.last_mut() {
        edges_of(top.0, &mut out);
        let edges = out.get(&top.0).map(Vec::as_slice).unwrap_or(&[]);
        let Some(e) = edges.get(top.1) else {
            stack.pop();
            path.pop(); // the edge into the device just left (none for the start)
            continue;
        };
        top.1 += 1;
        let (waiter, to) = (e.waiter, e.to);
        if to == start {
            path.push(Edge { waiter, to });
            return Some(path);
        }
        if !visited.contains(&to) {
            visited.push(to);
            path.push(Edge { waiter, to });
            stack.push((to, 0));
        }
    }
    None
}

fn run_name(run: i64) -> String {
    format!("run {:#x}", run as u32)
}

/// The message every call of the cycle fails with: what happened, where, and what to do.
fn describe(waiters: &[Waiter], cycle: &[Edge]) -> String {
    let steps: Vec<String> = cycle
        .iter()
        .map(|e| {
            let w = &waiters[e.waiter];
            format!(
                "device {} waits in {} ({}, call {}) for device {}",
                w.place.devices[w.rank],
                w.what,
                run_name(w.place.run),
                w.key.seq & 0xffff_ffff,
                e.to
            )
        })
        .collect();
    let mut runs: Vec<String> = Vec::new();
    for e in cycle {
        let run = run_name(waiters[e.waiter].place.run);
        if !runs.contains(&run) {
            runs.push(run);
        }
    }
    let shown = 8;
    let more = if steps.len() > shown { format!("; ... ({} waits in all)", steps.len()) } else { String::new() };
    format!(
        "tide: programs interleaved across devices (a deadlock, broken at once): {}{more}. Each device \
         runs the programs launched on it one at a time, in launch order, and these programs ({}) were \
         launched in different orders on different devices (two threads dispatching at once). Every \
         tide call of these runs fails; the process stays usable. Launch tide programs on one mesh \
         from one thread at a time: e.g. `with tide_jax.dispatch_lock(mesh): out = step(...)` \
         around each call of a jitted step in every thread",
        steps[..steps.len().min(shown)].join("; "),
        runs.join(", "),
    )
}

/// The message every call of a stalled run fails with.
fn describe_stall(w: &Watch, never: &[i64], wall: Duration, used: f64) -> String {
    format!(
        "tide: XLA:CPU never started this program on device {}: {} ({}, call {}) on device {} waited \
         {:.2} s for it, with no tide call of the run reaching that device, none waiting there, and \
         the process idle for the last {:.2} s ({:.0} % of a core). XLA:CPU admits 32 executions per device; programs launched \
         from several threads without waiting for their results can fill a device with executions \
         queued behind a launch that cannot get one of XLA's launch threads. Every tide call of this \
         run fails; the process stays usable. Launch tide programs on one mesh from one thread at a \
         time: e.g. `with tide_jax.dispatch_lock(mesh): out = step(...)` around each call of a \
         jitted step in every thread, or wait for results before launching more, or give XLA:CPU's \
         launch pool devices x (threads + 1) threads (PJRT_NPROC, set before JAX starts). (What else \
         looks the same to tide: a device idling this long in a host callback before its first tide \
         call, where TIDE_STALL_MS raises this bound and 0 turns the check off; or a program that \
         skips all its tide calls on that device, e.g. under a `cond` not every device takes.)",
        crate::error::short_list(never, 8).trim_matches(|c| c == '[' || c == ']'),
        w.what,
        run_name(w.place.run),
        w.key.seq & 0xffff_ffff,
        w.place.devices[w.rank],
        (w.created.elapsed() + REGISTER_AFTER).as_secs_f64(),
        wall.as_secs_f64(),
        used * 100.0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A session stand-in: fixed absent ranks until broken.
    struct Fake {
        absent: Mutex<Vec<usize>>,
        broken: AtomicBool,
    }

    impl Waitable for Fake {
        fn absent(&self) -> Vec<usize> {
            lock(&self.absent).clone()
        }
        fn break_with(&self, _msg: &str) {
            self.broken.store(true, Ordering::SeqCst);
            lock(&self.absent).clear();
        }
    }

    fn fake(absent: &[usize]) -> Arc<Fake> {
        Arc::new(Fake {
            absent: Mutex::new(absent.to_vec()),
            broken: AtomicBool::new(false),
        })
    }

    fn place(engine: &'static str, run: i64, devices: &[i64]) -> Place {
        Place {
            engine,
            run,
            devices: devices.into(),
            confirm_after: CONFIRM_AFTER,
            stall_after: None,
        }
    }

    /// A checked watch of `rank` (on `devices`, in `run`) over the stand-in session `s`.
    fn watch(engine: &'static str, run: i64, devices: &[i64], rank: usize, what: &str, site: i64, s: &Arc<Fake>) -> Watch {
        Watch::new(Some(&place(engine, run, devices)), rank, what, key(site), s.clone()).expect("a checked place")
    }

    fn key(site: i64) -> Key {
        Key {
            site,
            group: 0,
            seq: 0,
        }
    }

    // The tests below share the process-wide registry: each uses its own engine name, so their
    // waiters never form edges with another test's.

    #[test]
    fn two_runs_waiting_on_each_other_fail_at_the_second_check() {
        // Run 0x11 on device 7 (rank 1) misses device 1 (rank 0); run 0x22 on device 1 misses 7.
        let a = fake(&[0]);
        let b = fake(&[1]);
        let mut wa = watch("t2", 0x11, &[1, 7], 1, "A", 1, &a);
        let mut wb = watch("t2", 0x22, &[1, 7], 0, "B", 2, &b);
        assert_eq!(wa.check(), None, "registered, no cycle yet (b not registered)");
        assert_eq!(wb.check(), None, "first sighting of the cycle");
        assert_eq!(wb.check(), None, "seen, not yet for CONFIRM_AFTER");
        std::thread::sleep(CONFIRM_AFTER);
        let msg = wb.check().expect("seen for CONFIRM_AFTER: broken");
        assert!(msg.contains("device 1 waits in B") && msg.contains("for device 7"), "{msg}");
        assert!(msg.contains("device 7 waits in A") && msg.contains("dispatch_lock"), "{msg}");
        assert!(a.broken.load(Ordering::SeqCst) && b.broken.load(Ordering::SeqCst));
        // Both runs are failed now: another call of run 0x11 fails at its first check.
        let c = fake(&[0]);
        let mut wc = watch("t2", 0x11, &[1, 7], 1, "C", 3, &c);
        assert_eq!(wc.check().as_deref(), Some(msg.as_str()));
        assert!(c.broken.load(Ordering::SeqCst));
        drop((wa, wb, wc));
    }

    #[test]
    fn one_run_never_waits_on_itself_and_a_running_peer_is_no_edge() {
        // Same run on both devices (ranks still arriving): no cycle.
        let a = fake(&[0]);
        let b = fake(&[1]);
        let mut wa = watch("t1", 5, &[3, 4], 1, "A", 1, &a);
        let mut wb = watch("t1", 5, &[3, 4], 0, "A", 2, &b);
        for _ in 0..3 {
            assert_eq!(wa.check(), None);
            assert_eq!(wb.check(), None);
        }
        // Run 6 on device 4 misses device 3, which has no waiting call (it computes): no edge.
        drop(wb);
        let c = fake(&[0]);
        let mut wc = watch("t1", 6, &[3, 4], 1, "B", 3, &c);
        drop(wa);
        for _ in 0..3 {
            assert_eq!(wc.check(), None);
        }
        assert!(!c.broken.load(Ordering::SeqCst));
    }

    #[test]
    fn a_cycle_that_resolves_before_its_second_sighting_is_left_alone() {
        let a = fake(&[0]);
        let b = fake(&[1]);
        let mut wa = watch("t3", 0x31, &[0, 1], 1, "A", 1, &a);
        let mut wb = watch("t3", 0x32, &[0, 1], 0, "B", 2, &b);
        assert_eq!(wa.check(), None, "registered");
        assert_eq!(wb.check(), None, "registered: the cycle's first sighting");
        assert_eq!(wa.check(), None, "first sighting");
        std::thread::sleep(CONFIRM_AFTER / 2);
        lock(&b.absent).clear(); // device 0's meeting completed: no edge 0 -> 1 any more
        assert_eq!(wa.check(), None);
        std::thread::sleep(CONFIRM_AFTER);
        assert_eq!(wa.check(), None);
        assert_eq!(wb.check(), None);
        assert!(!a.broken.load(Ordering::SeqCst) && !b.broken.load(Ordering::SeqCst));
        drop((wa, wb));
    }

    #[test]
    fn three_devices_in_a_ring_of_three_runs() {
        // Device 10 (run 1) misses 11, 11 (run 2) misses 12, 12 (run 3) misses 10.
        let devs = [10, 11, 12];
        let s: Vec<Arc<Fake>> = (0..3).map(|r| fake(&[(r + 1) % 3])).collect();
        let mut w: Vec<Watch> = (0..3).map(|r| watch("t4", r as i64 + 1, &devs, r, "X", r as i64, &s[r])).collect();
        for x in w.iter_mut() {
            assert_eq!(x.check(), None);
        }
        assert_eq!(w[0].check(), None, "device 10's first sighting");
        std::thread::sleep(CONFIRM_AFTER);
        let msg = w[0].check().expect("the ring is a deadlock");
        assert!(msg.contains("device 10") && msg.contains("device 11") && msg.contains("device 12"), "{msg}");
        assert!(s.iter().all(|f| f.broken.load(Ordering::SeqCst)));
    }

    #[test]
    fn unchecked_places_get_no_watch() {
        let a = fake(&[0]);
        assert!(Watch::new(None, 0, "A", key(1), a.clone()).is_none());
        assert!(Watch::new(Some(&place("t5", 0, &[0, 1])), 0, "A", key(1), a.clone()).is_none());
        assert!(Watch::new(Some(&place("t5", 1, &[])), 0, "A", key(1), a.clone()).is_none());
        assert!(Watch::new(Some(&place("t5", 1, &[0])), 1, "A", key(1), a).is_none());
    }
}
