//! The control plane of a group of ranks in different processes of one host: who is there, a
//! barrier, failure propagation and dead-peer detection, over one small shared-memory control
//! block per rank (docs/multiprocess.md "Control blocks").
//!
//! Each rank writes only its own block and reads its peers':
//! - `epoch`: how many barriers this rank has arrived at. A barrier is "bump my epoch, wake its
//!   futex, wait until every peer's epoch reached mine". The Release store / Acquire load pair
//!   orders everything a rank wrote before arriving (its inputs copied into its data segment, its
//!   stage slots) before everything its peers read after leaving: the cross-process twin of the
//!   thread barrier the CPU engine relies on (engine::cpu, "Memory model").
//! - `failed` + message: set once, sticky; every waiter checks its peers' flags, so one rank's
//!   error makes the others fail fast with the root cause instead of timing out.
//! - `pid`, its start time and pid namespace: a waiter checks that the peers it waits for still
//!   exist (`/proc/PID/stat`: gone, a zombie, or a reused pid all mean dead), so a killed process
//!   is reported as "rank 3 (pid 1234) died" within `liveness_interval`, not after the timeout.
//! - the call announcement (`Announcement`), written before arriving at a call's entry barrier.
//!
//! Waits never spin for long: a short spin, then futex waits (non-private: the word is shared
//! between processes) in slices of at most `poll`, bounded by `timeout`.
//!
//! Lifetime: a rank creates its block, maps every peer's (`connect`), passes the join barrier,
//! then unlinks its block's name: every peer has mapped it by then, and nothing is left in
//! /dev/shm even if a process is killed later.

use super::shm::{segment_name, unlink_name, Created, Segment};
use crate::error::{Result, TideError};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const CONTROL_MAGIC: u64 = 0x7469_6465_6374_6c31; // "tidectl1"
const MSG_CAP: usize = 1000;

/// One rank's control block, at the start of its control segment.
#[repr(C)]
struct ControlBlock {
    magic: AtomicU64,
    pid: AtomicU64,
    start_time: AtomicU64,
    pid_ns: AtomicU64,
    world: AtomicU64,
    epoch: AtomicU32,
    failed: AtomicU32,
    msg_len: AtomicU32,
    /// The rank whose failure this is (a propagated failure keeps its origin).
    origin: AtomicU32,
    call_seq: AtomicU64,
    call_op: AtomicU64,
    call_site: AtomicI64,
    call_fingerprint: AtomicU64,
    call_data_class: AtomicU64,
    msg: [AtomicU8; MSG_CAP],
}

const CONTROL_BYTES: usize = 4096;
const _: () = assert!(std::mem::size_of::<ControlBlock>() <= CONTROL_BYTES);

/// What a rank says about the call it is entering; peers check they are in the same call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announcement {
    /// How many calls this rank made in this group before this one.
    pub seq: u64,
    /// 0 all-gather, 1 reduce-scatter.
    pub op: u64,
    /// The call site (for messages; sites are process-local ids and may differ between processes).
    pub site: i64,
    /// Hash of everything the plan was built from; equal on every rank of a call.
    pub fingerprint: u64,
    /// Size class of the data segment this rank uses for the call (`2^class` bytes).
    pub data_class: u64,
}

/// Timing of the control plane.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long any one wait may take before the call fails (TIDE_TIMEOUT_S).
    pub timeout: Duration,
    /// Longest single sleep of a waiter; bounds how late a failure flag is noticed.
    pub poll: Duration,
    /// How often a waiter checks that the peers it waits for are alive.
    pub liveness_interval: Duration,
}

impl Timing {
    pub fn from_config() -> Timing {
        Timing {
            timeout: crate::config::current().timeout(),
            poll: Duration::from_millis(20),
            liveness_interval: Duration::from_millis(100),
        }
    }
}

/// Identity of a process, to tell "dead" from "pid reused".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcId {
    pid: u64,
    start_time: u64,
    pid_ns: u64,
}

fn read_stat(pid: u64) -> std::io::Result<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // "pid (comm) state ppid ...": comm may hold spaces and parens; the state follows the last ')'.
    let rest = text.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().and_then(|s| s.chars().next()).unwrap_or('?');
    // Field 22 (starttime) is the 20th after the state (field 3).
    let start = fields.get(19).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((state, start))
}

fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0)
}

fn this_process() -> ProcId {
    let pid = std::process::id() as u64;
    ProcId {
        pid,
        start_time: read_stat(pid).map(|s| s.1).unwrap_or(0),
        pid_ns: pid_namespace(),
    }
}

/// `None` if `who` is (as far as we can tell) alive, else why it is dead.
fn death_of(who: ProcId, me: ProcId) -> Option<&'static str> {
    if who.pid == me.pid && who.pid_ns == me.pid_ns {
        return None;
    }
    if who.pid_ns != me.pid_ns || who.pid == 0 {
        return None; // another pid namespace: its pid means nothing here; rely on the timeout
    }
    match read_stat(who.pid) {
        Ok((state, start)) => {
            if state == 'Z' || state == 'X' {
                Some("exited")
            } else if who.start_time != 0 && start != 0 && start != who.start_time {
                Some("exited (its pid now belongs to another process)")
            } else {
                None
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("no longer exists"),
        Err(_) => {
            // No /proc: fall back to kill(pid, 0).
            // SAFETY: signal 0 only checks for existence.
            let r = unsafe { libc::kill(who.pid as libc::pid_t, 0) };
            if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
                Some("no longer exists")
            } else {
                None
            }
        }
    }
}

#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 in shared memory; returns on wake, timeout,
    // signal or value mismatch, all of which the caller handles by re-checking.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 in shared memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wait(_word: &AtomicU32, _expected: u32, timeout: Duration) {
    std::thread::sleep(timeout.min(Duration::from_micros(200)));
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_word: &AtomicU32) {}

/// The segment suffix of `what` in lane `lane` ("ctl", "s7-ctl", ...).
pub fn lane_name(lane: i64, what: &str) -> String {
    if lane == 0 {
        what.to_string()
    } else {
        format!("s{lane}-{what}")
    }
}

fn reached(epoch: u32, target: u32) -> bool {
    (epoch.wrapping_sub(target) as i32) >= 0
}

/// One rank's membership of a group of ranks spread over processes of one host.
pub struct ProcessGroup {
    job: u64,
    group: usize,
    rank: usize,
    world: usize,
    /// The ranks of this group's control plane, sorted, `rank` among them: every rank of the
    /// world, or (multi-node runs) the ranks of this rank's node; the rest are reached only
    /// through the rail (`transport::rail`), never through this host's shared memory.
    members: Vec<usize>,
    /// Which independent control plane of the group this is (`create_lane`; 0: the plain one).
    lane: i64,
    timing: Timing,
    me: ProcId,
    /// Every rank's control segment (ours included), indexed by rank; `None` until connected.
    blocks: Vec<Option<Segment>>,
    peers: Vec<ProcId>,
    /// First failure seen or caused by this rank; every later call fails with it.
    failure: Mutex<Option<String>>,
}

impl ProcessGroup {
    fn block(&self, q: usize) -> &ControlBlock {
        let seg = self.blocks[q].as_ref().expect("control block mapped");
        // SAFETY: the segment is CONTROL_BYTES long, page aligned, and holds a ControlBlock (all
        // fields are atomics, valid for any bit pattern, zero-initialised by ftruncate).
        unsafe { &*(seg.as_ptr() as *const ControlBlock) }
    }

    fn own(&self) -> &ControlBlock {
        self.block(self.rank)
    }

    /// Creates this rank's control block (not waiting for anyone), in a control plane over every
    /// rank of the world. A failure recorded before `connect` is seen by peers as soon as they map
    /// the block.
    pub fn create(
        job: u64,
        group: usize,
        rank: usize,
        world: usize,
        timing: Timing,
    ) -> Result<ProcessGroup> {
        Self::create_among(job, group, rank, world, (0..world).collect(), timing)
    }

    /// `create` for a control plane over `members` only (the ranks of one node): barriers,
    /// announcements and failures are shared with them and no one else.
    pub fn create_among(
        job: u64,
        group: usize,
        rank: usize,
        world: usize,
        members: Vec<usize>,
        timing: Timing,
    ) -> Result<ProcessGroup> {
        Self::create_lane(job, group, 0, rank, world, members, timing)
    }

