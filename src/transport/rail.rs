//! The rail of the CPU multi-process transport: copies between ranks on different nodes, over TCP
//! (docs/multiprocess.md "Across nodes"). Inside a node ranks share memory (`transport::cpu`);
//! across nodes nothing is shared: a plan's `Copy` whose source rank is on another node becomes a
//! send on the source's side and a receive on the destination's side, in plan order.
//!
//! Wiring:
//! - **Endpoint**, one per process: a TCP listener (`listen`) and an acceptor thread that files
//!   every incoming connection under the key its hello names: (job, group, call site, src rank,
//!   dst rank), or records a failure notice.
//! - **Addresses**: `register_peer(job, group, rank, "host:port")` for every rank of the job, done
//!   by `tide_jax` from JAX's key-value store before the first call (each process publishes its
//!   endpoint under `tide/rail/<job>/<process>`).
//! - **Streams**: one TCP connection per call site (lane, see `transport::cpu`) and ordered pair
//!   (src, dst) that a plan needs, opened by the receiving rank (connect + hello) the first time a
//!   call needs it and kept for the job. Data flows src -> dst only.
//!
//! One call, one rank (`CallRail`): at the start of each phase a sender thread writes, in plan
//! order, one frame per rail copy that reads this rank's memory (the sources are final: written in
//! earlier phases and, checked per plan, not written by this rank in this phase); the engine
//! receives each rail copy into its destination at its place in the plan; the phase ends when the
//! sender thread is done, then the node barrier. Frames carry (call seq, plan fingerprint, phase,
//! step, bytes), and a receiver that reads anything else fails naming the sender ("in a different
//! call") instead of writing garbage. Sends and receives follow the plan's step order on every
//! rank, so the smallest outstanding copy can always complete: no cycle of waits.
//!
//! Failure: every wait is sliced (`Timing::poll`), bounded by `Timing::timeout`, and checks this
//! node's control plane between slices, so a local failure stops the rail at once. A failing rank
//! shuts down all its streams: its remote peers read end-of-stream and fail at once, naming it
//! ("rank 2 on node 1 closed its rail stream"); on streams at a frame boundary it first writes an
//! error frame with its message. A dead remote process closes its sockets the same way (the kernel
//! does it). A failing rank also sends a failure notice to every process of its group
//! (`broadcast_failure`, delivered before its error returns, up to 250 ms), which every rail wait
//! checks: a peer waiting for it in a call it never reached fails at once too, and a rank that reads
//! a stream's end (a peer's half-written frame carries no error frame) waits up to 250 ms for the
//! notice (`notice_grace`), so it names the root cause, not the survivor whose stream ended. After a
//! failure the job's rail is unusable: later calls fail at once.

use super::group::{ProcessGroup, Timing};
use crate::error::{Result, TideError};
use crate::plan::{Action, Plan, Region};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const HELLO_MAGIC: u64 = 0x7469_6465_7261_696c; // "tiderail"
/// A failure notice instead of a stream: hello words (job, group, 0, failed rank, 0), then a u32
/// length and the message (`broadcast_failure`).
const NOTICE_MAGIC: u64 = 0x7469_6465_6661_696c; // "tidefail"
const FRAME_MAGIC: u32 = 0x7469_6466; // "tidf"
const HELLO_BYTES: usize = 48;
const FRAME_BYTES: usize = 40;
/// Frame kinds (bytes 4..8 of the header): data, or the sender's failure message.
const KIND_ERROR: u32 = 2;
const MAX_ERR_BYTES: usize = 4000;

/// (job, group, call site, src rank, dst rank) of one stream: each call site (lane) has its own
/// streams, since calls of different sites may run concurrently.
type StreamKey = (u64, usize, i64, usize, usize);

/// This process's endpoint: the listener's port and the streams accepted so far.
struct Endpoint {
    port: u16,
    accepted: Mutex<HashMap<StreamKey, TcpStream>>,
    arrived: Condvar,
}

static ENDPOINT: Lazy<Mutex<Option<Arc<Endpoint>>>> = Lazy::new(|| Mutex::new(None));
/// (job, group, rank) -> "host:port" of its process's endpoint.
type PeerTable = HashMap<(u64, usize, usize), String>;
static PEERS: Lazy<Mutex<PeerTable>> = Lazy::new(|| Mutex::new(HashMap::new()));
/// (job, group, rank) of this process's ranks that failed: their streams are refused.
static FAILED: Lazy<Mutex<std::collections::HashSet<(u64, usize, usize)>>> =
    Lazy::new(|| Mutex::new(std::collections::HashSet::new()));
