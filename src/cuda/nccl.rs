//! NCCL as the cross-node rail of the hierarchical plans (`plan::build`): a plan's cross-node `Copy`
//! (source and destination ranks on different nodes, always the same local index: the rail) becomes
//! an `ncclSend` on the source rank paired with an `ncclRecv` on the destination rank, all of one
//! phase in one `ncclGroupStart` / `ncclGroupEnd` (`cuda::multiproc`).
//!
//! Loading: `libnccl.so.2` (the soname JAX's wheel `nvidia-nccl-cu13` provides; when JAX already
//! loaded it, dlopen returns that same copy), or the path in `TIDE_NCCL_LIB`. Never plain
//! `libnccl.so`: on the GPU machine that is a second, apt-installed NCCL (reference/
//! platform-notes.md), and cudarc's loader tries it first, so tide loads NCCL itself. Symbols are
//! looked up at run time; a missing one is an error naming it.
//!
//! `NCCL_NVLS_ENABLE` is forced to 0 before the first communicator (NVLink multicast is forbidden on
//! the shared machines). One communicator per (job, group, rail): the ranks with the same local
//! index, NCCL rank = node index; its `ncclUniqueId` comes from node 0's rank of the rail (through
//! the multi-process mailbox, or registered by the Python bootstrap with `set_unique_id`).

use crate::error::{Result, TideError};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Mutex, OnceLock};

pub type UniqueId = [u8; 128];

#[repr(C)]
#[derive(Clone, Copy)]
struct NcclUniqueId {
    internal: [c_char; 128],
}