    /// `create_among` for lane `lane` of the group: an independent control plane (its own blocks,
    /// barriers and announcements) for calls that may run concurrently with other lanes' calls
    /// (the CPU transport gives each call site its own lane). Lane 0 is the group's plain plane.
    pub fn create_lane(
        job: u64,
        group: usize,
        lane: i64,
        rank: usize,
        world: usize,
        mut members: Vec<usize>,
        timing: Timing,
    ) -> Result<ProcessGroup> {
        members.sort_unstable();
        members.dedup();
        if rank >= world || !members.contains(&rank) || members.iter().any(|&q| q >= world) {
            return crate::invalid!(
                "tide multi-process group {group}: rank {rank} / members {members:?} outside world size {world} \
                 (the rank must be a member)"
            );
        }
        let me = this_process();
        let name = segment_name(job, group, rank, &lane_name(lane, "ctl"));
        let seg = match Segment::create(&name, CONTROL_BYTES)? {
            Created::New(seg) => seg,
            Created::Exists => {
                // A live owner means two processes claim the same rank; a dead one left it behind.
                if let Some(old) = Segment::open(&name, CONTROL_BYTES)? {
                    // SAFETY: as in `block`.
                    let b = unsafe { &*(old.as_ptr() as *const ControlBlock) };
                    let owner = ProcId {
                        pid: b.pid.load(Ordering::Acquire),
                        start_time: b.start_time.load(Ordering::Acquire),
                        pid_ns: b.pid_ns.load(Ordering::Acquire),
                    };
                    if b.magic.load(Ordering::Acquire) == CONTROL_MAGIC
                        && death_of(owner, me).is_none()
                    {
                        return Err(TideError::Rendezvous(format!(
                            "rank {rank} of group {group} (job {job:016x}) is already held by pid {}; \
                             two processes claim the same rank (check JAX_PROCESS_ID / the mesh)",
                            owner.pid
                        )));
                    }
                }
                unlink_name(&name);
                match Segment::create(&name, CONTROL_BYTES)? {
                    Created::New(seg) => seg,
                    Created::Exists => {
                        return Err(TideError::Rendezvous(format!(
                            "shared memory segment {name} keeps reappearing: two processes claim rank {rank}"
                        )))
                    }
                }
            }
        };
        let mut blocks: Vec<Option<Segment>> = (0..world).map(|_| None).collect();
        blocks[rank] = Some(seg);
        let pg = ProcessGroup {
            job,
            group,
            rank,
            world,
            members,
            lane,
            timing,
            me,
            blocks,
            peers: vec![
                ProcId {
                    pid: 0,
                    start_time: 0,
                    pid_ns: 0
                };
                world
            ],
            failure: Mutex::new(None),
        };
        let b = pg.own();
        b.pid.store(me.pid, Ordering::Relaxed);
        b.start_time.store(me.start_time, Ordering::Relaxed);
        b.pid_ns.store(me.pid_ns, Ordering::Relaxed);
        b.world.store(world as u64, Ordering::Relaxed);
        b.magic.store(CONTROL_MAGIC, Ordering::Release);
        let mut pg = pg;
        pg.peers[rank] = me;
        Ok(pg)
    }