/// (job, group) -> (rank, message): the first failure another process announced for the group
/// (`broadcast_failure`). Every rail wait checks it, so a rank waiting for a peer that failed
/// elsewhere (in a call this rank has not reached, say) fails at once with the root cause.
type NoticeTable = HashMap<(u64, usize), (usize, String)>;
static NOTICES: Lazy<Mutex<NoticeTable>> = Lazy::new(|| Mutex::new(HashMap::new()));
/// (job, group, rank) whose failure this process already announced.
static ANNOUNCED: Lazy<Mutex<std::collections::HashSet<(u64, usize, usize)>>> =
    Lazy::new(|| Mutex::new(std::collections::HashSet::new()));

/// The failure another process announced for (job, group), as an error for `what`.
fn noticed(job: u64, group: usize, gpus_per_node: usize, what: &str) -> Result<()> {
    match NOTICES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(job, group))
    {
        Some((rank, why)) => Err(rail_err(format!(
            "{what}: rank {rank} on node {} failed: {why}",
            rank / gpus_per_node.max(1)
        ))),
        None => Ok(()),
    }
}

/// How long a rank that read end-of-stream waits for the peer's failure notice before naming the
/// peer itself (a process that died sends none).
const NOTICE_GRACE: Duration = Duration::from_millis(250);
/// How long a failing rank waits for its failure notices to be delivered (`broadcast_failure`).
const NOTICE_WAIT: Duration = Duration::from_millis(250);

