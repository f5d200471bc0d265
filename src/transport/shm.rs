//! POSIX shared-memory segments (`shm_open` + `ftruncate` + `mmap`), the raw edge of the
//! cross-process transport. A `Segment` is one mapping of one named segment; the process that
//! creates a segment owns its name and unlinks it (`Segment::unlink`, or at exit through
//! `unlink_at_exit`), every other process only maps and unmaps it. Mappings stay valid after the
//! name is unlinked and after the owner dies: the memory lives until the last mapping goes.
//!
//! Names: `/tide-{job:016x}-g{group}-r{rank}-{what}` (docs/multiprocess.md "Segments"), so a job's
//! segments can be listed and removed with one glob over /dev/shm.

use crate::error::{Result, TideError};
use std::ffi::CString;
use std::sync::Mutex;

/// The segment name of `what` ("ctl", "d20", ...) for rank `rank` of `group` in job `job`.
pub fn segment_name(job: u64, group: usize, rank: usize, what: &str) -> String {
    format!("/tide-{job:016x}-g{group}-r{rank}-{what}")
}

fn errno_error(call: &str, name: &str) -> TideError {
    let err = std::io::Error::last_os_error();
    TideError::Rendezvous(format!("{call}({name}) failed: {err}"))
}

/// One mapping of a named shared-memory segment.
pub struct Segment {
    name: String,
    ptr: *mut u8,
    len: usize,
    owner: bool,
    unlinked: bool,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through atomics or is
// ordered by the transport's barriers (see transport::group).
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

/// Names created by this process and not yet unlinked; unlinked by the exit hook.
static OWNED: Mutex<Vec<String>> = Mutex::new(Vec::new());

extern "C" fn unlink_owned_at_exit() {
    let names = std::mem::take(&mut *OWNED.lock().unwrap_or_else(|e| e.into_inner()));
    for name in names {
        if let Ok(c) = CString::new(name) {
            // SAFETY: c is a valid NUL-terminated string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

fn remember_owned(name: &str) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        // SAFETY: registers a plain extern "C" function; failure only means no cleanup at exit.
        unsafe { libc::atexit(unlink_owned_at_exit) };
    });
    OWNED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(name.to_string());
}

fn forget_owned(name: &str) {
    OWNED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|n| n != name);
}

/// What `Segment::create` found when the name already existed.
pub enum Created {
    New(Segment),
    /// The name exists: someone else (or a crashed earlier run of this job) owns it.
    Exists,
}

impl Segment {
    /// Creates segment `name` of `len` bytes (zero-filled) and maps it, failing with `Exists`
    /// (not an error) when the name is taken.
    pub fn create(name: &str, len: usize) -> Result<Created> {
        let c = CString::new(name)
            .map_err(|_| TideError::Internal(format!("segment name {name:?} has a NUL")))?;
        // SAFETY: c is a valid NUL-terminated string.
        let fd = unsafe {
            libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
                return Ok(Created::Exists);
            }
            return Err(errno_error("shm_open(create)", name));
        }
        remember_owned(name);
        // SAFETY: fd is a valid descriptor we own.
        let sized = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        if sized != 0 {
            let err = errno_error("ftruncate", name);
            // SAFETY: fd is ours; the name is ours to unlink.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(c.as_ptr());
            }
            forget_owned(name);
            return Err(err);
        }
        let seg = Self::map_fd(fd, name, len, true);
        if seg.is_err() {
            // SAFETY: the name is ours to unlink.
            unsafe { libc::shm_unlink(c.as_ptr()) };
            forget_owned(name);
        }
        seg.map(Created::New)
    }

    /// Maps the existing segment `name`; `Ok(None)` if it does not exist (yet). `min_len` is the
    /// size the caller expects: a shorter segment (its owner has not sized it yet) is `Ok(None)` too.
    pub fn open(name: &str, min_len: usize) -> Result<Option<Segment>> {
        let c = CString::new(name)
            .map_err(|_| TideError::Internal(format!("segment name {name:?} has a NUL")))?;
        // SAFETY: c is a valid NUL-terminated string.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT) {
                return Ok(None);
            }
            return Err(errno_error("shm_open", name));
        }
        // SAFETY: fd is valid; st is plain data filled by fstat.
        let len = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                let err = errno_error("fstat", name);
                libc::close(fd);
                return Err(err);
            }
            st.st_size as usize
        };
        if len < min_len.max(1) {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Ok(None);
        }
        Self::map_fd(fd, name, len, false).map(Some)
    }

    fn map_fd(fd: libc::c_int, name: &str, len: usize, owner: bool) -> Result<Segment> {
        // SAFETY: maps `len` bytes of a descriptor we hold; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        let err = if ptr == libc::MAP_FAILED {
            Some(errno_error("mmap", name))
        } else {
            None
        };
        // SAFETY: the mapping (if any) keeps the memory; the descriptor is no longer needed.
        unsafe { libc::close(fd) };
        if let Some(e) = err {
            return Err(e);
        }
        Ok(Segment {
            name: name.to_string(),
            ptr: ptr as *mut u8,
            len,
            owner,
            unlinked: false,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Removes the name (owner only; idempotent). Existing mappings, ours and peers', stay valid.
    pub fn unlink(&mut self) {
        if !self.owner || self.unlinked {
            return;
        }
        self.unlinked = true;
        forget_owned(&self.name);
        if let Ok(c) = CString::new(self.name.clone()) {
            // SAFETY: c is a valid NUL-terminated string.
            if unsafe { libc::shm_unlink(c.as_ptr()) } != 0 {
                log::warn!(
                    "tide: shm_unlink({}) failed: {}",
                    self.name,
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: ptr/len is a mapping made in map_fd and not unmapped elsewhere.
        if unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) } != 0 {
            log::warn!(
                "tide: munmap({}) failed: {}",
                self.name,
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Removes `name` if it exists (a stale segment left by a crashed run of the same job).
pub fn unlink_name(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: c is a valid NUL-terminated string.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}
