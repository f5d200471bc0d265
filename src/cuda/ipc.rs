//! Peer GPU memory and events across processes of one host (docs/multiprocess.md, "CUDA").
//!
//! XLA's buffers are sub-allocations of one VMM pool per GPU (reference/gpu-facts.md, "Where XLA
//! keeps device memory"); legacy `cuIpcGetMemHandle` fails on them. So a buffer is shared as
//! (allocation, offset):
//! - **Export** (`Exporter`, the owner): `cuMemGetAddressRange` gives the allocation's base and size;
//!   `cuMemRetainAllocationHandle` succeeds on VMM memory, and `cuMemExportToShareableHandle`
//!   (POSIX file descriptor) exports it once per allocation. The retained handle is kept, so the
//!   handle value identifies the physical allocation: a later call that finds another handle at the
//!   same base (XLA freed the pool and made a new one there) exports it again with a new
//!   generation. Memory that is not VMM (tide's stage buffer, `cuMemAlloc`) falls back to
//!   `cuIpcGetMemHandle` on the base, re-queried every call (a reused address gets new handle bytes).
//! - **Passing the fd** (`FdChannel`): each rank binds an abstract-namespace Unix datagram socket
//!   `\0tide-{job}-g{group}-r{rank}-fd`; before a call's entry barrier the exporter sends, with
//!   `SCM_RIGHTS`, every VMM export a peer has not been sent yet (tracked per peer rank); after the
//!   barrier the importer receives what it lacks (already queued: the send happened before the
//!   barrier). No ptrace permission needed (pidfd_getfd would need it, and Yama forbids it between
//!   siblings on stock Ubuntu).
//! - **Import** (`Importer`, the reader): `cuMemImportFromShareableHandle` + `cuMemAddressReserve` +
//!   `cuMemMap` + `cuMemSetAccess` (read/write for the local device), once per (peer rank, base,
//!   size, generation); legacy handles through `cuIpcOpenMemHandle` (lazy peer access), once per
//!   handle bytes. A peer address is `mapped base + offset`. Mappings are kept for the life of the
//!   process (they pin the peer's physical memory; XLA's pool lives as long anyway).
//! - **Events**: created by the owner with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`
//!   (`ipc_event`), exported with `cuIpcGetEventHandle` (cached), opened by peers with
//!   `cuIpcOpenEventHandle` once per handle bytes.
//!
//! Every error names the driver call, this rank, the peer rank and its pid.

use super::driver::{check, CUdeviceptr, CUevent};
use crate::error::{Result, TideError};
use cudarc::driver::sys;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

static VMM_EXPORTS: AtomicU64 = AtomicU64::new(0);
static VMM_IMPORTS: AtomicU64 = AtomicU64::new(0);
static LEGACY_OPENS: AtomicU64 = AtomicU64::new(0);
static EVENT_OPENS: AtomicU64 = AtomicU64::new(0);

/// What this process did so far (for tests and logs): VMM exports, VMM imports, legacy
/// `cuIpcOpenMemHandle`s, `cuIpcOpenEventHandle`s. Each is once per allocation / event, not per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub vmm_exports: u64,
    pub vmm_imports: u64,
    pub legacy_opens: u64,
    pub event_opens: u64,
}

pub fn stats() -> Stats {
    Stats {
        vmm_exports: VMM_EXPORTS.load(Ordering::Relaxed),
        vmm_imports: VMM_IMPORTS.load(Ordering::Relaxed),
        legacy_opens: LEGACY_OPENS.load(Ordering::Relaxed),
        event_opens: EVENT_OPENS.load(Ordering::Relaxed),
    }
}

pub const KIND_VMM: u32 = 1;
pub const KIND_LEGACY: u32 = 2;

/// What a rank publishes about one allocation its peers read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocDesc {
    pub base: u64,
    pub size: u64,
    /// Export generation (VMM): changes when another physical allocation appears at `base`.
    pub gen: u64,
    pub kind: u32,
    /// `CUipcMemHandle` bytes (legacy only).
    pub legacy: [u8; 64],
}

impl AllocDesc {
    pub const WIRE_BYTES: usize = 8 * 4 + 64;

    pub fn encode(&self, out: &mut Vec<u8>) {
        for v in [self.base, self.size, self.gen, self.kind as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.legacy);
    }