/// `noticed`, polled for up to `NOTICE_GRACE`: Err with the announced failure if one arrives.
fn notice_grace(job: u64, group: usize, gpus_per_node: usize, what: &str) -> Result<()> {
    let end = Instant::now() + NOTICE_GRACE;
    loop {
        noticed(job, group, gpus_per_node, what)?;
        if Instant::now() >= end {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Tells every process of (job, group) with a registered rail address that `rank` (a rank of this
/// process) failed with `why`, once: their rail waits fail at once with this message instead of at
/// the timeout, and a peer that read this rank's stream end mid-frame learns the root cause from it
/// (`notice_grace`). One thread per address (1 s per connection, best effort); the caller waits for
/// them up to `NOTICE_WAIT`, so a process that exits right after its error (a failed job) still
/// delivers its notices to live peers, and a dead or unreachable one delays the error by no more.
pub fn broadcast_failure(job: u64, group: usize, rank: usize, why: &str) {
    if !ANNOUNCED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((job, group, rank))
    {
        return;
    }
    let mut addrs: Vec<String> = PEERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(k, _)| k.0 == job && k.1 == group)
        .map(|(_, a)| a.clone())
        .collect();
    addrs.sort();
    addrs.dedup();
    if addrs.is_empty() {
        return;
    }
    let msg = &why.as_bytes()[..why.len().min(MAX_ERR_BYTES)];
    let mut packet = Vec::with_capacity(HELLO_BYTES + 4 + msg.len());
    for w in [NOTICE_MAGIC, job, group as u64, 0, rank as u64, 0] {
        packet.extend_from_slice(&w.to_le_bytes());
    }
    packet.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    packet.extend_from_slice(msg);
    let packet = Arc::new(packet);
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let mut started = 0;
    for addr in addrs {
        let (packet, done) = (packet.clone(), done.clone());
        let spawned = std::thread::Builder::new()
            .name("tide-rail-notice".into())
            .spawn(move || {
                if let Some(sa) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) {
                    if let Ok(mut s) = TcpStream::connect_timeout(&sa, Duration::from_secs(1)) {
                        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                        let _ = s.write_all(&packet);
                    }
                }
                let _ = done.send(());
            });
        started += usize::from(spawned.is_ok());
    }
    let end = Instant::now() + NOTICE_WAIT;
    for _ in 0..started {
        let left = end.saturating_duration_since(Instant::now());
        if finished.recv_timeout(left).is_err() {
            break;
        }
    }
}

/// Bytes this process received through the rail (tests check the rail was used).
static RECEIVED: AtomicU64 = AtomicU64::new(0);

fn rail_err(msg: String) -> TideError {
    TideError::Rendezvous(msg)
}

/// Starts this process's rail endpoint on `bind_host` (e.g. "0.0.0.0" or "127.0.0.1", port chosen
/// by the system) and returns its port. Idempotent: later calls return the running endpoint's port.
pub fn listen(bind_host: &str) -> Result<u16> {
    let mut slot = ENDPOINT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ep) = slot.as_ref() {
        return Ok(ep.port);
    }
    let listener = TcpListener::bind((bind_host, 0))
        .map_err(|e| rail_err(format!("tide rail: cannot listen on {bind_host}: {e}")))?;
    let port = listener
        .local_addr()
        .map_err(|e| rail_err(format!("tide rail: listener address: {e}")))?
        .port();
    let ep = Arc::new(Endpoint {
        port,
        accepted: Mutex::new(HashMap::new()),
        arrived: Condvar::new(),
    });
    let acceptor = ep.clone();
    std::thread::Builder::new()
        .name("tide-rail-accept".into())
        .spawn(move || accept_loop(listener, acceptor))
        .map_err(|e| rail_err(format!("tide rail: cannot start the acceptor thread: {e}")))?;
    *slot = Some(ep);
    Ok(port)
}

fn accept_loop(listener: TcpListener, ep: Arc<Endpoint>) {
    for conn in listener.incoming() {
        let Ok(mut stream) = conn else { continue };
        // A hello that does not arrive promptly, or is not ours, drops the connection.
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let mut hello = [0u8; HELLO_BYTES];
        if stream.read_exact(&mut hello).is_err() {
            continue;
        }
        let word = |i: usize| u64::from_le_bytes(hello[i * 8..i * 8 + 8].try_into().unwrap());
        if word(0) == NOTICE_MAGIC {
            let mut len = [0u8; 4];
            let msg = stream.read_exact(&mut len).ok().and_then(|()| {
                let mut m = vec![0u8; (u32::from_le_bytes(len) as usize).min(MAX_ERR_BYTES)];
                stream.read_exact(&mut m).ok().map(|()| m)
            });
            let why = msg
                .map(|m| String::from_utf8_lossy(&m).into_owned())
                .unwrap_or_else(|| "(its message was cut off)".into());
            NOTICES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry((word(1), word(2) as usize))
                .or_insert((word(4) as usize, why));
            // Wake waiters for accepted streams: they check the notices.
            let _map = ep.accepted.lock().unwrap_or_else(|e| e.into_inner());
            ep.arrived.notify_all();
            continue;
        }
        if word(0) != HELLO_MAGIC {
            continue;
        }
        let key = (
            word(1),
            word(2) as usize,
            word(3) as i64,
            word(4) as usize,
            word(5) as usize,
        );
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_nodelay(true);
        if FAILED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&(key.0, key.1, key.3))
        {
            // The source rank failed here: its peer reads end-of-stream and fails at once.
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let mut map = ep.accepted.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(key, stream);
        ep.arrived.notify_all();
    }
}

/// Marks rank `rank` of `group` in `job` (a rank of this process) failed: its streams not taken yet
/// and any opened later are closed, so peers on other nodes fail at once instead of timing out.
pub fn fail_rank(job: u64, group: usize, rank: usize) {
    FAILED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((job, group, rank));
    if let Some(ep) = ENDPOINT.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        let mut map = ep.accepted.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|k, s| {
            let drop = k.0 == job && k.1 == group && k.3 == rank;
            if drop {
                let _ = s.shutdown(Shutdown::Both);
            }
            !drop
        });
    }
}

/// Records where rank `rank` of `group` in `job` listens ("host:port").
pub fn register_peer(job: u64, group: usize, rank: usize, addr: &str) -> Result<()> {
    if addr
        .to_socket_addrs()
        .map(|mut a| a.next().is_none())
        .unwrap_or(true)
    {
        return crate::invalid!(
            "tide rail: rank {rank} of group {group}: address {addr:?} does not resolve"
        );
    }
    PEERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((job, group, rank), addr.to_string());
    Ok(())
}

/// Bytes received through the rail by this process so far.
pub fn bytes_received() -> u64 {
    RECEIVED.load(Ordering::Relaxed)
}

/// One rail transfer of a plan: step `step` of phase `phase`, `bytes` from `src` to rank `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    pub phase: usize,
    pub step: usize,
    pub src: Region,
    pub dst_rank: usize,
    pub bytes: usize,
}

