//! Issuing a prepared plan's schedule on the streams, for both paths: the one phase loop and end
//! of call (`run_phases`, rules 3-5 / A2-A3 of the `cuda` module header), each command
//! (`Issuer::issue`), the batching of one stream's consecutive copies and small sums
//! (TIDE_COPY_BATCH, TIDE_FUSE_BYTES: `fuse`), 2-D copies (`Issuer::copy_2d`: on the copy
//! engines, as TIDE_COPY2D says: `copy2d` module header) and the NVLink multicast all-gather
//! (`issue_multicast`, `multicast` module header).
//!
//! What it is handed (`Issue`): MAIN and its side streams, the local, phase and `done` events
//! (an in-flight slot's, in-process; the device's, multi-process), whether small work is fused,
//! the multicast grant; and a `meeting::Meeting` whose hooks it calls at the points its contract
//! names. Every driver call goes through `driver`'s checked wrappers; nothing here blocks the host
//! on the device.

use super::copy2d;
use super::driver::{self, CUdevice, CUevent, CUstream, StridedCopy};
use super::fuse;
use super::kernels;
use super::meeting::{Meeting, RankInfo};
use super::multicast;
use super::prepare::{op_name, Prepared};
use super::schedule::{Cmd, CopyVia, RankEvent, MAIN};
use super::signal::Point;
use crate::call::CallInfo;
use crate::config::{Config, Copy2d};
use crate::error::{Result, TideError};
use crate::plan::{BufKind, Operand, Region};

/// The streams and events one call issues on: the schedule's MAIN (`main`: tide's stream of the
/// call's in-flight slot; XLA's stream or a slot's on the multi-process path), its side streams and
/// local events, and the kernel module.
pub(crate) struct Res<'a> {
    pub module: Option<&'a super::device::Module>,
    pub main: CUstream,
    pub side: &'a [CUstream],
    pub pool: &'a [CUevent],
    /// The event `Cmd::WaitOwnPrevDone` waits on; `None` skips those waits (the start/done
    /// driver: implied by rule A1, `ready` is recorded on the slot's own tide stream).
    pub prev_done: Option<CUevent>,
}

impl Res<'_> {
    fn stream(&self, s: usize) -> Result<CUstream> {
        if s == MAIN {
            Ok(self.main)
        } else {
            self.side
                .get(s - 1)
                .copied()
                .ok_or_else(|| TideError::Internal(format!("side stream {s} not created")))
        }
    }

    fn local_event(&self, event: usize) -> Result<CUevent> {
        self.pool
            .get(event)
            .copied()
            .ok_or_else(|| TideError::Internal(format!("local event {event} not created")))
    }

    fn module(&self) -> Result<&super::device::Module> {
        self.module
            .ok_or_else(|| TideError::Internal("kernel module not loaded".into()))
    }
}

/// What `run_phases` issues with besides the schedule: the streams and local events (`res`), the
/// events it records on MAIN at each phase boundary (`phase`) and at the end (`done`), whether
/// small copies and sums may go as batched launches (`fuse`, with TIDE_FUSE_BYTES), the NVLink
/// multicast grant of every rank (device, compute capability, grant), and the batched copies' hints.
pub(crate) struct Issue<'a> {
    pub res: Res<'a>,
    pub phase: &'a [CUevent],
    pub done: CUevent,
    pub fuse: bool,
    pub multicast: Option<(CUdevice, (i32, i32), multicast::Granted)>,
    /// Whether batched copies name the devices of their ranks as location hints (in-process), or
    /// this rank's device (multi-process: a peer's ordinal is its own process's numbering; the
    /// hints are ignored for non-managed memory, but must still name a device of this process).
    pub peer_hints: bool,
}

/// The one phase loop and end of call of both paths (rules 3-5 / A2-A3), over `meeting`
/// (`meeting` module header, hooks 1-5): each phase's commands on their streams (`meeting`'s rail
/// copies replaced by waits on its rail event, waits on ranks it does not reach skipped), phase
/// event and barrier between phases; then `done` on MAIN, the exit barrier, and MAIN waits on
/// every reached peer's `done`. Work is collected per stream and issued together: consecutive
/// copy-engine copies as one cuMemcpyBatchAsync (TIDE_COPY_BATCH; CUDA 13 drivers); small copies
/// and sums as batched kernel launches (TIDE_FUSE_BYTES, `fuse`, when `io.fuse`). A stream's
/// pending work is issued before any other command on it. On an error after work was enqueued,
/// MAIN still joins every side stream, so an event recorded on MAIN afterwards (`released`, or
/// XLA's stream itself on the synchronous multi-process path) marks the end of all of it.
pub(crate) fn run_phases(call: &CallInfo, io: &Issue, meeting: &dyn Meeting, prepared: &Prepared, cfg: &Config) -> Result<()> {
    let fusing = io.fuse && cfg.fuse_bytes > 0 && io.res.module.is_some();
    let issuer = Issuer {
        call,
        res: &io.res,
        infos: meeting.infos(),
        prepared,
        cfg,
        fusing,
        batching: fusing || (cfg.copy_batch && driver::init().map(|v| v >= 13000).unwrap_or(false)),
        peer_hints: io.peer_hints,
        max_pitch: std::cell::OnceCell::new(),
    };
    let phases_ok = issuer.all_phases(io, meeting);
    let ended = meeting.phases_ended(io.res.main);
    let res_ok = phases_ok.and(ended).and_then(|()| issuer.end_of_call(io, meeting));
    if res_ok.is_err() {
        issuer.join_side_streams();
    }
    res_ok
}