    pub fn decode(b: &[u8]) -> Option<AllocDesc> {
        if b.len() < Self::WIRE_BYTES {
            return None;
        }
        let u = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        let mut legacy = [0u8; 64];
        legacy.copy_from_slice(&b[32..96]);
        Some(AllocDesc {
            base: u(0),
            size: u(1),
            gen: u(2),
            kind: u(3) as u32,
            legacy,
        })
    }
}

struct Exported {
    size: u64,
    gen: u64,
    kind: u32,
    /// VMM: the retained allocation handle and the exported fd (kept open).
    handle: sys::CUmemGenericAllocationHandle,
    fd: Option<OwnedFd>,
    legacy: [u8; 64],
    sent_to: HashSet<usize>,
}

/// The owner's side: allocations exported so far, by base address.
#[derive(Default)]
pub struct Exporter {
    by_base: HashMap<u64, Exported>,
    next_gen: u64,
    events: HashMap<usize, [u8; 64]>,
}

// SAFETY: plain handles and fds, used under the owner's lock.
unsafe impl Send for Exporter {}

impl Exporter {
    /// The allocation holding `ptr` (exporting it if new) and `ptr`'s offset in it. `who` names
    /// the rank and buffer for errors. The device's context must be current.
    pub fn describe(&mut self, ptr: u64, who: &dyn Fn() -> String) -> Result<(AllocDesc, u64)> {
        let mut base: CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: valid out-pointers; ptr is a device address the caller got from XLA.
        check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
            "cuMemGetAddressRange",
            || format!("{}: buffer at {ptr:#x}", who()),
        )?;
        let offset = ptr - base;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; base is a mapped device address. Fails on non-VMM memory.
        let vmm =
            unsafe { sys::cuMemRetainAllocationHandle(&mut h, base as *mut std::ffi::c_void) }
                == sys::CUresult::CUDA_SUCCESS;
        if vmm {
            if let Some(e) = self.by_base.get(&base) {
                if e.kind == KIND_VMM && e.size == size as u64 && e.handle == h {
                    // SAFETY: drop the extra reference just taken; the cached one stays.
                    unsafe { sys::cuMemRelease(h) };
                    return Ok((e.desc(base), offset));
                }
            }
            let mut fd: i32 = -1;
            // SAFETY: out-pointer to an int, as the POSIX fd handle type wants; h is retained.
            let r = unsafe {
                sys::cuMemExportToShareableHandle(
                    &mut fd as *mut i32 as *mut std::ffi::c_void,
                    h,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            };
            if let Err(e) = check(r, "cuMemExportToShareableHandle(POSIX fd)", || {
                format!(
                    "{}: VMM allocation {base:#x} ({size} bytes) holding {ptr:#x}; was it created with \
                     requestedHandleTypes = POSIX_FILE_DESCRIPTOR?",
                    who()
                )
            }) {
                // SAFETY: release the reference taken above.
                unsafe { sys::cuMemRelease(h) };
                return Err(e);
            }
            self.next_gen += 1;
            VMM_EXPORTS.fetch_add(1, Ordering::Relaxed);
            let e = Exported {
                size: size as u64,
                gen: self.next_gen,
                kind: KIND_VMM,
                handle: h,
                // SAFETY: the driver returned a new fd that we own.
                fd: Some(unsafe { OwnedFd::from_raw_fd(fd) }),
                legacy: [0; 64],
                sent_to: HashSet::new(),
            };
            let d = e.desc(base);
            if let Some(old) = self.by_base.insert(base, e) {
                if old.kind == KIND_VMM {
                    // SAFETY: the old export's reference; peers hold their own imports.
                    unsafe { sys::cuMemRelease(old.handle) };
                }
            }
            return Ok((d, offset));
        }
        let mut mh: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; base is the start of a cuMemAlloc allocation.
        check(
            unsafe { sys::cuIpcGetMemHandle(&mut mh, base) },
            "cuIpcGetMemHandle",
            || {
                format!(
                    "{}: allocation {base:#x} ({size} bytes) holding {ptr:#x} is neither VMM-exportable \
                     (cuMemRetainAllocationHandle failed) nor legacy-IPC capable",
                    who()
                )
            },
        )?;
        let mut legacy = [0u8; 64];
        for (d, s) in legacy.iter_mut().zip(mh.reserved.iter()) {
            *d = *s as u8;
        }
        let e = self.by_base.entry(base).or_insert_with(|| Exported {
            size: size as u64,
            gen: 0,
            kind: KIND_LEGACY,
            handle: 0,
            fd: None,
            legacy,
            sent_to: HashSet::new(),
        });
        if e.kind != KIND_LEGACY || e.legacy != legacy || e.size != size as u64 {
            if e.kind == KIND_VMM {
                // SAFETY: the stale VMM export's reference.
                unsafe { sys::cuMemRelease(e.handle) };
            }
            *e = Exported {
                size: size as u64,
                gen: 0,
                kind: KIND_LEGACY,
                handle: 0,
                fd: None,
                legacy,
                sent_to: HashSet::new(),
            };
        }
        Ok((e.desc(base), offset))
    }