/// The rail transfers of `plan` for a topology of `gpus_per_node` ranks per node: every `Copy`
/// whose source and executor are on different nodes, in plan order. Errors for what the rail
/// cannot carry: a reduction reading another node, or a transfer whose source its owner writes
/// in the same phase (the sender reads sources at phase start).
pub fn transfers(plan: &Plan) -> Result<Vec<Transfer>> {
    let g = plan.topology.gpus_per_node.max(1);
    let node = |r: usize| r / g;
    let mut out = Vec::new();
    for (k, phase) in plan.phases.iter().enumerate() {
        for (i, s) in phase.steps.iter().enumerate() {
            match &s.action {
                Action::Copy { src, bytes, .. } if node(src.rank) != node(s.executor) => {
                    out.push(Transfer {
                        phase: k,
                        step: i,
                        src: *src,
                        dst_rank: s.executor,
                        bytes: *bytes,
                    });
                }
                Action::Reduce { srcs, .. } => {
                    if let Some(o) = srcs
                        .iter()
                        .find(|o| node(o.region.rank) != node(s.executor))
                    {
                        return Err(TideError::Internal(format!(
                            "tide rail: phase {k} step {i}: {s} reduces rank {}'s memory on another node; \
                             only copies cross nodes",
                            o.region.rank
                        )));
                    }
                }
                _ => {}
            }
        }
        // A source must not be written by its owner during the phase that sends it.
        for t in out.iter().filter(|t| t.phase == k) {
            let (a0, a1) = (t.src.offset, t.src.offset + t.bytes);
            for s in phase.steps.iter().filter(|s| s.executor == t.src.rank) {
                let hit = s.action.writes().into_iter().any(|(dst, n)| {
                    dst.rank == t.src.rank
                        && dst.kind == t.src.kind
                        && dst.index == t.src.index
                        && dst.offset < a1
                        && a0 < dst.offset + n
                });
                if hit {
                    return Err(TideError::Internal(format!(
                        "tide rail: phase {k}: rank {} writes the source of its rail copy to rank {} in the \
                         same phase ({s})",
                        t.src.rank, t.dst_rank
                    )));
                }
            }
        }
    }
    Ok(out)
}

/// One rank's rail state in one (job, group), kept across calls.
pub struct RankRail {
    job: u64,
    group: usize,
    site: i64,
    rank: usize,
    gpus_per_node: usize,
    /// Streams this rank sends on, by destination rank.
    out: HashMap<usize, TcpStream>,
    /// Streams this rank receives on, by source rank.
    inc: HashMap<usize, TcpStream>,
    failed: Option<String>,
}

impl RankRail {
    pub fn new(job: u64, group: usize, site: i64, rank: usize, gpus_per_node: usize) -> RankRail {
        RankRail {
            job,
            group,
            site,
            rank,
            gpus_per_node: gpus_per_node.max(1),
            out: HashMap::new(),
            inc: HashMap::new(),
            failed: None,
        }
    }

    fn node(&self, r: usize) -> usize {
        r / self.gpus_per_node
    }