/// One call's issuing: what every command needs to find its streams, events and addresses.
struct Issuer<'a> {
    call: &'a CallInfo,
    res: &'a Res<'a>,
    infos: &'a [RankInfo],
    prepared: &'a Prepared,
    cfg: &'a Config,
    /// Small copies and sums as batched launches (TIDE_FUSE_BYTES, in-process).
    fusing: bool,
    /// Consecutive copies of one stream collected (TIDE_COPY_BATCH, or `fusing`).
    batching: bool,
    peer_hints: bool,
    /// The device's largest 2-D copy pitch (`driver::max_pitch`), asked at the call's first 2-D copy.
    max_pitch: std::cell::OnceCell<usize>,
}

/// Work collected per stream, issued before any other command on its stream (`fuse` header).
struct Pending {
    /// Copies per stream (MAIN first).
    copies: Vec<Vec<fuse::PendingCopy>>,
    /// 2-D copies per stream, under TIDE_COPY2D other than 1 (`copy2d` module header). A stream
    /// has pending 1-D or 2-D copies, never both (either kind flushes the other first).
    strided: copy2d::Pending,
    /// Sums on MAIN.
    sums: Vec<fuse::SumSeg>,
}

impl Issuer<'_> {
    /// Every phase: the meeting's phase start, the commands, pending work, then (between phases)
    /// the phase event, the meeting's hook and the phase barrier (rule 4). The multicast
    /// all-gather instead, where every rank was granted it.
    fn all_phases(&self, io: &Issue, meeting: &dyn Meeting) -> Result<()> {
        let main = self.res.main;
        if let Some((dev, cc, g)) = io.multicast {
            let pushed = *io
                .phase
                .first()
                .ok_or_else(|| TideError::Internal("no pushed event".into()))?;
            return issue_multicast(self.call, dev, cc, self.res, pushed, self.prepared, self.infos, meeting, g, self.cfg);
        }
        let sched = &self.prepared.schedule;
        let nphases = sched.phases.len();
        let mut pending = Pending {
            copies: vec![Vec::new(); self.res.side.len() + 1],
            strided: copy2d::Pending::new(self.res.side.len() + 1),
            sums: Vec::new(),
        };
        for (p, phase) in sched.phases.iter().enumerate() {
            meeting.phase_start(p, main)?;
            for cmd in &phase.cmds {
                self.route(&mut pending, meeting, p, cmd)?;
            }
            self.flush_sums(&mut pending.sums)?;
            for s in 0..pending.copies.len() {
                self.flush_strided(s, &mut pending.strided)?;
                self.flush_copies(s, &mut pending.copies)?;
            }
            if p + 1 < nphases {
                let ev = *io
                    .phase
                    .get(p)
                    .ok_or_else(|| TideError::Internal(format!("phase event {p} not created")))?;
                let (rank, ord) = (self.call.rank, self.call.device_ordinal);
                // SAFETY: valid event and stream; context current.
                unsafe { driver::event_record(ev, main, || format!("rank {rank} device {ord}: phase {p} event"))? };
                meeting.phase_recorded(p, main)?;
                meeting.barrier(&format!("phase {p} ({})", phase.name))?;
            }
        }
        Ok(())
    }

    /// One command of phase `p`: skipped (a wait on a rank the meeting does not reach), collected
    /// (a small sum, a batchable copy, a 2-D copy), replaced by a wait on the meeting's rail event,
    /// or issued. A stream's pending work is flushed before anything else is issued on it.
    fn route(&self, pending: &mut Pending, meeting: &dyn Meeting, p: usize, cmd: &Cmd) -> Result<()> {
        let s = cmd.stream();
        if let Cmd::WaitRank { rank: q, .. } = cmd {
            if !meeting.reaches(*q) {
                return Ok(());
            }
        }
        if !matches!(cmd, Cmd::Copy2D { .. }) {
            self.flush_strided(s, &mut pending.strided)?;
        }
        if let Cmd::Copy { src, dst, bytes, .. } = cmd {
            // A copy onto itself moves nothing: the casting all-gather's own rows, already in place
            // (`crate::cast`: this rank's operand is a view of its own rows of the result).
            if address(self.infos, src, *bytes)? == address(self.infos, dst, *bytes)? {
                return Ok(());
            }
        }
        if self.call.at.is_some() {
            if let Cmd::Copy { src, dst, .. } | Cmd::Copy2D { src, dst, .. } = cmd {
                if src.kind == BufKind::Output || dst.kind == BufKind::Output {
                    // Reduce-scatter plans write results with Reduce and Zero only (plan::build);
                    // a copy would need a host address of a slice chosen on the device.
                    return Err(TideError::Internal(format!(
                        "{}: a copy touches a result of a reduce-scatter into slices",
                        self.step_ctx(p, 0, dst)
                    )));
                }
            }
        }
        if let Cmd::Copy2D { .. } = cmd {
            // Never between nodes (`Action::CopyBlocks`): no rail event stands for it.
            return self.copy_2d(pending, p, cmd);
        }
        let rail = meeting.rail_event(p, cmd);
        if self.fusing && s == MAIN && rail.is_none() {
            if let Cmd::Reduce { dst, srcs, elems, .. } = cmd {
                if let Some(seg) = self.sum_segment(dst, srcs, *elems)? {
                    self.flush_copies(MAIN, &mut pending.copies)?;
                    if !fuse::sum_joins(&pending.sums, &seg, fuse::sum_batch_limit(self.cfg.rs_max_ctas)) {
                        self.flush_sums(&mut pending.sums)?;
                    }
                    pending.sums.push(seg);
                    return Ok(());
                }
            }
        }
        if s == MAIN {
            self.flush_sums(&mut pending.sums)?;
        }
        if self.batching {
            if let (Cmd::Copy { src, dst, bytes, via, .. }, None) = (cmd, rail) {
                // Copy-engine copies join any batch; SM copies only batched launches.
                if *via == CopyVia::CopyEngine || (self.fusing && *bytes < self.cfg.fuse_bytes) {
                    let ord = self.call.device_ordinal;
                    let c = fuse::PendingCopy {
                        dst: address(self.infos, dst, *bytes)?,
                        src: address(self.infos, src, *bytes)?,
                        bytes: *bytes,
                        dst_dev: if self.peer_hints { self.infos[dst.rank].device } else { ord },
                        src_dev: if self.peer_hints { self.infos[src.rank].device } else { ord },
                    };
                    let list = pending
                        .copies
                        .get(s)
                        .ok_or_else(|| TideError::Internal(format!("stream {s} out of range")))?;
                    if !fuse::copy_joins(list, &c) {
                        self.flush_copies(s, &mut pending.copies)?;
                    }
                    pending.copies[s].push(c);
                    return Ok(());
                }
            }
            self.flush_copies(s, &mut pending.copies)?;
        }
        match rail {
            Some(ev) => {
                let sx = self.res.stream(s)?;
                let (rank, ord) = (self.call.rank, self.call.device_ordinal);
                // SAFETY: the meeting's rail event, recorded at this phase's start.
                unsafe {
                    driver::stream_wait_event(sx, ev, || {
                        format!("rank {rank} device {ord}: stream {s} on the rail transfers of phase {p}")
                    })
                }
            }
            None => self.issue(p, cmd),
        }
    }

    /// Rule 5 / A3: done (this rank's reads of peers' memory are before it: the schedule joined
    /// the side streams into MAIN), exit barrier, every reached peer's done.
    fn end_of_call(&self, io: &Issue, meeting: &dyn Meeting) -> Result<()> {
        let main = self.res.main;
        let (rank, ord) = (self.call.rank, self.call.device_ordinal);
        // SAFETY: valid event and stream.
        unsafe { driver::event_record(io.done, main, || format!("rank {rank} device {ord}: done event"))? };
        meeting.done_recorded(main)?;
        meeting.barrier("exit")?;
        for (q, info) in self.infos.iter().enumerate() {
            if q != rank && meeting.reaches(q) {
                // The peer's done, recorded before the exit barrier; not recorded again before
                // this rank left the meeting (the module header).
                info.wait(main, Point::Done, || format!("rank {rank} device {ord}: on rank {q}'s done event"))?;
            }
        }
        Ok(())
    }

    /// The error path: MAIN joins every side stream (one join event per side stream where there
    /// are enough), best effort.
    fn join_side_streams(&self) {
        let res = self.res;
        let events = self.prepared.schedule.events;
        for (k, &s) in res.side.iter().enumerate() {
            let ev = res.pool.get(events + k).or(res.pool.get(events)).copied();
            if let Err(j) = record_wait(ev, s, res.main) {
                log::warn!("tide: rank {}: joining side streams after an error failed: {j}", self.call.rank);
            }
        }
    }

    fn flush_sums(&self, sums: &mut Vec<fuse::SumSeg>) -> Result<()> {
        if sums.is_empty() {
            return Ok(());
        }
        let (call, rank, ord) = (self.call, self.call.rank, self.call.device_ordinal);
        let r = fuse::issue_sums(self.res.module()?, self.res.main, sums, self.cfg.rs_max_ctas, &|| {
            format!("tide {} site {} rank {rank} device {ord}: batched sums", op_name(call.op), call.site)
        });
        sums.clear();
        r
    }

    /// Issues the copies pending on stream `s`: small ones as batched launches (TIDE_FUSE_BYTES),
    /// the rest as one cuMemcpyBatchAsync in pieces (`fuse::ce_pieces`; source order: stream;
    /// hints: the devices holding source and destination), or one cuMemcpyAsync each where the
    /// driver has no batch API or TIDE_COPY_BATCH=0.
    fn flush_copies(&self, s: usize, pending: &mut [Vec<fuse::PendingCopy>]) -> Result<()> {
        let Some(list) = pending.get_mut(s) else {
            return Ok(());
        };
        if list.is_empty() {
            return Ok(());
        }
        let (cfg, rank, ord) = (self.cfg, self.call.rank, self.call.device_ordinal);
        let mut copies = std::mem::take(list);
        let stream = self.res.stream(s)?;
        // Small copies as batched launches (TIDE_FUSE_BYTES): all of them on MAIN (SM copies), on
        // a copy stream only from TIDE_FUSE_CE_MIN of them (`fuse::fuses_copies`: fewer stay on the
        // copy engine, which progresses beside a kernel holding every SM). Pairwise independent
        // (`fuse::copy_joins`), so they may run in any order.
        if let Some(m) = self.res.module.filter(|_| self.fusing) {
            let small = copies.iter().filter(|c| c.bytes < cfg.fuse_bytes).count();
            if fuse::fuses_copies(s == MAIN, small, cfg.fuse_ce_min) {
                let (fused, rest): (Vec<_>, Vec<_>) = copies.into_iter().partition(|c| c.bytes < cfg.fuse_bytes);
                fuse::issue_copies(m, stream, &fused, cfg.rs_max_ctas, &|| {
                    format!("rank {rank} device {ord}: batched copies on stream {s}")
                })?;
                copies = rest;
            }
        }
        if copies.is_empty() {
            return Ok(());
        }
        if s == MAIN {
            return Err(TideError::Internal(format!(
                "rank {rank}: {} large SM copies pending on tide's stream",
                copies.len()
            )));
        }
        let api_batch = cfg.copy_batch && driver::init().map(|v| v >= 13000).unwrap_or(false) && driver::batch_copy_supported();
        if !api_batch {
            let what = || format!("rank {rank} device {ord}: copy on stream {s}");
            for c in &copies {
                // SAFETY: addresses bounds-checked by `address`; ordering per the module header.
                unsafe { driver::memcpy_async(c.dst, c.src, c.bytes, stream, what)? };
            }
            return Ok(());
        }
        // One batch, a lone copy too, in pieces (`fuse::ce_pieces`): a large same-device piece
        // would run on SMs.
        let pieces = fuse::ce_pieces(&copies, cfg.ce_piece_bytes);
        let what = || {
            format!(
                "rank {rank} device {ord}: {} copies on stream {s} ({} pieces), {} bytes",
                copies.len(),
                pieces.len(),
                copies.iter().map(|c| c.bytes).sum::<usize>()
            )
        };
        // SAFETY: as above, for every piece of every copy of the batch.
        unsafe { driver::memcpy_batch_async(&pieces, stream, what) }
    }

    /// A 2-D copy (`Cmd::Copy2D`), after the 1-D copies pending on its stream (stream order), on
    /// the copy engines as TIDE_COPY2D says (`copy2d` module header): under `1` issued at once, one
    /// cuMemcpy2DAsync per piece of at most TIDE_CE_PIECE_BYTES; otherwise collected with the
    /// stream's other 2-D copies (`copy2d::Pending`: independent ones only) and issued before the
    /// stream's next other command (`flush_strided`). One onto itself moves nothing (as a `Copy`'s).
    /// Where the driver would refuse its pitches (above CU_DEVICE_ATTRIBUTE_MAX_PITCH: a block row
    /// of more than 2 GiB), its blocks go as 1-D copies instead, collected and batched as any other
    /// (logged once).
    fn copy_2d(&self, pending: &mut Pending, p: usize, cmd: &Cmd) -> Result<()> {
        let Cmd::Copy2D { stream: si, step, src, dst, bytes, blocks, src_pitch, dst_pitch } = *cmd else {
            return Err(TideError::Internal("copy_2d given another command".into()));
        };
        let sa = address_2d(self.infos, &src, bytes, blocks, src_pitch)?;
        let da = address_2d(self.infos, &dst, bytes, blocks, dst_pitch)?;
        if sa == da && (blocks == 1 || src_pitch == dst_pitch) {
            return Ok(());
        }
        let ord = self.call.device_ordinal;
        // One block: the pitches are never stepped over, the driver still wants them >= the width.
        let (sp, dp) = if blocks == 1 { (bytes, bytes) } else { (src_pitch, dst_pitch) };
        // (A failed query leaves the limit to the driver: the copy then fails naming itself.)
        let max = *self.max_pitch.get_or_init(|| driver::max_pitch(ord).unwrap_or(usize::MAX));
        if sp.max(dp) > max || sp.min(dp) < bytes {
            static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "tide: {}: a 2-D copy of {blocks} x {bytes} bytes has pitches {src_pitch} / {dst_pitch}, \
                     which cuMemcpy2DAsync refuses (the device's largest: {max}): its blocks go as 1-D \
                     copies (logged once)",
                    self.step_ctx(p, step, &src)
                );
            }
            return self.copy_blocks_1d(pending, si, p, step, (sa, src_pitch, src.rank), (da, dst_pitch, dst.rank), bytes, blocks);
        }
        self.flush_copies(si, &mut pending.copies)?;
        let dev = |r: usize| if self.peer_hints { self.infos[r].device } else { ord };
        let c = StridedCopy { dst: da, dst_pitch: dp, src: sa, src_pitch: sp, width: bytes, rows: blocks, dst_dev: dev(dst.rank), src_dev: dev(src.rank) };
        if !self.collects_2d() {
            return self.issue_2d(si, &[c], &|| {
                format!(
                    "{} -> {:?} of rank {}, {blocks} blocks of {bytes} bytes, pitches {src_pitch} / {dst_pitch}",
                    self.step_ctx(p, step, &src),
                    dst.kind,
                    dst.rank
                )
            });
        }
        match pending.strided.push(si, c) {
            Some(earlier) => self.issue_2d(si, &earlier, &|| self.pending_2d_ctx(si, earlier.len())),
            None => Ok(()),
        }
    }

    /// Whether 2-D copies are collected per stream (TIDE_COPY2D other than 1), not issued at once.
    fn collects_2d(&self) -> bool {
        !matches!(self.cfg.copy2d, Copy2d::PerPiece | Copy2d::Flat)
    }

    fn pending_2d_ctx(&self, s: usize, n: usize) -> String {
        let call = self.call;
        format!(
            "tide {} site {} rank {} device {}: {n} 2-D copies on stream {s} (TIDE_COPY2D={})",
            op_name(call.op),
            call.site,
            call.rank,
            call.device_ordinal,
            self.cfg.copy2d.name()
        )
    }

    /// Issues the 2-D copies pending on stream `s` (`copy_2d`), if any.
    fn flush_strided(&self, s: usize, pending: &mut copy2d::Pending) -> Result<()> {
        if pending.is_empty(s) {
            return Ok(());
        }
        let list = pending.take(s);
        self.issue_2d(s, &list, &|| self.pending_2d_ctx(s, list.len()))
    }

    /// Issues `copies` (pairwise independent, each range bounds-checked by `address_2d`) on stream
    /// `si` as `copy2d::issue_plan` says for TIDE_COPY2D: cuMemcpy2DAsync per piece or band, or
    /// cuMemcpy3DBatchAsync_v2 where the driver has it (else the unbatched form, logged once).
    fn issue_2d(&self, si: usize, copies: &[StridedCopy], what: &dyn Fn() -> String) -> Result<()> {
        let via = self.cfg.copy2d;
        let batch_ok = via.batched() && driver::batch_copy_3d_supported();
        if via.batched() && !batch_ok {
            static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "tide: TIDE_COPY2D={}: this CUDA driver has no cuMemcpy3DBatchAsync_v2 (CUDA 12.8+ drivers): \
                     2-D copies go as TIDE_COPY2D={} does, one cuMemcpy2DAsync each (logged once)",
                    via.name(),
                    if via.banded() { "bands" } else { "1" }
                );
            }
        }
        let s = self.res.stream(si)?;
        for op in copy2d::issue_plan(copies, via, self.cfg.copy2d_band_bytes, self.cfg.ce_piece_bytes, batch_ok) {
            match op {
                copy2d::Op2d::One(c) => {
                    // SAFETY: every row of both ends bounds-checked by `address_2d` against the
                    // buffers their ranks published (peer access enabled); the plan's 2-D copies
                    // read and write different buffers (Input -> Output / Stage); ordering per the
                    // module header.
                    unsafe {
                        driver::memcpy_2d_async(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width, c.rows, s, || {
                            format!("{}: {} rows of {} bytes at {:#x} <- {:#x}", what(), c.rows, c.width, c.dst, c.src)
                        })?
                    };
                }
                copy2d::Op2d::Batch(list) => {
                    // SAFETY: as above, for every copy; the copies are pairwise independent
                    // (`copy2d::joins`), so they may run in any order, as a batch's do.
                    unsafe { driver::memcpy_3d_batch_async(&list, s, what)? };
                }
            }
        }
        Ok(())
    }

    /// The blocks of a 2-D copy as 1-D copies on stream `si` (the fallback of `copy_2d`): collected
    /// into the stream's pending batch where copies are batched, else one cuMemcpyAsync each.
    /// `src` and `dst`: (address of block 0, pitch, rank), bounds-checked by the caller.
    #[allow(clippy::too_many_arguments)]
    fn copy_blocks_1d(
        &self,
        pending: &mut Pending,
        si: usize,
        p: usize,
        step: usize,
        src: (u64, usize, usize),
        dst: (u64, usize, usize),
        bytes: usize,
        blocks: usize,
    ) -> Result<()> {
        self.flush_strided(si, &mut pending.strided)?;
        let ord = self.call.device_ordinal;
        let dev = |r: usize| if self.peer_hints { self.infos[r].device } else { ord };
        let block = |j: usize| fuse::PendingCopy {
            dst: dst.0 + (j * dst.1) as u64,
            src: src.0 + (j * src.1) as u64,
            bytes,
            dst_dev: dev(dst.2),
            src_dev: dev(src.2),
        };
        if self.batching {
            for j in 0..blocks {
                let c = block(j);
                let list = pending
                    .copies
                    .get(si)
                    .ok_or_else(|| TideError::Internal(format!("stream {si} out of range")))?;
                if !fuse::copy_joins(list, &c) {
                    self.flush_copies(si, &mut pending.copies)?;
                }
                pending.copies[si].push(c);
            }
            return Ok(());
        }
        let s = self.res.stream(si)?;
        for j in 0..blocks {
            let c = block(j);
            // SAFETY: as `copy_2d`: each block bounds-checked by `address_2d`.
            unsafe {
                driver::memcpy_async(c.dst, c.src, bytes, s, || {
                    format!("rank {} device {ord}: phase {p} step {step}, block {j} of a 2-D copy", self.call.rank)
                })?
            };
        }
        Ok(())
    }

    /// A Reduce as one batched-sum segment, if it qualifies (TIDE_FUSE_BYTES): one launch's worth
    /// of sources (at most `kernels::MAX_SRCS` of one dtype), output smaller than TIDE_FUSE_BYTES,
    /// at most TIDE_RS_CTA_BYTES read and written.
    /// Ranges are bounds-checked here.
    fn sum_segment(&self, dst: &Region, srcs: &[Operand], elems: usize) -> Result<Option<fuse::SumSeg>> {
        // One CTA does a segment alone: it moves at most TIDE_RS_CTA_BYTES, as a CTA of a
        // launch does (issue #22), so it lives as briefly.
        let moved = elems.saturating_mul(4 + srcs.iter().map(|o| o.dtype.size_bytes()).sum::<usize>());
        let indexed = self.call.at.is_some()
            && (dst.kind == BufKind::Output || srcs.iter().any(|o| o.region.kind == BufKind::Output));
        if indexed
            || elems.saturating_mul(4) >= self.cfg.fuse_bytes
            || (self.cfg.rs_cta_bytes > 0 && moved > self.cfg.rs_cta_bytes)
            || srcs.is_empty()
            || srcs.len() > kernels::MAX_SRCS
            || srcs.iter().any(|o| o.dtype != srcs[0].dtype)
        {
            return Ok(None);
        }
        let dtype = srcs[0].dtype;
        kernels::sum_kernel(dtype)?;
        let da = address(self.infos, dst, elems * 4)?;
        let mut p = [0u64; kernels::MAX_SRCS];
        for (k, o) in srcs.iter().enumerate() {
            p[k] = address(self.infos, &o.region, elems * o.dtype.size_bytes())?;
        }
        let vectorized = kernels::sum_vectorized(da, &p[..srcs.len()]);
        Ok(Some(fuse::SumSeg {
            dtype,
            dst: da,
            srcs: p,
            nsrc: srcs.len(),
            elems: elems as u64,
            accumulate: false,
            mode: kernels::sum_mode(vectorized),
        }))
    }

    /// Issues one command of phase `p` on its stream.
    fn issue(&self, p: usize, cmd: &Cmd) -> Result<()> {
        let (rank, ord) = (self.call.rank, self.call.device_ordinal);
        let s = self.res.stream(cmd.stream())?;
        match cmd {
            Cmd::WaitRank { rank: q, event, .. } => {
                let point = match event {
                    RankEvent::Ready => Point::Ready,
                    RankEvent::Phase(ph) => Point::Phase(*ph),
                };
                self.infos[*q].wait(s, point, || format!("rank {rank} device {ord}: on rank {q}'s {event:?} event"))
            }
            Cmd::WaitOwnPrevDone { .. } => {
                let Some(done) = self.res.prev_done else {
                    return Ok(());
                };
                // SAFETY: our own event.
                unsafe {
                    driver::stream_wait_event(s, done, || {
                        format!("rank {rank} device {ord}: side stream on the previous done event")
                    })
                }
            }
            Cmd::Record { event, .. } => {
                let ev = self.res.local_event(*event)?;
                // SAFETY: valid event and stream.
                unsafe { driver::event_record(ev, s, || format!("rank {rank} device {ord}: local event {event}")) }
            }
            Cmd::Wait { event, .. } => {
                let ev = self.res.local_event(*event)?;
                // SAFETY: valid event and stream.
                unsafe { driver::stream_wait_event(s, ev, || format!("rank {rank} device {ord}: local event {event}")) }
            }
            Cmd::Copy { step, src, dst, bytes, via, .. } => self.copy(s, p, *step, src, dst, *bytes, *via),
            Cmd::Copy2D { .. } => Err(TideError::Internal("a 2-D copy goes through `copy_2d`".into())),
            Cmd::Zero { step, dst, bytes, .. } => {
                let da = address(self.infos, dst, *bytes)?;
                if let Some((at, count, stride)) = self.at_of(p, *step, dst)? {
                    return self.zero_at(s, p, *step, dst, da, *bytes, (at, count, stride));
                }
                // SAFETY: range bounds-checked; the buffer is this rank's output.
                unsafe {
                    driver::memset_zero_async(da, *bytes, s, || {
                        format!("{}, {bytes} bytes", self.step_ctx(p, *step, dst))
                    })
                }
            }
            Cmd::Reduce { step, dst, srcs, elems, .. } => self.reduce(s, p, *step, dst, srcs, *elems),
        }
    }

    /// A Copy step: on the copy engine (cuMemcpyAsync), or as a `tide_copy` launch on MAIN.
    #[allow(clippy::too_many_arguments)]
    fn copy(&self, s: CUstream, p: usize, step: usize, src: &Region, dst: &Region, bytes: usize, via: CopyVia) -> Result<()> {
        let sa = address(self.infos, src, bytes)?;
        let da = address(self.infos, dst, bytes)?;
        match via {
            CopyVia::CopyEngine => {
                // SAFETY: both ranges bounds-checked against the buffers their ranks published;
                // peer access enabled; ordering per the module header.
                unsafe {
                    driver::memcpy_async(da, sa, bytes, s, || {
                        format!("{} -> {:?} of rank {}, {bytes} bytes", self.step_ctx(p, step, src), dst.kind, dst.rank)
                    })
                }
            }
            CopyVia::Sm => {
                let m = self.res.module()?;
                let width = kernels::copy_width(da, sa);
                let grid = kernels::grid((bytes as u64).div_ceil(width as u64), self.cfg.rs_max_ctas);
                let (mut d, mut sp, mut n, mut w) = (da, sa, bytes as u64, width);
                let mut params: [*mut std::ffi::c_void; 4] = [
                    &mut d as *mut u64 as *mut _,
                    &mut sp as *mut u64 as *mut _,
                    &mut n as *mut u64 as *mut _,
                    &mut w as *mut i32 as *mut _,
                ];
                // SAFETY: params match tide_copy(void*, const void*, unsigned long long, int) and
                // live across the call (the driver copies them at launch); ranges bounds-checked.
                unsafe {
                    driver::launch_kernel(m.copy, grid, kernels::threads(), s, &mut params, "cuLaunchKernel(tide_copy)", || {
                        format!("{}, {bytes} bytes, grid {grid}", self.step_ctx(p, step, src))
                    })
                }
            }
        }
    }

    /// A Reduce step: one `rs_sum_*` launch per run of sources of one dtype (`kernels::sum_launches`),
    /// the first writing dst, the others accumulating.
    fn reduce(&self, s: CUstream, p: usize, step: usize, dst: &Region, srcs: &[Operand], elems: usize) -> Result<()> {
        let m = self.res.module()?;
        let da = address(self.infos, dst, elems * 4)?;
        let dtypes: Vec<_> = srcs.iter().map(|o| o.dtype).collect();
        // Into slices (`CallInfo::at`): dst and source 0 may be this rank's result, moved on the
        // device to the slice the index selects; any other source must not be a result.
        let dst_at = self.at_of(p, step, dst)?;
        let src0_at = match srcs.first() {
            Some(o) => self.at_of(p, step, &o.region)?,
            None => None,
        };
        for o in srcs.iter().skip(1) {
            if self.at_of(p, step, &o.region)?.is_some() {
                return Err(TideError::Internal(format!(
                    "{}: a sum reads a result of a reduce-scatter into slices past its first source",
                    self.step_ctx(p, step, &o.region)
                )));
            }
        }
        for l in kernels::sum_launches(&dtypes)? {
            let mut ptrs = kernels::SrcPtrs {
                p: [0; kernels::MAX_SRCS],
            };
            for k in 0..l.count {
                let o = &srcs[l.first + k];
                ptrs.p[k] = address(self.infos, &o.region, elems * o.dtype.size_bytes())?;
            }
            // Source 0 of this launch is the step's source 0 only in the first launch.
            let s0_at = if l.first == 0 { src0_at } else { None };
            let at = dst_at.or(s0_at);
            if let (Some(a), Some(b)) = (dst_at, s0_at) {
                if a != b {
                    return Err(TideError::Internal(format!(
                        "{}: a sum reads and writes results of different parameters of a reduce-scatter into slices",
                        self.step_ctx(p, step, dst)
                    )));
                }
            }
            // A slice stride that is not a multiple of 16 bytes would break the vectors' alignment.
            let vectorized = kernels::sum_vectorized(da, &ptrs.p[..l.count]) && at.is_none_or(|(_, _, stride)| stride % 16 == 0);
            let mode = kernels::sum_mode(vectorized);
            let grid = kernels::grid(kernels::sum_units(elems as u64, vectorized), self.cfg.rs_max_ctas);
            // The six parameters of rs_sum_*; an indexed sum (rs_sum_at_*) appends four.
            let (mut d, mut nsrc, mut n, mut acc, mut vec) = (da, l.count as i32, elems as u64, l.accumulate as i32, mode);
            let (at_ptr, count, stride) = at.unwrap_or((0, 0, 0));
            let mask = dst_at.is_some() as u32 | ((s0_at.is_some() as u32) << 1);
            let (mut ap, mut ac, mut st, mut mk) = (at_ptr, count, stride, mask);
            let mut params: [*mut std::ffi::c_void; 10] = [
                &mut d as *mut u64 as *mut _,
                &mut ptrs as *mut kernels::SrcPtrs as *mut _,
                &mut nsrc as *mut i32 as *mut _,
                &mut n as *mut u64 as *mut _,
                &mut acc as *mut i32 as *mut _,
                &mut vec as *mut i32 as *mut _,
                &mut ap as *mut u64 as *mut _,
                &mut ac as *mut u64 as *mut _,
                &mut st as *mut u64 as *mut _,
                &mut mk as *mut u32 as *mut _,
            ];
            let (f, used, kernel) = match at {
                Some(_) => (m.sum_at(l.dtype)?, 10, "cuLaunchKernel(rs_sum_at)"),
                None => (m.sum(l.dtype)?, 6, "cuLaunchKernel(rs_sum)"),
            };
            // SAFETY: the first `used` params match rs_sum_*(float*, TideSrcs, int, unsigned long
            // long, int, int) (TideSrcs = SrcPtrs, repr(C)), all ten rs_sum_at_*(..., const int*,
            // unsigned long long, unsigned long long, unsigned int); they live across the call. All
            // ranges bounds-checked (an indexed one against slice 0: the kernel moves it to the slice
            // clamp(index, 0, count - 1), inside the buffer of count slices); sources are local or
            // peer memory with access enabled.
            unsafe {
                driver::launch_kernel(f, grid, kernels::threads(), s, &mut params[..used], kernel, || {
                    let into = if at.is_some() { format!(" into a slice of {count}") } else { String::new() };
                    format!(
                        "{}, {} {} sources from {}, {elems} elements{into}, grid {grid}",
                        self.step_ctx(p, step, dst),
                        l.count,
                        l.dtype.name(),
                        l.first
                    )
                })?
            };
        }
        Ok(())
    }

    /// For a reduce-scatter into slices (`CallInfo::at`): (index address, slices, slice stride in
    /// bytes) when `r` is a result, which must be this rank's own; None otherwise.
    fn at_of(&self, p: usize, step: usize, r: &Region) -> Result<Option<(u64, u64, u64)>> {
        let Some(at) = self.call.at else {
            return Ok(None);
        };
        if r.kind != BufKind::Output {
            return Ok(None);
        }
        if r.rank != self.call.rank {
            return Err(TideError::Internal(format!(
                "{}: touches another rank's result of a reduce-scatter into slices",
                self.step_ctx(p, step, r)
            )));
        }
        let stride = self.prepared.plan.output_bytes(r.index) as u64;
        Ok(Some((at.index_ptr as u64, at.count as u64, stride)))
    }

    /// A Zero into a slice chosen on the device: `tide_zero_at` (padding rows: a few rows).
    #[allow(clippy::too_many_arguments)]
    fn zero_at(&self, s: CUstream, p: usize, step: usize, dst: &Region, da: u64, bytes: usize, at: (u64, u64, u64)) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let m = self.res.module()?;
        let grid = kernels::grid((bytes as u64).div_ceil(4), self.cfg.rs_max_ctas);
        let (mut d, mut n, mut ap, mut ac, mut st) = (da, bytes as u64, at.0, at.1, at.2);
        let mut params: [*mut std::ffi::c_void; 5] = [
            &mut d as *mut u64 as *mut _,
            &mut n as *mut u64 as *mut _,
            &mut ap as *mut u64 as *mut _,
            &mut ac as *mut u64 as *mut _,
            &mut st as *mut u64 as *mut _,
        ];
        // SAFETY: params match tide_zero_at(void*, unsigned long long, const int*, unsigned long
        // long, unsigned long long); range bounds-checked against slice 0, moved in the buffer.
        unsafe {
            driver::launch_kernel(m.zero_at, grid, kernels::threads(), s, &mut params, "cuLaunchKernel(tide_zero_at)", || {
                format!("{}, {bytes} bytes into a slice of {}", self.step_ctx(p, step, dst), at.1)
            })
        }
    }

    /// "phase 0 step 12, param 3 (name, shape) on rank 1" for error messages.
    fn step_ctx(&self, phase: usize, step: usize, r: &Region) -> String {
        let call = self.call;
        let param = match r.kind {
            BufKind::Input | BufKind::Output => self
                .prepared
                .layout
                .params
                .get(r.index)
                .map(|p| format!(", {}", p.describe()))
                .unwrap_or_default(),
            BufKind::Stage => format!(", stage slot {}", r.index),
        };
        format!(
            "tide {} site {} rank {} device {}: phase {phase} step {step}{param}, {:?} of rank {}",
            op_name(call.op),
            call.site,
            call.rank,
            call.device_ordinal,
            r.kind,
            r.rank
        )
    }
}