    /// Maps every peer's control block (waiting for peers that have not started yet), then passes
    /// the join barrier and unlinks this rank's block name.
    pub fn connect(&mut self) -> Result<()> {
        let start = Instant::now();
        let deadline = start + self.timing.timeout;
        let mut sleep = Duration::from_micros(200);
        loop {
            let mut missing = Vec::new();
            for &q in &self.members {
                if self.blocks[q].is_some() {
                    continue;
                }
                let name = segment_name(self.job, self.group, q, &lane_name(self.lane, "ctl"));
                let ready = match Segment::open(&name, CONTROL_BYTES)? {
                    Some(seg) => {
                        // SAFETY: as in `block`.
                        let b = unsafe { &*(seg.as_ptr() as *const ControlBlock) };
                        if b.magic.load(Ordering::Acquire) == CONTROL_MAGIC {
                            let their_world = b.world.load(Ordering::Relaxed) as usize;
                            if their_world != self.world {
                                return Err(self.fail_with(format!(
                                    "rank {q} of group {} has world size {their_world}, rank {} has {}",
                                    self.group, self.rank, self.world
                                )));
                            }
                            self.peers[q] = ProcId {
                                pid: b.pid.load(Ordering::Relaxed),
                                start_time: b.start_time.load(Ordering::Relaxed),
                                pid_ns: b.pid_ns.load(Ordering::Relaxed),
                            };
                            Some(seg)
                        } else {
                            None
                        }
                    }
                    None => None,
                };
                match ready {
                    Some(seg) => self.blocks[q] = Some(seg),
                    None => missing.push(q),
                }
            }
            self.check_peer_failures("joining")?;
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let site = if self.lane != 0 {
                    format!(" at call site {}", self.lane)
                } else {
                    String::new()
                };
                return Err(self.fail_with(format!(
                    "rank {} of group {} waited {:.1?} for ranks {} to join{site} (no control block \
                     {}): did every process start, with the same TIDE job id, and trace the same tide calls? \
                     (A process that failed before reaching this call, an uncaught exception say, never \
                     joins: its own output says why, and `python -m tide_jax.launch` names it.)",
                    self.rank,
                    self.group,
                    self.timing.timeout,
                    crate::error::short_list(&missing, 16),
                    segment_name(self.job, self.group, missing[0], &lane_name(self.lane, "ctl"))
                )));
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(self.timing.poll);
        }
        let joined = self.barrier("join");
        if let Some(seg) = self.blocks[self.rank].as_mut() {
            seg.unlink();
        }
        joined
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }
    pub fn timing(&self) -> Timing {
        self.timing
    }
    /// The ranks of this control plane (sorted, this rank included).
    pub fn members(&self) -> &[usize] {
        &self.members
    }
    pub fn pid_of(&self, q: usize) -> u64 {
        self.peers[q].pid
    }

    /// The failure this rank recorded, if any.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records `why` as this rank's failure (the first one sticks), publishes it to peers and wakes
    /// them. Returns the error to hand back to the caller.
    pub fn fail_with(&self, why: String) -> TideError {
        self.fail_from(self.rank, why)
    }