    /// Tells every receiver of this rank why it fails (an error frame, on each stream that is at a
    /// frame boundary: all but `torn`, whose last frame a stopped sender left half written), then
    /// shuts every stream down: peers on other nodes fail at once with this rank's reason (or
    /// read end-of-stream). The rail is unusable afterwards.
    pub fn abort(&mut self, why: &str, torn: Option<usize>) {
        if self.failed.is_some() {
            return;
        }
        self.failed = Some(why.to_string());
        let msg = &why.as_bytes()[..why.len().min(MAX_ERR_BYTES)];
        let never = AtomicBool::new(false);
        for (&dst, s) in &self.out {
            if Some(dst) != torn {
                let _ = s.set_write_timeout(Some(Duration::from_millis(50)));
                let deadline = Instant::now() + Duration::from_secs(1);
                let mut h = frame(0, 0, 0, 0, msg.len());
                h[4..8].copy_from_slice(&KIND_ERROR.to_le_bytes());
                let _ = write_sliced(s, &h, deadline, &never)
                    .and_then(|()| write_sliced(s, msg, deadline, &never));
            }
        }
        for s in self.out.values().chain(self.inc.values()) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Opens the streams `list` needs that are not open yet: first this rank's incoming ones
    /// (connect to the source's endpoint, send the hello), then its outgoing ones (wait for the
    /// destination's hello at this process's endpoint).
    fn connect(
        &mut self,
        list: &[Transfer],
        group: &ProcessGroup,
        timing: &Timing,
        what: &str,
    ) -> Result<()> {
        let mut need_in: Vec<usize> = list
            .iter()
            .filter(|t| t.dst_rank == self.rank && !self.inc.contains_key(&t.src.rank))
            .map(|t| t.src.rank)
            .collect();
        need_in.sort_unstable();
        need_in.dedup();
        let mut need_out: Vec<usize> = list
            .iter()
            .filter(|t| t.src.rank == self.rank && !self.out.contains_key(&t.dst_rank))
            .map(|t| t.dst_rank)
            .collect();
        need_out.sort_unstable();
        need_out.dedup();
        if need_in.is_empty() && need_out.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + timing.timeout;
        for q in need_in {
            let addr = PEERS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&(self.job, self.group, q))
                .cloned()
                .ok_or_else(|| {
                    rail_err(format!(
                        "{what}: no rail address for rank {q} (node {}) of group {}: the multi-node CPU path \
                         needs tide_jax to publish every process's endpoint (tide_jax.initialize() + a \
                         multi-process mesh), or register_peer in Rust",
                        self.node(q),
                        self.group
                    ))
                })?;
            let mut sleep = Duration::from_millis(1);
            let stream = loop {
                match TcpStream::connect(addr.as_str()) {
                    Ok(s) => break s,
                    Err(e) => {
                        group.poll_failures(&format!("connecting the rail of {what}"))?;
                        noticed(self.job, self.group, self.gpus_per_node, what)?;
                        if Instant::now() >= deadline {
                            return Err(rail_err(format!(
                                "{what}: cannot reach rank {q} (node {}) at {addr} for {:.1?}: {e}",
                                self.node(q),
                                timing.timeout
                            )));
                        }
                        std::thread::sleep(sleep);
                        sleep = (sleep * 2).min(timing.poll);
                    }
                }
            };
            let _ = stream.set_nodelay(true);
            let mut hello = Vec::with_capacity(HELLO_BYTES);
            for w in [
                HELLO_MAGIC,
                self.job,
                self.group as u64,
                self.site as u64,
                q as u64,
                self.rank as u64,
            ] {
                hello.extend_from_slice(&w.to_le_bytes());
            }
            (&stream).write_all(&hello).map_err(|e| {
                rail_err(format!("{what}: hello to rank {q} at {addr} failed: {e}"))
            })?;
            self.inc.insert(q, stream);
        }
        if need_out.is_empty() {
            return Ok(());
        }
        let ep = ENDPOINT
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                rail_err(format!(
                    "{what}: this process has no rail endpoint (tide_jax starts it for multi-node CPU meshes)"
                ))
            })?;
        let mut map = ep.accepted.lock().unwrap_or_else(|e| e.into_inner());
        for r in need_out {
            let key = (self.job, self.group, self.site, self.rank, r);
            loop {
                if let Some(s) = map.remove(&key) {
                    self.out.insert(r, s);
                    break;
                }
                group.poll_failures(&format!("waiting for the rail of {what}"))?;
                noticed(self.job, self.group, self.gpus_per_node, what)?;
                let now = Instant::now();
                if now >= deadline {
                    return Err(rail_err(format!(
                        "{what}: rank {r} (node {}) did not open its rail stream from rank {} within {:.1?}",
                        self.node(r),
                        self.rank,
                        timing.timeout
                    )));
                }
                map = ep
                    .arrived
                    .wait_timeout(map, timing.poll.min(deadline - now))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Ok(())
    }
}

fn frame(seq: u64, fingerprint: u64, phase: usize, step: usize, bytes: usize) -> [u8; FRAME_BYTES] {
    let mut h = [0u8; FRAME_BYTES];
    h[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..24].copy_from_slice(&fingerprint.to_le_bytes());
    h[24..28].copy_from_slice(&(phase as u32).to_le_bytes());
    h[28..32].copy_from_slice(&(step as u32).to_le_bytes());
    h[32..40].copy_from_slice(&(bytes as u64).to_le_bytes());
    h
}

/// Writes all of `buf`, in slices of `poll`, until `deadline` or `stop`.
fn write_sliced(
    s: &TcpStream,
    mut buf: &[u8],
    deadline: Instant,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    while !buf.is_empty() {
        if stop.load(Ordering::Relaxed) {
            return Err(std::io::Error::new(
                ErrorKind::Interrupted,
                "stopped: this rank failed",
            ));
        }
        match (&*s).write(buf) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    ErrorKind::WriteZero,
                    "connection closed",
                ))
            }
            Ok(n) => buf = &buf[n..],
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if Instant::now() >= deadline {
                    return Err(std::io::Error::new(
                        ErrorKind::TimedOut,
                        "the receiver did not read in time",
                    ));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One frame this rank sends in a phase.
struct Send {
    stream: TcpStream,
    dst: usize,
    header: [u8; FRAME_BYTES],
    ptr: usize,
    bytes: usize,
}

/// What a phase's sender thread ends with: on failure, its message and the torn destination.
type SendResult = std::result::Result<(), (String, Option<usize>)>;

/// The rail of one call on one rank, handed to `engine::cpu::execute_rank_with`.
pub struct CallRail<'a> {
    rail: &'a mut RankRail,
    group: &'a ProcessGroup,
    timing: Timing,
    list: Vec<Transfer>,
    /// Source address of each of this rank's sends, by index in `list`.
    src_addr: HashMap<usize, usize>,
    seq: u64,
    fingerprint: u64,
    what: &'a str,
    /// The phase's sender thread: on failure, its message and the destination whose frame it left
    /// half written (if any).
    sender: Option<std::thread::JoinHandle<SendResult>>,
    torn: Option<usize>,
    stop: Arc<AtomicBool>,
}

