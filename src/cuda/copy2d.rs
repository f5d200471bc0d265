//! 2-D copies on the copy engines (issue #37, [Note: strided parameters] in `layout.rs`): how the
//! 2-D copies of one stream (`schedule::Cmd::Copy2D`: a peer's rows landing in a result gathered
//! along dim k > 0, a strided slice staged into a reduce-scatter slot) are handed to the driver
//! under TIDE_COPY2D (`config::Copy2d`). Pure and unit-tested here; `issue::Issuer` collects a
//! stream's copies in a `Pending`, asks `issue_plan` for the driver operations and issues them.
//!
//! - `1` (`PerPiece`): each copy at once, one cuMemcpy2DAsync per piece of at most
//!   TIDE_CE_PIECE_BYTES in whole rows (`pieces`).
//! - `batch`: a stream's consecutive independent copies, in those pieces, as one
//!   cuMemcpy3DBatchAsync_v2 of depth-1 operations (`driver::batch_op_2d`), at most `BATCH_OPS`
//!   operations per call.
//! - `bands`: the copies cut into row bands of `band_rows` rows, issued band-major (`bands`: band b
//!   of every copy, then band b + 1), one cuMemcpy2DAsync each: the copies in flight together land
//!   neighbouring rows of the result (a peer's band b next to the other peers' band b).
//! - `batch-bands`: the same bands, band-major, as cuMemcpy3DBatchAsync_v2 calls.
//!
//! Every variant is a copy-engine copy (no SM kernel: docs/design.md "2-D copies"). Where the driver
//! lacks cuMemcpy3DBatchAsync_v2, `issue_plan(.., batch_ok = false)` gives `batch` as `1` and
//! `batch-bands` as `bands` (the issuer logs it once).
//!
//! Ordering contract: a copy joins a stream's pending copies only if it touches no byte another
//! pending copy writes, and writes none another reads (`joins`); so the pending copies may run in
//! any order and at once, as the operations of one batch do. The issuer issues a stream's pending
//! copies before any other command on that stream (and its pending 1-D copies before a 2-D copy
//! joins), so stream order holds everywhere else. Together the operations of `issue_plan` move
//! exactly the rows of the copies handed to it, each once (tested below).

use super::driver::StridedCopy;
use crate::config::Copy2d;

/// The most operations one cuMemcpy3DBatchAsync_v2 call carries (a longer list goes as several
/// calls, in stream order; the driver documents no limit, so this only bounds one call's
/// descriptor array).
pub const BATCH_OPS: usize = 1024;

/// The pieces of a 2-D copy of `blocks` blocks of `bytes` bytes, one `cuMemcpy2DAsync` each: (first
/// block, blocks) ranges of equal size (the last one shorter) covering `0..blocks` in order, each
/// moving at most `max_piece` bytes (at least one block): the size rule of `fuse::ce_pieces`, in
/// whole blocks. No second piece is forced: each piece is a driver call of its own here.
pub fn pieces(blocks: usize, bytes: usize, max_piece: usize) -> Vec<(usize, usize)> {
    if blocks == 0 {
        return Vec::new();
    }
    let per = (max_piece.max(4096) / bytes.max(1)).max(1);
    let size = blocks.div_ceil(blocks.div_ceil(per));
    (0..blocks).step_by(size).map(|first| (first, size.min(blocks - first))).collect()
}

/// Rows `first..first + count` of `c` as a copy of their own.
pub fn sub_rows(c: &StridedCopy, first: usize, count: usize) -> StridedCopy {
    StridedCopy {
        dst: c.dst + (first * c.dst_pitch) as u64,
        src: c.src + (first * c.src_pitch) as u64,
        rows: count,
        ..*c
    }
}

/// `count` rows of `width` bytes, `pitch` apart, from `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub at: u64,
    pub pitch: usize,
    pub width: usize,
    pub count: usize,
}

