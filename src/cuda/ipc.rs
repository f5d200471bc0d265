//! Peer GPU memory across processes of one host (docs/multiprocess.md, "CUDA").
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
//!   job (they pin the peer's physical memory; XLA's pool lives as long anyway) and given back
//!   after a failure (`Importer::release_all`, once the device finished tide's work: a dead
//!   peer's memory is freed only when its last mapping goes).
//! - **No events**: ranks signal each other through counters in shared host memory
//!   (`cuda::signal`), which a survivor can release when a peer dies; an interprocess event of a
//!   dead peer could never be waited out.
//!
//! Every error names the driver call, this rank, the peer rank and its pid.

use super::driver::{self, CUmemGenericAllocationHandle};
use crate::error::{Result, TideError};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

static VMM_EXPORTS: AtomicU64 = AtomicU64::new(0);
static VMM_IMPORTS: AtomicU64 = AtomicU64::new(0);
static LEGACY_OPENS: AtomicU64 = AtomicU64::new(0);
/// Bytes of peers' allocations mapped in this process now (VMM imports and legacy opens).
static MAPPED_BYTES: AtomicU64 = AtomicU64::new(0);

/// What this process did so far (for tests and logs): VMM exports, VMM imports, legacy
/// `cuIpcOpenMemHandle`s. Each is once per allocation, not per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub vmm_exports: u64,
    pub vmm_imports: u64,
    pub legacy_opens: u64,
    /// Bytes of peers' allocations mapped now (not a count: goes down at `Importer::release_all`).
    pub mapped_bytes: u64,
}

