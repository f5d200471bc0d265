//! One rank's part of a plan, scheduled onto CUDA streams: pure data, no CUDA, unit-tested here.
//!
//! Input: a `Plan` and the executing rank. Output: per phase, the exact list of commands the CUDA
//! engine issues, in host order: which stream each step (or piece of a step) goes on, and the event
//! records and waits that order them. The engine translates each command into one driver call or
//! kernel launch (`cuda::issue`), so everything about ordering is decided, and tested, here.
//!
//! Streams: index `MAIN` (0) is the call's main stream (tide's stream of the call's in-flight slot;
//! on the multi-process path XLA's stream or a slot's); `1..=copy_streams + 1` are tide's side
//! copy streams.
//! - Copy-engine copies with a peer end go on side streams `1..=copy_streams`. A maximal run of
//!   consecutive copy-engine copies of this executor (a *segment*: the all-gather's whole phase; one
//!   chunk of the reduce-scatter) has its peer copies split into contiguous pieces that balance
//!   bytes over those streams (least-loaded first; pieces of at least `min_piece_bytes`, split at
//!   multiples of `split_align` from the copy's start).
//! - Local copies under `LocalCopy::CopyEngine` (both ends on this rank) go, whole, on one more side
//!   stream, `copy_streams + 1`, so they overlap the peer copies rather than queue behind them;
//!   under `LocalCopy::CopyEnginePeers` they are balanced with the peer copies over streams
//!   `1..=copy_streams` (fewer copies at once).
//! - 2-D copies (`Action::CopyBlocks`: a strided parameter's rows landing in the gathered result, a
//!   strided slice staged into its slot; [Note: strided parameters] in `layout.rs`) stay 2-D
//!   (`Cmd::Copy2D`, issued as TIDE_COPY2D says: `cuda::copy2d`) and are always copy-engine copies:
//!   they join the segment and are balanced with the 1-D copies, split only between whole blocks.
//!   A local one goes on `copy_streams + 1` unless local copies join the peers' (under
//!   `LocalCopy::Sm` too: never the SM copy kernel). Plans flattened into 1-D copies
//!   (`Plan::flattened`, TIDE_COPY2D=0) schedule as before.
//! - Reduce, Zero and SM local copies go on MAIN (XLA's stream). A Reduce is split into *sum
//!   pieces* of at most `sum_piece_bytes` bytes read + written (one kernel launch each, whose CTAs
//!   then live a few microseconds: issue #22), at multiples of `SUM_PIECE_ALIGN` elements so every
//!   piece keeps the step's 16-byte alignment; each piece is its own unit on MAIN, so a copy into
//!   a stage slot waits only for the last piece that reads it.
//!
//! Ordering inside the rank (plan semantics: one executor's steps act in listed order wherever the
//! byte ranges they touch overlap with at least one write): step B depends on every earlier step A
//! whose accesses conflict with B's. When B goes on a stream other than A's, the engine records a
//! local event right after A's piece and B's stream waits on it: once per producer stream, on the
//! event after the latest piece B needs there (a sum of seven staged slices waits once per copy
//! stream, not seven times). Vector clocks per stream skip waits already implied (FIFO order on a
//! stream, or transitively through an earlier wait), so the reduce-scatter's slot reuse costs one
//! record and one wait per slot hand-over. An event then waited on by no one is not recorded, so
//! the copies on either side of it join one batch (`cuda::issue` forms a batch of a stream's
//! consecutive copies): a chunk's staged slices go as one batch per copy stream. Measured beside a
//! one-wave GEMM (bench/results/2026-12-05-1h200 runs 47-48): with 16 MiB staging slots, within
//! issue #22's bars and faster than one batch per slice with 32 MiB slots.
//!
//! Across ranks (see `cuda` module header for why these are enough): at its first command of phase 0 a
//! side stream waits on this rank's previous `done` event and on the `ready` event of every rank whose
//! buffers it touches (its own included); MAIN waits on the `ready` of every peer it touches. At its
//! first command of phase p > 0 every stream waits on the phase p-1 events of all ranks (MAIN: of the
//! peers). Every phase ends with MAIN waiting on each side stream used in it (a *join*).

use crate::config::LocalCopy;
use crate::error::{Result, TideError};
use crate::plan::{Action, BufKind, Operand, Plan, Region};
use std::collections::HashMap;

/// Stream index of XLA's stream; side copy streams are 1..=copy_streams + 1 (the last for local copies).
pub const MAIN: usize = 0;

/// An event published by some rank at the rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankEvent {
    /// Recorded on the rank's XLA stream before the call's rendezvous: its inputs are written and its
    /// outputs are free to be written.
    Ready,
    /// Recorded on the rank's XLA stream at the end of phase p, after it joined its side streams.
    Phase(usize),
}

/// How a copy is carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyVia {
    /// cuMemcpyAsync on a side stream.
    CopyEngine,
    /// The `tide_copy` kernel on MAIN.
    Sm,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cmd {
    /// `stream` waits on `rank`'s published `event` (cuStreamWaitEvent).
    WaitRank {
        stream: usize,
        rank: usize,
        event: RankEvent,
    },
    /// `stream` waits on this rank's `done` event of its previous call (tide's stage slots and side
    /// streams are reused across calls, possibly under different XLA streams).
    WaitOwnPrevDone { stream: usize },
    /// Record local event number `event` (unique within the call) on `stream`.
    Record { stream: usize, event: usize },
    /// `stream` waits on local event `event`, recorded earlier in this call.
    Wait { stream: usize, event: usize },
    /// Copy `bytes` bytes; `step` is the step's index in its phase (for error messages).
    Copy {
        stream: usize,
        step: usize,
        src: Region,
        dst: Region,
        bytes: usize,
        via: CopyVia,
    },
    /// A 2-D copy on a copy engine (an `Action::CopyBlocks`, or a range of its blocks): `blocks`
    /// pieces of `bytes` bytes, piece j from `src.offset + j * src_pitch` to `dst.offset + j *
    /// dst_pitch`.
    Copy2D {
        stream: usize,
        step: usize,
        src: Region,
        dst: Region,
        bytes: usize,
        blocks: usize,
        src_pitch: usize,
        dst_pitch: usize,
    },
    Zero {
        stream: usize,
        step: usize,
        dst: Region,
        bytes: usize,
    },
    Reduce {
        stream: usize,
        step: usize,
        dst: Region,
        srcs: Vec<Operand>,
        elems: usize,
    },
}