type NcclComm = *mut c_void;
type NcclResult = c_int;
const NCCL_UINT8: c_int = 1;
const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclConfig_t` of NCCL 2.28 (nccl.h, `ncclConfig_v22800`); unset ints are INT_MIN, pointers null.
#[repr(C)]
struct NcclConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
    comm_name: *const c_char,
    collnet_enable: c_int,
    cta_policy: c_int,
    shrink_share: c_int,
    nvls_ctas: c_int,
    n_channels_per_net_peer: c_int,
    nvlink_centric_sched: c_int,
}

struct Lib {
    _lib: libloading::Library,
    path: String,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut NcclComm, c_int, NcclUniqueId, c_int) -> NcclResult,
    send: unsafe extern "C" fn(
        *const c_void,
        usize,
        c_int,
        c_int,
        NcclComm,
        *mut c_void,
    ) -> NcclResult,
    recv:
        unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    last_error: Option<unsafe extern "C" fn(NcclComm) -> *const c_char>,
    comm_abort: Option<unsafe extern "C" fn(NcclComm) -> NcclResult>,
    init_config: Option<
        unsafe extern "C" fn(
            *mut NcclComm,
            c_int,
            NcclUniqueId,
            c_int,
            *mut NcclConfig,
        ) -> NcclResult,
    >,
    async_error: Option<unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult>,
}

static LIB: OnceLock<std::result::Result<Lib, String>> = OnceLock::new();

fn load() -> std::result::Result<Lib, String> {
    // Loaded once per process, so the process's setting (`CONFIG`), not a test's override.
    let path = crate::config::CONFIG
        .nccl_lib
        .clone()
        .unwrap_or_else(|| "libnccl.so.2".into());
    // SAFETY: loading NCCL runs its (benign) initializers.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| format!("loading NCCL from {path:?} failed: {e} (set TIDE_NCCL_LIB to the libnccl.so.2 of the nvidia-nccl wheel JAX uses)"))?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the signature matches nccl.h (2.28) for this symbol.
            let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("NCCL at {path:?} has no symbol {}: {e}", $name))?;
            *s
        }};
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: valid out-pointer.
    unsafe { get_version(&mut version) };
    let last_error = unsafe { lib.get(b"ncclGetLastError\0") }.ok().map(|s| *s);
    let comm_abort = unsafe { lib.get(b"ncclCommAbort\0") }.ok().map(|s| *s);
    let init_config = unsafe { lib.get(b"ncclCommInitRankConfig\0") }
        .ok()
        .map(|s| *s);
    let async_error = unsafe { lib.get(b"ncclCommGetAsyncError\0") }
        .ok()
        .map(|s| *s);
    Ok(Lib {
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        error_string: sym!("ncclGetErrorString"),
        last_error,
        comm_abort,
        init_config,
        async_error,
        version,
        path,
        _lib: lib,
    })
}

fn lib() -> Result<&'static Lib> {
    LIB.get_or_init(load).as_ref().map_err(|e| TideError::Cuda {
        call: "NCCL (dlopen)".into(),
        detail: e.clone(),
    })
}

/// "2.28.9 from libnccl.so.2", or why NCCL cannot be used.
pub fn describe() -> Result<String> {
    let l = lib()?;
    let v = l.version;
    Ok(format!(
        "{}.{}.{} from {}",
        v / 10000,
        (v / 100) % 100,
        v % 100,
        l.path
    ))
}

/// Inside a group, a non-blocking communicator may answer "in progress": not an error.
fn progress_ok(r: NcclResult) -> NcclResult {
    if r == NCCL_IN_PROGRESS {
        0
    } else {
        r
    }
}

fn check(r: NcclResult, call: &str, comm: NcclComm, what: impl FnOnce() -> String) -> Result<()> {
    if r == 0 {
        return Ok(());
    }
    let l = lib()?;
    // SAFETY: NCCL returns static strings.
    let text = unsafe { CStr::from_ptr((l.error_string)(r)) }
        .to_string_lossy()
        .into_owned();
    let last = match l.last_error {
        // SAFETY: as above; a null comm asks for the last global error.
        Some(f) => {
            let p = unsafe { f(comm) };
            if p.is_null() {
                String::new()
            } else {
                let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
                if s.is_empty() {
                    s
                } else {
                    format!("; last error: {s}")
                }
            }
        }
        None => String::new(),
    };
    Err(TideError::Cuda {
        call: call.to_string(),
        detail: format!("{text} (ncclResult {r}){last} [{}]", what()),
    })
}

/// A new `ncclUniqueId` (the rail's node-0 rank makes it).
pub fn unique_id() -> Result<UniqueId> {
    let l = lib()?;
    let mut id = NcclUniqueId { internal: [0; 128] };
    // SAFETY: valid out-pointer.
    check(
        unsafe { (l.get_unique_id)(&mut id) },
        "ncclGetUniqueId",
        std::ptr::null_mut(),
        String::new,
    )?;
    let mut out = [0u8; 128];
    for (d, s) in out.iter_mut().zip(id.internal.iter()) {
        *d = *s as u8;
    }
    Ok(out)
}

/// Unique ids registered from outside (the Python bootstrap, through JAX's key-value store), by
/// (job, group, rail): used instead of the mailbox exchange when present.
type Registry = Mutex<HashMap<(u64, usize, usize), UniqueId>>;
static REGISTERED: OnceLock<Registry> = OnceLock::new();

pub fn set_unique_id(job: u64, group: usize, rail: usize, id: UniqueId) {
    REGISTERED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((job, group, rail), id);
}

pub fn registered_unique_id(job: u64, group: usize, rail: usize) -> Option<UniqueId> {
    REGISTERED
        .get()?
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(job, group, rail))
        .copied()
}

/// C entry for the Python bootstrap: writes a fresh id into `out` (128 bytes). 0 on success.
///
/// # Safety
/// `out` must point to 128 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tide_nccl_unique_id(out: *mut u8) -> c_int {
    match unique_id() {
        Ok(id) => {
            std::ptr::copy_nonoverlapping(id.as_ptr(), out, 128);
            0
        }
        Err(e) => {
            log::error!("tide: {e}");
            1
        }
    }
}

/// C entry for the Python bootstrap: registers the id of (job, group, rail).
///
/// # Safety
/// `id` must point to 128 readable bytes.
#[no_mangle]
pub unsafe extern "C" fn tide_nccl_set_unique_id(job: u64, group: u64, rail: u64, id: *const u8) {
    let mut v = [0u8; 128];
    std::ptr::copy_nonoverlapping(id, v.as_mut_ptr(), 128);
    set_unique_id(job, group as usize, rail as usize, v);
}

/// One rail communicator (never destroyed: lives as long as the job's process).
///
/// Non-blocking (`config.blocking = 0`) where NCCL has `ncclCommInitRankConfig` and
/// `ncclCommGetAsyncError`: initialization and every `ncclGroupEnd` are then completed by polling,
/// and between polls `alive` checks the peers (a dead peer, or the timeout, aborts the communicator
/// with a clear error instead of blocking the host forever, e.g. in `ncclCommInitRank` when a peer
/// died before joining). Without those symbols: blocking calls.
pub struct Comm {
    raw: NcclComm,
    pub rank: usize,
    pub nranks: usize,
    pub what: String,
    nonblocking: bool,
    timeout: std::time::Duration,
}

/// Checks the other members between polls: Err ends the wait (and aborts the communicator).
pub type Alive<'a> = &'a mut dyn FnMut() -> Result<()>;

// SAFETY: an NCCL communicator may be used from any thread, one at a time (callers lock).
unsafe impl Send for Comm {}

impl Comm {
    /// `ncclCommInitRank(Config)` on the current CUDA context's device (collective over the rail:
    /// every member calls it in the same tide call). `what` names the rail for errors.
    pub fn init(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        what: String,
        timeout: std::time::Duration,
        alive: Alive,
    ) -> Result<Comm> {
        let l = lib()?;
        if std::env::var("NCCL_NVLS_ENABLE")
            .map(|v| v.trim() != "0")
            .unwrap_or(true)
        {
            // NVLink multicast is forbidden on these machines; NCCL reads this at communicator init.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let mut c = NcclUniqueId { internal: [0; 128] };
        for (d, s) in c.internal.iter_mut().zip(id.iter()) {
            *d = *s as c_char;
        }
        let mut raw: NcclComm = std::ptr::null_mut();
        let nonblocking = l.init_config.is_some() && l.async_error.is_some();
        let r = match (l.init_config, nonblocking) {
            (Some(f), true) => {
                let u = i32::MIN;
                let mut cfg = NcclConfig {
                    size: std::mem::size_of::<NcclConfig>(),
                    magic: 0xcafe_beef,
                    version: l.version as u32,
                    blocking: 0,
                    cga_cluster_size: u,
                    min_ctas: u,
                    max_ctas: u,
                    net_name: std::ptr::null(),
                    split_share: u,
                    traffic_class: u,
                    comm_name: std::ptr::null(),
                    collnet_enable: u,
                    cta_policy: u,
                    shrink_share: u,
                    nvls_ctas: u,
                    n_channels_per_net_peer: u,
                    nvlink_centric_sched: u,
                };
                // SAFETY: valid out-pointer and config (NCCL copies it); the id is the rail's.
                unsafe { f(&mut raw, nranks as c_int, c, rank as c_int, &mut cfg) }
            }
            // SAFETY: valid out-pointer; the id is the rail's, equal on every member.
            _ => unsafe { (l.comm_init_rank)(&mut raw, nranks as c_int, c, rank as c_int) },
        };
        let comm = Comm {
            raw,
            rank,
            nranks,
            what,
            nonblocking,
            timeout,
        };
        if r != NCCL_IN_PROGRESS {
            if let Err(e) = check(r, "ncclCommInitRank", raw, || {
                format!("{}: rank {rank} of {nranks}", comm.what)
            }) {
                if !raw.is_null() {
                    comm.abort();
                }
                return Err(e);
            }
        }
        match comm.settle("ncclCommInitRank", alive) {
            Ok(()) => Ok(comm),
            Err(e) => {
                comm.abort();
                Err(e)
            }
        }
    }

    /// Non-blocking communicator: polls until the last operation finished (or failed), checking
    /// `alive` between polls, bounded by the timeout.
    fn settle(&self, call: &str, alive: Alive) -> Result<()> {
        if !self.nonblocking {
            return Ok(());
        }
        let l = lib()?;
        let f = l
            .async_error
            .ok_or_else(|| TideError::Internal("ncclCommGetAsyncError missing".into()))?;
        let start = std::time::Instant::now();
        let mut sleep = std::time::Duration::from_micros(20);
        loop {
            let mut st: NcclResult = NCCL_IN_PROGRESS;
            // SAFETY: a live communicator; valid out-pointer.
            let r = unsafe { f(self.raw, &mut st) };
            check(r, "ncclCommGetAsyncError", self.raw, || {
                format!("{} after {call}", self.what)
            })?;
            if st != NCCL_IN_PROGRESS {
                return check(st, call, self.raw, || {
                    format!("{}: rank {} of {}", self.what, self.rank, self.nranks)
                });
            }
            alive().map_err(|e| match e {
                TideError::Rendezvous(m) => {
                    TideError::Rendezvous(format!("{m} (during {call} on {})", self.what))
                }
                other => other,
            })?;
            if start.elapsed() > self.timeout {
                return Err(TideError::Rendezvous(format!(
                    "{call} on {} (rank {} of {}) did not complete within {:.1?} (TIDE_TIMEOUT_S)",
                    self.what, self.rank, self.nranks, self.timeout
                )));
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(std::time::Duration::from_millis(5));
        }
    }

    /// `ncclCommAbort`: after a failed call (a peer died or failed), so that transfers already
    /// enqueued with a peer that will never match them end instead of blocking the stream forever.
    /// The communicator is gone afterwards.
    pub fn abort(self) {
        match lib().ok().and_then(|l| l.comm_abort) {
            // SAFETY: a live communicator, not used after this.
            Some(f) => {
                let r = unsafe { f(self.raw) };
                if r != 0 {
                    log::warn!("tide: ncclCommAbort on {} returned {r}", self.what);
                }
            }
            None => log::warn!(
                "tide: NCCL has no ncclCommAbort; {} left as it is",
                self.what
            ),
        }
    }

    pub fn group_start(&self) -> Result<()> {
        let l = lib()?;
        // SAFETY: plain call.
        check(
            unsafe { (l.group_start)() },
            "ncclGroupStart",
            self.raw,
            || self.what.clone(),
        )
    }

    pub fn group_end(&self, what: impl FnOnce() -> String, alive: Alive) -> Result<()> {
        let l = lib()?;
        // SAFETY: plain call, after group_start.
        let r = unsafe { (l.group_end)() };
        if r != NCCL_IN_PROGRESS {
            check(r, "ncclGroupEnd", self.raw, || {
                format!("{}: {}", self.what, what())
            })?;
        }
        self.settle("ncclGroupEnd", alive)
    }

    /// `bytes` bytes from device address `ptr` to rail rank `peer`, on `stream`.
    pub fn send(
        &self,
        ptr: u64,
        bytes: usize,
        peer: usize,
        stream: usize,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let l = lib()?;
        // SAFETY: ptr..ptr+bytes is a live device buffer of this rank (bounds-checked by the caller).
        check(
            progress_ok(unsafe {
                (l.send)(
                    ptr as *const c_void,
                    bytes,
                    NCCL_UINT8,
                    peer as c_int,
                    self.raw,
                    stream as *mut c_void,
                )
            }),
            "ncclSend",
            self.raw,
            || {
                format!(
                    "{}: rank {} -> rank {peer}, {bytes} bytes: {}",
                    self.what,
                    self.rank,
                    what()
                )
            },
        )
    }

    /// `bytes` bytes from rail rank `peer` into device address `ptr`, on `stream`.
    pub fn recv(
        &self,
        ptr: u64,
        bytes: usize,
        peer: usize,
        stream: usize,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let l = lib()?;
        // SAFETY: as in send; the destination is this rank's own memory.
        check(
            progress_ok(unsafe {
                (l.recv)(
                    ptr as *mut c_void,
                    bytes,
                    NCCL_UINT8,
                    peer as c_int,
                    self.raw,
                    stream as *mut c_void,
                )
            }),
            "ncclRecv",
            self.raw,
            || {
                format!(
                    "{}: rank {} <- rank {peer}, {bytes} bytes: {}",
                    self.what,
                    self.rank,
                    what()
                )
            },
        )
    }
}