    /// Sends to peer `q` (through `chan`, to `peer_addr`) every VMM export in `allocs` it has not
    /// been sent yet. Call before the barrier after which `q` imports.
    pub fn send_new(
        &mut self,
        chan: &FdChannel,
        me: usize,
        q: usize,
        peer_addr: &str,
        allocs: &[AllocDesc],
    ) -> Result<()> {
        for a in allocs.iter().filter(|a| a.kind == KIND_VMM) {
            let Some(e) = self.by_base.get_mut(&a.base) else {
                continue;
            };
            if e.gen != a.gen || e.sent_to.contains(&q) {
                continue;
            }
            let fd = e.fd.as_ref().map(|f| f.as_raw_fd()).ok_or_else(|| {
                TideError::Internal(format!("rank {me}: VMM export {:#x} has no fd", a.base))
            })?;
            chan.send(peer_addr, &FdMsg { from: me as u64, base: a.base, size: a.size, gen: a.gen }, fd)
                .map_err(|e| {
                    TideError::Rendezvous(format!(
                        "rank {me}: sending the fd of allocation {:#x} ({} bytes) to rank {q} over {peer_addr:?}: {e}",
                        a.base, a.size
                    ))
                })?;
            e.sent_to.insert(q);
        }
        Ok(())
    }

    /// `cuIpcGetEventHandle` of an interprocess event (cached).
    pub fn event_handle(&mut self, ev: usize, who: &dyn Fn() -> String) -> Result<[u8; 64]> {
        if let Some(h) = self.events.get(&ev) {
            return Ok(*h);
        }
        let mut eh: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; ev was created with CU_EVENT_INTERPROCESS.
        check(
            unsafe { sys::cuIpcGetEventHandle(&mut eh, ev as CUevent) },
            "cuIpcGetEventHandle",
            who,
        )?;
        let mut h = [0u8; 64];
        for (d, s) in h.iter_mut().zip(eh.reserved.iter()) {
            *d = *s as u8;
        }
        self.events.insert(ev, h);
        Ok(h)
    }
}

impl Exported {
    fn desc(&self, base: u64) -> AllocDesc {
        AllocDesc {
            base,
            size: self.size,
            gen: self.gen,
            kind: self.kind,
            legacy: self.legacy,
        }
    }
}

/// An event peers in other processes can wait on (`CU_EVENT_INTERPROCESS` needs DISABLE_TIMING).
/// The device's context must be current.
pub fn ipc_event(device: i64, what: &str) -> Result<CUevent> {
    let mut e: CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: valid out-pointer; context current.
    check(
        unsafe { sys::cuEventCreate(&mut e, flags) },
        "cuEventCreate(INTERPROCESS)",
        || format!("device {device}, {what} event"),
    )?;
    Ok(e)
}

/// The reader's side: peers' allocations and events opened in this process, for one local device.
pub struct Importer {
    device: i64,
    vmm: HashMap<(usize, u64, u64, u64), u64>,
    legacy: HashMap<[u8; 64], u64>,
    events: HashMap<[u8; 64], CUevent>,
    /// fds received but not imported yet, by (rank, base, size, gen).
    pending: HashMap<(usize, u64, u64, u64), OwnedFd>,
    /// VMM allocations of this process (other devices) this device was granted access to.
    granted: HashSet<(u64, u64, u64)>,
}

// SAFETY: plain handles, used under the owner's lock.
unsafe impl Send for Importer {}

impl Importer {
    pub fn new(device: i64) -> Importer {
        Importer {
            device,
            vmm: HashMap::new(),
            legacy: HashMap::new(),
            events: HashMap::new(),
            pending: HashMap::new(),
            granted: HashSet::new(),
        }
    }