impl Rows {
    pub fn dst_of(c: &StridedCopy) -> Rows {
        Rows { at: c.dst, pitch: c.dst_pitch, width: c.width, count: c.rows }
    }
    pub fn src_of(c: &StridedCopy) -> Rows {
        Rows { at: c.src, pitch: c.src_pitch, width: c.width, count: c.rows }
    }

    /// From the first byte of the first row to the end of the last.
    fn span(&self) -> (i128, i128) {
        let a = self.at as i128;
        (a, a + (self.count as i128 - 1) * self.pitch as i128 + self.width as i128)
    }

    /// Whether the two share a byte. Exact where both step by the same pitch (or either is one
    /// row), which is every pair a plan's 2-D copies of one parameter or slot make; otherwise the
    /// spans are compared (interleaved rows that never touch count as overlapping: safe, it only
    /// ends a batch early).
    pub fn overlaps(&self, o: &Rows) -> bool {
        if self.count == 0 || o.count == 0 || self.width == 0 || o.width == 0 {
            return false;
        }
        let (mut a, mut b) = (*self, *o);
        if a.count == 1 {
            a.pitch = b.pitch;
        }
        if b.count == 1 {
            b.pitch = a.pitch;
        }
        if a.pitch != b.pitch || a.pitch == 0 {
            let ((a0, a1), (b0, b1)) = (self.span(), o.span());
            return a0 < b1 && b0 < a1;
        }
        // Row j of a and row k of b meet iff d - wa < m p < d + wb, m = j - k, d = b.at - a.at;
        // m p grows with m, so the least m above (d - wa) / p that is a possible j - k decides.
        let (p, d) = (a.pitch as i128, b.at as i128 - a.at as i128);
        let (wa, wb) = (a.width as i128, b.width as i128);
        let m = (d - wa).div_euclid(p) + 1;
        let m = m.max(-(b.count as i128 - 1));
        m < a.count as i128 && m * p < d + wb
    }
}

/// Whether `a` and `b` may not run at once (one writes bytes the other reads or writes).
pub fn conflicts(a: &StridedCopy, b: &StridedCopy) -> bool {
    let (ad, bd) = (Rows::dst_of(a), Rows::dst_of(b));
    ad.overlaps(&bd) || ad.overlaps(&Rows::src_of(b)) || Rows::src_of(a).overlaps(&bd)
}

/// Whether `c` may join `pending` (one batch, any order).
pub fn joins(pending: &[StridedCopy], c: &StridedCopy) -> bool {
    !pending.iter().any(|p| conflicts(p, c))
}

/// Rows of one band of a copy of `width`-byte rows: about `band_bytes`, at most `max_piece` bytes
/// (as a piece), at least one row.
pub fn band_rows(width: usize, band_bytes: usize, max_piece: usize) -> usize {
    (band_bytes.min(max_piece.max(4096)) / width.max(1)).max(1)
}

/// The copies cut into bands of `band_rows(.., band_bytes, max_piece)` rows (the last band of
/// each shorter), band-major: band 0 of every copy in the given order, then band 1, ...
pub fn bands(copies: &[StridedCopy], band_bytes: usize, max_piece: usize) -> Vec<StridedCopy> {
    let per: Vec<usize> = copies.iter().map(|c| band_rows(c.width, band_bytes, max_piece)).collect();
    let nbands = copies.iter().zip(&per).map(|(c, &r)| c.rows.div_ceil(r)).max().unwrap_or(0);
    let mut out = Vec::with_capacity(copies.iter().zip(&per).map(|(c, &r)| c.rows.div_ceil(r)).sum());
    for b in 0..nbands {
        for (c, &r) in copies.iter().zip(&per) {
            let first = b * r;
            if first < c.rows {
                out.push(sub_rows(c, first, r.min(c.rows - first)));
            }
        }
    }
    out
}