pub fn stats() -> Stats {
    Stats {
        vmm_exports: VMM_EXPORTS.load(Ordering::Relaxed),
        vmm_imports: VMM_IMPORTS.load(Ordering::Relaxed),
        legacy_opens: LEGACY_OPENS.load(Ordering::Relaxed),
        mapped_bytes: MAPPED_BYTES.load(Ordering::Relaxed),
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
    handle: CUmemGenericAllocationHandle,
    fd: Option<OwnedFd>,
    legacy: [u8; 64],
    sent_to: HashSet<usize>,
}

/// The owner's side: allocations exported so far, by base address.
#[derive(Default)]
pub struct Exporter {
    by_base: HashMap<u64, Exported>,
    next_gen: u64,
}

// SAFETY: plain handles and fds, used under the owner's lock.
unsafe impl Send for Exporter {}

impl Exporter {
    /// The allocation holding `ptr` (exporting it if new) and `ptr`'s offset in it. `who` names
    /// the rank and buffer for errors. The device's context must be current.
    pub fn describe(&mut self, ptr: u64, who: &dyn Fn() -> String) -> Result<(AllocDesc, u64)> {
        // SAFETY: ptr is a device address the caller got from XLA (or tide's stage buffer).
        let (base, size) = unsafe { driver::mem_address_range(ptr, || format!("{}: buffer at {ptr:#x}", who()))? };
        let offset = ptr - base;
        // SAFETY: base is a mapped device address. None on non-VMM memory.
        if let Some(h) = unsafe { driver::mem_retain_allocation_handle(base) } {
            return self.describe_vmm(ptr, base, size, h, who).map(|d| (d, offset));
        }
        // SAFETY: base is the start of a cuMemAlloc allocation (not VMM, checked above).
        let legacy = unsafe {
            driver::ipc_mem_handle(base, || {
                format!(
                    "{}: allocation {base:#x} ({size} bytes) holding {ptr:#x} is neither VMM-exportable \
                     (cuMemRetainAllocationHandle failed) nor legacy-IPC capable",
                    who()
                )
            })?
        };
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
                let _ = unsafe { driver::mem_release(e.handle, String::new) };
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

    /// `describe` of VMM memory: `h` is a new reference on the allocation at `base`, kept (as the
    /// export's) or dropped (the allocation was exported before).
    fn describe_vmm(&mut self, ptr: u64, base: u64, size: usize, h: CUmemGenericAllocationHandle, who: &dyn Fn() -> String) -> Result<AllocDesc> {
        if let Some(e) = self.by_base.get(&base) {
            if e.kind == KIND_VMM && e.size == size as u64 && e.handle == h {
                // SAFETY: drop the extra reference just taken; the cached one stays.
                let _ = unsafe { driver::mem_release(h, String::new) };
                return Ok(e.desc(base));
            }
        }
        // SAFETY: h is retained.
        let fd = unsafe {
            driver::mem_export_fd(h, || {
                format!(
                    "{}: VMM allocation {base:#x} ({size} bytes) holding {ptr:#x}; was it created with \
                     requestedHandleTypes = POSIX_FILE_DESCRIPTOR?",
                    who()
                )
            })
        };
        let fd = match fd {
            Ok(fd) => fd,
            Err(e) => {
                // SAFETY: release the reference taken above.
                let _ = unsafe { driver::mem_release(h, String::new) };
                return Err(e);
            }
        };
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
                let _ = unsafe { driver::mem_release(old.handle, String::new) };
            }
        }
        Ok(d)
    }

    /// Drops every export (after a failure: the job will not publish again): the references on
    /// the VMM allocations and the exported fds. Returns how many VMM exports it dropped.
    pub fn release_all(&mut self, me: usize) -> usize {
        let mut n = 0;
        for (base, e) in self.by_base.drain() {
            if e.kind == KIND_VMM {
                // SAFETY: the export's own reference; peers hold their own imports.
                match unsafe { driver::mem_release(e.handle, || format!("rank {me}: export of {base:#x}")) } {
                    Ok(()) => n += 1,
                    Err(err) => log::warn!("tide: {err}"),
                }
            }
        }
        n
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

/// The reader's side: peers' allocations opened in this process, for one local device.
pub struct Importer {
    device: i64,
    /// Mapped base by (peer rank, base, size, generation).
    vmm: HashMap<(usize, u64, u64, u64), u64>,
    /// Opened address and size by handle bytes.
    legacy: HashMap<[u8; 64], (u64, u64)>,
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
        let device = self.device;
        // SAFETY: a mapped range of this process (the peer rank's allocation).
        let r = unsafe {
            driver::mem_set_access(a.base, a.size as usize, device, || {
                format!(
                    "rank {me} (device {device}): granting access to rank {q}'s VMM allocation {:#x} ({} bytes) in this process",
                    a.base, a.size
                )
            })
        };
        if let Err(e) = r {
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
                if let Some(&(p, _)) = self.legacy.get(&a.legacy) {
                    return Ok(p);
                }
                let p = driver::ipc_open_mem_handle(&a.legacy, || who("legacy IPC"))?;
                self.legacy.insert(a.legacy, (p, a.size));
                LEGACY_OPENS.fetch_add(1, Ordering::Relaxed);
                MAPPED_BYTES.fetch_add(a.size, Ordering::Relaxed);
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
                let p = map_vmm(device, fd, a.size as usize, &|| who("VMM"))?;
                self.vmm.insert(key, p);
                VMM_IMPORTS.fetch_add(1, Ordering::Relaxed);
                MAPPED_BYTES.fetch_add(a.size, Ordering::Relaxed);
                log::info!("tide: rank {me} mapped rank {q}'s (pid {pid}) VMM allocation {:#x} ({} bytes) at {p:#x}", a.base, a.size);
                Ok(p)
            }
            k => Err(TideError::Internal(format!(
                "{}: unknown allocation kind {k}",
                who("describe")
            ))),
        }
    }

    /// Unmaps every peer allocation and closes every pending fd (after a failure,
    /// once nothing enqueued uses them: the caller drained the device). Returns the bytes unmapped.
    pub fn release_all(&mut self, me: usize) -> u64 {
        let device = self.device;
        let mut bytes = 0;
        for ((q, base, size, _), p) in self.vmm.drain() {
            let what = || format!("rank {me} (device {device}): rank {q}'s VMM allocation {base:#x} mapped at {p:#x}");
            // SAFETY: our mapping of `size` bytes at `p` (from `map_vmm`); nothing uses it any more.
            let r = unsafe { driver::mem_unmap(p, size as usize, what).and_then(|()| driver::mem_address_free(p, size as usize, what)) };
            match r {
                Ok(()) => bytes += size,
                Err(e) => log::warn!("tide: {e}"),
            }
        }
        for (_, (p, size)) in self.legacy.drain() {
            // SAFETY: opened by `ipc_open_mem_handle`; nothing uses it any more.
            match unsafe { driver::ipc_close_mem_handle(p, || format!("rank {me} (device {device}): legacy IPC mapping at {p:#x}")) } {
                Ok(()) => bytes += size,
                Err(e) => log::warn!("tide: {e}"),
            }
        }
        self.pending.clear();
        self.granted.clear();
        MAPPED_BYTES.fetch_sub(bytes.min(MAPPED_BYTES.load(Ordering::Relaxed)), Ordering::Relaxed);
        bytes
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
}

/// Imports the VMM allocation exported as `fd` (`size` bytes), maps it at a fresh address and
/// grants device `device` read/write access; on an error, whatever was done is undone.
fn map_vmm(device: i64, fd: OwnedFd, size: usize, who: &dyn Fn() -> String) -> Result<u64> {
    let h = driver::mem_import_fd(fd.as_raw_fd(), who)?;
    drop(fd);
    let p = match driver::mem_address_reserve(size, who) {
        Ok(p) => p,
        Err(e) => {
            // SAFETY: h imported above.
            let _ = unsafe { driver::mem_release(h, String::new) };
            return Err(e);
        }
    };
    // SAFETY: p..p+size reserved above; h is the imported allocation of that size.
    if let Err(e) = unsafe { driver::mem_map(p, size, h, who) } {
        // SAFETY: reserved above, nothing mapped; h imported above.
        unsafe {
            let _ = driver::mem_address_free(p, size, String::new);
            let _ = driver::mem_release(h, String::new);
        }
        return Err(e);
    }
    // The mapping holds the allocation now.
    // SAFETY: h imported above.
    let _ = unsafe { driver::mem_release(h, String::new) };
    // SAFETY: p..p+size mapped.
    if let Err(e) = unsafe { driver::mem_set_access(p, size, device, who) } {
        // SAFETY: mapped above; nothing uses it yet.
        unsafe {
            let _ = driver::mem_unmap(p, size, String::new);
            let _ = driver::mem_address_free(p, size, String::new);
        }
        return Err(e);
    }
    Ok(p)
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