impl<'a> CallRail<'a> {
    /// Prepares the rail of one call: `list` from `transfers(plan)`, `addr(region)` the address of
    /// a region of this rank's memory. Opens missing streams.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        rail: &'a mut RankRail,
        group: &'a ProcessGroup,
        timing: Timing,
        list: Vec<Transfer>,
        addr: &dyn Fn(&Region) -> Result<usize>,
        seq: u64,
        fingerprint: u64,
        what: &'a str,
    ) -> Result<CallRail<'a>> {
        if let Some(why) = &rail.failed {
            return Err(rail_err(format!(
                "{what}: the rail of this job failed earlier and is unusable: {why}"
            )));
        }
        let mut src_addr = HashMap::new();
        for (i, t) in list
            .iter()
            .enumerate()
            .filter(|(_, t)| t.src.rank == rail.rank)
        {
            src_addr.insert(i, addr(&t.src)?);
        }
        rail.connect(&list, group, &timing, what)?;
        Ok(CallRail {
            rail,
            group,
            timing,
            list,
            src_addr,
            seq,
            fingerprint,
            what,
            sender: None,
            torn: None,
            stop: Arc::new(AtomicBool::new(false)),
        })
    }

    fn join_sender(&mut self) -> Result<()> {
        if let Some(h) = self.sender.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err((m, torn))) => {
                    self.torn = torn;
                    return Err(rail_err(format!("{}: {m}", self.what)));
                }
                Err(_) => {
                    return Err(rail_err(format!(
                        "{}: the rail sender thread panicked",
                        self.what
                    )))
                }
            }
        }
        Ok(())
    }

    /// Ends the call: on error, stops the sender and shuts the rail down (peers fail naming us).
    pub fn finish(mut self, result: &Result<()>) {
        if let Err(e) = result {
            self.stop.store(true, Ordering::Relaxed);
            let _ = self.join_sender();
            self.rail.abort(&e.to_string(), self.torn);
        }
    }
}