/// One driver operation of a flush.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op2d {
    /// One cuMemcpy2DAsync.
    One(StridedCopy),
    /// One cuMemcpy3DBatchAsync_v2 (at most `BATCH_OPS` copies).
    Batch(Vec<StridedCopy>),
}

/// The driver operations, in issue order, that land `copies` (pairwise independent: `joins`)
/// under `via`: pieces of at most `max_piece` bytes (`pieces`) or bands of about `band_bytes`
/// (`bands`), each its own cuMemcpy2DAsync or together in batches. `batch_ok`: whether the driver
/// has cuMemcpy3DBatchAsync_v2 (without it, `batch` issues as `1`, `batch-bands` as `bands`).
/// Empty copies (no rows or no bytes) are left out (the driver refuses a zero extent).
pub fn issue_plan(copies: &[StridedCopy], via: Copy2d, band_bytes: usize, max_piece: usize, batch_ok: bool) -> Vec<Op2d> {
    let copies: Vec<StridedCopy> = copies.iter().filter(|c| c.rows > 0 && c.width > 0).copied().collect();
    let split = if via.banded() {
        bands(&copies, band_bytes, max_piece)
    } else {
        copies
            .iter()
            .flat_map(|c| pieces(c.rows, c.width, max_piece).into_iter().map(move |(first, n)| sub_rows(c, first, n)))
            .collect()
    };
    if via.batched() && batch_ok {
        split.chunks(BATCH_OPS).map(|ch| Op2d::Batch(ch.to_vec())).collect()
    } else {
        split.into_iter().map(Op2d::One).collect()
    }
}

/// The 2-D copies collected per stream (`issue::Issuer`; index = schedule stream, MAIN first).
#[derive(Debug, Default)]
pub struct Pending {
    per_stream: Vec<Vec<StridedCopy>>,
}

impl Pending {
    pub fn new(streams: usize) -> Pending {
        Pending { per_stream: vec![Vec::new(); streams] }
    }

    /// Adds `c` to stream `s`'s copies; where it may not join them (`joins`), returns them first
    /// (to be issued before it) and starts a new list with `c`.
    pub fn push(&mut self, s: usize, c: StridedCopy) -> Option<Vec<StridedCopy>> {
        if s >= self.per_stream.len() {
            self.per_stream.resize(s + 1, Vec::new());
        }
        let list = &mut self.per_stream[s];
        let earlier = if joins(list, &c) { None } else { Some(std::mem::take(list)) };
        list.push(c);
        earlier
    }

    /// Stream `s`'s copies, taken (empty if none).
    pub fn take(&mut self, s: usize) -> Vec<StridedCopy> {
        self.per_stream.get_mut(s).map(std::mem::take).unwrap_or_default()
    }