impl Cmd {
    pub fn stream(&self) -> usize {
        match self {
            Cmd::WaitRank { stream, .. }
            | Cmd::WaitOwnPrevDone { stream }
            | Cmd::Record { stream, .. }
            | Cmd::Wait { stream, .. }
            | Cmd::Copy { stream, .. }
            | Cmd::Copy2D { stream, .. }
            | Cmd::Zero { stream, .. }
            | Cmd::Reduce { stream, .. } => *stream,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseSchedule {
    pub name: String,
    pub cmds: Vec<Cmd>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub rank: usize,
    pub world: usize,
    pub phases: Vec<PhaseSchedule>,
    /// Side streams used (indices 1..=side_streams).
    pub side_streams: usize,
    /// Local events needed (ids 0..events).
    pub events: usize,
    /// Whether any command needs the NVRTC module (Reduce, SM copy).
    pub needs_kernels: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedOptions {
    pub copy_streams: usize,
    pub local_copy: LocalCopy,
    pub min_piece_bytes: usize,
    pub split_align: usize,
    /// Bytes (read + written) of one sum piece: one reduction launch (0: a Reduce is one launch).
    pub sum_piece_bytes: usize,
}

/// Sum pieces start at multiples of this many elements from their step's start (256 bytes of fp32
/// output, 128 of 2-byte sources): the 16-byte vector path stays aligned in every piece.
pub const SUM_PIECE_ALIGN: usize = 64;

impl SchedOptions {
    pub fn new(copy_streams: usize, local_copy: LocalCopy) -> SchedOptions {
        SchedOptions {
            copy_streams: copy_streams.max(1),
            local_copy,
            min_piece_bytes: 1 << 20,
            split_align: 4096,
            sum_piece_bytes: 0,
        }
    }

    /// The same options with reductions split into pieces of `bytes` (0: whole).
    pub fn with_sum_pieces(mut self, bytes: usize) -> SchedOptions {
        self.sum_piece_bytes = bytes;
        self
    }
}

/// How a Reduce of `elems` elements whose sources are `src_bytes` bytes per element in all (fp32
/// output: 4 more) is split into launches of at most `piece_bytes` bytes read + written: (first
/// element, elements) of each piece, in order, covering `0..elems` exactly once. Pieces are of
/// equal size rounded up to `SUM_PIECE_ALIGN` elements (the last one shorter), never smaller than
/// `SUM_PIECE_ALIGN` elements; `piece_bytes` 0 gives one piece.
pub fn sum_pieces(elems: usize, src_bytes: usize, piece_bytes: usize) -> Vec<(usize, usize)> {
    if elems == 0 {
        return Vec::new();
    }
    let per_elem = src_bytes.saturating_add(4);
    if piece_bytes == 0 {
        return vec![(0, elems)];
    }
    let cap = (piece_bytes / per_elem).max(SUM_PIECE_ALIGN);
    let count = elems.div_ceil(cap);
    let size = elems.div_ceil(count).div_ceil(SUM_PIECE_ALIGN) * SUM_PIECE_ALIGN;
    let mut out = Vec::with_capacity(count);
    let mut start = 0;
    while start < elems {
        let n = size.min(elems - start);
        out.push((start, n));
        start += n;
    }
    out
}

/// One byte range a step touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    pub rank: usize,
    pub kind: BufKind,
    pub index: usize,
    pub start: usize,
    pub end: usize,
    pub write: bool,
}

fn access(r: &Region, len: usize, write: bool) -> Result<Access> {
    let end = r
        .offset
        .checked_add(len)
        .ok_or_else(|| TideError::Internal(format!("plan region {r:?} + {len} bytes overflows")))?;
    Ok(Access {
        rank: r.rank,
        kind: r.kind,
        index: r.index,
        start: r.offset,
        end,
        write,
    })
}

/// The byte ranges an action reads and writes.
pub fn accesses(action: &Action) -> Result<Vec<Access>> {
    Ok(match action {
        Action::Copy { src, dst, bytes } => {
            vec![access(src, *bytes, false)?, access(dst, *bytes, true)?]
        }
        Action::Zero { dst, bytes } => vec![access(dst, *bytes, true)?],
        Action::CopyBlocks { .. } => {
            let mut v = Vec::new();
            for (r, n) in action.reads() {
                v.push(access(&r, n, false)?);
            }
            for (r, n) in action.writes() {
                v.push(access(&r, n, true)?);
            }
            v
        }
        Action::Reduce { dst, srcs, elems } => {
            let mut v = Vec::with_capacity(srcs.len() + 1);
            for s in srcs {
                let len = elems.checked_mul(s.dtype.size_bytes()).ok_or_else(|| {
                    TideError::Internal(format!("reduce of {elems} elements overflows"))
                })?;
                v.push(access(&s.region, len, false)?);
            }
            let len = elems.checked_mul(4).ok_or_else(|| {
                TideError::Internal(format!("reduce of {elems} elements overflows"))
            })?;
            v.push(access(dst, len, true)?);
            v
        }
    })
}

/// For each step (in order), the earlier steps it must wait for, sorted: those with a conflicting
/// access (overlapping bytes of one buffer, at least one of the two a write; an empty access
/// touches no byte, so it conflicts with nothing). One sweep
/// per buffer over its accesses in order of their start, so the cost is the overlapping pairs,
/// not all pairs: a 2-D copy lists thousands of pieces, and one rank's schedule of a layer of four
/// Llama-3-8B matrices sharded along dim 1 at world 8 took 10 s to build comparing every pair
/// (12 s flattened), 0.07-0.15 s in one sweep (this CPU machine).
pub fn dependencies(steps: &[Vec<Access>]) -> Vec<Vec<usize>> {
    // Per buffer: (start, end, write, step) of every non-empty access.
    type Touch = (usize, usize, bool, usize);
    let mut by_buf: HashMap<(usize, BufKind, usize), Vec<Touch>> = HashMap::new();
    for (k, acc) in steps.iter().enumerate() {
        for a in acc.iter().filter(|a| a.start < a.end) {
            by_buf.entry((a.rank, a.kind, a.index)).or_default().push((a.start, a.end, a.write, k));
        }
    }
    let mut deps: Vec<Vec<usize>> = vec![Vec::new(); steps.len()];
    for list in by_buf.values_mut() {
        list.sort_unstable();
        // The accesses started so far that have not ended: each overlaps the next one taken.
        let mut open: Vec<(usize, bool, usize)> = Vec::new();
        for &(start, end, write, k) in list.iter() {
            open.retain(|&(e, _, _)| e > start);
            for &(_, w, j) in &open {
                if (write || w) && j != k {
                    deps[k.max(j)].push(k.min(j));
                }
            }
            open.push((end, write, k));
        }
    }
    for d in &mut deps {
        d.sort_unstable();
        d.dedup();
    }
    deps
}

/// A contiguous piece of item `item` (bytes `offset..offset+bytes`) assigned to side stream `stream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub item: usize,
    pub stream: usize,
    pub offset: usize,
    pub bytes: usize,
}

/// Splits a segment of copies (`sizes`, in order) into contiguous pieces balanced by bytes over the
/// side streams `1..=loads.len()`, least-loaded streams first; `loads` (bytes per side stream so far)
/// is updated. Uses `min(streams, total / min_piece)` streams (at least one); split points are
/// multiples of `align` from each copy's start.
pub fn balance(sizes: &[usize], loads: &mut [usize], min_piece: usize, align: usize) -> Vec<Piece> {
    balance_units(sizes, &vec![align; sizes.len()], loads, min_piece)
}

/// `balance` with a split unit per copy: copy k is split only at multiples of `units[k]` bytes
/// from its start (a 2-D copy: between whole blocks).
pub fn balance_units(sizes: &[usize], units: &[usize], loads: &mut [usize], min_piece: usize) -> Vec<Piece> {
    let total: usize = sizes.iter().sum();
    let mut out = Vec::new();
    if total == 0 || loads.is_empty() {
        return out;
    }
    let n_eff = (total / min_piece.max(1)).clamp(1, loads.len());
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by_key(|&s| (loads[s], s));
    order.truncate(n_eff);
    let target = total.div_ceil(n_eff);
    let (mut si, mut filled) = (0usize, 0usize);
    for (item, &size) in sizes.iter().enumerate() {
        let align = units.get(item).copied().unwrap_or(1).max(1);
        let mut off = 0;
        while off < size {
            let remaining = size - off;
            let last = si + 1 >= n_eff;
            let room = if last {
                remaining
            } else {
                target.saturating_sub(filled)
            };
            let mut take = remaining.min(room);
            if take < remaining {
                take = take / align * align;
            }
            if take == 0 {
                si += 1;
                filled = 0;
                continue;
            }
            let s = order[si.min(n_eff - 1)];
            out.push(Piece {
                item,
                stream: s + 1,
                offset: off,
                bytes: take,
            });
            loads[s] += take;
            filled += take;
            off += take;
            if !last && filled >= target {
                si += 1;
                filled = 0;
            }
        }
    }
    out
}

struct Unit {
    /// Index of the step in its phase.
    step: usize,
    stream: usize,
    cmd: Cmd,
}

/// Builds rank `rank`'s schedule of `plan`: per phase, this rank's steps (`my_steps`) become
/// units on streams (`assign_streams`), ordered by their dependencies and emitted in host order
/// with the waits and events stream order needs (`Emitter`), then MAIN joins the side streams.
pub fn build(plan: &Plan, rank: usize, opts: &SchedOptions) -> Result<Schedule> {
    let world = plan.topology.world();
    if rank >= world {
        return Err(TideError::Internal(format!(
            "rank {rank} outside world {world}"
        )));
    }
    // Side streams 1..=copy_streams carry peer copies; one more, `local_stream`, carries the
    // copy-engine copies whose both ends are this rank's (the all-gather's own shard): on a stream
    // of its own, the HBM-bound local copy runs concurrently with the NVLink-bound peer copies
    // instead of queueing behind them on the same streams.
    let peer_streams = opts.copy_streams.max(1);
    let mut streams = Streams {
        local_stream: peer_streams + 1,
        nstreams: 1 + peer_streams + 1,
        // Bytes per peer stream so far (balanced by bytes).
        loads_peer: vec![0usize; peer_streams],
        loads_local: vec![0usize; 1],
    };
    let mut phases = Vec::with_capacity(plan.phases.len());
    let mut next_event = 0usize;
    let mut side_used_any = 0usize;
    let mut needs_kernels = false;

    for (p, phase) in plan.phases.iter().enumerate() {
        let mine = my_steps(phase, p, rank, world)?;
        let (units, step_units, kernels) = assign_streams(&mine, rank, opts, &mut streams);
        needs_kernels |= kernels;

        // Dependencies between this executor's steps.
        let acc: Vec<Vec<Access>> = mine
            .iter()
            .map(|(_, a)| accesses(a))
            .collect::<Result<_>>()?;
        let deps = dependencies(&acc);
        let touched = touched_ranks(&units, streams.nstreams);
        let needs_record = needs_record(&units, &step_units, &deps);

        // Emission in host order with vector clocks.
        let mut em = Emitter::new(streams.nstreams, units.len(), next_event);
        for (mi, unit_ids) in step_units.iter().enumerate() {
            for &u in unit_ids {
                let s = units[u].stream;
                if !em.used[s] {
                    em.used[s] = true;
                    em.first_waits(s, p, rank, world, &touched[s]);
                }
                em.dependency_waits(s, p, u, &deps[mi], &units, &step_units)?;
                em.push_unit(s, u, &units[u].cmd, needs_record[u]);
            }
        }
        side_used_any = side_used_any.max(em.join_side_streams());
        next_event = em.next_event;
        phases.push(PhaseSchedule {
            name: phase.name.clone(),
            cmds: em.cmds,
        });
    }
    drop_unwaited_records(&mut phases);
    Ok(Schedule {
        rank,
        world,
        phases,
        side_streams: side_used_any,
        events: next_event,
        needs_kernels,
    })
}

/// Drops the records of events no command waits on (a sum of seven staged slices once waited
/// seven times): no driver call, and the copies on either side join one batch.
fn drop_unwaited_records(phases: &mut [PhaseSchedule]) {
    let waited: std::collections::HashSet<usize> = phases
        .iter()
        .flat_map(|ph| ph.cmds.iter())
        .filter_map(|c| match c {
            Cmd::Wait { event, .. } => Some(*event),
            _ => None,
        })
        .collect();
    for ph in phases.iter_mut() {
        ph.cmds.retain(|c| !matches!(c, Cmd::Record { event, .. } if !waited.contains(event)));
    }
}

/// The streams of a schedule and how many bytes each carries so far.
struct Streams {
    local_stream: usize,
    nstreams: usize,
    loads_peer: Vec<usize>,
    loads_local: Vec<usize>,
}

/// Phase `p`'s non-empty steps executed by `rank`, validated (ranks in the world, reductions with
/// sources), as (index in the phase, action).
fn my_steps(phase: &crate::plan::Phase, p: usize, rank: usize, world: usize) -> Result<Vec<(usize, &Action)>> {
    let mut mine: Vec<(usize, &Action)> = Vec::new();
    for (k, step) in phase.steps.iter().enumerate() {
        if step.executor != rank {
            continue;
        }
        let empty = match &step.action {
            Action::Copy { bytes, .. } | Action::Zero { bytes, .. } => *bytes == 0,
            Action::CopyBlocks { bytes, blocks, .. } => *bytes == 0 || *blocks == 0,
            Action::Reduce { elems, srcs, .. } => {
                if srcs.is_empty() && *elems > 0 {
                    return Err(TideError::Internal(format!(
                        "rank {rank}: phase {p} step {k}: reduce without sources"
                    )));
                }
                *elems == 0
            }
        };
        if empty {
            continue;
        }
        for a in accesses(&step.action)? {
            if a.rank >= world {
                return Err(TideError::Internal(format!(
                    "phase {p} step {k} names rank {} outside world {world}",
                    a.rank
                )));
            }
        }
        mine.push((k, &step.action));
    }
    Ok(mine)
}

/// Stream assignment: units (whole steps or copy pieces), grouped per step (`step_units[i]`: the
/// units of `mine[i]`), and whether any unit needs the kernel module. Runs of copy-engine copies
/// are split and balanced by bytes over the peer streams (local copies on `local_stream`); every
/// other step is one unit on MAIN.
fn assign_streams(mine: &[(usize, &Action)], rank: usize, opts: &SchedOptions, streams: &mut Streams) -> (Vec<Unit>, Vec<Vec<usize>>, bool) {
    let mut units: Vec<Unit> = Vec::new();
    let mut step_units: Vec<Vec<usize>> = vec![Vec::new(); mine.len()];
    let mut needs_kernels = false;
    let mut i = 0;
    while i < mine.len() {
        let is_ce_copy = |a: &Action| match a {
            Action::Copy { src, dst, .. } => {
                src.rank != rank || dst.rank != rank || opts.local_copy != LocalCopy::Sm
            }
            Action::CopyBlocks { .. } => true,
            _ => false,
        };
        if is_ce_copy(mine[i].1) {
            let mut j = i;
            while j < mine.len() && is_ce_copy(mine[j].1) {
                j += 1;
            }
            for piece in copy_pieces(&mine[i..j], rank, opts, streams) {
                let mi = i + piece.item;
                let (k, a) = mine[mi];
                let cmd = match a {
                    Action::Copy { src, dst, .. } => Cmd::Copy {
                        stream: piece.stream,
                        step: k,
                        src: Region { offset: src.offset + piece.offset, ..*src },
                        dst: Region { offset: dst.offset + piece.offset, ..*dst },
                        bytes: piece.bytes,
                        via: CopyVia::CopyEngine,
                    },
                    // A range of whole blocks (`copy_pieces` splits only between blocks).
                    Action::CopyBlocks { src, dst, bytes, src_pitch, dst_pitch, .. } => {
                        let first = piece.offset / bytes;
                        Cmd::Copy2D {
                            stream: piece.stream,
                            step: k,
                            src: Region { offset: src.offset + first * src_pitch, ..*src },
                            dst: Region { offset: dst.offset + first * dst_pitch, ..*dst },
                            bytes: *bytes,
                            blocks: piece.bytes / bytes,
                            src_pitch: *src_pitch,
                            dst_pitch: *dst_pitch,
                        }
                    }
                    _ => continue,
                };
                step_units[mi].push(units.len());
                units.push(Unit {
                    step: k,
                    stream: piece.stream,
                    cmd,
                });
            }
            i = j;
        } else if let (k, Action::Reduce { dst, srcs, elems }) = mine[i] {
            let src_bytes: usize = srcs.iter().map(|o| o.dtype.size_bytes()).sum();
            for (first, n) in sum_pieces(*elems, src_bytes, opts.sum_piece_bytes) {
                let mut d = *dst;
                d.offset += first * 4;
                let piece_srcs: Vec<Operand> = srcs
                    .iter()
                    .map(|o| {
                        let mut o = *o;
                        o.region.offset += first * o.dtype.size_bytes();
                        o
                    })
                    .collect();
                step_units[i].push(units.len());
                units.push(Unit {
                    step: k,
                    stream: MAIN,
                    cmd: Cmd::Reduce {
                        stream: MAIN,
                        step: k,
                        dst: d,
                        srcs: piece_srcs,
                        elems: n,
                    },
                });
            }
            needs_kernels = true;
            i += 1;
        } else {
            let (k, a) = mine[i];
            let cmd = match a {
                Action::Copy { src, dst, bytes } => Cmd::Copy {
                    stream: MAIN,
                    step: k,
                    src: *src,
                    dst: *dst,
                    bytes: *bytes,
                    via: CopyVia::Sm,
                },
                Action::Zero { dst, bytes } => Cmd::Zero {
                    stream: MAIN,
                    step: k,
                    dst: *dst,
                    bytes: *bytes,
                },
                Action::Reduce { .. } | Action::CopyBlocks { .. } => {
                    unreachable!("Reduce steps are split into sum pieces above, 2-D copies are copy-engine copies")
                }
            };
            if matches!(cmd, Cmd::Copy { .. }) {
                needs_kernels = true;
            }
            step_units[i].push(units.len());
            units.push(Unit {
                step: k,
                stream: MAIN,
                cmd,
            });
            i += 1;
        }
    }
    (units, step_units, needs_kernels)
}

/// The pieces of a run of copy-engine copies (`segment`): peer copies and local copies balanced
/// separately (`balance_units`), local ones on `local_stream`; under `LocalCopy::CopyEnginePeers`
/// all of them together over the peer streams. A 2-D copy is split only between whole blocks (its
/// pieces' offsets and sizes count the bytes it moves, `bytes` per block). `item` is the index in
/// the segment.
fn copy_pieces(segment: &[(usize, &Action)], rank: usize, opts: &SchedOptions, streams: &mut Streams) -> Vec<Piece> {
    let mut pieces = Vec::new();
    // Whether copy m goes on the local stream: a local copy, unless local copies join the peers'
    // (a local 2-D copy under `LocalCopy::Sm` too: it is a copy-engine copy all the same).
    let on_local_stream = |m: usize| match segment[m].1 {
        Action::Copy { src, dst, .. } => opts.local_copy == LocalCopy::CopyEngine && src.rank == rank && dst.rank == rank,
        Action::CopyBlocks { src, dst, .. } => {
            opts.local_copy != LocalCopy::CopyEnginePeers && src.rank == rank && dst.rank == rank
        }
        _ => false,
    };
    // (bytes moved, split unit) of copy m.
    let size_unit = |m: usize| match segment[m].1 {
        Action::Copy { bytes, .. } => Some((*bytes, opts.split_align)),
        Action::CopyBlocks { bytes, blocks, .. } => Some((bytes * blocks, *bytes)),
        _ => None,
    };
    for local in [false, true] {
        let members: Vec<usize> = (0..segment.len())
            .filter(|&m| size_unit(m).is_some() && on_local_stream(m) == local)
            .collect();
        let (sizes, units): (Vec<usize>, Vec<usize>) = members.iter().filter_map(|&m| size_unit(m)).unzip();
        let loads = if local {
            &mut streams.loads_local
        } else {
            &mut streams.loads_peer
        };
        for mut piece in balance_units(&sizes, &units, loads, opts.min_piece_bytes) {
            piece.item = members[piece.item];
            if local {
                piece.stream = streams.local_stream;
            }
            pieces.push(piece);
        }
    }
    pieces
}

/// The ranks whose memory each stream touches (sorted).
fn touched_ranks(units: &[Unit], nstreams: usize) -> Vec<Vec<usize>> {
    let mut touched: Vec<Vec<usize>> = vec![Vec::new(); nstreams];
    for u in units {
        let ranks: Vec<usize> = match &u.cmd {
            Cmd::Copy { src, dst, .. } | Cmd::Copy2D { src, dst, .. } => vec![src.rank, dst.rank],
            Cmd::Zero { dst, .. } => vec![dst.rank],
            Cmd::Reduce { dst, srcs, .. } => {
                let mut v: Vec<usize> = srcs.iter().map(|s| s.region.rank).collect();
                v.push(dst.rank);
                v
            }
            _ => vec![],
        };
        for r in ranks {
            if !touched[u.stream].contains(&r) {
                touched[u.stream].push(r);
            }
        }
    }
    for t in &mut touched {
        t.sort_unstable();
    }
    touched
}

/// Units that need an event recorded after them: for each step another stream depends on, the
/// last of its units on each of its streams (a stream's units complete in order, so waiting on
/// the last covers the others: `Emitter::dependency_waits` waits on the latest per stream; the
/// events it then does not wait on are dropped, `drop_unwaited_records`).
fn needs_record(units: &[Unit], step_units: &[Vec<usize>], deps: &[Vec<usize>]) -> Vec<bool> {
    let mut needs_record = vec![false; units.len()];
    for (mi, d) in deps.iter().enumerate() {
        for &dep in d {
            for &du in &step_units[dep] {
                let ds = units[du].stream;
                let last_on_stream = !step_units[dep].iter().any(|&o| o > du && units[o].stream == ds);
                if last_on_stream && step_units[mi].iter().any(|&u| units[u].stream != ds) {
                    needs_record[du] = true;
                }
            }
        }
    }
    needs_record
}

/// One phase's emission in host order: the commands, a vector clock per stream (`clock[s][x]`:
/// how many units of stream x stream s is ordered after), each unit's position on its stream, and
/// the events recorded after units (with the recording stream's clock then).
struct Emitter {
    cmds: Vec<Cmd>,
    clock: Vec<Vec<usize>>,
    used: Vec<bool>,
    pos: Vec<usize>,
    event_of: HashMap<usize, (usize, Vec<usize>)>,
    next_event: usize,
    nstreams: usize,
}

impl Emitter {
    fn new(nstreams: usize, nunits: usize, next_event: usize) -> Emitter {
        Emitter {
            cmds: Vec::new(),
            clock: vec![vec![0; nstreams]; nstreams],
            used: vec![false; nstreams],
            pos: vec![0; nunits],
            event_of: HashMap::new(),
            next_event,
            nstreams,
        }
    }

    /// Stream `s`'s waits before its first command of phase `p` (rules 3 and 4 of the `cuda`
    /// module header): phase 0, the `ready` of every rank it touches; later phases, every rank's
    /// previous phase event.
    fn first_waits(&mut self, s: usize, p: usize, rank: usize, world: usize, touched: &[usize]) {
        if p == 0 {
            // A side stream that waits on this rank's own `ready` needs no wait on its
            // previous `done`: MAIN waited on that `done` before recording `ready`
            // (module header, rule 1). Pull plans always write the executor's memory,
            // so this only keeps the wait for a stream that touches peers alone.
            if s != MAIN && !touched.contains(&rank) {
                self.cmds.push(Cmd::WaitOwnPrevDone { stream: s });
            }
            for &r in touched {
                if s != MAIN || r != rank {
                    self.cmds.push(Cmd::WaitRank {
                        stream: s,
                        rank: r,
                        event: RankEvent::Ready,
                    });
                }
            }
        } else {
            for r in 0..world {
                if s != MAIN || r != rank {
                    self.cmds.push(Cmd::WaitRank {
                        stream: s,
                        rank: r,
                        event: RankEvent::Phase(p - 1),
                    });
                }
            }
        }
    }

    #[allow(clippy::needless_range_loop)] // x indexes two clocks
    /// Waits of unit `u` (on stream `s`) on the units of its step's dependencies `deps` that are on
    /// other streams and not yet ordered before it: per other stream one wait, on the event after
    /// the latest of those units there (a stream's units complete in order, so it orders the
    /// earlier ones: a sum of seven staged slices waits once on their copy stream, not seven
    /// times).
    fn dependency_waits(&mut self, s: usize, p: usize, u: usize, deps: &[usize], units: &[Unit], step_units: &[Vec<usize>]) -> Result<()> {
        let mut latest: Vec<Option<usize>> = vec![None; self.nstreams];
        for &dep in deps {
            for &du in &step_units[dep] {
                let ds = units[du].stream;
                if ds != s && latest[ds].is_none_or(|l| self.pos[du] > self.pos[l]) {
                    latest[ds] = Some(du);
                }
            }
        }
        for du in latest.into_iter().flatten() {
            let ds = units[du].stream;
            if self.clock[s][ds] >= self.pos[du] {
                continue;
            }
            let (ev, evclock) = self.event_of.get(&du).ok_or_else(|| {
                TideError::Internal(format!(
                    "schedule: no event after unit {du} (phase {p} step {}) needed by step {}",
                    units[du].step, units[u].step
                ))
            })?;
            self.cmds.push(Cmd::Wait {
                stream: s,
                event: *ev,
            });
            for x in 0..self.nstreams {
                self.clock[s][x] = self.clock[s][x].max(evclock[x]);
            }
        }
        Ok(())
    }

    /// Unit `u`'s command on stream `s`, then its event if a unit on another stream depends on it.
    fn push_unit(&mut self, s: usize, u: usize, cmd: &Cmd, record: bool) {
        self.cmds.push(cmd.clone());
        self.clock[s][s] += 1;
        self.pos[u] = self.clock[s][s];
        if record {
            let ev = self.next_event;
            self.next_event += 1;
            self.cmds.push(Cmd::Record {
                stream: s,
                event: ev,
            });
            self.event_of.insert(u, (ev, self.clock[s].clone()));
        }
    }

    #[allow(clippy::needless_range_loop)] // x indexes two clocks
    /// Join: MAIN waits on every side stream used in this phase. Returns the highest side stream
    /// used (0: none).
    fn join_side_streams(&mut self) -> usize {
        let mut side_used = 0;
        for s in 1..self.nstreams {
            if self.used[s] {
                side_used = side_used.max(s);
                if self.clock[MAIN][s] < self.clock[s][s] {
                    let ev = self.next_event;
                    self.next_event += 1;
                    self.cmds.push(Cmd::Record {
                        stream: s,
                        event: ev,
                    });
                    self.cmds.push(Cmd::Wait {
                        stream: MAIN,
                        event: ev,
                    });
                    let c = self.clock[s].clone();
                    for x in 0..self.nstreams {
                        self.clock[MAIN][x] = self.clock[MAIN][x].max(c[x]);
                    }
                }
            }
        }
        side_used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, GroupLayout, ParamSpec};
    use crate::plan::{Op, Phase, Step};
    use crate::topology::Topology;
    use std::collections::HashMap as Map;

    fn region(rank: usize, kind: BufKind, index: usize, offset: usize) -> Region {
        Region {
            rank,
            kind,
            index,
            offset,
        }
    }

    fn dummy_layout(world: usize) -> GroupLayout {
        GroupLayout::new(
            &[ParamSpec::new("w", &[world.max(1) * 4], DType::BF16)],
            world,
        )
        .unwrap()
    }

    /// A direct all-gather over `world` ranks of params with the given shard bytes; each rank pulls
    /// every rank's shard (its own included) into its output at `q * shard`.
    fn ag_plan(world: usize, shards: &[usize]) -> Plan {
        let mut steps = Vec::new();
        for r in 0..world {
            for (i, &sb) in shards.iter().enumerate() {
                for q in 0..world {
                    steps.push(Step {
                        executor: r,
                        action: Action::Copy {
                            src: region(q, BufKind::Input, i, 0),
                            dst: region(r, BufKind::Output, i, q * sb),
                            bytes: sb,
                        },
                    });
                }
            }
        }
        Plan {
            op: Op::AllGather,
            topology: Topology::single_node(world),
            layout: dummy_layout(world),
            phases: vec![Phase {
                name: "gather".into(),
                steps,
            }],
            stage_slot_bytes: vec![],
        }
    }

    /// A chunked bf16 -> f32 reduce-scatter: param i has `world * owned[i]` elements; rank r owns
    /// elements [r*owned, (r+1)*owned). Chunks of `chunk` elements; peers' slices are staged into
    /// slot c % slots (peer q at piece index q - (q > r)), then reduced in rank order. `lookahead`
    /// lists chunk c+1's copies before chunk c's reduce when the slot is free. Zero steps write
    /// `pad` f32 padding elements after each owned range.
    fn rs_plan(
        world: usize,
        owned: &[usize],
        chunk: usize,
        slots: usize,
        lookahead: bool,
        pad: usize,
    ) -> Plan {
        let slot_bytes = (world - 1).max(1) * chunk * 2;
        let mut steps = Vec::new();
        for r in 0..world {
            // All (param, chunk) units of this rank in order.
            let mut units = Vec::new();
            for (i, &n) in owned.iter().enumerate() {
                let mut c0 = 0;
                while c0 < n {
                    units.push((i, c0, chunk.min(n - c0)));
                    c0 += chunk;
                }
            }
            let copies = |u: usize, steps: &mut Vec<Step>| {
                let (i, c0, len) = units[u];
                let slot = u % slots;
                for q in (0..world).filter(|&q| q != r) {
                    let piece = q - usize::from(q > r);
                    steps.push(Step {
                        executor: r,
                        action: Action::Copy {
                            src: region(q, BufKind::Input, i, (r * owned[i] + c0) * 2),
                            dst: region(r, BufKind::Stage, slot, piece * chunk * 2),
                            bytes: len * 2,
                        },
                    });
                }
            };
            let reduce = |u: usize, steps: &mut Vec<Step>| {
                let (i, c0, len) = units[u];
                let slot = u % slots;
                let srcs = (0..world)
                    .map(|q| {
                        let region = if q == r {
                            region(r, BufKind::Input, i, (r * owned[i] + c0) * 2)
                        } else {
                            let piece = q - usize::from(q > r);
                            region(r, BufKind::Stage, slot, piece * chunk * 2)
                        };
                        Operand {
                            region,
                            dtype: DType::BF16,
                        }
                    })
                    .collect();
                steps.push(Step {
                    executor: r,
                    action: Action::Reduce {
                        dst: region(r, BufKind::Output, i, c0 * 4),
                        srcs,
                        elems: len,
                    },
                });
            };
            if lookahead && slots >= 2 {
                if !units.is_empty() {
                    copies(0, &mut steps);
                }
                for u in 0..units.len() {
                    if u + 1 < units.len() {
                        copies(u + 1, &mut steps);
                    }
                    reduce(u, &mut steps);
                }
            } else {
                for u in 0..units.len() {
                    copies(u, &mut steps);
                    reduce(u, &mut steps);
                }
            }
            if pad > 0 {
                for (i, &n) in owned.iter().enumerate() {
                    steps.push(Step {
                        executor: r,
                        action: Action::Zero {
                            dst: region(r, BufKind::Output, i, n * 4),
                            bytes: pad * 4,
                        },
                    });
                }
            }
        }
        Plan {
            op: Op::ReduceScatter,
            topology: Topology::single_node(world),
            layout: dummy_layout(world),
            phases: vec![Phase {
                name: "reduce".into(),
                steps,
            }],
            stage_slot_bytes: vec![slot_bytes; slots],
        }
    }

    type Mem = Map<(usize, BufKind, usize), Vec<u8>>;

    fn bf16_f32(b: &[u8]) -> f32 {
        f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
    }

    fn apply(mem: &mut Mem, action_src: &Action) {
        match action_src {
            Action::Copy { src, dst, bytes } => {
                let data =
                    mem[&(src.rank, src.kind, src.index)][src.offset..src.offset + bytes].to_vec();
                mem.get_mut(&(dst.rank, dst.kind, dst.index)).unwrap()
                    [dst.offset..dst.offset + bytes]
                    .copy_from_slice(&data);
            }
            Action::CopyBlocks { .. } => {
                for (src, dst) in action_src.reads().into_iter().zip(action_src.writes()) {
                    apply(mem, &Action::Copy { src: src.0, dst: dst.0, bytes: src.1 });
                }
            }
            Action::Zero { dst, bytes } => {
                mem.get_mut(&(dst.rank, dst.kind, dst.index)).unwrap()
                    [dst.offset..dst.offset + bytes]
                    .fill(0);
            }
            Action::Reduce { dst, srcs, elems } => {
                let mut out = Vec::with_capacity(elems * 4);
                for e in 0..*elems {
                    let mut acc = 0f32;
                    for (k, s) in srcs.iter().enumerate() {
                        let b = &mem[&(s.region.rank, s.region.kind, s.region.index)];
                        let at = s.region.offset + s.dtype.size_bytes() * e;
                        let x = match s.dtype {
                            DType::BF16 => bf16_f32(&b[at..]),
                            DType::F16 => crate::engine::cpu::f16_to_f32(u16::from_le_bytes([
                                b[at],
                                b[at + 1],
                            ])),
                            DType::F32 => {
                                f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
                            }
                            other => panic!("reduce of {other:?}"),
                        };
                        acc = if k == 0 { x } else { acc + x };
                    }
                    out.extend_from_slice(&acc.to_le_bytes());
                }
                mem.get_mut(&(dst.rank, dst.kind, dst.index)).unwrap()
                    [dst.offset..dst.offset + out.len()]
                    .copy_from_slice(&out);
            }
        }
    }

    fn cmd_action(c: &Cmd) -> Option<Action> {
        match c {
            Cmd::Copy {
                src, dst, bytes, ..
            } => Some(Action::Copy {
                src: *src,
                dst: *dst,
                bytes: *bytes,
            }),
            Cmd::Copy2D { src, dst, bytes, blocks, src_pitch, dst_pitch, .. } => Some(Action::CopyBlocks {
                src: *src,
                dst: *dst,
                bytes: *bytes,
                blocks: *blocks,
                src_pitch: *src_pitch,
                dst_pitch: *dst_pitch,
            }),
            Cmd::Zero { dst, bytes, .. } => Some(Action::Zero {
                dst: *dst,
                bytes: *bytes,
            }),
            Cmd::Reduce {
                dst, srcs, elems, ..
            } => Some(Action::Reduce {
                dst: *dst,
                srcs: srcs.clone(),
                elems: *elems,
            }),
            _ => None,
        }
    }

    /// Buffers big enough for every region the plan touches, inputs filled with finite bf16 noise,
    /// everything else with 0xAB.
    fn init_mem(plan: &Plan, seed: u64) -> Mem {
        let mut mem: Mem = Map::new();
        for ph in &plan.phases {
            for st in &ph.steps {
                for a in accesses(&st.action).unwrap() {
                    let e = mem.entry((a.rank, a.kind, a.index)).or_default();
                    if e.len() < a.end {
                        e.resize(a.end, 0);
                    }
                }
            }
        }
        let mut x = seed | 1;
        let mut keys: Vec<_> = mem.keys().copied().collect();
        keys.sort();
        for key in keys {
            let buf = mem.get_mut(&key).unwrap();
            if key.1 == BufKind::Input {
                for ch in buf.chunks_mut(2) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let mut h = (x >> 20) as u16;
                    if h & 0x7f80 == 0x7f80 {
                        h &= !0x4000;
                    }
                    ch.copy_from_slice(&h.to_le_bytes()[..ch.len()]);
                }
            } else {
                buf.fill(0xAB);
            }
        }
        mem
    }

    /// The plan's meaning: every step in listed order (executors never conflict within a phase).
    fn reference(plan: &Plan, mem: &mut Mem) {
        for ph in &plan.phases {
            for st in &ph.steps {
                apply(mem, &st.action);
            }
        }
    }

    /// Runs every rank's schedule as independent streams in a random legal order: a stream's head
    /// command runs when it is a data command or a satisfied wait; local events are per rank.
    /// Cross-rank events (ready, previous done) are complete from the start; phase p + 1 starts
    /// when every rank's phase p has ended (every stream of it waits on every rank's phase p event,
    /// recorded on MAIN after its join).
    fn simulate(scheds: &[Schedule], mem: &mut Mem, seed: u64) {
        let nphases = scheds.iter().map(|s| s.phases.len()).max().unwrap_or(0);
        let mut recorded: std::collections::HashSet<(usize, usize)> = Default::default();
        for p in 0..nphases {
            simulate_phase(scheds, p, mem, seed.wrapping_add(p as u64), &mut recorded);
        }
    }

    fn simulate_phase(scheds: &[Schedule], p: usize, mem: &mut Mem, seed: u64, recorded: &mut std::collections::HashSet<(usize, usize)>) {
        let mut queues: Vec<(usize, usize, std::collections::VecDeque<Cmd>)> = Vec::new();
        for s in scheds {
            let mut per: Map<usize, std::collections::VecDeque<Cmd>> = Map::new();
            for c in s.phases.get(p).map(|ph| ph.cmds.as_slice()).unwrap_or(&[]) {
                per.entry(c.stream()).or_default().push_back(c.clone());
            }
            for (st, q) in per {
                queues.push((s.rank, st, q));
            }
        }
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        loop {
            let runnable: Vec<usize> = (0..queues.len())
                .filter(|&i| match queues[i].2.front() {
                    None => false,
                    Some(Cmd::Wait { event, .. }) => recorded.contains(&(queues[i].0, *event)),
                    Some(_) => true,
                })
                .collect();
            if runnable.is_empty() {
                assert!(
                    queues.iter().all(|q| q.2.is_empty()),
                    "deadlock: streams blocked on waits"
                );
                return;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = runnable[(x % runnable.len() as u64) as usize];
            let rank = queues[i].0;
            let c = queues[i].2.pop_front().unwrap();
            match &c {
                Cmd::Record { event, .. } => {
                    recorded.insert((rank, *event));
                }
                other => {
                    if let Some(a) = cmd_action(other) {
                        apply(mem, &a);
                    }
                }
            }
        }
    }

    fn outputs(mem: &Mem) -> Vec<((usize, usize), Vec<u8>)> {
        let mut v: Vec<_> = mem
            .iter()
            .filter(|(k, _)| k.1 == BufKind::Output)
            .map(|(k, b)| ((k.0, k.2), b.clone()))
            .collect();
        v.sort();
        v
    }

    fn check_plan(plan: &Plan, opts: &SchedOptions, seeds: u64) {
        let world = plan.topology.world();
        let scheds: Vec<Schedule> = (0..world).map(|r| build(plan, r, opts).unwrap()).collect();
        let mut want = init_mem(plan, 7);
        reference(plan, &mut want);
        for seed in 0..seeds {
            let mut mem = init_mem(plan, 7);
            simulate(&scheds, &mut mem, seed);
            assert_eq!(outputs(&mem), outputs(&want), "seed {seed}, opts {opts:?}");
        }
    }

    /// The engine's copy batches of one phase's commands (`issue::Issuer::route` with batching on):
    /// a stream's consecutive copies, ended by any other command on that stream. Each batch: its
    /// stream and its copies' step indices.
    fn copy_batches(cmds: &[Cmd]) -> Vec<(usize, Vec<usize>)> {
        let mut open: Map<usize, Vec<usize>> = Map::new();
        let mut out = Vec::new();
        for c in cmds {
            let s = c.stream();
            if let Cmd::Copy { step, .. } = c {
                open.entry(s).or_default().push(*step);
            } else if let Some(b) = open.remove(&s) {
                out.push((s, b));
            }
        }
        out.extend(open);
        out
    }

    fn opts(streams: usize, local: LocalCopy, min_piece: usize) -> SchedOptions {
        SchedOptions {
            copy_streams: streams,
            local_copy: local,
            min_piece_bytes: min_piece,
            split_align: 16,
            sum_piece_bytes: 0,
        }
    }

    #[test]
    fn sum_pieces_cover_every_element_once_aligned_and_bounded() {
        for elems in [0usize, 1, 63, 64, 65, 100, 4096, 4099, 100_003, 1 << 20] {
            for src_bytes in [2usize, 4, 8, 16, 32] {
                for piece_bytes in [0usize, 1, 100, 512, 4096, 1 << 16, 3 << 20] {
                    let pieces = sum_pieces(elems, src_bytes, piece_bytes);
                    let mut next = 0;
                    for &(first, n) in &pieces {
                        assert_eq!(first, next, "{elems} {src_bytes} {piece_bytes}: {pieces:?}");
                        assert!(n > 0);
                        assert_eq!(first % SUM_PIECE_ALIGN, 0);
                        next = first + n;
                    }
                    assert_eq!(next, elems, "{elems} {src_bytes} {piece_bytes}");
                    if piece_bytes == 0 {
                        assert!(pieces.len() <= 1);
                        continue;
                    }
                    let cap = (piece_bytes / (src_bytes + 4)).max(SUM_PIECE_ALIGN);
                    let largest = pieces.iter().map(|p| p.1).max().unwrap_or(0);
                    // At most one alignment unit above the cap, and no more pieces than needed.
                    assert!(largest <= cap + SUM_PIECE_ALIGN, "{elems} {src_bytes} {piece_bytes}: {largest} > {cap}");
                    assert!(pieces.len() <= elems.div_ceil(cap));
                }
            }
        }
        // Equal pieces, not a tiny tail: 4099 bf16 elements from 2 sources in 4 KiB pieces.
        assert_eq!(sum_pieces(4099, 4, 4096), vec![(0, 512), (512, 512), (1024, 512), (1536, 512), (2048, 512), (2560, 512), (3072, 512), (3584, 512), (4096, 3)]);
        assert_eq!(sum_pieces(1000, 2, 3000), vec![(0, 512), (512, 488)]);
    }

    #[test]
    fn reduces_split_into_pieces_on_main_with_offsets() {
        // World 1: the whole reduce-scatter is one Reduce per parameter (a cast) and a Zero.
        let layout = real_layout(1);
        let rs = crate::plan::reduce_scatter(&layout, Topology::single_node(1), Default::default()).unwrap();
        let s = build(&rs, 0, &opts(1, LocalCopy::CopyEngine, 64).with_sum_pieces(1024)).unwrap();
        let reduces: Vec<&Cmd> = s.phases[0].cmds.iter().filter(|c| matches!(c, Cmd::Reduce { .. })).collect();
        // "big" (4096 bf16, 6 bytes per element read + written): 170 elements fit 1024 bytes, so
        // pieces of 192 (rounded up to 64) -> 22 pieces; every piece on MAIN, offsets contiguous.
        let big = layout.params.iter().position(|p| p.name == "big").unwrap();
        let mut next = 0;
        for c in &reduces {
            if let Cmd::Reduce { stream, dst, srcs, elems, .. } = c {
                assert_eq!(*stream, MAIN);
                if dst.index == big {
                    assert_eq!(dst.offset, next * 4);
                    assert_eq!(srcs[0].region.offset, next * 2);
                    assert!(*elems <= 192);
                    next += elems;
                }
            }
        }
        assert_eq!(next, 4096);
        assert_eq!(reduces.iter().filter(|c| matches!(c, Cmd::Reduce { dst, .. } if dst.index == big)).count(), 22);
        // No events: everything is on MAIN.
        assert_eq!(s.events, 0);
    }

    #[test]
    fn a_reused_slot_waits_once_for_the_last_piece_reading_it() {
        // 2 ranks, 4 chunks of 16 elements through 2 slots, each chunk's reduce in 4 pieces (16 x
        // 2 bytes x 2 sources + 4 = 8 bytes per element, pieces of 64 elements: 16 -> 1 piece; use
        // chunks of 256 elements instead: 4 pieces each).
        let plan = rs_plan(2, &[1024], 256, 2, false, 0);
        let whole = build(&plan, 0, &opts(1, LocalCopy::CopyEngine, 1 << 20)).unwrap();
        let split = build(&plan, 0, &opts(1, LocalCopy::CopyEngine, 1 << 20).with_sum_pieces(64 * 8)).unwrap();
        let count = |s: &Schedule, f: &dyn Fn(&Cmd) -> bool| s.phases[0].cmds.iter().filter(|c| f(c)).count();
        let reduces = |c: &Cmd| matches!(c, Cmd::Reduce { .. });
        let waits = |c: &Cmd| matches!(c, Cmd::Wait { .. });
        let records = |c: &Cmd| matches!(c, Cmd::Record { .. });
        assert_eq!(count(&whole, &reduces), 4);
        assert_eq!(count(&split, &reduces), 16);
        // The same waits and records: one record after the last piece of a chunk, not one per piece.
        assert_eq!(count(&split, &waits), count(&whole, &waits), "{:#?}", split.phases[0].cmds);
        assert_eq!(count(&split, &records), count(&whole, &records));
        check_plan(&plan, &opts(1, LocalCopy::CopyEngine, 64).with_sum_pieces(64 * 8), 40);
    }

    #[test]
    fn balance_splits_contiguously_and_evenly() {
        let mut loads = vec![0; 4];
        let pieces = balance(&[100, 300, 0, 4000], &mut loads, 64, 16);
        // Every item covered exactly once, in order, contiguous.
        for (item, size) in [(0usize, 100usize), (1, 300), (3, 4000)] {
            let mut off = 0;
            for p in pieces.iter().filter(|p| p.item == item) {
                assert_eq!(p.offset, off);
                assert!(p.offset % 16 == 0);
                off += p.bytes;
            }
            assert_eq!(off, size);
        }
        assert_eq!(loads.iter().sum::<usize>(), 4400);
        let (mn, mx) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
        assert!(mx - mn <= 4 * 16, "unbalanced {loads:?}");
        assert!(pieces.iter().all(|p| (1..=4).contains(&p.stream)));
    }

    #[test]
    fn balance_uses_few_streams_for_small_segments_and_least_loaded_first() {
        let mut loads = vec![10, 0, 5];
        let pieces = balance(&[50], &mut loads, 1 << 20, 4096);
        assert_eq!(
            pieces,
            vec![Piece {
                item: 0,
                stream: 2,
                offset: 0,
                bytes: 50
            }]
        );
        assert_eq!(loads, vec![10, 50, 5]);
        let pieces = balance(&[7], &mut loads, 1 << 20, 4096);
        assert_eq!(pieces[0].stream, 3);
        assert!(balance(&[], &mut loads, 1, 1).is_empty());
        assert!(balance(&[0, 0], &mut loads, 1, 1).is_empty());
    }

    fn conflict(a: &Access, b: &Access) -> bool {
        (a.write || b.write)
            && a.rank == b.rank
            && a.kind == b.kind
            && a.index == b.index
            && a.start < b.end
            && b.start < a.end
    }

    /// `dependencies` as every pair compared (what it computed before the sweep).
    fn dependencies_pairwise(steps: &[Vec<Access>]) -> Vec<Vec<usize>> {
        (0..steps.len())
            .map(|k| (0..k).filter(|&j| steps[k].iter().any(|a| steps[j].iter().any(|b| conflict(a, b)))).collect())
            .collect()
    }

    #[test]
    fn dependencies_sweep_equals_every_pair_compared() {
        let mut x = 12345u64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        for _ in 0..200 {
            let steps: Vec<Vec<Access>> = (0..1 + next(30))
                .map(|_| {
                    (0..next(4))
                        .map(|_| {
                            let start = next(64);
                            Access {
                                rank: next(2),
                                kind: [BufKind::Input, BufKind::Output, BufKind::Stage][next(3)],
                                index: next(2),
                                start,
                                end: start + 1 + next(20),
                                write: next(2) == 0,
                            }
                        })
                        .collect()
                })
                .collect();
            assert_eq!(dependencies(&steps), dependencies_pairwise(&steps), "{steps:?}");
        }
    }

    #[test]
    fn dependencies_follow_overlapping_writes() {
        let w = |start, end| Access {
            rank: 0,
            kind: BufKind::Stage,
            index: 0,
            start,
            end,
            write: true,
        };
        let r = |start, end| Access {
            rank: 0,
            kind: BufKind::Stage,
            index: 0,
            start,
            end,
            write: false,
        };
        let other = Access {
            rank: 0,
            kind: BufKind::Stage,
            index: 1,
            start: 0,
            end: 100,
            write: true,
        };
        let steps = vec![
            vec![w(0, 10)],
            vec![r(5, 6)],
            vec![r(0, 10)],
            vec![w(9, 20)],
            vec![other],
            vec![r(10, 20)],
        ];
        let d = dependencies(&steps);
        assert_eq!(
            d,
            vec![vec![], vec![0], vec![0], vec![0, 2], vec![], vec![3]]
        );
    }

    #[test]
    fn all_gather_schedule_spreads_copies_and_waits_on_ready() {
        let plan = ag_plan(2, &[8 << 20, 1 << 20, 64]);
        let s = build(&plan, 1, &SchedOptions::new(4, LocalCopy::CopyEngine)).unwrap();
        assert!(!s.needs_kernels);
        assert_eq!(s.side_streams, 5);
        let cmds = &s.phases[0].cmds;
        // Every side stream starts with the previous-done wait, then the ready of each rank it reads
        // or writes (rank 1 always: it writes rank 1's outputs).
        for st in 1..=5 {
            let mine: Vec<&Cmd> = cmds.iter().filter(|c| c.stream() == st).collect();
            // Its own ready implies its previous done (MAIN waited on it before recording ready).
            assert!(!mine
                .iter()
                .any(|c| matches!(c, Cmd::WaitOwnPrevDone { .. })));
            let mut want: Vec<usize> = mine
                .iter()
                .filter_map(|c| {
                    if let Cmd::Copy { src, .. } = c {
                        Some(src.rank)
                    } else {
                        None
                    }
                })
                .chain([1])
                .collect();
            want.sort_unstable();
            want.dedup();
            for (k, r) in want.iter().enumerate() {
                assert_eq!(
                    mine[k],
                    &Cmd::WaitRank {
                        stream: st,
                        rank: *r,
                        event: RankEvent::Ready
                    }
                );
            }
            assert!(matches!(mine[want.len()], Cmd::Copy { .. }));
        }
        // No waits between copies (independent), one join per side stream at the end.
        let waits = cmds
            .iter()
            .filter(|c| matches!(c, Cmd::Wait { .. }))
            .count();
        assert_eq!(waits, 5);
        assert_eq!(s.events, 5);
        assert!(cmds
            .iter()
            .rev()
            .take(10)
            .all(|c| matches!(c, Cmd::Record { .. } | Cmd::Wait { stream: MAIN, .. })));
        // Peer bytes balanced over streams 1..=4; local copies whole, on stream 5.
        let mut peer = [0usize; 6];
        let mut local = [0usize; 6];
        for c in cmds {
            if let Cmd::Copy {
                stream,
                bytes,
                via,
                src,
                ..
            } = c
            {
                assert_eq!(*via, CopyVia::CopyEngine);
                if src.rank == 1 {
                    local[*stream] += bytes
                } else {
                    peer[*stream] += bytes
                }
            }
        }
        let total = (8 << 20) + (1 << 20) + 64;
        assert_eq!(peer.iter().sum::<usize>(), total);
        assert_eq!(local.iter().sum::<usize>(), total);
        for st in 1..=4 {
            assert!(peer[st].abs_diff(total / 4) <= 4096, "{peer:?}");
        }
        assert_eq!(local[5], total, "{local:?}");
        assert_eq!(
            cmds.iter()
                .filter(|c| matches!(c, Cmd::Copy { stream: 5, .. }))
                .count(),
            3,
            "one local copy per parameter"
        );
        check_plan(&plan, &opts(4, LocalCopy::CopyEngine, 1 << 20), 3);
    }

    #[test]
    fn all_gather_ce_peers_balances_the_own_shard_with_the_peer_copies() {
        // TIDE_LOCAL_COPY=ce-peers: the own shard's copies join the peer copies' streams (balanced by
        // bytes with them, nothing on the local stream); same results under every interleaving.
        for (world, streams) in [(1usize, 1usize), (2, 1), (3, 2), (8, 1), (8, 3)] {
            let shards = [80_000usize, 10_000, 64, 1000];
            let plan = ag_plan(world, &shards);
            for rank in [0, world - 1] {
                let s = build(&plan, rank, &opts(streams, LocalCopy::CopyEnginePeers, 16 << 10)).unwrap();
                assert!(!s.needs_kernels);
                let mut per_stream = vec![0usize; streams + 2];
                let mut own = 0;
                for c in &s.phases[0].cmds {
                    if let Cmd::Copy { stream, bytes, via, src, dst, .. } = c {
                        assert_eq!(*via, CopyVia::CopyEngine);
                        assert!((1..=streams).contains(stream), "world {world} rank {rank}: {c:?}");
                        per_stream[*stream] += bytes;
                        if src.rank == rank && dst.rank == rank {
                            own += bytes;
                        }
                    }
                }
                let total: usize = shards.iter().sum();
                assert_eq!(own, total, "the own shard, whole");
                assert_eq!(per_stream.iter().sum::<usize>(), world * total);
                for st in 1..=streams {
                    assert!(per_stream[st].abs_diff(world * total / streams) <= 16 << 10, "{per_stream:?}");
                }
            }
            check_plan(&plan, &opts(streams, LocalCopy::CopyEnginePeers, 16 << 10), 10);
            check_plan(&plan, &opts(streams, LocalCopy::CopyEnginePeers, 64), 5);
        }
    }

    #[test]
    fn all_gather_sm_local_copy_goes_on_main() {
        let plan = ag_plan(3, &[1000, 24]);
        let s = build(&plan, 2, &opts(2, LocalCopy::Sm, 64)).unwrap();
        assert!(s.needs_kernels);
        for c in &s.phases[0].cmds {
            if let Cmd::Copy {
                stream, src, via, ..
            } = c
            {
                assert_eq!(*via == CopyVia::Sm, src.rank == 2);
                assert_eq!(*stream == MAIN, src.rank == 2);
            }
            // MAIN touches only its own rank: no ready wait on MAIN.
            if let Cmd::WaitRank { stream, .. } = c {
                assert_ne!(*stream, MAIN);
            }
        }
        check_plan(&plan, &opts(2, LocalCopy::Sm, 64), 20);
        check_plan(&plan, &opts(3, LocalCopy::CopyEngine, 64), 20);
    }

    #[test]
    fn reduce_scatter_schedule_orders_slot_reuse() {
        // Many chunks through 2 slots: the copy into a slot must wait for the reduce that last read it,
        // and each reduce for its copies.
        for &(world, slots, lookahead) in &[
            (2usize, 2usize, false),
            (2, 2, true),
            (3, 2, true),
            (4, 3, false),
            (5, 1, false),
            (8, 3, false),
            (8, 2, true),
        ] {
            let plan = rs_plan(world, &[37, 100, 5], 16, slots, lookahead, 3);
            for streams in [1usize, 2, 3] {
                check_plan(&plan, &opts(streams, LocalCopy::CopyEngine, 8), 40);
                check_plan(&plan, &opts(streams, LocalCopy::CopyEnginePeers, 8), 20);
            }
        }
    }

    #[test]
    fn reduce_scatter_waits_are_minimal() {
        // 2 ranks, one side stream, 4 chunks, 2 slots: per chunk one record after its copy and one
        // wait by the reduce; from chunk 2 on one record after the reduce that frees the slot and one
        // wait by the copy; then the join.
        let plan = rs_plan(2, &[64], 16, 2, false, 0);
        let s = build(&plan, 0, &opts(1, LocalCopy::CopyEngine, 1 << 20)).unwrap();
        assert!(s.needs_kernels);
        let cmds = &s.phases[0].cmds;
        let waits_main = cmds
            .iter()
            .filter(|c| matches!(c, Cmd::Wait { stream: MAIN, .. }))
            .count();
        let waits_side = cmds
            .iter()
            .filter(|c| matches!(c, Cmd::Wait { stream: 1, .. }))
            .count();
        assert_eq!(waits_main, 4, "{cmds:#?}");
        assert_eq!(waits_side, 2, "{cmds:#?}");
        // Join: the last copy was already waited on by the last reduce, so no extra join.
        assert!(matches!(cmds.last(), Some(Cmd::Reduce { .. })), "{cmds:#?}");
        // MAIN never waits on ready (it reads only its own input and stage); the side stream does.
        assert!(cmds.iter().any(|c| matches!(
            c,
            Cmd::WaitRank {
                stream: 1,
                rank: 1,
                event: RankEvent::Ready
            }
        )));
        assert!(!cmds
            .iter()
            .any(|c| matches!(c, Cmd::WaitRank { stream: MAIN, .. })));
    }

    #[test]
    fn a_sum_of_staged_slices_waits_once_per_copy_stream() {
        // 8 ranks, 4 chunks, 2 slots: each chunk stages 7 peers' slices, then sums them. The sum
        // waits once per copy stream (on the event after the latest copy it reads there), the
        // events before the others are not recorded, and each staged slice is still a copy batch
        // of its own. Every interleaving still gives the reference bytes.
        let plan = rs_plan(8, &[64], 16, 2, false, 0);
        for streams in [1usize, 2, 3] {
            let o = opts(streams, LocalCopy::CopyEnginePeers, 1 << 20);
            let s = build(&plan, 0, &o).unwrap();
            let cmds = &s.phases[0].cmds;
            let mut waits_before: Vec<usize> = Vec::new();
            let mut run = 0;
            for c in cmds {
                match c {
                    Cmd::Wait { stream: MAIN, .. } => run += 1,
                    Cmd::Reduce { .. } => {
                        waits_before.push(run);
                        run = 0;
                    }
                    _ => {}
                }
            }
            assert_eq!(waits_before.len(), 4, "{cmds:#?}");
            assert!(waits_before.iter().all(|&w| w >= 1 && w <= streams), "{streams} streams: {waits_before:?}");
            // Records on the copy streams: at most one per chunk and stream (after its last copy).
            let side_records = cmds.iter().filter(|c| matches!(c, Cmd::Record { stream, .. } if *stream != MAIN)).count();
            assert!(side_records <= 4 * streams, "{streams} streams: {side_records} records: {cmds:#?}");
            assert!(copy_batches(cmds).len() <= 4 * streams, "{streams} streams: one batch per chunk and stream: {cmds:#?}");
            check_coalesced(cmds);
            check_plan(&plan, &o, 20);
        }
    }

    /// What `drop_unwaited_records` promises of a phase: every recorded event is waited
    /// on, no copy batch holds copies of two steps that a later step waits on separately (the
    /// batches of a schedule that waited on each), and no stream waits twice on one producer stream
    /// between two of its other commands.
    fn check_coalesced(cmds: &[Cmd]) {
        let mut recorded_on: Map<usize, usize> = Map::new();
        for c in cmds {
            if let Cmd::Record { stream, event } = c {
                assert!(cmds.iter().any(|w| matches!(w, Cmd::Wait { event: e, .. } if e == event)), "event {event} unwaited");
                recorded_on.insert(*event, *stream);
            }
        }
        // (consumer stream) -> producer streams waited on since its last other command
        let mut since: Map<usize, Vec<usize>> = Map::new();
        for c in cmds {
            match c {
                Cmd::Wait { stream, event } => {
                    let producer = recorded_on[event];
                    let seen = since.entry(*stream).or_default();
                    assert!(!seen.contains(&producer), "stream {stream} waits twice on stream {producer}: {cmds:#?}");
                    seen.push(producer);
                }
                other => {
                    since.remove(&other.stream());
                }
            }
        }
    }

    #[test]
    fn random_layouts_schedule_coalesced_and_race_free() {
        // Fresh random groups each run (the seed is in every failure; TIDE_SCHEDULE_SEED replays
        // one): 1-5 parameters of 0-2 dims and mixed dtypes on 1-8 ranks, 1-3 stage slots of
        // random size, 1-3 copy streams, either local-copy mode, sums whole or in pieces. Both
        // collectives: every interleaving of the streams gives the reference bytes, and the
        // reduce-scatter's schedule waits once per producer stream, records only what is waited on
        // and keeps one step per copy batch.
        let base = std::env::var("TIDE_SCHEDULE_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
        });
        let mut x = base | 1;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        for case in 0..24 {
            let world = 1 + next(8);
            let dtypes = [DType::BF16, DType::F16, DType::F32];
            let specs: Vec<ParamSpec> = (0..1 + next(5))
                .map(|i| {
                    let dims: Vec<usize> = (0..next(3)).map(|_| 1 + next(40)).collect();
                    ParamSpec::new(format!("p{i}"), &dims, dtypes[next(3)])
                })
                .collect();
            let what = format!("seed {base} case {case}: world {world}, {specs:?}");
            let layout = GroupLayout::new(&specs, world).unwrap();
            let topo = Topology::single_node(world);
            let rs_opts = crate::plan::RsOptions {
                stage_slots: 1 + next(3),
                slot_bytes: 64 * (1 + next(64)),
            };
            let local = [LocalCopy::CopyEngine, LocalCopy::CopyEnginePeers][next(2)];
            let o = opts(1 + next(3), local, 16 * (1 + next(16))).with_sum_pieces([0, 256, 1000][next(3)]);
            let what = format!("{what}, {rs_opts:?}, {o:?}");
            let rs = crate::plan::reduce_scatter(&layout, topo, rs_opts).unwrap();
            for rank in 0..world {
                let s = build(&rs, rank, &o).unwrap();
                for ph in &s.phases {
                    check_coalesced(&ph.cmds);
                }
            }
            let result = std::panic::catch_unwind(|| {
                check_plan(&rs, &o, 3);
                check_plan(&crate::plan::all_gather(&layout, topo).unwrap(), &o, 3);
            });
            assert!(result.is_ok(), "{what}: a stream order gave other bytes than the reference");
        }
    }

    #[test]
    fn a_layer_reduce_scatter_records_only_what_is_waited_on() {
        // A Llama-3-8B layer (bf16), 3 slots of 32 MiB, sums in pieces of 16 x 512 KiB. At world 8
        // rank 0 with one copy stream: 33 records and 33 waits (when every staged slice's event was
        // recorded and waited on: 141 and 141), and a chunk's seven staged slices in one copy batch
        // (18 batches; 126 when each staged slice was its own batch).
        let specs = [
            ParamSpec::new("wq", &[4096, 4096], DType::BF16),
            ParamSpec::new("wk", &[1024, 4096], DType::BF16),
            ParamSpec::new("wv", &[1024, 4096], DType::BF16),
            ParamSpec::new("wo", &[4096, 4096], DType::BF16),
            ParamSpec::new("w1", &[14336, 4096], DType::BF16),
            ParamSpec::new("w3", &[14336, 4096], DType::BF16),
            ParamSpec::new("w2", &[4096, 14336], DType::BF16),
            ParamSpec::new("attn_norm", &[4096], DType::BF16),
            ParamSpec::new("mlp_norm", &[4096], DType::BF16),
        ];
        for world in [2usize, 3, 8] {
            let layout = GroupLayout::new(&specs, world).unwrap();
            let topo = Topology::single_node(world);
            let rs_opts = crate::plan::RsOptions {
                stage_slots: 3,
                slot_bytes: 32 << 20,
            };
            let rs = crate::plan::reduce_scatter(&layout, topo, rs_opts).unwrap();
            let ag = crate::plan::all_gather(&layout, topo).unwrap();
            for streams in [1usize, 2, 3] {
                let o = opts(streams, LocalCopy::CopyEnginePeers, 1 << 20).with_sum_pieces(16 * 512 * 1024);
                for rank in [0, world - 1] {
                    let s = build(&rs, rank, &o).unwrap();
                    for ph in &s.phases {
                        check_coalesced(&ph.cmds);
                    }
                    if world == 8 && streams == 1 && rank == 0 {
                        let cmds = &s.phases[0].cmds;
                        let count = |f: fn(&Cmd) -> bool| cmds.iter().filter(|c| f(c)).count();
                        assert_eq!(count(|c| matches!(c, Cmd::Record { .. })), 33);
                        assert_eq!(count(|c| matches!(c, Cmd::Wait { .. })), 33);
                        assert_eq!(copy_batches(cmds).len(), 18, "one copy batch per chunk");
                    }
                    // The all-gather's copies wait on nothing of the call: its records are all waited on.
                    let s = build(&ag, rank, &o).unwrap();
                    for ph in &s.phases {
                        check_coalesced(&ph.cmds);
                    }
                }
            }
        }
    }

    #[test]
    fn dropping_waits_is_caught_by_the_simulator() {
        // The simulator has teeth: without the cross-stream waits some interleaving goes wrong.
        let plan = rs_plan(2, &[64], 16, 2, true, 0);
        let o = opts(2, LocalCopy::CopyEngine, 8);
        let scheds: Vec<Schedule> = (0..2)
            .map(|r| {
                let mut s = build(&plan, r, &o).unwrap();
                s.phases[0].cmds.retain(|c| !matches!(c, Cmd::Wait { .. }));
                s
            })
            .collect();
        let mut want = init_mem(&plan, 7);
        reference(&plan, &mut want);
        let mut bad = 0;
        for seed in 0..40 {
            let mut mem = init_mem(&plan, 7);
            simulate(&scheds, &mut mem, seed);
            if outputs(&mem) != outputs(&want) {
                bad += 1;
            }
        }
        assert!(bad > 0);
    }

    #[test]
    fn multi_phase_waits_on_all_ranks_phase_events() {
        let mut plan = ag_plan(3, &[256]);
        let p2 = plan.phases[0].clone();
        plan.phases.push(Phase {
            name: "again".into(),
            steps: p2.steps,
        });
        let s = build(&plan, 0, &opts(1, LocalCopy::CopyEngine, 64)).unwrap();
        let c1 = &s.phases[1].cmds;
        for r in 0..3 {
            assert!(c1.contains(&Cmd::WaitRank {
                stream: 1,
                rank: r,
                event: RankEvent::Phase(0)
            }));
        }
        assert!(!c1.iter().any(|c| matches!(c, Cmd::WaitOwnPrevDone { .. })));
        // Event ids are unique across phases.
        let recs: Vec<usize> = s
            .phases
            .iter()
            .flat_map(|p| &p.cmds)
            .filter_map(|c| {
                if let Cmd::Record { event, .. } = c {
                    Some(*event)
                } else {
                    None
                }
            })
            .collect();
        let mut d = recs.clone();
        d.dedup();
        assert_eq!(recs.len(), d.len());
        assert_eq!(s.events, recs.len());
    }

    fn real_layout(world: usize) -> GroupLayout {
        let specs = [
            ParamSpec::new("wq", &[37, 24], DType::BF16),
            ParamSpec::new("norm", &[5], DType::BF16),
            ParamSpec::new("scalar", &[], DType::F32),
            ParamSpec::new("w_up", &[301, 3], DType::F16),
            ParamSpec::new("big", &[4096], DType::BF16),
        ];
        GroupLayout::new(&specs, world).unwrap()
    }

    #[test]
    fn core_direct_plans_run_correctly_under_random_stream_orders() {
        for world in [1usize, 2, 3, 5, 8] {
            let layout = real_layout(world);
            let topo = Topology::single_node(world);
            let ag = crate::plan::all_gather(&layout, topo).unwrap();
            for o in [
                opts(4, LocalCopy::CopyEngine, 256),
                opts(2, LocalCopy::Sm, 1 << 20),
            ] {
                check_plan(&ag, &o, 4);
            }
            for slot_bytes in [256usize, 4096, 1 << 20] {
                let rs_opts = crate::plan::RsOptions {
                    stage_slots: 2,
                    slot_bytes,
                };
                let rs = crate::plan::reduce_scatter(&layout, topo, rs_opts).unwrap();
                for o in [
                    opts(1, LocalCopy::CopyEngine, 64),
                    opts(2, LocalCopy::CopyEngine, 64),
                    // Reductions in pieces of 64 to a few hundred elements (issue #22).
                    opts(1, LocalCopy::CopyEngine, 64).with_sum_pieces(600),
                    opts(2, LocalCopy::CopyEngine, 64).with_sum_pieces(3000),
                ] {
                    check_plan(&rs, &o, 4);
                }
            }
        }
    }

    #[test]
    fn core_hierarchical_plans_schedule() {
        // Multi-node plans are refused by the engine for now, but their schedules must still build
        // (peer stage reads, several phases) so the later work only adds the rail.
        let layout = real_layout(4);
        let topo = Topology::new(2, 2).unwrap();
        let ag = crate::plan::all_gather(&layout, topo).unwrap();
        let rs = crate::plan::reduce_scatter(
            &layout,
            topo,
            crate::plan::RsOptions {
                stage_slots: 2,
                slot_bytes: 512,
            },
        )
        .unwrap();
        for r in 0..4 {
            let s = build(&ag, r, &opts(2, LocalCopy::CopyEngine, 64)).unwrap();
            assert_eq!(s.phases.len(), ag.phases.len());
            let s = build(&rs, r, &opts(2, LocalCopy::CopyEngine, 64)).unwrap();
            assert_eq!(s.phases.len(), rs.phases.len());
        }
    }

    /// A group mixing strided parameters (along dims 1 and 2, rows of one element, a block wider
    /// than a small slot's piece) with dim-0 ones (uneven, padded), as tests/plans_strided.rs.
    fn strided_group(world: usize, op: Op) -> Vec<ParamSpec> {
        let mut g = vec![
            ParamSpec::new("experts.w1", &[3, 2 * world, 5], DType::BF16).along(1),
            ParamSpec::new("w_cols", &[4, 3 * world], DType::F32).along(1),
            ParamSpec::new("w7x5", &[7, 5], DType::BF16),
            ParamSpec::new("experts.w2", &[2, 3, world], DType::F16).along(2),
            ParamSpec::new("lead1", &[1, world, 3], DType::F32).along(1),
            ParamSpec::new("wide", &[5, world, 33], DType::BF16).along(1),
            ParamSpec::new("tall", &[64, 2 * world, 4], DType::BF16).along(1),
        ];
        if op == Op::AllGather {
            g.push(ParamSpec::new("u8_cols", &[5, 2 * world], DType::U8).along(1));
            g.push(ParamSpec::new("s64_9", &[9], DType::S64));
        }
        g
    }

    /// Finite values of `dtype` (bytes of any other dtype), deterministic per seed.
    fn finite_values(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut out = Vec::with_capacity(n * dtype.size_bytes());
        for _ in 0..n {
            let r = next();
            let sign = (r & 1) as u32;
            let exp = 119 + ((r >> 1) % 16) as u32;
            match dtype {
                DType::F32 => out.extend_from_slice(&((sign << 31) | (exp << 23) | ((r >> 8) as u32 & 0x7f_ffff)).to_le_bytes()),
                DType::BF16 => out.extend_from_slice(&(((sign << 15) | (exp << 7) | ((r >> 8) as u32 & 0x7f)) as u16).to_le_bytes()),
                DType::F16 => out.extend_from_slice(&(((sign << 15) | ((exp - 112) << 10) | ((r >> 8) as u32 & 0x3ff)) as u16).to_le_bytes()),
                other => out.extend((0..other.size_bytes()).map(|k| (r >> (8 * k)) as u8)),
            }
        }
        out
    }

    /// Every rank's schedule of `plan` (2-D copies kept) replayed in random stream orders gives
    /// the CPU engine's outputs (`engine::cpu::run_threads` on the same inputs), bitwise.
    #[allow(clippy::needless_range_loop)] // ranks and params index several tables at once
    fn check_against_cpu_engine(plan: &Plan, o: &SchedOptions, seeds: u64, what: &str) {
        let world = plan.topology.world();
        let n = plan.layout.len();
        let inputs: Vec<Vec<Vec<u8>>> = (0..world)
            .map(|r| {
                (0..n)
                    .map(|i| {
                        let p = &plan.layout.params[i];
                        let elems = plan.input_bytes(i) / p.dtype.size_bytes();
                        finite_values(p.dtype, elems, 77 + (r as u64) * 1000 + i as u64)
                    })
                    .collect()
            })
            .collect();
        let want = crate::engine::cpu::run_threads(plan, &inputs).unwrap();
        let scheds: Vec<Schedule> = (0..world).map(|r| build(plan, r, o).unwrap()).collect();
        for seed in 0..seeds {
            let mut mem: Mem = Map::new();
            for r in 0..world {
                for i in 0..n {
                    mem.insert((r, BufKind::Input, i), inputs[r][i].clone());
                    mem.insert((r, BufKind::Output, i), vec![0xa5; plan.output_bytes(i)]);
                }
                for (k, &b) in plan.stage_slot_bytes.iter().enumerate() {
                    mem.insert((r, BufKind::Stage, k), vec![0xab; b]);
                }
            }
            simulate(&scheds, &mut mem, seed);
            for r in 0..world {
                for i in 0..n {
                    assert!(
                        mem[&(r, BufKind::Output, i)] == want[r][i],
                        "{what}, {o:?}, seed {seed}: rank {r} {} differs from the CPU engine",
                        plan.layout.params[i].describe()
                    );
                }
            }
        }
    }

    #[test]
    fn strided_plans_keep_2d_copies_and_replay_to_the_cpu_engine() {
        // [Note: strided parameters]: the all-gather lands each rank's rows of a parameter
        // gathered along dim k > 0 as one 2-D copy, the reduce-scatter stages strided slices into
        // its slots with 2-D copies. Scheduled unflattened (`Cmd::Copy2D`), on 1-3 copy streams in
        // every local-copy mode, split into whole blocks where small pieces balance them, with
        // slots small enough to cut chunks inside a block: the CPU engine's bytes, for one node of
        // 1, 2, 3 and 8 ranks and 2x1 / 2x2 nodes (several phases).
        let topologies = [(1, 1), (1, 2), (1, 3), (1, 8), (2, 1), (2, 2)];
        for (nodes, gpus) in topologies {
            let topo = Topology::new(nodes, gpus).unwrap();
            let world = topo.world();
            for op in [Op::AllGather, Op::ReduceScatter] {
                let layout = GroupLayout::new(&strided_group(world, op), world).unwrap();
                let plans: Vec<Plan> = match op {
                    Op::AllGather => vec![crate::plan::all_gather(&layout, topo).unwrap()],
                    Op::ReduceScatter => [(2usize, 96usize), (3, 1 << 12), (1, 1 << 20)]
                        .into_iter()
                        .filter_map(|(stage_slots, slot_bytes)| {
                            crate::plan::reduce_scatter(&layout, topo, crate::plan::RsOptions { stage_slots, slot_bytes }).ok()
                        })
                        .collect(),
                };
                assert!(!plans.is_empty());
                for plan in &plans {
                    plan.validate().unwrap();
                    let has_2d = plan.phases.iter().flat_map(|ph| &ph.steps).any(|s| matches!(s.action, Action::CopyBlocks { .. }));
                    assert!(has_2d || gpus == 1, "{op:?} {topo}: no 2-D copy in the plan");
                    for o in [
                        opts(1, LocalCopy::CopyEnginePeers, 1 << 20),
                        opts(2, LocalCopy::CopyEngine, 64),
                        opts(3, LocalCopy::Sm, 16).with_sum_pieces(1000),
                        opts(2, LocalCopy::CopyEnginePeers, 32).with_sum_pieces(256),
                    ] {
                        let what = format!("{op:?} {topo} slots {:?}", plan.stage_slot_bytes);
                        for r in 0..world {
                            let s = build(plan, r, &o).unwrap();
                            for ph in &s.phases {
                                if op == Op::ReduceScatter {
                                    check_coalesced(&ph.cmds);
                                }
                                for c in &ph.cmds {
                                    if let Cmd::Copy2D { stream, src, dst, .. } = c {
                                        assert_ne!(*stream, MAIN, "{what}: a 2-D copy on MAIN");
                                        let local = src.rank == r && dst.rank == r;
                                        if local && o.local_copy != LocalCopy::CopyEnginePeers {
                                            assert_eq!(*stream, o.copy_streams + 1, "{what}: a local 2-D copy off the local stream");
                                        } else {
                                            assert!(*stream <= o.copy_streams, "{what}");
                                        }
                                    }
                                }
                            }
                        }
                        check_against_cpu_engine(plan, &o, 3, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn a_2d_copy_is_balanced_over_the_copy_streams_in_whole_blocks() {
        // World 8, one parameter gathered along dim 1: each rank's rows land as one 2-D copy of
        // 64 blocks of 8 bytes (4 bf16 elements; pitch 64 in the result). With pieces of at least
        // 128 bytes over 3 streams, the 8 copies (4 KiB) spread evenly, each piece a range of
        // whole blocks, together covering every block once.
        let world = 8;
        let layout = GroupLayout::new(&[ParamSpec::new("w", &[64, 4 * world], DType::BF16).along(1)], world).unwrap();
        let ag = crate::plan::all_gather(&layout, Topology::single_node(world)).unwrap();
        for local in [LocalCopy::CopyEnginePeers, LocalCopy::CopyEngine, LocalCopy::Sm] {
            let o = opts(3, local, 128);
            let s = build(&ag, 2, &o).unwrap();
            let mut per_stream = Map::<usize, usize>::new();
            let mut covered = Map::<usize, Vec<(usize, usize)>>::new(); // source rank -> block ranges
            for c in &s.phases[0].cmds {
                assert!(!matches!(c, Cmd::Copy { .. }), "{local:?}: a 1-D copy: {c:?}");
                if let Cmd::Copy2D { stream, src, dst, bytes, blocks, src_pitch, dst_pitch, .. } = c {
                    assert_eq!((*bytes, *src_pitch, *dst_pitch), (8, 8, 8 * world));
                    assert_eq!(src.offset % 8, 0);
                    *per_stream.entry(*stream).or_default() += bytes * blocks;
                    covered.entry(src.rank).or_default().push((src.offset / 8, *blocks));
                    assert_eq!(dst.offset, src.rank * 8 + (src.offset / 8) * dst_pitch);
                }
            }
            for q in 0..world {
                let mut ranges = covered.remove(&q).unwrap_or_default();
                ranges.sort();
                let mut next = 0;
                for (first, n) in ranges {
                    assert_eq!(first, next, "{local:?}: rank {q}'s blocks");
                    next += n;
                }
                assert_eq!(next, 64, "{local:?}: rank {q}'s blocks");
            }
            let peer: Vec<usize> = (1..=3).map(|st| per_stream.get(&st).copied().unwrap_or(0)).collect();
            match local {
                // The own rows join the peers' streams: 8 x 512 bytes over 3 streams.
                LocalCopy::CopyEnginePeers => {
                    assert_eq!(peer.iter().sum::<usize>(), 4096);
                    assert!(peer.iter().max().unwrap() - peer.iter().min().unwrap() <= 2 * 8 * 8, "{peer:?}");
                }
                // The own rows on the local stream, whole; never on MAIN, never an SM copy.
                _ => {
                    assert_eq!(per_stream.get(&4), Some(&512), "{local:?}: {per_stream:?}");
                    assert_eq!(peer.iter().sum::<usize>(), 3584);
                    assert!(!s.needs_kernels);
                }
            }
        }
    }

    // ---- The cross-rank protocol of `cuda::run`, modelled over several back-to-back calls ----
    //
    // Per call k and rank r, in host order (as `cuda::prepare` / `cuda::run` issue them):
    //   XLA's stream: write this call's inputs (XLA's producer), wait own previous `done`, record
    //   `ready`; [rendezvous]; the schedule's commands; record `done`; [exit barrier]; MAIN waits on
    //   every peer's `done`; XLA's stream: read the outputs (XLA's consumer).
    // The host enqueues every call before the GPU runs anything (the host may run arbitrarily far
    // ahead); each wait captures its event's record count at enqueue time (cuStreamWaitEvent
    // semantics); then all streams of all ranks progress in a random legal order. Input and output
    // buffers and stage slots are the same in every call (XLA reusing them at once is the worst
    // case). Every call's outputs must equal the plan's meaning on that call's inputs.

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Ev {
        Ready(usize),
        Done(usize),
        Local(usize, usize),
    }

    #[derive(Clone, Debug)]
    enum M {
        Data(Action),
        Wait(Ev, u64),
        Record(Ev),
        WriteInputs(usize, usize),
        ReadOutputs(usize, usize),
    }

    fn fill_rank_inputs(mem: &mut Mem, rank: usize, call: usize) {
        let mut keys: Vec<_> = mem
            .keys()
            .copied()
            .filter(|k| k.0 == rank && k.1 == BufKind::Input)
            .collect();
        keys.sort();
        for key in keys {
            let mut x =
                ((call as u64) << 40) ^ ((rank as u64) << 20) ^ (key.2 as u64 * 7919) ^ 0x5151;
            for ch in mem.get_mut(&key).unwrap().chunks_mut(2) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let mut h = (x >> 20) as u16;
                if h & 0x7f80 == 0x7f80 {
                    h &= !0x4000;
                }
                ch.copy_from_slice(&h.to_le_bytes()[..ch.len()]);
            }
        }
    }

    type RankOutputs = Vec<(usize, Vec<u8>)>;

    fn rank_outputs(mem: &Mem, rank: usize) -> RankOutputs {
        let mut v: Vec<_> = mem
            .iter()
            .filter(|(k, _)| k.0 == rank && k.1 == BufKind::Output)
            .map(|(k, b)| (k.2, b.clone()))
            .collect();
        v.sort();
        v
    }

    /// Which protocol waits the model issues (all true = the engine's protocol).
    #[derive(Clone, Copy, Debug)]
    struct Rules {
        main_waits_prev_done: bool,
        main_waits_peer_done: bool,
        side_waits_ready: bool,
    }

    fn protocol_run(
        plan: &Plan,
        scheds: &[Schedule],
        calls: usize,
        rules: Rules,
        seed: u64,
    ) -> bool {
        let world = scheds.len();
        let mut queues: Map<(usize, usize), std::collections::VecDeque<M>> = Map::new();
        let mut records: Map<Ev, u64> = Map::new();
        let enq = |queues: &mut Map<(usize, usize), std::collections::VecDeque<M>>,
                   records: &mut Map<Ev, u64>,
                   r: usize,
                   s: usize,
                   m: M| {
            let m = match m {
                M::Wait(ev, _) => M::Wait(ev, *records.get(&ev).unwrap_or(&0)),
                M::Record(ev) => {
                    *records.entry(ev).or_insert(0) += 1;
                    M::Record(ev)
                }
                other => other,
            };
            queues.entry((r, s)).or_default().push_back(m);
        };
        for k in 0..calls {
            for r in 0..world {
                enq(&mut queues, &mut records, r, MAIN, M::WriteInputs(r, k));
                if rules.main_waits_prev_done {
                    enq(&mut queues, &mut records, r, MAIN, M::Wait(Ev::Done(r), 0));
                }
                enq(&mut queues, &mut records, r, MAIN, M::Record(Ev::Ready(r)));
            }
            // rendezvous
            for (r, sch) in scheds.iter().enumerate() {
                for c in &sch.phases[0].cmds {
                    let s = c.stream();
                    let m = match c {
                        Cmd::WaitRank {
                            rank,
                            event: RankEvent::Ready,
                            ..
                        } => {
                            if !rules.side_waits_ready {
                                continue;
                            }
                            M::Wait(Ev::Ready(*rank), 0)
                        }
                        Cmd::WaitRank { .. } => panic!("single-phase plans only"),
                        Cmd::WaitOwnPrevDone { .. } => M::Wait(Ev::Done(r), 0),
                        Cmd::Record { event, .. } => M::Record(Ev::Local(r, *event)),
                        Cmd::Wait { event, .. } => M::Wait(Ev::Local(r, *event), 0),
                        other => M::Data(cmd_action(other).unwrap()),
                    };
                    enq(&mut queues, &mut records, r, s, m);
                }
                enq(&mut queues, &mut records, r, MAIN, M::Record(Ev::Done(r)));
            }
            // exit barrier
            for r in 0..world {
                if rules.main_waits_peer_done {
                    for q in (0..world).filter(|&q| q != r) {
                        enq(&mut queues, &mut records, r, MAIN, M::Wait(Ev::Done(q), 0));
                    }
                }
                enq(&mut queues, &mut records, r, MAIN, M::ReadOutputs(r, k));
            }
        }
        // The GPU.
        let mut mem = init_mem(plan, 1);
        let mut executed: Map<Ev, u64> = Map::new();
        let mut seen: Map<(usize, usize), RankOutputs> = Map::new();
        let mut keys: Vec<(usize, usize)> = queues.keys().copied().collect();
        keys.sort();
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        loop {
            let runnable: Vec<(usize, usize)> = keys
                .iter()
                .copied()
                .filter(|k| match queues[k].front() {
                    None => false,
                    Some(M::Wait(ev, target)) => executed.get(ev).copied().unwrap_or(0) >= *target,
                    Some(_) => true,
                })
                .collect();
            if runnable.is_empty() {
                assert!(queues.values().all(|q| q.is_empty()), "deadlock");
                break;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = runnable[(x % runnable.len() as u64) as usize];
            match queues.get_mut(&key).unwrap().pop_front().unwrap() {
                M::Data(a) => apply(&mut mem, &a),
                M::Wait(..) => {}
                M::Record(ev) => *executed.entry(ev).or_insert(0) += 1,
                M::WriteInputs(r, k) => fill_rank_inputs(&mut mem, r, k),
                M::ReadOutputs(r, k) => {
                    seen.insert((r, k), rank_outputs(&mem, r));
                }
            }
        }
        // The meaning of each call.
        for k in 0..calls {
            let mut want = init_mem(plan, 1);
            for r in 0..world {
                fill_rank_inputs(&mut want, r, k);
            }
            reference(plan, &mut want);
            for r in 0..world {
                if seen[&(r, k)] != rank_outputs(&want, r) {
                    return false;
                }
            }
        }
        true
    }

    const ALL_RULES: Rules = Rules {
        main_waits_prev_done: true,
        main_waits_peer_done: true,
        side_waits_ready: true,
    };

    fn protocol_plans() -> Vec<(Plan, SchedOptions)> {
        let mut v = Vec::new();
        for world in [2usize, 3] {
            let layout = real_layout(world);
            let topo = Topology::single_node(world);
            v.push((
                crate::plan::all_gather(&layout, topo).unwrap(),
                opts(2, LocalCopy::CopyEngine, 256),
            ));
            v.push((
                crate::plan::all_gather(&layout, topo).unwrap(),
                opts(2, LocalCopy::Sm, 256),
            ));
            let rs = crate::plan::RsOptions {
                stage_slots: 2,
                slot_bytes: 1024,
            };
            v.push((
                crate::plan::reduce_scatter(&layout, topo, rs).unwrap(),
                opts(2, LocalCopy::CopyEngine, 256),
            ));
            // Reductions in sum pieces (issue #22): slot reuse waits on the last piece only.
            v.push((
                crate::plan::reduce_scatter(&layout, topo, rs).unwrap(),
                opts(2, LocalCopy::CopyEngine, 256).with_sum_pieces(64 * 6),
            ));
        }
        v
    }

    #[test]
    fn protocol_keeps_back_to_back_calls_race_free() {
        for (plan, o) in protocol_plans() {
            let world = plan.topology.world();
            let scheds: Vec<Schedule> = (0..world).map(|r| build(&plan, r, &o).unwrap()).collect();
            for seed in 0..6 {
                assert!(
                    protocol_run(&plan, &scheds, 3, ALL_RULES, seed),
                    "{:?} world {world} seed {seed}",
                    plan.op
                );
            }
        }
    }

    #[test]
    fn protocol_model_catches_each_missing_rule() {
        // Without the peer-done wait, XLA may overwrite an input a peer is still copying; without
        // the ready waits, a peer may copy an input before XLA wrote it. The model must see both.
        let (plan, o) = protocol_plans().swap_remove(0);
        let scheds: Vec<Schedule> = (0..2).map(|r| build(&plan, r, &o).unwrap()).collect();
        for rules in [
            Rules {
                main_waits_peer_done: false,
                ..ALL_RULES
            },
            Rules {
                side_waits_ready: false,
                ..ALL_RULES
            },
        ] {
            let caught = (0..40).any(|seed| !protocol_run(&plan, &scheds, 3, rules, seed));
            assert!(caught, "{rules:?} not caught");
        }
    }

    // ---- The start/done protocol (`cuda::execute_phase`), modelled over calls in flight ----
    //
    // Rules A1-A6 of the `cuda` module header. Per call k, rank r, in-flight slot b = k % SLOTS
    // (each slot: its own tide stream T, side streams, events and stage slots; XLA's buffers of
    // call k are buffer set b, so calls k and k+SLOTS reuse the same memory, the worst case):
    //   start(k): X (XLA's stream) writes the inputs (XLA's producer), records `entry[b]`;
    //     T waits on `entry[b]` (A1) and records `ready[b]` (so `ready` follows the slot's
    //     previous call too, even one whose done never ran); [rendezvous]; the schedule's commands with MAIN = T
    //     (side streams wait on `done[b]` of the slot's previous call and on `ready[b]` of every
    //     rank they touch, A2); T records `done[b]`; [exit barrier]; T waits on every peer's
    //     `done[b]` and records `released[b]` (A3); [leave].
    //   done(k): X waits on `released[b]` (A4), then reads the outputs (XLA's consumer) and may
    //     overwrite the inputs (the next call on set b writes them).
    // Host order: start(0), start(1), done(0), start(2), done(1), ... (SLOTS = 2 calls in flight),
    // or start(k), done(k) back to back (the synchronous targets).

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum AEv {
        Entry(usize, usize),
        Ready(usize, usize),
        Done(usize, usize),
        Released(usize, usize),
        Local(usize, usize, usize),
    }

    #[derive(Clone, Debug)]
    enum AM {
        /// (buffer set, slot, action)
        Data(usize, usize, Action),
        Wait(AEv, u64),
        Record(AEv),
        WriteInputs(usize, usize, usize),
        ReadOutputs(usize, usize, usize),
    }

    #[derive(Clone, Copy, Debug)]
    struct AsyncRules {
        /// A1: tide's stream waits on its own `ready`.
        tide_waits_ready: bool,
        /// A2: streams wait on the `ready` of every peer they touch.
        waits_peer_ready: bool,
        /// The schedule's `WaitOwnPrevDone` (side streams on the slot's previous `done`). Implied
        /// by A1 (`ready` is recorded on T after the slot's previous call), so the engine skips it.
        side_waits_prev_done: bool,
        /// A3: `released` follows every peer's `done` (they finished reading my inputs).
        release_waits_peer_done: bool,
        /// A4: done makes XLA's stream wait on `released`.
        xla_waits_released: bool,
    }

    const ASYNC_ALL: AsyncRules = AsyncRules {
        tide_waits_ready: true,
        waits_peer_ready: true,
        side_waits_prev_done: false,
        release_waits_peer_done: true,
        xla_waits_released: true,
    };

    /// Applies `a` to XLA's buffer set `set` and the stage slots of in-flight slot `stage`.
    fn apply_split(set: &mut Mem, stage: &mut Mem, a: &Action) {
        for (k, v) in stage.drain() {
            set.insert(k, v);
        }
        apply(set, a);
        let keys: Vec<_> = set
            .keys()
            .filter(|k| k.1 == BufKind::Stage)
            .copied()
            .collect();
        for k in keys {
            stage.insert(k, set.remove(&k).unwrap());
        }
    }

    /// Stream keys: (rank, 0) is XLA's stream; (rank, 1 + slot * 64 + s) is stream `s` of the
    /// slot (s = MAIN is tide's stream T). `sets`: XLA's buffer sets (call k uses set k % sets;
    /// `slots` is the worst case, `calls` means XLA never reuses a buffer). `skip_done`: a call
    /// whose done never runs (a start without done; its outputs are not checked).
    #[allow(clippy::too_many_arguments)]
    fn async_run(
        plan: &Plan,
        scheds: &[Schedule],
        calls: usize,
        slots: usize,
        sets: usize,
        skip_done: Option<usize>,
        rules: AsyncRules,
        seed: u64,
    ) -> bool {
        let world = scheds.len();
        type Q = Map<(usize, usize), std::collections::VecDeque<AM>>;
        let mut queues: Q = Map::new();
        let mut records: Map<AEv, u64> = Map::new();
        let enq = |queues: &mut Q, records: &mut Map<AEv, u64>, key: (usize, usize), m: AM| {
            let m = match m {
                AM::Wait(ev, _) => AM::Wait(ev, *records.get(&ev).unwrap_or(&0)),
                AM::Record(ev) => {
                    *records.entry(ev).or_insert(0) += 1;
                    AM::Record(ev)
                }
                other => other,
            };
            queues.entry(key).or_default().push_back(m);
        };
        let tide = |r: usize, b: usize, s: usize| (r, 1 + b * 64 + s);
        let start = |queues: &mut Q, records: &mut Map<AEv, u64>, k: usize| {
            let b = k % slots;
            let set = k % sets;
            for r in 0..world {
                enq(queues, records, (r, 0), AM::WriteInputs(set, r, k));
                enq(queues, records, (r, 0), AM::Record(AEv::Entry(r, b)));
                if rules.tide_waits_ready {
                    enq(
                        queues,
                        records,
                        tide(r, b, MAIN),
                        AM::Wait(AEv::Entry(r, b), 0),
                    );
                }
                enq(
                    queues,
                    records,
                    tide(r, b, MAIN),
                    AM::Record(AEv::Ready(r, b)),
                );
            }
            // rendezvous
            for (r, sch) in scheds.iter().enumerate() {
                for c in &sch.phases[0].cmds {
                    let key = tide(r, b, c.stream());
                    let m = match c {
                        Cmd::WaitRank {
                            rank,
                            event: RankEvent::Ready,
                            ..
                        } => {
                            if !rules.waits_peer_ready {
                                continue;
                            }
                            AM::Wait(AEv::Ready(*rank, b), 0)
                        }
                        Cmd::WaitRank { .. } => panic!("single-phase plans only"),
                        Cmd::WaitOwnPrevDone { .. } => {
                            if !rules.side_waits_prev_done {
                                continue;
                            }
                            AM::Wait(AEv::Done(r, b), 0)
                        }
                        Cmd::Record { event, .. } => AM::Record(AEv::Local(r, b, *event)),
                        Cmd::Wait { event, .. } => AM::Wait(AEv::Local(r, b, *event), 0),
                        other => AM::Data(set, b, cmd_action(other).unwrap()),
                    };
                    enq(queues, records, key, m);
                }
                // T joins the side streams (the engine records one join event per side stream).
                for s in 1..=sch.side_streams {
                    enq(
                        queues,
                        records,
                        tide(r, b, s),
                        AM::Record(AEv::Local(r, b, 1000 + s)),
                    );
                    enq(
                        queues,
                        records,
                        tide(r, b, MAIN),
                        AM::Wait(AEv::Local(r, b, 1000 + s), 0),
                    );
                }
                enq(
                    queues,
                    records,
                    tide(r, b, MAIN),
                    AM::Record(AEv::Done(r, b)),
                );
            }
            // exit barrier
            for r in 0..world {
                if rules.release_waits_peer_done {
                    for q in (0..world).filter(|&q| q != r) {
                        enq(
                            queues,
                            records,
                            tide(r, b, MAIN),
                            AM::Wait(AEv::Done(q, b), 0),
                        );
                    }
                }
                enq(
                    queues,
                    records,
                    tide(r, b, MAIN),
                    AM::Record(AEv::Released(r, b)),
                );
            }
        };
        let done = |queues: &mut Q, records: &mut Map<AEv, u64>, k: usize| {
            if skip_done == Some(k) {
                return;
            }
            let b = k % slots;
            let set = k % sets;
            for r in 0..world {
                if rules.xla_waits_released {
                    enq(queues, records, (r, 0), AM::Wait(AEv::Released(r, b), 0));
                }
                enq(queues, records, (r, 0), AM::ReadOutputs(set, r, k));
            }
        };
        for k in 0..calls {
            start(&mut queues, &mut records, k);
            if k + 1 >= slots {
                done(&mut queues, &mut records, k + 1 - slots);
            }
        }
        for k in calls.saturating_sub(slots - 1)..calls {
            done(&mut queues, &mut records, k);
        }
        // The GPU: every stream of every rank progresses in a random legal order.
        let mut mems: Vec<Mem> = (0..sets).map(|_| init_mem(plan, 1)).collect();
        let mut stages: Vec<Mem> = (0..slots)
            .map(|_| {
                let mut m = init_mem(plan, 1);
                m.retain(|k, _| k.1 == BufKind::Stage);
                m
            })
            .collect();
        for m in &mut mems {
            m.retain(|k, _| k.1 != BufKind::Stage);
        }
        let mut executed: Map<AEv, u64> = Map::new();
        let mut seen: Map<(usize, usize), RankOutputs> = Map::new();
        let mut keys: Vec<(usize, usize)> = queues.keys().copied().collect();
        keys.sort();
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        loop {
            let runnable: Vec<(usize, usize)> = keys
                .iter()
                .copied()
                .filter(|k| match queues[k].front() {
                    None => false,
                    Some(AM::Wait(ev, target)) => executed.get(ev).copied().unwrap_or(0) >= *target,
                    Some(_) => true,
                })
                .collect();
            if runnable.is_empty() {
                assert!(queues.values().all(|q| q.is_empty()), "deadlock");
                break;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = runnable[(x % runnable.len() as u64) as usize];
            match queues.get_mut(&key).unwrap().pop_front().unwrap() {
                AM::Data(set, b, a) => apply_split(&mut mems[set], &mut stages[b], &a),
                AM::Wait(..) => {}
                AM::Record(ev) => *executed.entry(ev).or_insert(0) += 1,
                AM::WriteInputs(b, r, k) => fill_rank_inputs(&mut mems[b], r, k),
                AM::ReadOutputs(b, r, k) => {
                    seen.insert((r, k), rank_outputs(&mems[b], r));
                }
            }
        }
        for k in 0..calls {
            let mut want = init_mem(plan, 1);
            for r in 0..world {
                fill_rank_inputs(&mut want, r, k);
            }
            reference(plan, &mut want);
            for r in 0..world {
                // A call whose done never ran: nothing read its outputs, but tide's streams must
                // still have completed it, uncorrupted by the next call on its slot.
                let got = match skip_done == Some(k) {
                    true => rank_outputs(&mems[k % sets], r),
                    false => seen[&(r, k)].clone(),
                };
                if got != rank_outputs(&want, r) {
                    return false;
                }
            }
        }
        true
    }

    #[test]
    fn start_done_protocol_is_race_free_with_calls_in_flight() {
        for (plan, o) in protocol_plans() {
            let world = plan.topology.world();
            let scheds: Vec<Schedule> = (0..world).map(|r| build(&plan, r, &o).unwrap()).collect();
            for slots in [1usize, 2, 3] {
                for seed in 0..4 {
                    assert!(
                        async_run(&plan, &scheds, 5, slots, slots, None, ASYNC_ALL, seed),
                        "{:?} world {world} slots {slots} seed {seed}",
                        plan.op
                    );
                }
            }
            // A start without done (call 1): its slot is taken again by call 1 + slots; tide's
            // own resources stay race-free (XLA's buffers are distinct here: `sets = calls`).
            for seed in 0..4 {
                assert!(
                    async_run(&plan, &scheds, 5, 2, 5, Some(1), ASYNC_ALL, seed),
                    "{:?} world {world} start without done, seed {seed}",
                    plan.op
                );
            }
        }
    }

    #[test]
    fn start_done_model_catches_each_missing_rule() {
        // Each rule guards a real race: without A1 tide reads inputs before XLA wrote them (and
        // overwrites outputs XLA still reads); A2's peer ready waits, the same for peers' inputs;
        // A2's previous-done wait, a stage slot refilled while the slot's previous call reduces
        // it; A3, XLA overwrites an input a peer still copies; A4, XLA reads outputs not written.
        let plans = protocol_plans();
        let ag = &plans[0];
        // (The schedule's previous-done wait is not needed: `ready` is recorded on T, after the
        // slot's previous call; `start_done_protocol_is_race_free_with_calls_in_flight` runs
        // without it, a start without done included.)
        for (which, skip, rules) in [
            (
                ag,
                None,
                AsyncRules {
                    tide_waits_ready: false,
                    waits_peer_ready: false,
                    ..ASYNC_ALL
                },
            ),
            (
                ag,
                None,
                AsyncRules {
                    waits_peer_ready: false,
                    ..ASYNC_ALL
                },
            ),
            (
                ag,
                None,
                AsyncRules {
                    release_waits_peer_done: false,
                    ..ASYNC_ALL
                },
            ),
            (
                ag,
                None,
                AsyncRules {
                    xla_waits_released: false,
                    ..ASYNC_ALL
                },
            ),
        ] {
            let (plan, o) = which;
            let world = plan.topology.world();
            let scheds: Vec<Schedule> = (0..world).map(|r| build(plan, r, o).unwrap()).collect();
            let sets = if skip.is_some() { 5 } else { 2 };
            let caught =
                (0..300).any(|seed| !async_run(plan, &scheds, 6, 2, sets, skip, rules, seed));
            assert!(caught, "{rules:?} not caught on {:?}", plan.op);
        }
    }
}
