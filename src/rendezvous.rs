//! In-process rendezvous: the ranks of one collective call, each on its own host thread (XLA runs
//! each local device's program on its own thread), meet, exchange a value, and pass barriers.
//! See docs/design.md "Rendezvous".
//!
//! Lifetime of a session: the first rank to `join` (or `abandon`) a key creates it in a process-wide
//! registry; every rank that joins holds an `Arc` to it; the rank whose arrival completes the count
//! (`world` arrivals, joins and abandons alike) removes it from the registry, so a key is used once.
//! A session whose peers never all arrive (a rank timed out, a thread died) stays in the registry,
//! marked failed, so a very late arrival fails at once with the recorded error instead of waiting;
//! later calls use a fresh `seq` and hence a fresh key, so a failed key never breaks them.
//!
//! Keys: `(site, group, seq)`. The FFI edge takes `seq` from `run_seq` (XLA's RunId plus a count
//! of this rank's calls of the site in that run), so ranks re-synchronize at every run even after
//! one of them skipped a call; `next_seq` (a plain per-rank count) remains for callers without a
//! run id.
//!
//! Protocol for callers: `join` -> work, with `barrier`s between phases -> `leave`, where `leave`
//! is reached on every path once `join` returned `Ok` (see `join`). A rank that fails before it
//! can join calls `abandon`.
//!
//! Every wait is bounded by the session's timeout; a rank that fails (`fail`, `abandon`, or a
//! timeout seen by any rank) poisons the session and every waiter returns that error at once.
//! Errors name the call (`what`), the key, the label and which ranks were missing.

use crate::deadlock::{self, Place, Waitable};
use crate::engine::Barrier;
use crate::error::{Result, TideError};
use once_cell::sync::{Lazy, OnceCell};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a waiting rank spins before it parks on the condition variable.
const SPIN: Duration = Duration::from_micros(50);

/// Identifies one execution of one call site by one group of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub site: i64,
    pub group: usize,
    pub seq: u64,
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keys from `run_seq` carry XLA's run id in the high half.
        match self.seq >> 32 {
            0 => write!(f, "group {} seq {}", self.group, self.seq),
            run => write!(
                f,
                "group {} run {:#x} call {}",
                self.group,
                run,
                self.seq & 0xffff_ffff
            ),
        }
    }
}

/// Locks `m`, ignoring poisoning: every critical section here leaves the state consistent, and a
/// panic elsewhere must not turn into a panic (or abort) inside an FFI call.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// (site, group, rank): what the per-rank counters are keyed by.
type RankKey = (i64, usize, usize);

static SEQS: Lazy<Mutex<HashMap<RankKey, u64>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The n-th execution (from 0) of `site` by `rank` of `group`: every rank counts its own, so the
/// counts agree across ranks of an SPMD program. Call it once per execution, before anything that
/// can fail, so a rank that fails early still keeps its count in step with its peers.
pub fn next_seq(site: i64, group: usize, rank: usize) -> u64 {
    let mut seqs = lock(&SEQS);
    let n = seqs.entry((site, group, rank)).or_insert(0);
    let seq = *n;
    *n += 1;
    seq
}

/// How many runs per (site, group, rank) keep their own call count: runs in flight at once on one
/// device (the same jitted program launched from several Python threads) each count separately.
const RUNS_TRACKED: usize = 64;

/// (run id, calls of the site in that run) of a rank's recent runs, oldest first.
type RecentRuns = Vec<(i64, u32)>;

/// Per (site, group, rank): the runs it recently executed `site` in and how many times it did in
/// each.
static RUN_CALLS: Lazy<Mutex<HashMap<RankKey, RecentRuns>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// The sequence number of this execution of `site` by `rank` of `group` within XLA's run `run_id`
/// (the FFI context `RunId`, distinct for every launch, shared by every device of one launch):
/// `(run_id << 32) | call`, where `call` counts this rank's executions of `site` in that run (a
/// loop body runs it many times).
///
/// Unlike `next_seq`, ranks re-synchronize at every run: if one rank never reached the call in some
/// run (a device failed earlier in the program), its peers time out in that run only, and the next
/// run meets again. Runs may interleave on a device (two Python threads launching the same program
/// at once): each of the last `RUNS_TRACKED` runs keeps its own count, so a loop's calls of one run
/// never take another run's numbers.
pub fn run_seq(site: i64, group: usize, rank: usize, run_id: i64) -> u64 {
    let mut calls = lock(&RUN_CALLS);
    let runs = calls.entry((site, group, rank)).or_default();
    let at = match runs.iter().position(|r| r.0 == run_id) {
        Some(at) => at,
        None => {
            if runs.len() == RUNS_TRACKED {
                runs.remove(0);
            }
            runs.push((run_id, 0));
            runs.len() - 1
        }
    };
    let call = runs[at].1;
    runs[at].1 = call.wrapping_add(1);
    ((run_id as u64) << 32) | call as u64
}