impl crate::engine::Rail for CallRail<'_> {
    fn is_remote(&self, rank: usize) -> bool {
        self.rail.node(rank) != self.rail.node(self.rail.rank)
    }

    fn begin_phase(&mut self, phase: usize) -> Result<()> {
        self.join_sender()?;
        let mut sends = Vec::new();
        for (i, t) in self.list.iter().enumerate() {
            if t.phase != phase || t.src.rank != self.rail.rank {
                continue;
            }
            let stream = self.rail.out[&t.dst_rank].try_clone().map_err(|e| {
                rail_err(format!(
                    "{}: rail stream to rank {}: {e}",
                    self.what, t.dst_rank
                ))
            })?;
            sends.push(Send {
                stream,
                dst: t.dst_rank,
                header: frame(self.seq, self.fingerprint, t.phase, t.step, t.bytes),
                ptr: self.src_addr[&i],
                bytes: t.bytes,
            });
        }
        if sends.is_empty() {
            return Ok(());
        }
        let (stop, timing, rank, g) = (
            self.stop.clone(),
            self.timing,
            self.rail.rank,
            self.rail.gpus_per_node,
        );
        let handle = std::thread::Builder::new()
            .name("tide-rail-send".into())
            .spawn(move || {
                for s in sends {
                    let _ = s.stream.set_write_timeout(Some(timing.poll));
                    let deadline = Instant::now() + timing.timeout;
                    // SAFETY: the source lies in this rank's live buffer, final since earlier phases
                    // and not written during this one (`transfers` checks it); the engine does not
                    // return before this thread is joined (`end_phase`, `finish`).
                    let data = unsafe { std::slice::from_raw_parts(s.ptr as *const u8, s.bytes) };
                    if stop.load(Ordering::Relaxed) {
                        return Err(("stopped: this rank failed".to_string(), None));
                    }
                    let r = write_sliced(&s.stream, &s.header, deadline, &stop)
                        .and_then(|()| write_sliced(&s.stream, data, deadline, &stop));
                    if let Err(e) = r {
                        let why = if matches!(
                            e.kind(),
                            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::WriteZero
                        ) {
                            format!(
                                "rank {} on node {} closed its rail stream from rank {rank} (it failed or \
                                 exited: its own error says why): {e}",
                                s.dst,
                                s.dst / g
                            )
                        } else {
                            format!("rail send from rank {rank} to rank {} (node {}) failed: {e}", s.dst, s.dst / g)
                        };
                        return Err((why, Some(s.dst)));
                    }
                }
                Ok(())
            })
            .map_err(|e| rail_err(format!("{}: cannot start the rail sender: {e}", self.what)))?;
        self.sender = Some(handle);
        Ok(())
    }

    unsafe fn recv(&mut self, phase: usize, step: usize, dst: *mut u8, bytes: usize) -> Result<()> {
        let t = self
            .list
            .iter()
            .find(|t| t.phase == phase && t.step == step)
            .copied()
            .ok_or_else(|| {
                rail_err(format!(
                    "{}: phase {phase} step {step} is not a rail copy",
                    self.what
                ))
            })?;
        let q = t.src.rank;
        let node_q = self.rail.node(q);
        let stream = self
            .rail
            .inc
            .get(&q)
            .ok_or_else(|| rail_err(format!("{}: no rail stream from rank {q}", self.what)))?;
        let _ = stream.set_read_timeout(Some(self.timing.poll));
        let deadline = Instant::now() + self.timing.timeout;
        let what = self.what;
        let group = self.group;
        let (job, group_id, g) = (self.rail.job, self.rail.group, self.rail.gpus_per_node);
        let read_all = |buf: &mut [u8], part: &str| -> Result<()> {
            let mut got = 0;
            while got < buf.len() {
                match (&*stream).read(&mut buf[got..]) {
                    Ok(0) => {
                        // A peer that failed closes its streams, then tells every process why
                        // (`broadcast_failure`): a stream it left half written carries no error frame,
                        // so wait briefly for the notice, which names the root cause.
                        notice_grace(job, group_id, g, what)?;
                        return Err(rail_err(format!(
                            "{what}: rank {q} on node {node_q} closed its rail stream (it failed or exited: \
                             its own error says why) while this rank waited for the {part} of phase {phase} \
                             step {step}"
                        )));
                    }
                    Ok(n) => got += n,
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                        group.poll_failures(&format!("rail receive of {what}"))?;
                        noticed(job, group_id, g, what)?;
                        if Instant::now() >= deadline {
                            return Err(rail_err(format!(
                                "{what}: timed out after {:.1?} waiting for rank {q} on node {node_q} \
                                 (phase {phase} step {step}, TIDE_TIMEOUT_S)",
                                self.timing.timeout
                            )));
                        }
                    }
                    Err(e) => {
                        return Err(rail_err(format!(
                            "{what}: rail stream from rank {q} on node {node_q} failed: {e}"
                        )))
                    }
                }
            }
            Ok(())
        };
        let mut h = [0u8; FRAME_BYTES];
        read_all(&mut h, "frame header")?;
        if h[0..4] == FRAME_MAGIC.to_le_bytes() && h[4..8] == KIND_ERROR.to_le_bytes() {
            let n = (u64::from_le_bytes(h[32..40].try_into().unwrap()) as usize).min(MAX_ERR_BYTES);
            let mut msg = vec![0u8; n];
            let why = match read_all(&mut msg, "failure message") {
                Ok(()) => String::from_utf8_lossy(&msg).into_owned(),
                Err(_) => "(its message was cut off)".to_string(),
            };
            return Err(rail_err(format!(
                "{what}: rank {q} on node {node_q} failed: {why}"
            )));
        }
        let want = frame(self.seq, self.fingerprint, phase, step, bytes);
        if h != want {
            let word = |a: usize| u64::from_le_bytes(h[a..a + 8].try_into().unwrap());
            return Err(rail_err(format!(
                "{what}: rank {q} on node {node_q} is in a different call: its frame is call {} plan {:016x} \
                 phase {} step {} ({} bytes), this rank expects call {} plan {:016x} phase {phase} step {step} \
                 ({bytes} bytes); every process must run the same program",
                word(8),
                word(16),
                u32::from_le_bytes(h[24..28].try_into().unwrap()),
                u32::from_le_bytes(h[28..32].try_into().unwrap()),
                word(32),
                self.seq,
                self.fingerprint
            )));
        }
        // SAFETY: caller contract (dst valid for `bytes` writes, exclusively ours until we return).
        let buf = unsafe { std::slice::from_raw_parts_mut(dst, bytes) };
        read_all(buf, "data")?;
        RECEIVED.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(())
    }

    fn end_phase(&mut self, _phase: usize) -> Result<()> {
        self.join_sender()
    }
}