    /// A peer in this process: its addresses are valid here, but a VMM allocation is accessible
    /// only from the devices its mapping grants (peer access does not apply to VMM memory), so
    /// grant this device read/write access to it, once. Legacy memory needs nothing beyond peer
    /// access (the caller enables it).
    pub fn grant_local(&mut self, me: usize, q: usize, a: &AllocDesc) -> Result<()> {
        if a.kind != KIND_VMM || a.size == 0 || !self.granted.insert((a.base, a.size, a.gen)) {
            return Ok(());
        }
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device as i32,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: a mapped range of this process (the peer rank's allocation); one descriptor.
        let r = unsafe { sys::cuMemSetAccess(a.base, a.size as usize, &desc, 1) };
        if let Err(e) = check(r, "cuMemSetAccess", || {
            format!(
                "rank {me} (device {}): granting access to rank {q}'s VMM allocation {:#x} ({} bytes) in this process",
                self.device, a.base, a.size
            )
        }) {
            self.granted.remove(&(a.base, a.size, a.gen));
            return Err(e);
        }
        Ok(())
    }

    /// This process's address of peer `q`'s allocation `a` (mapping it on first use). VMM fds are
    /// taken from `chan` (sent before the barrier the caller passed), waiting at most `wait`.
    pub fn map(
        &mut self,
        me: usize,
        q: usize,
        pid: u64,
        a: &AllocDesc,
        chan: &FdChannel,
        wait: Duration,
    ) -> Result<u64> {
        let device = self.device;
        let who = |call: &str| {
            format!("rank {me} (device {device}) importing rank {q}'s (pid {pid}) allocation {:#x} ({} bytes) [{call}]", a.base, a.size)
        };
        match a.kind {
            KIND_LEGACY => {
                if let Some(&p) = self.legacy.get(&a.legacy) {
                    return Ok(p);
                }
                let mut mh: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
                for (d, s) in mh.reserved.iter_mut().zip(a.legacy.iter()) {
                    *d = *s as std::ffi::c_char;
                }
                let mut p: CUdeviceptr = 0;
                // SAFETY: valid out-pointer; handle bytes from the peer's cuIpcGetMemHandle.
                check(
                    unsafe {
                        sys::cuIpcOpenMemHandle_v2(
                            &mut p,
                            mh,
                            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                        )
                    },
                    "cuIpcOpenMemHandle",
                    || who("legacy IPC"),
                )?;
                self.legacy.insert(a.legacy, p);
                LEGACY_OPENS.fetch_add(1, Ordering::Relaxed);
                Ok(p)
            }
            KIND_VMM => {
                let key = (q, a.base, a.size, a.gen);
                if let Some(&p) = self.vmm.get(&key) {
                    return Ok(p);
                }
                let fd = self
                    .take_fd(key, chan, wait)
                    .map_err(|e| TideError::Rendezvous(format!("{}: {e}", who("fd"))))?;
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: valid out-pointer; for POSIX fds the "os handle" is the fd value itself.
                check(
                    unsafe {
                        sys::cuMemImportFromShareableHandle(
                            &mut h,
                            fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        )
                    },
                    "cuMemImportFromShareableHandle",
                    || who("VMM"),
                )?;
                drop(fd);
                let size = a.size as usize;
                let mut p: CUdeviceptr = 0;
                // SAFETY: valid out-pointer; fresh VA range of the allocation's size.
                let r = unsafe { sys::cuMemAddressReserve(&mut p, size, 0, 0, 0) };
                if let Err(e) = check(r, "cuMemAddressReserve", || who("VMM")) {
                    unsafe { sys::cuMemRelease(h) };
                    return Err(e);
                }
                // SAFETY: p..p+size reserved above; h is the imported allocation of that size.
                let r = unsafe { sys::cuMemMap(p, size, 0, h, 0) };
                if let Err(e) = check(r, "cuMemMap", || who("VMM")) {
                    unsafe {
                        sys::cuMemAddressFree(p, size);
                        sys::cuMemRelease(h);
                    }
                    return Err(e);
                }
                // The mapping holds the allocation now.
                // SAFETY: h imported above.
                unsafe { sys::cuMemRelease(h) };
                let desc = sys::CUmemAccessDesc {
                    location: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: self.device as i32,
                    },
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
                // SAFETY: p..p+size mapped; one access descriptor.
                let r = unsafe { sys::cuMemSetAccess(p, size, &desc, 1) };
                if let Err(e) = check(r, "cuMemSetAccess", || who("VMM")) {
                    unsafe {
                        sys::cuMemUnmap(p, size);
                        sys::cuMemAddressFree(p, size);
                    }
                    return Err(e);
                }
                self.vmm.insert(key, p);
                VMM_IMPORTS.fetch_add(1, Ordering::Relaxed);
                log::info!("tide: rank {me} mapped rank {q}'s (pid {pid}) VMM allocation {:#x} ({} bytes) at {p:#x}", a.base, a.size);
                Ok(p)
            }
            k => Err(TideError::Internal(format!(
                "{}: unknown allocation kind {k}",
                who("describe")
            ))),
        }
    }

    fn take_fd(
        &mut self,
        key: (usize, u64, u64, u64),
        chan: &FdChannel,
        wait: Duration,
    ) -> std::io::Result<OwnedFd> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(fd) = self.pending.remove(&key) {
                return Ok(fd);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match chan.recv(left)? {
                Some((m, fd)) => {
                    self.pending
                        .insert((m.from as usize, m.base, m.size, m.gen), fd);
                }
                None => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no file descriptor for it arrived on {:?} within {wait:?}",
                            chan.name
                        ),
                    ))
                }
            }
        }
    }

    /// Peer `q`'s interprocess event, opened once per handle.
    pub fn event(
        &mut self,
        me: usize,
        q: usize,
        pid: u64,
        handle: &[u8; 64],
        what: &str,
    ) -> Result<CUevent> {
        if let Some(&e) = self.events.get(handle) {
            return Ok(e);
        }
        let mut eh: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        for (d, s) in eh.reserved.iter_mut().zip(handle.iter()) {
            *d = *s as std::ffi::c_char;
        }
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; handle bytes from the peer's cuIpcGetEventHandle.
        check(
            unsafe { sys::cuIpcOpenEventHandle(&mut e, eh) },
            "cuIpcOpenEventHandle",
            || {
                format!(
                    "rank {me} (device {}) opening rank {q}'s (pid {pid}) {what} event",
                    self.device
                )
            },
        )?;
        self.events.insert(*handle, e);
        EVENT_OPENS.fetch_add(1, Ordering::Relaxed);
        Ok(e)
    }
}