/// Sessions by (value type, key). Type-erased so one registry serves every `Session<T>`.
type Registry = HashMap<(TypeId, Key), Arc<dyn Any + Send + Sync>>;
static REGISTRY: Lazy<Mutex<Registry>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Number of sessions currently registered (all value types). For tests and diagnostics.
pub fn live_sessions() -> usize {
    lock(&REGISTRY).len()
}

struct State<T> {
    /// Published values, by rank.
    values: Vec<Option<T>>,
    /// Ranks that joined or abandoned.
    arrived: Vec<bool>,
    arrivals: usize,
    /// Reusable barrier: generation, who is in the current generation, and its label.
    barrier_gen: u64,
    barrier_in: Vec<bool>,
    barrier_count: usize,
    barrier_label: String,
    /// Ranks that called `leave`.
    departed: Vec<bool>,
    departures: usize,
    /// The first failure: the rank it is blamed on and the message peers report.
    failed: Option<(usize, String)>,
}

/// One meeting of `world` ranks. Values are indexed by rank.
pub struct Session<T> {
    what: String,
    key: Key,
    world: usize,
    timeout: Duration,
    state: Mutex<State<T>>,
    cv: Condvar,
    /// Bumped (under the lock) at every `notify_all`: waiters spin on it briefly before parking.
    epoch: AtomicU64,
    /// All values, set once by the rank that completes the join.
    values: OnceCell<Vec<T>>,
}

fn missing(flags: &[bool]) -> Vec<usize> {
    flags
        .iter()
        .enumerate()
        .filter(|(_, &f)| !f)
        .map(|(r, _)| r)
        .collect()
}

/// "rank 3", "ranks [1, 2]", or for many the first few and the count: a message never grows with
/// the world size.
fn describe_ranks(ranks: &[usize]) -> String {
    match ranks.len() {
        1 => format!("rank {}", ranks[0]),
        _ => format!("ranks {}", crate::error::short_list(ranks, 16)),
    }
}