impl Drop for CallRail<'_> {
    fn drop(&mut self) {
        // An early return (error) without `finish`: never leave a sender reading our buffers.
        if self.sender.is_some() {
            self.stop.store(true, Ordering::Relaxed);
            let _ = self.join_sender();
            self.rail
                .abort(&format!("{}: ended early", self.what), self.torn);
        }
    }
}

/// Writes `msg` NUL-terminated into `err` (capacity `cap`), truncated.
///
/// # Safety
/// `err` must be null or point to `cap` writable bytes.
unsafe fn write_err(err: *mut std::os::raw::c_char, cap: usize, msg: &str) {
    if err.is_null() || cap == 0 {
        return;
    }
    let n = msg.len().min(cap - 1);
    // SAFETY: n + 1 <= cap bytes at err (caller contract).
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
        *err.add(n) = 0;
    }
}

/// C entry for `tide_jax`: starts this process's rail endpoint on `bind_host` and returns its
/// port, or -1 with the reason in `err`.
///
/// # Safety
/// `bind_host` must be a NUL-terminated string; `err` null or `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tide_rail_listen(
    bind_host: *const std::os::raw::c_char,
    err: *mut std::os::raw::c_char,
    cap: usize,
) -> i32 {
    // SAFETY: caller contract.
    let host = unsafe { std::ffi::CStr::from_ptr(bind_host) }.to_string_lossy();
    match listen(&host) {
        Ok(port) => port as i32,
        Err(e) => {
            // SAFETY: caller contract.
            unsafe { write_err(err, cap, &e.to_string()) };
            -1
        }
    }
}

/// C entry for `tide_jax`: `register_peer`. 0 on success, else -1 with the reason in `err`.
///
/// # Safety
/// `addr` must be a NUL-terminated string; `err` null or `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tide_rail_register(
    job: u64,
    group: u64,
    rank: u64,
    addr: *const std::os::raw::c_char,
    err: *mut std::os::raw::c_char,
    cap: usize,
) -> i32 {
    // SAFETY: caller contract.
    let addr = unsafe { std::ffi::CStr::from_ptr(addr) }.to_string_lossy();
    match register_peer(job, group as usize, rank as usize, &addr) {
        Ok(()) => 0,
        Err(e) => {
            // SAFETY: caller contract.
            unsafe { write_err(err, cap, &e.to_string()) };
            -1
        }
    }
}

/// C entry: bytes this process received through the rail so far (tests check the rail was used).
#[no_mangle]
pub extern "C" fn tide_rail_bytes_received() -> u64 {
    bytes_received()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failing rank's notice reaches a live process before `broadcast_failure` returns or within
    /// `notice_grace`; a dead address delays it by at most `NOTICE_WAIT`; a group with no notice
    /// waits out the grace and names nobody.
    #[test]
    fn notice_arrives_within_the_grace_and_a_dead_address_costs_at_most_the_wait() {
        let port = listen("127.0.0.1").unwrap();
        let job = 0x6e6f_7469_6365; // a job no other test uses
        // A dead address (nothing listens on it) beside this process's live one.
        let dead = TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap();
        register_peer(job, 0, 0, &format!("127.0.0.1:{port}")).unwrap();
        register_peer(job, 0, 1, &dead.to_string()).unwrap();
        let none = Instant::now();
        assert!(notice_grace(job, 0, 1, "call").is_ok());
        assert!(none.elapsed() >= NOTICE_GRACE);

        let start = Instant::now();
        broadcast_failure(job, 0, 3, "rank 2 (pid 7) died");
        assert!(start.elapsed() <= NOTICE_WAIT + Duration::from_millis(100), "{:?}", start.elapsed());
        let err = notice_grace(job, 0, 1, "tide all_gather call 4").unwrap_err().to_string();
        assert!(
            err.contains("tide all_gather call 4: rank 3 on node 3 failed: rank 2 (pid 7) died"),
            "{err}"
        );
    }
}
