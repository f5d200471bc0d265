//! Signals between processes: the points a rank publishes to peers in other processes (its
//! `ready`, its `done`, the end of each phase) as counters in host shared memory that streams
//! write and wait on with stream memory operations, where interprocess events were used before.
//!
//! Why not interprocess events: a stream waiting on a peer's event that the peer recorded but never
//! completed (the peer was killed) waits forever, and CUDA has no way to cancel the wait; the
//! survivor's device never drains, so tide could never give back the job's memory after a peer
//! died (measured on the H200: 256 MiB kept until the process exited). A counter in memory that
//! this process maps can be released by a plain store of the CPU.
//!
//! A `Page` is one page of host memory shared by the processes of a job (the last page of a rank's
//! CUDA mailbox segment), registered with CUDA in each process that uses it. Point `k` is slot `k`
//! of it, two 32-bit words:
//! - `enqueued`: how many writes of the point its owner has enqueued; written by the owner's CPU
//!   when it enqueues a write (`record`), before the barrier that tells peers the point exists;
//! - `value`: written by the owner's stream (`cuStreamWriteValue32`, fenced: whoever sees the value
//!   sees the stream's earlier writes) when the stream reaches the point.
//!
//! A peer's stream waits (`wait`) for `value >= enqueued` as read when the wait is enqueued: the
//! most recent write enqueued so far, exactly what `cuStreamWaitEvent` captures of an event. A point
//! never recorded (`enqueued == 0`) is not waited on, as an event never recorded is not.
//! Counters wrap (the wait compares wrap-aware). `release` sets every point's value to its
//! `enqueued`: every wait ever enqueued on the page ends. Only for a peer that died: its stream
//! will write nothing more, and what the waits ordered (reads of its memory) no longer matters
//! because the call failed.
//!
//! Ownership: the owner writes `enqueued` and (through its stream) `value`; peers only read, except
//! `release` of a dead owner's page. Pages stay mapped and registered for the life of the process
//! (the mailboxes are the job's, kept as long as it is).

use super::driver::{self, CUdeviceptr, CUstream};
use crate::error::{Result, TideError};
use std::sync::atomic::{AtomicU32, Ordering};

/// The bytes of a page (the tail of a rank's mailbox segment).
pub const PAGE_BYTES: usize = 4096;
/// Slots per page: ready, done and up to `SLOTS - 2` phase points.
pub const SLOTS: usize = PAGE_BYTES / 8;

/// A point a rank publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    Ready,
    Done,
    /// The end of phase `p` (recorded before the phase barrier).
    Phase(usize),
}

impl Point {
    /// The point's slot in a page.
    pub fn slot(self) -> Result<usize> {
        let k = match self {
            Point::Ready => 0,
            Point::Done => 1,
            Point::Phase(p) => p.saturating_add(2),
        };
        if k < SLOTS {
            Ok(k)
        } else {
            Err(TideError::InvalidArgument(format!(
                "{self:?}: a plan of more than {} phases cannot signal across processes",
                SLOTS - 1
            )))
        }
    }
}

/// One registered page of signals: its host address (this process's mapping) and the device
/// address CUDA gave it. Copies are views of the same page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    host: usize,
    dev: CUdeviceptr,
}

impl Page {
    /// Registers the page at `host` (page-aligned, `PAGE_BYTES` mapped for the life of the process)
    /// with CUDA; the context of some device must be current.
    ///
    /// # Safety
    /// `host` points at `PAGE_BYTES` of shared memory that stays mapped for the life of the
    /// process and is used only as signals.
    pub unsafe fn register(host: *mut u8, what: impl Fn() -> String) -> Result<Page> {
        if host.is_null() || !(host as usize).is_multiple_of(PAGE_BYTES) {
            return Err(TideError::Internal(format!("{}: signal page at {host:p} is not page-aligned", what())));
        }
        // SAFETY: the caller's guarantee.
        let dev = unsafe { driver::host_register(host, PAGE_BYTES, || format!("{}: signal page", what()))? };
        Ok(Page { host: host as usize, dev })
    }

    /// A page over plain memory, never registered: for `release` and the counters in unit tests.
    #[cfg(test)]
    fn unregistered(host: *mut u8) -> Page {
        Page { host: host as usize, dev: 0 }
    }

    fn word(&self, slot: usize, w: usize) -> &AtomicU32 {
        // SAFETY: slot < SLOTS (Point::slot), so the word is inside the page, which is mapped for
        // the life of the process and 4-byte aligned; every access to it is atomic.
        unsafe { &*((self.host + slot * 8 + w * 4) as *const AtomicU32) }
    }
    fn enqueued(&self, slot: usize) -> &AtomicU32 {
        self.word(slot, 0)
    }
    fn value(&self, slot: usize) -> &AtomicU32 {
        self.word(slot, 1)
    }