/// Best effort on the error path: `to` waits on everything enqueued so far on `from`.
fn record_wait(ev: Option<CUevent>, from: CUstream, to: CUstream) -> Result<()> {
    let ev = ev.ok_or_else(|| TideError::Internal("no event".into()))?;
    // SAFETY: valid handles; errors are ignored by the caller.
    unsafe {
        driver::event_record(ev, from, String::new)?;
        driver::stream_wait_event(to, ev, String::new)
    }
}

/// The device address of `len` bytes at `r`, bounds-checked against what its rank published.
pub(crate) fn address(infos: &[RankInfo], r: &Region, len: usize) -> Result<u64> {
    let info = infos.get(r.rank).ok_or_else(|| {
        TideError::Internal(format!("region {r:?} names a rank outside the group"))
    })?;
    let list = match r.kind {
        BufKind::Input => &info.inputs,
        BufKind::Output => &info.outputs,
        BufKind::Stage => &info.stages,
    };
    let (base, bytes) = *list.get(r.index).ok_or_else(|| {
        TideError::Internal(format!("region {r:?}: no such buffer on rank {}", r.rank))
    })?;
    match r.offset.checked_add(len) {
        Some(end) if end <= bytes => Ok(base + r.offset as u64),
        _ => Err(TideError::Internal(format!(
            "region {r:?} + {len} bytes is outside its buffer of {bytes} bytes on rank {}",
            r.rank
        ))),
    }
}