/// The payload that travels with a file descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdMsg {
    pub from: u64,
    pub base: u64,
    pub size: u64,
    pub gen: u64,
}

const FD_MAGIC: u64 = 0x7469_6465_6664_3031; // "tidefd01"

/// An abstract-namespace Unix datagram socket that receives file descriptors (`SCM_RIGHTS`).
pub struct FdChannel {
    sock: OwnedFd,
    pub name: String,
}

fn sockaddr(name: &str) -> std::io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: all-zero is a valid sockaddr_un.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = name.as_bytes();
    if b.len() + 1 > a.sun_path.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "socket name too long",
        ));
    }
    // Abstract namespace: leading NUL, no file.
    for (i, &c) in b.iter().enumerate() {
        a.sun_path[i + 1] = c as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + b.len();
    Ok((a, len as libc::socklen_t))
}

impl FdChannel {
    /// The socket name of a rank (without the leading NUL).
    pub fn name_of(job: u64, group: usize, rank: usize) -> String {
        format!("tide-{job:016x}-g{group}-r{rank}-fd")
    }

    pub fn bind(name: &str) -> std::io::Result<FdChannel> {
        // SAFETY: plain socket creation.
        let s = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if s < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: s is a new socket we own.
        let sock = unsafe { OwnedFd::from_raw_fd(s) };
        let (a, len) = sockaddr(name)?;
        // SAFETY: a is a valid sockaddr_un of length len.
        if unsafe {
            libc::bind(
                sock.as_raw_fd(),
                &a as *const _ as *const libc::sockaddr,
                len,
            )
        } != 0
        {
            let e = std::io::Error::last_os_error();
            return Err(std::io::Error::new(
                e.kind(),
                format!("bind(@{name}): {e} (another process holds this rank?)"),
            ));
        }
        Ok(FdChannel {
            sock,
            name: name.to_string(),
        })
    }