    /// The owner enqueues on `stream` the next write of `point` (the CPU counts it first).
    ///
    /// # Safety
    /// `stream` is a live stream of the context the page was registered in.
    pub unsafe fn record(&self, stream: CUstream, point: Point, what: impl FnOnce() -> String) -> Result<()> {
        let k = point.slot()?;
        let n = self.enqueued(k).load(Ordering::Relaxed).wrapping_add(1);
        self.enqueued(k).store(n, Ordering::Release);
        // SAFETY: the page is registered (`register`) and mapped for the life of the process; the
        // stream is the caller's guarantee.
        unsafe { driver::stream_write_value32(stream, self.dev + (k * 8 + 4) as u64, n, what) }
    }

    /// `stream` waits for the most recent write of `point` enqueued so far by the page's owner (none
    /// if it never recorded one).
    ///
    /// # Safety
    /// As `record`.
    pub unsafe fn wait(&self, stream: CUstream, point: Point, what: impl FnOnce() -> String) -> Result<()> {
        let k = point.slot()?;
        let n = self.enqueued(k).load(Ordering::Acquire);
        if n == 0 {
            return Ok(());
        }
        // SAFETY: as `record`.
        unsafe { driver::stream_wait_value32(stream, self.dev + (k * 8 + 4) as u64, n, what) }
    }

    /// Ends every wait on this page, past and future: each point's value becomes its `enqueued`.
    /// Only for a page whose owner died (module header).
    pub fn release(&self) {
        for k in 0..SLOTS {
            let n = self.enqueued(k).load(Ordering::Acquire);
            self.value(k).store(n, Ordering::Release);
        }
    }

    /// Whether a wait enqueued now on `point` would have to wait: its owner's stream has not
    /// reached the most recent write enqueued (the unit tests' view; no engine path asks).
    #[cfg(test)]
    fn pending(&self, point: Point) -> Result<bool> {
        let k = point.slot()?;
        let n = self.enqueued(k).load(Ordering::Acquire);
        let v = self.value(k).load(Ordering::Acquire);
        Ok((v.wrapping_sub(n) as i32) < 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(align(4096))]
    struct Mem([u8; PAGE_BYTES]);

    #[test]
    fn points_have_distinct_slots_inside_the_page() {
        assert_eq!(Point::Ready.slot().unwrap(), 0);
        assert_eq!(Point::Done.slot().unwrap(), 1);
        assert_eq!(Point::Phase(0).slot().unwrap(), 2);
        assert_eq!(Point::Phase(SLOTS - 3).slot().unwrap(), SLOTS - 1);
        let err = Point::Phase(SLOTS - 2).slot().unwrap_err().to_string();
        assert!(err.contains("phases"), "{err}");
        assert!(Point::Phase(usize::MAX).slot().is_err());
    }

    #[test]
    fn release_ends_every_pending_wait_and_wraps() {
        let mut m = Box::new(Mem([0; PAGE_BYTES]));
        let p = Page::unregistered(m.0.as_mut_ptr());
        // Owner enqueued 3 writes of done, its stream ran 1; 7 of phase 4 with a wrapped counter.
        p.enqueued(1).store(3, Ordering::Relaxed);
        p.value(1).store(1, Ordering::Relaxed);
        p.enqueued(6).store(2, Ordering::Relaxed);
        p.value(6).store(u32::MAX - 4, Ordering::Relaxed);
        assert!(p.pending(Point::Done).unwrap());
        assert!(p.pending(Point::Phase(4)).unwrap());
        assert!(!p.pending(Point::Ready).unwrap(), "never recorded: nothing to wait for");
        p.release();
        for pt in [Point::Ready, Point::Done, Point::Phase(4), Point::Phase(100)] {
            assert!(!p.pending(pt).unwrap(), "{pt:?}");
        }
        assert_eq!(p.value(1).load(Ordering::Relaxed), 3);
        assert_eq!(p.value(6).load(Ordering::Relaxed), 2);
        // A value past the target (wrapped) is not pending.
        p.value(1).store(4, Ordering::Relaxed);
        assert!(!p.pending(Point::Done).unwrap());
    }

    #[test]
    fn register_refuses_an_unaligned_page() {
        let mut m = Box::new(Mem([0; PAGE_BYTES]));
        // SAFETY: refused before any CUDA call.
        let err = unsafe { Page::register(m.0.as_mut_ptr().wrapping_add(8), || "rank 0".into()) }.unwrap_err();
        assert!(err.to_string().contains("page-aligned"), "{err}");
    }
}