impl<T: Clone + Send + Sync + 'static> Session<T> {
    /// Publishes `value` for `rank` and waits (at most `timeout`) until all `world` ranks have.
    /// `what` names the call in errors ("tide all_gather site 3").
    ///
    /// Protocol: once `join` returns `Ok`, peers hold this rank's value (buffer addresses) and may
    /// use it, so the caller must end with `leave`, on every path. The session may already be
    /// failed (a peer failed right after joining): `check` says so, and every `barrier` fails.
    /// `join` returns `Err` only when the meeting never completed (a rank abandoned it or did not
    /// arrive in time); then nobody received anybody's value and there is nothing to leave.
    pub fn join(
        what: &str,
        key: Key,
        rank: usize,
        world: usize,
        value: T,
        timeout: Duration,
    ) -> Result<Arc<Session<T>>> {
        Self::join_at(what, key, rank, world, value, timeout, None)
    }

    /// `join` for a call whose `place` (run and devices of its ranks) is known: a wait that is
    /// part of a cycle of programs interleaved across devices fails within milliseconds with a
    /// message saying so (`deadlock`), instead of at the timeout; a call of a run that such a
    /// break failed fails at once.
    pub fn join_at(
        what: &str,
        key: Key,
        rank: usize,
        world: usize,
        value: T,
        timeout: Duration,
        place: Option<&Place>,
    ) -> Result<Arc<Session<T>>> {
        if let Some(msg) = place.and_then(deadlock::failed_run) {
            let err = TideError::Rendezvous(msg);
            Self::abandon(what, key, rank, world, &err, timeout);
            return Err(err);
        }
        let session = Self::arrive(what, key, rank, world, timeout, Some(value), None)?;
        if let Some(p) = place {
            deadlock::arrived(p, rank);
        }
        let start = Instant::now();
        let deadline = start + timeout;
        // Made at the first check (most meetings complete before it). Declared before the state
        // guard, so it is dropped (deregistered) after the guard: the deadlock registry is never
        // locked while this session's state is (lock order).
        let mut watch: Option<deadlock::Watch> = None;
        let mut next_check = place.map(|_| start + deadlock::REGISTER_AFTER);
        let mut st = lock(&session.state);
        let mut spun = false;
        loop {
            // Complete (every rank published): peers may use our value from now on, so we return
            // the session even if it already failed; the caller must `leave` it.
            if session.values.get().is_some() {
                return Ok(session.clone());
            }
            if let Some(err) = session.failure(&st) {
                return Err(err);
            }
            let mut now = Instant::now();
            if now >= deadline {
                // The hint reads the deadlock registry: never while holding the state (lock
                // order). The meeting may complete or fail meanwhile: then that is the answer.
                let mut hint = None;
                if let Some(p) = place {
                    let absent = missing(&st.arrived);
                    drop(st);
                    hint = deadlock::absent_hint(p, &absent);
                    st = lock(&session.state);
                    if session.values.get().is_some() {
                        return Ok(session.clone());
                    }
                    if let Some(err) = session.failure(&st) {
                        return Err(err);
                    }
                }
                let absent = missing(&st.arrived);
                let mut msg = session.timeout_message(&absent, "join");
                msg.push_str(hint.as_deref().unwrap_or(""));
                session.poison(&mut st, absent[0], msg.clone());
                return Err(TideError::Rendezvous(msg));
            }
            let mut until = deadline;
            if let Some(check_at) = next_check {
                if now >= check_at {
                    drop(st);
                    if watch.is_none() {
                        let waitable = session.clone() as Arc<dyn Waitable>;
                        watch = deadlock::Watch::new(place, rank, what, key, waitable);
                    }
                    // A break fails this session too; no watch (an unchecked place): no more checks.
                    let broken = watch.as_mut().map(|w| w.check().is_some());
                    st = lock(&session.state);
                    match broken {
                        Some(true) => continue,
                        Some(false) => {
                            now = Instant::now();
                            next_check = Some(now + deadlock::CHECK_EVERY);
                        }
                        None => next_check = None,
                    }
                }
                if let Some(check_at) = next_check {
                    until = until.min(check_at);
                }
            }
            st = session.wait(st, until.saturating_duration_since(now), &mut spun);
        }
    }

    /// For a rank that failed before it could join `key`: counts it as arrived and poisons the
    /// session with `err`, so peers waiting in (or later joining) it fail at once with that error
    /// instead of timing out. Returns without waiting.
    pub fn abandon(
        what: &str,
        key: Key,
        rank: usize,
        world: usize,
        err: &TideError,
        timeout: Duration,
    ) {
        // An error here (bad rank, a session of another world size) leaves peers to time out,
        // which still names this rank; nothing better can be done.
        let _ = Self::arrive(what, key, rank, world, timeout, None, Some(err));
    }

    /// Registers `rank`'s arrival at `key` (with a value, or as a failure) and returns the session.
    fn arrive(
        what: &str,
        key: Key,
        rank: usize,
        world: usize,
        timeout: Duration,
        value: Option<T>,
        err: Option<&TideError>,
    ) -> Result<Arc<Session<T>>> {
        if world == 0 || rank >= world {
            return Err(TideError::InvalidArgument(format!(
                "{what} {key}: rank {rank} is outside world size {world}"
            )));
        }
        let reg_key = (TypeId::of::<Session<T>>(), key);
        let mut reg = lock(&REGISTRY);
        let session: Arc<Session<T>> = match reg.get(&reg_key) {
            Some(any) => any.clone().downcast::<Session<T>>().map_err(|_| {
                TideError::Internal(format!(
                    "{what} {key}: rendezvous registry holds a session of another type"
                ))
            })?,
            None => {
                let s = Arc::new(Session::new(what, key, world, timeout));
                reg.insert(reg_key, s.clone() as Arc<dyn Any + Send + Sync>);
                s
            }
        };
        let mut st = lock(&session.state);
        if session.world != world {
            let msg = format!(
                "{what} {key}: rank {rank} joined with world size {world} but peers use {}",
                session.world
            );
            session.poison(&mut st, rank, msg.clone());
            return Err(TideError::InvalidArgument(msg));
        }
        if st.arrived[rank] {
            let msg = format!(
                "{what} {key}: rank {rank} joined twice (two devices map to the same rank, or call \
                 sites share a site id)"
            );
            session.poison(&mut st, rank, msg.clone());
            return Err(TideError::InvalidArgument(msg));
        }
        st.arrived[rank] = true;
        st.arrivals += 1;
        st.values[rank] = value;
        if let Some(e) = err {
            session.poison(
                &mut st,
                rank,
                format!("{what} {key}: rank {rank} failed: {e}"),
            );
        }
        if st.arrivals == world {
            reg.remove(&reg_key);
            // Publish only if nobody failed before the meeting completed: a rank that timed out
            // has returned already, and its buffers must not be handed to anybody.
            if st.failed.is_none() && st.values.iter().all(Option::is_some) {
                let all: Vec<T> = st.values.iter_mut().filter_map(Option::take).collect();
                let _ = session.values.set(all);
            }
            session.wake();
        }
        drop(st);
        drop(reg);
        Ok(session)
    }

    fn new(what: &str, key: Key, world: usize, timeout: Duration) -> Session<T> {
        Session {
            what: what.to_string(),
            key,
            world,
            timeout,
            state: Mutex::new(State {
                values: (0..world).map(|_| None).collect(),
                arrived: vec![false; world],
                arrivals: 0,
                barrier_gen: 0,
                barrier_in: vec![false; world],
                barrier_count: 0,
                barrier_label: String::new(),
                departed: vec![false; world],
                departures: 0,
                failed: None,
            }),
            cv: Condvar::new(),
            epoch: AtomicU64::new(0),
            values: OnceCell::new(),
        }
    }

    /// The session's failure, if a rank failed it (or timed out in it).
    pub fn check(&self) -> Result<()> {
        match self.failure(&lock(&self.state)) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Everyone's values, indexed by rank. Empty only on a session that failed before all joined
    /// (never returned by a successful `join`).
    pub fn values(&self) -> &[T] {
        self.values.get().map(|v| v.as_slice()).unwrap_or(&[])
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The key this session was joined under.
    pub fn key(&self) -> Key {
        self.key
    }

    /// Barrier `label` over all ranks; fails if a peer failed or did not arrive within the timeout.
    pub fn barrier(&self, rank: usize, label: &str) -> Result<()> {
        let mut st = lock(&self.state);
        if let Some(err) = self.failure(&st) {
            return Err(err);
        }
        if rank >= self.world {
            return Err(TideError::Internal(format!(
                "{} {}: barrier '{label}' entered by rank {rank} of world {}",
                self.what, self.key, self.world
            )));
        }
        if st.barrier_in[rank] {
            let msg = format!(
                "{} {}: rank {rank} entered barrier '{label}' twice while '{}' was still open",
                self.what, self.key, st.barrier_label
            );
            self.poison(&mut st, rank, msg.clone());
            return Err(TideError::Internal(msg));
        }
        if st.barrier_count == 0 {
            st.barrier_label = label.to_string();
        } else if st.barrier_label != label {
            let msg = format!(
                "{} {}: rank {rank} entered barrier '{label}' while peers are at '{}' (ranks \
                 disagree on the plan)",
                self.what, self.key, st.barrier_label
            );
            self.poison(&mut st, rank, msg.clone());
            return Err(TideError::Internal(msg));
        }
        st.barrier_in[rank] = true;
        st.barrier_count += 1;
        if st.barrier_count == self.world {
            st.barrier_in.iter_mut().for_each(|b| *b = false);
            st.barrier_count = 0;
            st.barrier_gen += 1;
            self.wake();
            return Ok(());
        }
        let gen = st.barrier_gen;
        let deadline = Instant::now() + self.timeout;
        let mut spun = false;
        loop {
            if st.barrier_gen != gen {
                return Ok(());
            }
            if let Some(err) = self.failure(&st) {
                return Err(err);
            }
            let now = Instant::now();
            if now >= deadline {
                let absent = missing(&st.barrier_in);
                let msg = self.timeout_message(&absent, label);
                self.poison(&mut st, absent[0], msg.clone());
                return Err(TideError::Rendezvous(msg));
            }
            st = self.wait(st, deadline - now, &mut spun);
        }
    }

    /// The last wait of every rank that joined, on success and on failure alike: returns once every
    /// rank has left (or after the timeout), so no rank returns (and lets its buffers go) while a
    /// peer may still be reading them. Unlike `barrier`, a failure does not cut it short; a failed
    /// peer still leaves (after `fail`), and a peer that does not leave in time is named. Returns the
    /// session's failure if there was one, else `Ok` once all left.
    pub fn leave(&self, rank: usize) -> Result<()> {
        let mut st = lock(&self.state);
        if rank >= self.world || st.departed[rank] {
            return Err(TideError::Internal(format!(
                "{} {}: rank {rank} left twice or is outside world {}",
                self.what, self.key, self.world
            )));
        }
        st.departed[rank] = true;
        st.departures += 1;
        if st.departures == self.world {
            self.wake();
        }
        let deadline = Instant::now() + self.timeout;
        let mut spun = false;
        while st.departures < self.world {
            let now = Instant::now();
            if now >= deadline {
                let absent = missing(&st.departed);
                let msg = self.timeout_message(&absent, "exit");
                self.poison(&mut st, absent[0], msg.clone());
                return Err(TideError::Rendezvous(msg));
            }
            st = self.wait(st, deadline - now, &mut spun);
        }
        match self.failure(&st) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Whether every rank has called `leave` (false after a `leave` that timed out).
    pub fn all_left(&self) -> bool {
        lock(&self.state).departures == self.world
    }

    /// Marks this session failed by `rank` with `err`, so peers waiting in it fail fast with it.
    pub fn fail(&self, rank: usize, err: &TideError) {
        let mut st = lock(&self.state);
        let msg = format!("{} {}: rank {rank} failed: {err}", self.what, self.key);
        self.poison(&mut st, rank, msg);
    }

    /// Wakes every waiter (call with the state locked).
    fn wake(&self) {
        self.epoch.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
    }

    /// One wait for a state change: the first time (per `spun`), a short spin on `epoch` with the
    /// lock released (peers on other cores usually arrive within microseconds, and a parked
    /// thread takes tens of microseconds to wake), then back to the caller to re-check; after
    /// that, the condition variable, at most `left`. No wake-up is lost: the caller re-checks its
    /// condition under the lock before every wait, and `wake` runs under the lock.
    fn wait<'a>(
        &'a self,
        st: MutexGuard<'a, State<T>>,
        left: Duration,
        spun: &mut bool,
    ) -> MutexGuard<'a, State<T>> {
        if !*spun {
            *spun = true;
            let seen = self.epoch.load(Ordering::Acquire);
            drop(st);
            let start = Instant::now();
            let limit = SPIN.min(left);
            while self.epoch.load(Ordering::Acquire) == seen && start.elapsed() < limit {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            }
            return lock(&self.state);
        }
        self.cv
            .wait_timeout(st, left)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    /// Records the first failure and wakes every waiter.
    fn poison(&self, st: &mut State<T>, rank: usize, msg: String) {
        if st.failed.is_none() {
            st.failed = Some((rank, msg));
        }
        self.wake();
    }

    fn failure(&self, st: &State<T>) -> Option<TideError> {
        st.failed
            .as_ref()
            .map(|(_, msg)| TideError::Rendezvous(msg.clone()))
    }

    fn timeout_message(&self, absent: &[usize], label: &str) -> String {
        format!(
            "{} {}: {} did not arrive at '{label}' within {} s",
            self.what,
            self.key,
            describe_ranks(absent),
            fmt_secs(self.timeout)
        )
    }
}

fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

impl<T: Clone + Send + Sync + 'static> Waitable for Session<T> {
    fn absent(&self) -> Vec<usize> {
        let st = lock(&self.state);
        if self.values.get().is_some() || st.failed.is_some() {
            return Vec::new();
        }
        missing(&st.arrived)
    }

    fn break_with(&self, msg: &str) {
        let mut st = lock(&self.state);
        if self.values.get().is_none() {
            let blamed = missing(&st.arrived).first().copied().unwrap_or(0);
            self.poison(&mut st, blamed, msg.to_string());
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Barrier for Session<T> {
    fn wait(&self, rank: usize, phase: usize) -> Result<()> {
        self.barrier(rank, &format!("phase {phase}"))
    }
}