    pub fn is_empty(&self, s: usize) -> bool {
        self.per_stream.get(s).is_none_or(|l| l.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn copy(dst: u64, dst_pitch: usize, src: u64, src_pitch: usize, width: usize, rows: usize) -> StridedCopy {
        StridedCopy { dst, dst_pitch, src, src_pitch, width, rows, dst_dev: 0, src_dev: 0 }
    }

    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Every row an operation list moves, (destination, source, bytes), with how often (pieces and
    /// bands never cut a row).
    fn moved(ops: &[StridedCopy]) -> HashMap<(u64, u64, usize), usize> {
        let mut m = HashMap::new();
        for c in ops {
            for j in 0..c.rows {
                let row = (c.dst + (j * c.dst_pitch) as u64, c.src + (j * c.src_pitch) as u64, c.width);
                *m.entry(row).or_insert(0) += 1;
            }
        }
        m
    }

    fn flat(ops: &[Op2d]) -> Vec<StridedCopy> {
        ops.iter()
            .flat_map(|o| match o {
                Op2d::One(c) => vec![*c],
                Op2d::Batch(v) => v.clone(),
            })
            .collect()
    }

    #[test]
    fn pieces_cover_whole_blocks_in_bounded_pieces() {
        for blocks in [0usize, 1, 2, 7, 4096, 14336] {
            for bytes in [1usize, 1000, 4096, 1 << 20, 40 << 20] {
                for max_piece in [4096usize, 1 << 20, 32 << 20] {
                    let pieces = pieces(blocks, bytes, max_piece);
                    let mut next = 0;
                    for &(first, n) in &pieces {
                        assert_eq!(first, next);
                        assert!(n >= 1 && (n == 1 || n * bytes <= max_piece), "{blocks} {bytes} {max_piece}: {pieces:?}");
                        next += n;
                    }
                    assert_eq!(next, blocks);
                }
            }
        }
        // 14336 blocks of 1 KiB (a peer's rows of a [14336, 4096] bf16 weight gathered along dim 1
        // at world 8) in 32 MiB pieces: one piece; in 4 MiB pieces: 4 equal ones.
        assert_eq!(pieces(14336, 1024, 32 << 20), vec![(0, 14336)]);
        assert_eq!(pieces(14336, 1024, 4 << 20), vec![(0, 3584), (3584, 3584), (7168, 3584), (10752, 3584)]);
    }

    #[test]
    fn overlap_is_exact_for_one_pitch_and_never_missed() {
        let brute = |a: &Rows, b: &Rows| {
            a.width > 0 && b.width > 0 && (0..a.count).any(|j| {
                (0..b.count).any(|k| {
                    let (x, y) = (a.at + (j * a.pitch) as u64, b.at + (k * b.pitch) as u64);
                    x < y + b.width as u64 && y < x + a.width as u64
                })
            })
        };
        let mut x = 12345u64;
        let mut r = |n: usize| (xorshift(&mut x) % n as u64) as usize;
        for case in 0..20_000 {
            let pa = 1 + r(40);
            let pb = if case % 3 == 0 { 1 + r(40) } else { pa };
            let a = Rows { at: 1000 + r(200) as u64, pitch: pa, width: r(pa + 1), count: r(6) };
            let b = Rows { at: 1000 + r(200) as u64, pitch: pb, width: r(pb + 1), count: r(6) };
            let (got, want) = (a.overlaps(&b), brute(&a, &b));
            assert_eq!(got, b.overlaps(&a), "symmetric: {a:?} {b:?}");
            if pa == pb || a.count <= 1 || b.count <= 1 {
                assert_eq!(got, want, "{a:?} {b:?}");
            } else {
                assert!(got || !want, "an overlap missed: {a:?} {b:?}");
            }
        }
        // The all-gather's pieces of one result: peers' rows interleave and never touch.
        let peer = |q: u64| copy(1 << 30 | (q * 3584), 28672, (1 << 32) + (q << 24), 3584, 3584, 4096);
        let all: Vec<StridedCopy> = (0..8).map(peer).collect();
        for q in 1..8 {
            assert!(joins(&all[..q], &all[q]), "peer {q} joins the others");
        }
        assert!(!joins(&all, &StridedCopy { width: 3585, ..all[3] }), "a row one byte wider touches the next peer's");
        assert!(!joins(&all, &copy(7, 1, all[5].dst + 28672 * 9 + 100, 1, 1, 1)), "reads a pending destination");
    }

    #[test]
    fn bands_cover_every_row_once_band_major() {
        let mut x = 99u64;
        for case in 0..400 {
            let n = 1 + (xorshift(&mut x) % 9) as usize;
            let mut copies = Vec::new();
            for k in 0..n {
                let width = 1 + (xorshift(&mut x) % 5000) as usize;
                let rows = (xorshift(&mut x) % 300) as usize + usize::from(case % 2 == 0);
                let dst_pitch = width * (1 + n) + (xorshift(&mut x) % 64) as usize;
                copies.push(copy((k as u64) * width as u64 + (1 << 40), dst_pitch, (k as u64) << 32, width, width, rows));
            }
            let band_bytes = 1 + (xorshift(&mut x) % 70_000) as usize;
            let max_piece = [4096usize, 1 << 20, 32 << 20][case % 3];
            let out = bands(&copies, band_bytes, max_piece);
            // Every row of every copy exactly once, nothing else.
            let mut seen: HashMap<(usize, usize), usize> = HashMap::new();
            let mut last_band = 0;
            for b in &out {
                let k = copies.iter().position(|c| c.src >> 32 == b.src >> 32).unwrap();
                let c = &copies[k];
                assert_eq!((b.width, b.dst_pitch, b.src_pitch), (c.width, c.dst_pitch, c.src_pitch));
                let first = ((b.src - c.src) as usize) / c.src_pitch;
                assert_eq!(b.src, c.src + (first * c.src_pitch) as u64, "source offset in whole rows");
                assert_eq!(b.dst, c.dst + (first * c.dst_pitch) as u64, "destination offset of the same row");
                let per = band_rows(c.width, band_bytes, max_piece);
                assert_eq!(first % per, 0, "bands start at multiples of the band");
                assert!(b.rows >= 1 && b.rows <= per && (b.rows == 1 || b.rows * b.width <= max_piece.max(4096)));
                assert!(first / per >= last_band, "band-major: band {} after band {last_band}", first / per);
                last_band = first / per;
                for j in first..first + b.rows {
                    *seen.entry((k, j)).or_insert(0) += 1;
                }
            }
            let want: usize = copies.iter().map(|c| c.rows).sum();
            assert_eq!(seen.len(), want, "case {case}");
            assert!(seen.values().all(|&v| v == 1));
        }
        // 8 peers of 4096 rows of 3584 bytes in 1 MiB bands: 292 rows each (the last 8 rows), 15
        // bands, band 0 of every peer first.
        let peers: Vec<StridedCopy> = (0..8u64).map(|q| copy(q * 3584, 28672, q << 32, 3584, 3584, 4096)).collect();
        let out = bands(&peers, 1 << 20, 32 << 20);
        assert_eq!(out.len(), 15 * 8);
        assert_eq!(out[..8].iter().map(|b| (b.rows, b.dst)).collect::<Vec<_>>(), (0..8u64).map(|q| (292, q * 3584)).collect::<Vec<_>>());
        assert_eq!((out[8].dst, out[8].src), (292 * 28672, 292 * 3584));
        assert_eq!(out[119].rows, 4096 - 14 * 292);
    }

    #[test]
    fn every_variant_moves_each_row_once() {
        let mut x = 7u64;
        for case in 0..200 {
            let n = 1 + (xorshift(&mut x) % 8) as usize;
            let width = 1 + (xorshift(&mut x) % 9000) as usize;
            let rows = (xorshift(&mut x) % 40) as usize + usize::from(case % 5 != 0);
            let copies: Vec<StridedCopy> =
                (0..n).map(|q| copy((1 << 30) + (q * width) as u64, width * n, (q as u64) << 32, width, width, rows)).collect();
            let want = moved(&copies);
            let band_bytes = 1 + (xorshift(&mut x) % 50_000) as usize;
            let max_piece = [4096usize, 65536, 32 << 20][case % 3];
            for via in [Copy2d::PerPiece, Copy2d::Batch, Copy2d::Bands, Copy2d::BatchBands] {
                for batch_ok in [true, false] {
                    let ops = issue_plan(&copies, via, band_bytes, max_piece, batch_ok);
                    assert_eq!(moved(&flat(&ops)), want, "{via:?} batch_ok {batch_ok} case {case}");
                    for o in &ops {
                        match o {
                            Op2d::One(c) => {
                                assert!(!(via.batched() && batch_ok), "{via:?}: a lone copy");
                                assert!(c.rows >= 1 && c.width >= 1);
                                assert!(c.rows == 1 || c.rows * c.width <= max_piece.max(4096), "{via:?}: {c:?}");
                            }
                            Op2d::Batch(v) => {
                                assert!(via.batched() && batch_ok, "{via:?}: batched");
                                assert!(!v.is_empty() && v.len() <= BATCH_OPS);
                            }
                        }
                    }
                }
            }
            // `1` keeps today's operations: the pieces of each copy in order.
            let per_piece = flat(&issue_plan(&copies, Copy2d::PerPiece, band_bytes, max_piece, true));
            let today: Vec<StridedCopy> =
                copies.iter().flat_map(|c| pieces(rows, width, max_piece).into_iter().map(move |(f, k)| sub_rows(c, f, k))).collect();
            assert_eq!(per_piece, today);
        }
        // Many small bands: batches of at most BATCH_OPS, in order.
        let many: Vec<StridedCopy> = (0..4u64).map(|q| copy(q * 16, 64, q << 32, 16, 16, 1000)).collect();
        let ops = issue_plan(&many, Copy2d::BatchBands, 16, 32 << 20, true);
        assert_eq!(ops.iter().map(|o| if let Op2d::Batch(v) = o { v.len() } else { 0 }).collect::<Vec<_>>(), vec![1024, 1024, 1024, 928]);
        assert_eq!(moved(&flat(&ops)), moved(&many));
        // An empty copy is left out.
        assert!(issue_plan(&[copy(0, 16, 1 << 20, 16, 16, 0)], Copy2d::Batch, 1, 4096, true).is_empty());
    }

    #[test]
    fn pending_copies_split_where_they_conflict() {
        let mut p = Pending::new(2);
        let a = copy(1000, 64, 1 << 20, 16, 16, 4);
        let b = copy(1016, 64, 2 << 20, 16, 16, 4);
        assert_eq!(p.push(1, a), None);
        assert_eq!(p.push(1, b), None, "interleaved rows that never touch join");
        assert!(p.is_empty(0) && !p.is_empty(1));
        let c = copy(3 << 20, 16, 1000 + 64 * 3, 16, 16, 1);
        assert_eq!(p.push(1, c), Some(vec![a, b]), "reads a pending destination: the others go first");
        assert_eq!(p.take(1), vec![c]);
        assert!(p.is_empty(1));
        assert_eq!(p.push(5, a), None, "streams grow on demand");
        assert_eq!(p.take(5), vec![a]);
    }

    /// A strided all-gather as the engine lands it: every rank's schedule (2-D copies kept), each
    /// stream's 2-D copies collected as the issuer does (`Pending`, issued before any other command
    /// of their stream) and issued under each variant, run on a byte-addressed memory: the CPU
    /// engine's result, bitwise. Odd shapes, world 3 and 8, pieces and bands that do not divide.
    #[test]
    fn strided_gathers_land_as_the_cpu_engine_under_every_variant() {
        use crate::cuda::schedule::{self, Cmd, SchedOptions};
        use crate::layout::{DType, GroupLayout, ParamSpec};
        use crate::plan::{BufKind, Region};
        for world in [3usize, 8] {
            let specs = vec![
                ParamSpec::new("experts.up", &[4, 2 * world, 33], DType::BF16).along(1),
                ParamSpec::new("w_cols", &[64, 3 * world], DType::F32).along(1),
                ParamSpec::new("w7x5", &[7, 5], DType::BF16),
                ParamSpec::new("experts.down", &[3, 5, 4 * world], DType::F16).along(2),
                ParamSpec::new("big_cols", &[512, 8 * world], DType::BF16).along(1),
            ];
            let layout = GroupLayout::new(&specs, world).unwrap();
            let plan = crate::plan::all_gather(&layout, crate::topology::Topology::single_node(world)).unwrap();
            let n = layout.len();
            let mut x = 5u64;
            let inputs: Vec<Vec<Vec<u8>>> =
                (0..world).map(|_| (0..n).map(|i| (0..plan.input_bytes(i)).map(|_| xorshift(&mut x) as u8).collect()).collect()).collect();
            let want = crate::engine::cpu::run_threads(&plan, &inputs).unwrap();
            // One address space: buffer (rank, kind, index) at base + offset, 4 KiB apart.
            let mut bases: HashMap<(usize, BufKind, usize), (u64, usize)> = HashMap::new();
            let mut top = 1u64 << 20;
            for r in 0..world {
                for i in 0..n {
                    for (kind, bytes) in [(BufKind::Input, plan.input_bytes(i)), (BufKind::Output, plan.output_bytes(i))] {
                        bases.insert((r, kind, i), (top, bytes));
                        top += (bytes as u64).div_ceil(4096) * 4096 + 4096;
                    }
                }
            }
            let addr = |reg: &Region| bases[&(reg.rank, reg.kind, reg.index)].0 + reg.offset as u64;
            for streams in [1usize, 3] {
                for rank in [0, world - 1] {
                    let sched = schedule::build(&plan, rank, &SchedOptions::new(streams, crate::config::LocalCopy::CopyEnginePeers)).unwrap();
                    for via in [Copy2d::PerPiece, Copy2d::Batch, Copy2d::Bands, Copy2d::BatchBands] {
                        for (band_bytes, max_piece) in [(40usize, 4096usize), (3000, 1 << 20), (2 << 20, 32 << 20)] {
                            let mut mem = vec![0xa5u8; top as usize];
                            for r in 0..world {
                                for i in 0..n {
                                    let b = bases[&(r, BufKind::Input, i)].0 as usize;
                                    mem[b..b + inputs[r][i].len()].copy_from_slice(&inputs[r][i]);
                                }
                            }
                            let run = |mem: &mut Vec<u8>, list: Vec<StridedCopy>| {
                                for c in flat(&issue_plan(&list, via, band_bytes, max_piece, true)) {
                                    for j in 0..c.rows {
                                        let (d, s) = (c.dst as usize + j * c.dst_pitch, c.src as usize + j * c.src_pitch);
                                        mem.copy_within(s..s + c.width, d);
                                    }
                                }
                            };
                            let mut pending = Pending::new(streams + 2);
                            for ph in &sched.phases {
                                for cmd in &ph.cmds {
                                    let s = cmd.stream();
                                    match cmd {
                                        Cmd::Copy2D { src, dst, bytes, blocks, src_pitch, dst_pitch, .. } => {
                                            let c = StridedCopy {
                                                dst: addr(dst),
                                                dst_pitch: *dst_pitch,
                                                src: addr(src),
                                                src_pitch: *src_pitch,
                                                width: *bytes,
                                                rows: *blocks,
                                                dst_dev: 0,
                                                src_dev: 0,
                                            };
                                            if via == Copy2d::PerPiece {
                                                run(&mut mem, vec![c]);
                                            } else if let Some(earlier) = pending.push(s, c) {
                                                run(&mut mem, earlier);
                                            }
                                        }
                                        other => {
                                            let list = pending.take(s);
                                            run(&mut mem, list);
                                            if let Cmd::Copy { src, dst, bytes, .. } = other {
                                                let (d, s) = (addr(dst) as usize, addr(src) as usize);
                                                mem.copy_within(s..s + bytes, d);
                                            }
                                        }
                                    }
                                }
                                for s in 0..streams + 2 {
                                    let list = pending.take(s);
                                    run(&mut mem, list);
                                }
                            }
                            for i in 0..n {
                                let (b, bytes) = bases[&(rank, BufKind::Output, i)];
                                assert!(
                                    mem[b as usize..b as usize + bytes] == want[rank][i][..],
                                    "world {world} rank {rank} streams {streams} {via:?} bands {band_bytes} pieces {max_piece}: {} differs",
                                    specs[i].name
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