/// The device address of block 0 of `blocks` blocks of `bytes` bytes, `pitch` apart, at `r`: every
/// block bounds-checked against what its rank published (`address` of the span from block 0 to
/// the end of the last block).
pub(crate) fn address_2d(infos: &[RankInfo], r: &Region, bytes: usize, blocks: usize, pitch: usize) -> Result<u64> {
    let span = blocks
        .checked_sub(1)
        .and_then(|b| b.checked_mul(pitch))
        .and_then(|o| o.checked_add(bytes))
        .ok_or_else(|| TideError::Internal(format!("region {r:?}: {blocks} blocks of {bytes} bytes, pitch {pitch}: empty or overflowing")))?;
    address(infos, r, span)
}

/// The NVLink multicast all-gather (see the `multicast` module header): set up the (site, group)
/// buffer once, collectively; store this rank's shards to the multicast address on MAIN; "pushed"
/// event and barrier; fan out every rank's rows from the local backing to the outputs on side
/// stream 1; MAIN joins it. Only reachable with a `Granted` from every rank.
#[allow(clippy::too_many_arguments)]
fn issue_multicast(
    call: &CallInfo,
    dev: CUdevice,
    cc: (i32, i32),
    res: &Res,
    pushed: CUevent,
    prepared: &Prepared,
    infos: &[RankInfo],
    meeting: &dyn Meeting,
    g: multicast::Granted,
    cfg: &Config,
) -> Result<()> {
    let main = res.main;
    let ord = call.device_ordinal;
    let rank = call.rank;
    let mp = multicast::plan(&prepared.layout, rank);
    let shared = multicast::shared(call.site, call.group, mp.bytes);
    // Every rank reads `complete` after the same barrier, so all agree on whether to set up.
    meeting.barrier("multicast check")?;
    if !shared.complete() {
        if rank == 0 {
            shared.set_handle(multicast::create(g, call.world, mp.bytes, ord)?);
        }
        meeting.barrier("multicast created")?;
        let (handle, size) = shared.handle()?;
        multicast::add_device(g, handle, dev, ord)?;
        meeting.barrier("multicast devices added")?;
        shared.set_rank(rank, multicast::bind_and_map(g, handle, size, ord)?);
        meeting.barrier("multicast bound")?;
        if rank == 0 {
            shared.mark_complete();
        }
    }
    let mine = shared.rank(rank)?;
    let f = multicast::kernel(g, ord, cc)?;
    let me = &infos[rank];
    for s in &mp.stores {
        let (src, bytes) = me.inputs[s.param];
        if bytes < s.bytes || s.mc_offset + s.bytes > mine.size {
            return Err(TideError::Internal(format!(
                "multicast store of param {} out of bounds",
                s.param
            )));
        }
        multicast::launch_store(g, f, main, mine.mc + s.mc_offset as u64, src, s.bytes, cfg.rs_max_ctas)?;
    }
    // SAFETY: valid event and stream; context current.
    unsafe { driver::event_record(pushed, main, || format!("rank {rank} device {ord}: multicast pushed event"))? };
    meeting.barrier("multicast pushed")?;
    let side = res.stream(1)?;
    for (q, info) in infos.iter().enumerate() {
        // Rank q's pushed event (its phase 0 event), recorded before the barrier above.
        info.wait(side, Point::Phase(0), || format!("rank {rank} device {ord}: on rank {q}'s multicast pushed event"))?;
    }
    for fan in &mp.fanout {
        let (out, out_bytes) = me.outputs[fan.param];
        if fan.out_offset + fan.bytes > out_bytes || fan.backing_offset + fan.bytes > mine.size {
            return Err(TideError::Internal(format!(
                "multicast fan-out of param {} from rank {} out of bounds",
                fan.param, fan.src_rank
            )));
        }
        // SAFETY: ranges checked above; both on this device.
        unsafe {
            driver::memcpy_async(
                out + fan.out_offset as u64,
                mine.uc + fan.backing_offset as u64,
                fan.bytes,
                side,
                || format!("rank {rank} device {ord}: multicast fan-out"),
            )?
        };
    }
    let join = *res
        .pool
        .first()
        .ok_or_else(|| TideError::Internal("no local event".into()))?;
    // SAFETY: valid handles.
    unsafe {
        driver::event_record(join, side, || format!("rank {rank} device {ord}: multicast join"))?;
        driver::stream_wait_event(main, join, || format!("rank {rank} device {ord}: multicast join"))
    }
}