    /// Sends `fd` with `msg` to the socket named `to` (never blocks: a full queue is an error).
    pub fn send(&self, to: &str, msg: &FdMsg, fd: RawFd) -> std::io::Result<()> {
        let (a, len) = sockaddr(to)?;
        let mut payload = [0u8; 40];
        for (i, v) in [FD_MAGIC, msg.from, msg.base, msg.size, msg.gen]
            .iter()
            .enumerate()
        {
            payload[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        let mut iov = libc::iovec {
            iov_base: payload.as_mut_ptr() as *mut _,
            iov_len: payload.len(),
        };
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        let mut cbuf = vec![0u8; space];
        // SAFETY: msghdr zeroed then filled with valid pointers that outlive sendmsg.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_name = &a as *const _ as *mut _;
        mh.msg_namelen = len;
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf.as_mut_ptr() as *mut _;
        mh.msg_controllen = space as _;
        // SAFETY: control buffer sized by CMSG_SPACE for one fd.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::copy_nonoverlapping(
                &fd as *const RawFd as *const u8,
                libc::CMSG_DATA(c),
                std::mem::size_of::<RawFd>(),
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            // SAFETY: mh valid as above.
            let r = unsafe {
                libc::sendmsg(
                    self.sock.as_raw_fd(),
                    &mh,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if r >= 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            return Err(e);
        }
    }

    /// One message and its fd, waiting at most `wait`; None on timeout.
    pub fn recv(&self, wait: Duration) -> std::io::Result<Option<(FdMsg, OwnedFd)>> {
        let deadline = Instant::now() + wait;
        loop {
            let mut payload = [0u8; 40];
            let mut iov = libc::iovec {
                iov_base: payload.as_mut_ptr() as *mut _,
                iov_len: payload.len(),
            };
            let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
            let mut cbuf = vec![0u8; space];
            // SAFETY: as in send.
            let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
            mh.msg_iov = &mut iov;
            mh.msg_iovlen = 1;
            mh.msg_control = cbuf.as_mut_ptr() as *mut _;
            mh.msg_controllen = space as _;
            // SAFETY: mh valid.
            let r = unsafe {
                libc::recvmsg(
                    self.sock.as_raw_fd(),
                    &mut mh,
                    libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
                )
            };
            if r >= 0 {
                // SAFETY: walk the control messages the kernel wrote.
                let mut fd: Option<OwnedFd> = None;
                unsafe {
                    let mut c = libc::CMSG_FIRSTHDR(&mh);
                    while !c.is_null() {
                        if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS
                        {
                            let mut raw: RawFd = -1;
                            std::ptr::copy_nonoverlapping(
                                libc::CMSG_DATA(c),
                                &mut raw as *mut RawFd as *mut u8,
                                std::mem::size_of::<RawFd>(),
                            );
                            if raw >= 0 {
                                fd = Some(OwnedFd::from_raw_fd(raw));
                            }
                        }
                        c = libc::CMSG_NXTHDR(&mh, c);
                    }
                }
                let u =
                    |i: usize| u64::from_le_bytes(payload[i * 8..i * 8 + 8].try_into().unwrap());
                if r as usize != payload.len() || u(0) != FD_MAGIC {
                    continue; // not ours: drop it (and its fd)
                }
                let Some(fd) = fd else { continue };
                return Ok(Some((
                    FdMsg {
                        from: u(1),
                        base: u(2),
                        size: u(3),
                        gen: u(4),
                    },
                    fd,
                )));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let ms = (deadline - now).as_millis().clamp(1, 50) as i32;
            let mut p = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, ms) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_channel_passes_a_descriptor() {
        let name_a = format!("tide-test-{}-a", std::process::id());
        let name_b = format!("tide-test-{}-b", std::process::id());
        let a = FdChannel::bind(&name_a).unwrap();
        let b = FdChannel::bind(&name_b).unwrap();
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let m = FdMsg {
            from: 3,
            base: 0x1000,
            size: 4096,
            gen: 7,
        };
        a.send(&name_b, &m, f.as_raw_fd()).unwrap();
        let (got, fd) = b.recv(Duration::from_secs(2)).unwrap().expect("a message");
        assert_eq!(got, m);
        assert_ne!(fd.as_raw_fd(), f.as_raw_fd());
        assert!(b.recv(Duration::from_millis(10)).unwrap().is_none());
        let d = AllocDesc {
            base: 1,
            size: 2,
            gen: 3,
            kind: KIND_VMM,
            legacy: [9; 64],
        };
        let mut v = Vec::new();
        d.encode(&mut v);
        assert_eq!(v.len(), AllocDesc::WIRE_BYTES);
        assert_eq!(AllocDesc::decode(&v), Some(d));
    }
}