    fn fail_from(&self, origin: usize, why: String) -> TideError {
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(why.clone());
            let b = self.own();
            let bytes = why.as_bytes();
            let n = bytes.len().min(MSG_CAP);
            for (dst, &src) in b.msg.iter().zip(&bytes[..n]) {
                dst.store(src, Ordering::Relaxed);
            }
            b.msg_len.store(n as u32, Ordering::Relaxed);
            b.origin.store(origin as u32, Ordering::Relaxed);
            b.failed.store(1, Ordering::Release);
            // Wake whoever waits on any block we have mapped: they re-check the failure flags.
            for seg in self.blocks.iter().flatten() {
                // SAFETY: as in `block`.
                futex_wake(unsafe { &(*(seg.as_ptr() as *const ControlBlock)).epoch });
            }
        }
        TideError::Rendezvous(slot.clone().unwrap_or(why))
    }

    fn peer_message(&self, q: usize) -> String {
        let b = self.block(q);
        let n = (b.msg_len.load(Ordering::Relaxed) as usize).min(MSG_CAP);
        let bytes: Vec<u8> = b.msg[..n]
            .iter()
            .map(|x| x.load(Ordering::Relaxed))
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Fails (and propagates) if this rank or a peer of its control plane has failed: for waits
    /// outside the group's own barriers (the rail) that must not outlive a local failure.
    pub fn poll_failures(&self, label: &str) -> Result<()> {
        self.check_peer_failures(label)
    }

    /// Fails (and propagates) if this rank or a mapped peer has failed.
    fn check_peer_failures(&self, label: &str) -> Result<()> {
        if let Some(why) = self.failure() {
            return Err(TideError::Rendezvous(why));
        }
        for &q in &self.members {
            if q == self.rank || self.blocks[q].is_none() {
                continue;
            }
            if self.block(q).failed.load(Ordering::Acquire) != 0 {
                let msg = self.peer_message(q);
                let origin =
                    (self.block(q).origin.load(Ordering::Relaxed) as usize).min(self.world - 1);
                // Propagate the root cause unchanged; say who saw it only in our own error.
                self.fail_from(origin, msg.clone());
                let pid = self.peers[origin].pid;
                let pid = if pid == 0 { self.peers[q].pid } else { pid };
                return Err(TideError::Rendezvous(format!(
                    "rank {} at {label}: peer rank {origin} (pid {pid}) failed: {msg}",
                    self.rank
                )));
            }
        }
        Ok(())
    }

    fn check_liveness(&self, waiting_for: &[usize], label: &str) -> Result<()> {
        for &q in waiting_for {
            if let Some(how) = death_of(self.peers[q], self.me) {
                // The origin of this failure is the dead rank, whoever noticed it.
                return Err(self.fail_from(q, format!(
                    "rank {q} (pid {}) died ({how}) while rank {} waited for it at {label} of group {}",
                    self.peers[q].pid, self.rank, self.group
                )));
            }
        }
        Ok(())
    }

    /// Writes this rank's announcement for the call it is entering (before its entry barrier).
    pub fn announce(&self, a: Announcement) {
        let b = self.own();
        b.call_seq.store(a.seq, Ordering::Relaxed);
        b.call_op.store(a.op, Ordering::Relaxed);
        b.call_site.store(a.site, Ordering::Relaxed);
        b.call_fingerprint.store(a.fingerprint, Ordering::Relaxed);
        b.call_data_class.store(a.data_class, Ordering::Relaxed);
    }

    /// Rank `q`'s announcement; valid after a barrier that followed its `announce`.
    pub fn announcement(&self, q: usize) -> Announcement {
        let b = self.block(q);
        Announcement {
            seq: b.call_seq.load(Ordering::Relaxed),
            op: b.call_op.load(Ordering::Relaxed),
            site: b.call_site.load(Ordering::Relaxed),
            fingerprint: b.call_fingerprint.load(Ordering::Relaxed),
            data_class: b.call_data_class.load(Ordering::Relaxed),
        }
    }

    /// Waits until every rank arrived here. Fails, never hangs: on timeout (naming the missing
    /// ranks), on a peer's failure (with its message), or when a peer it waits for died.
    pub fn barrier(&self, label: &str) -> Result<()> {
        self.check_peer_failures(label)?;
        let own = &self.own().epoch;
        let target = own.load(Ordering::Relaxed).wrapping_add(1);
        own.store(target, Ordering::Release);
        futex_wake(own);

        let start = Instant::now();
        let deadline = start + self.timing.timeout;
        let mut next_liveness = start + self.timing.liveness_interval;
        for &q in self.members.iter().filter(|&&q| q != self.rank) {
            let word = &self.block(q).epoch;
            let mut spins = 0u32;
            loop {
                let seen = word.load(Ordering::Acquire);
                if reached(seen, target) {
                    break;
                }
                if spins < 64 {
                    spins += 1;
                    std::hint::spin_loop();
                    continue;
                }
                self.check_peer_failures(label)?;
                let now = Instant::now();
                if now >= next_liveness {
                    let behind: Vec<usize> = (self.members.iter().copied())
                        .filter(|&p| {
                            p != self.rank
                                && !reached(self.block(p).epoch.load(Ordering::Acquire), target)
                        })
                        .collect();
                    self.check_liveness(&behind, label)?;
                    next_liveness = now + self.timing.liveness_interval;
                }
                if now >= deadline {
                    let behind: Vec<String> = (self.members.iter().copied())
                        .filter(|&p| {
                            p != self.rank
                                && !reached(self.block(p).epoch.load(Ordering::Acquire), target)
                        })
                        .map(|p| format!("{p} (pid {})", self.peers[p].pid))
                        .collect();
                    return Err(self.fail_with(format!(
                        "rank {} of group {} timed out after {:.1?} at {label}: ranks [{}] did not arrive \
                         (TIDE_TIMEOUT_S)",
                        self.rank,
                        self.group,
                        self.timing.timeout,
                        behind.join(", ")
                    )));
                }
                let slice = self
                    .timing
                    .poll
                    .min(deadline - now)
                    .min(next_liveness.saturating_duration_since(now));
                futex_wait(word, seen, slice.max(Duration::from_micros(50)));
            }
        }
        Ok(())
    }
}

/// The CPU engine's view of a process group: `execute_rank` calls `wait(rank, phase)` after each
/// phase of the plan; `what` names the call in errors.
pub struct PhaseBarrier<'a> {
    pub group: &'a ProcessGroup,
    pub what: &'a str,
}

impl crate::engine::Barrier for PhaseBarrier<'_> {
    fn wait(&self, _rank: usize, phase: usize) -> Result<()> {
        self.group
            .barrier(&format!("phase {phase} of {}", self.what))
    }
}
