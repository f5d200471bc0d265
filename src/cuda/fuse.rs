//! Batched launches of small segments (TIDE_FUSE_BYTES, in-process path): a group of many small
//! parameters used to cost one driver operation per parameter and stream (a copy-engine copy, a
//! `tide_copy` or an `rs_sum` launch; 5-7 us each on one H200, issue #9). Runs of such segments on
//! one stream are collected here and issued as `tide_copy_batch` / `rs_sum_batch_*` launches
//! (kernels/rs_sum.cu: up to `COPY_BATCH` copies or `SUM_BATCH` sums per launch, one CTA per
//! segment at a time, at most TIDE_RS_MAX_CTAS CTAs, the same bodies as the single kernels, so bitwise equal).
//!
//! Ordering contract: the segments of one batched launch run concurrently, so a segment joins a
//! pending batch only if it touches bytes disjoint from every pending segment (none writes what
//! another reads or writes); otherwise the batch is issued first. The caller issues a stream's
//! pending batch before any other command on that stream (events, waits, other work), so stream
//! order is kept everywhere else. Collection and packing are pure and unit-tested here; the launch
//! is one `cuLaunchKernel` with the descriptor struct as its parameter (`__grid_constant__`).

use super::device::Module;
use super::driver::{self, CUstream};
use super::kernels::{self, CopyBatch, SumBatch, COPY_BATCH, MAX_SRCS, SUM_BATCH};
use crate::error::{Result, TideError};
use crate::layout::DType;

/// A copy waiting to be issued (copy-engine or SM), with the devices holding its two ends: the
/// driver's batched copy.
pub use super::driver::BatchCopy as PendingCopy;

/// One `rs_sum` launch's worth of a Reduce (`nsrc <= MAX_SRCS` sources of one dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumSeg {
    pub dtype: DType,
    pub dst: u64,
    pub srcs: [u64; MAX_SRCS],
    pub nsrc: usize,
    pub elems: u64,
    pub accumulate: bool,
    /// `kernels::sum_mode`.
    pub mode: i32,
}

fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    alen > 0 && blen > 0 && a < b + blen && b < a + alen
}

impl PendingCopy {
    /// Whether this copy and `o` may not run concurrently.
    pub fn conflicts(&self, o: &PendingCopy) -> bool {
        let (n, m) = (self.bytes as u64, o.bytes as u64);
        overlaps(self.dst, n, o.dst, m) || overlaps(self.dst, n, o.src, m) || overlaps(self.src, n, o.dst, m)
    }
}

impl SumSeg {
    fn dst_len(&self) -> u64 {
        self.elems * 4
    }
    fn src_len(&self) -> u64 {
        self.elems * self.dtype.size_bytes() as u64
    }
    /// Whether this sum and `o` may not run concurrently.
    pub fn conflicts(&self, o: &SumSeg) -> bool {
        let writes = |a: &SumSeg, b: &SumSeg| {
            overlaps(a.dst, a.dst_len(), b.dst, b.dst_len())
                || b.srcs[..b.nsrc].iter().any(|&s| overlaps(a.dst, a.dst_len(), s, b.src_len()))
        };
        writes(self, o) || writes(o, self)
    }
}

/// Whether `c` may join `pending` (same batch) without reordering conflicting work.
pub fn copy_joins(pending: &[PendingCopy], c: &PendingCopy) -> bool {
    !pending.iter().any(|p| p.conflicts(c))
}

/// Whether the `small` copies (each under TIDE_FUSE_BYTES) pending on a stream go as batched SM
/// launches: on tide's own stream (`on_main`: SM copies) whenever there are any; on a copy stream
/// only from `ce_min` of them (TIDE_FUSE_CE_MIN; at least 2: one small copy stays on the copy
/// engine; 0 = never), since a copy-engine copy progresses beside a kernel that holds every SM and
/// an SM launch does not (issue #38).
pub fn fuses_copies(on_main: bool, small: usize, ce_min: usize) -> bool {
    small > 0 && (on_main || (ce_min > 0 && small >= ce_min.max(2)))
}

/// Segments per batched sum launch: one CTA each, so at most TIDE_RS_MAX_CTAS (and `SUM_BATCH`).
pub fn sum_batch_limit(max_ctas: u32) -> usize {
    (max_ctas.max(1) as usize).min(SUM_BATCH)
}

/// Whether `s` may join the pending sums: same dtype (one kernel per dtype), fewer than `limit`
/// (`sum_batch_limit`), no conflict.
pub fn sum_joins(pending: &[SumSeg], s: &SumSeg, limit: usize) -> bool {
    pending.len() < limit
        && pending.first().is_none_or(|p| p.dtype == s.dtype)
        && !pending.iter().any(|p| p.conflicts(s))
}

/// The copies a copy-engine batch issues (issue #22): each copy in pieces of at most `max_piece`
/// bytes, and at least `CE_MIN_PIECES` pieces in all where the bytes allow, split at multiples of
/// 4 KiB from each copy's start (of 256, 16 or 1 bytes for small copies). Measured on one H200
/// (bench/results/2026-12-03-1h200, runs 1-2): what decides is the size of a piece. A same-device
/// copy of 256 MiB in one piece (cuMemcpyAsync or a one-entry cuMemcpyBatchAsync) runs on SMs (a
/// one-wave GEMM beside it +63 to +67 %), in 2 pieces of 128 MiB partly (+28 %), in 8 pieces of 32
/// MiB on copy engines (+0.8 to +3.6 %); a lone 32 MiB copy on copy engines too (+0.9 %). The
/// second piece is cheap insurance, not the cause. Pieces of one copy are disjoint, so they may run
/// in any order, as a batch's copies do.
pub fn ce_pieces(copies: &[PendingCopy], max_piece: usize) -> Vec<PendingCopy> {
    let max_piece = max_piece.max(4096);
    let mut out: Vec<PendingCopy> = Vec::new();
    for c in copies {
        let n = c.bytes.div_ceil(max_piece).max(1);
        let size = c.bytes.div_ceil(n).div_ceil(4096) * 4096;
        let mut off = 0;
        while off < c.bytes || (off == 0 && c.bytes == 0) {
            let b = size.min(c.bytes - off);
            out.push(PendingCopy { dst: c.dst + off as u64, src: c.src + off as u64, bytes: b, ..*c });
            off += b.max(1);
        }
    }
    // Fewer than CE_MIN_PIECES: halve the largest piece (while it can be halved).
    while out.len() < CE_MIN_PIECES {
        let Some((k, big)) = out.iter().enumerate().max_by_key(|(_, c)| c.bytes).map(|(k, c)| (k, *c)) else {
            break;
        };
        let unit = [4096usize, 256, 16, 1].into_iter().find(|&u| big.bytes >= 2 * u).unwrap_or(1);
        let half = (big.bytes / 2) / unit * unit;
        if half == 0 {
            break;
        }
        out[k].bytes = half;
        out.insert(k + 1, PendingCopy { dst: big.dst + half as u64, src: big.src + half as u64, bytes: big.bytes - half, ..big });
    }
    out
}

/// Copies of one copy-engine batch: at least this many (`ce_pieces`).
pub const CE_MIN_PIECES: usize = 2;

/// The descriptor structs of batched copy launches (`COPY_BATCH` segments each).
pub fn pack_copies(copies: &[PendingCopy]) -> Vec<(CopyBatch, i32)> {
    copies
        .chunks(COPY_BATCH)
        .map(|chunk| {
            let mut b = CopyBatch::default();
            for (k, c) in chunk.iter().enumerate() {
                b.dst[k] = c.dst;
                b.src[k] = c.src;
                b.bytes[k] = c.bytes as u64;
                b.width[k] = kernels::copy_width(c.dst, c.src);
            }
            (b, chunk.len() as i32)
        })
        .collect()
}

/// The descriptor struct of one batched sum launch (at most `SUM_BATCH` segments of one dtype).
pub fn pack_sums(sums: &[SumSeg]) -> Result<(SumBatch, i32)> {
    if sums.len() > SUM_BATCH || sums.iter().any(|s| s.dtype != sums[0].dtype || s.nsrc == 0 || s.nsrc > MAX_SRCS) {
        return Err(TideError::Internal(format!("malformed sum batch of {} segments", sums.len())));
    }
    let mut b = SumBatch::default();
    for (k, s) in sums.iter().enumerate() {
        b.dst[k] = s.dst;
        b.n[k] = s.elems;
        b.src[k] = s.srcs;
        b.nsrc[k] = s.nsrc as i32;
        b.accumulate[k] = s.accumulate as i32;
        b.vectorized[k] = s.mode;
    }
    Ok((b, sums.len() as i32))
}

/// One batched launch: `f(batch, count)` on `stream` with `grid` CTAs.
fn launch<T>(f: driver::CUfunction, batch: &mut T, count: i32, grid: u32, stream: CUstream, what: &dyn Fn() -> String) -> Result<()> {
    let mut count = count;
    let mut params: [*mut std::ffi::c_void; 2] = [batch as *mut T as *mut _, &mut count as *mut i32 as *mut _];
    // SAFETY: params match `(const __grid_constant__ Tide*Batch, int)` (T is the repr(C) twin of
    // the descriptor struct) and live across the call (the driver copies them at launch); the
    // caller bounds-checked every segment's range against its buffer.
    unsafe {
        driver::launch_kernel(f, grid, kernels::threads(), stream, &mut params, "cuLaunchKernel(batched)", || {
            format!("{}, {count} segments, grid {grid}", what())
        })
    }
}

/// Issues `copies` (each range checked by the caller, pairwise independent) as batched copy launches.
pub fn issue_copies(m: &Module, stream: CUstream, copies: &[PendingCopy], max_ctas: u32, what: &dyn Fn() -> String) -> Result<()> {
    for (mut b, n) in pack_copies(copies) {
        launch(m.copy_batch, &mut b, n, (n.max(1) as u32).min(max_ctas.max(1)), stream, what)?;
    }
    Ok(())
}

/// Issues `sums` (one dtype, pairwise independent, at most `sum_batch_limit(max_ctas)`) as one
/// batched sum launch of one CTA per segment.
pub fn issue_sums(m: &Module, stream: CUstream, sums: &[SumSeg], max_ctas: u32, what: &dyn Fn() -> String) -> Result<()> {
    if sums.is_empty() {
        return Ok(());
    }
    if sums.len() > sum_batch_limit(max_ctas) {
        return Err(TideError::Internal(format!("{} sums in one batch, limit {}", sums.len(), sum_batch_limit(max_ctas))));
    }
    let (mut b, n) = pack_sums(sums)?;
    launch(m.sum_batch(sums[0].dtype)?, &mut b, n, n as u32, stream, what)
}

#[cfg(test)]
mod tests {

    #[test]
    fn copy_streams_fuse_only_many_small_copies() {
        // tide's stream: any small copy is an SM copy, fused.
        assert!(fuses_copies(true, 1, 0));
        assert!(fuses_copies(true, 1, 32));
        assert!(!fuses_copies(true, 0, 32));
        // A copy stream: from TIDE_FUSE_CE_MIN small copies (and never one alone), never at 0.
        for min in [0usize, 1, 2, 3, 32] {
            for small in 0..80usize {
                let want = min > 0 && small >= min.max(2);
                assert_eq!(fuses_copies(false, small, min), want, "small {small}, min {min}");
            }
        }
        // The default keeps a Llama layer's two norms at world 8 (14 copies) on the copy engines.
        let default = crate::config::Config::defaults().fuse_ce_min;
        assert!(!fuses_copies(false, 14, default) && fuses_copies(false, 64, default));
    }

    use super::*;

    fn copy(dst: u64, src: u64, bytes: usize) -> PendingCopy {
        PendingCopy { dst, src, bytes, dst_dev: 0, src_dev: 0 }
    }

    fn sum(dst: u64, srcs: &[u64], elems: u64, dtype: DType) -> SumSeg {
        let mut p = [0u64; MAX_SRCS];
        p[..srcs.len()].copy_from_slice(srcs);
        SumSeg { dtype, dst, srcs: p, nsrc: srcs.len(), elems, accumulate: false, mode: 1 }
    }

    #[test]
    fn copies_join_only_when_disjoint() {
        let pending = vec![copy(1000, 5000, 100), copy(2000, 6000, 100)];
        assert!(copy_joins(&pending, &copy(3000, 7000, 100)));
        assert!(!copy_joins(&pending, &copy(1050, 7000, 100)), "write-write");
        assert!(!copy_joins(&pending, &copy(5050, 7000, 10)), "writes a pending source");
        assert!(!copy_joins(&pending, &copy(9000, 2099, 10)), "reads a pending destination");
        assert!(copy_joins(&pending, &copy(1100, 5000, 100)), "adjacent, shared source read");
        assert!(copy_joins(&pending, &copy(1000, 5000, 0)), "empty");
    }

    #[test]
    fn sums_join_only_when_disjoint_same_dtype_and_room() {
        let a = sum(0, &[10_000, 20_000], 64, DType::BF16);
        let l = SUM_BATCH;
        assert!(sum_joins(&[a], &sum(256, &[10_000, 30_000], 64, DType::BF16), l), "shared source");
        assert!(!sum_joins(&[a], &sum(255, &[40_000], 64, DType::BF16), l), "dst overlap");
        assert!(!sum_joins(&[a], &sum(1000, &[100], 64, DType::BF16), l), "reads a pending dst");
        assert!(!sum_joins(&[a], &sum(10_100, &[40_000], 4, DType::BF16), l), "writes a pending source");
        assert!(!sum_joins(&[a], &sum(4096, &[40_000], 64, DType::F32), l), "dtype");
        let full: Vec<SumSeg> = (0..SUM_BATCH as u64).map(|k| sum(k * 1024, &[1 << 30], 8, DType::BF16)).collect();
        assert!(!sum_joins(&full, &sum(1 << 20, &[1 << 30], 8, DType::BF16), l), "full");
        assert!(!sum_joins(&full[..3], &sum(1 << 20, &[1 << 30], 8, DType::BF16), sum_batch_limit(3)), "CTA bound");
        assert_eq!((sum_batch_limit(0), sum_batch_limit(16), sum_batch_limit(132)), (1, 16, 16));
    }

    #[test]
    fn ce_pieces_cover_each_copy_once_in_bounded_pieces() {
        let covered = |pieces: &[PendingCopy], c: &PendingCopy| -> usize {
            let mut mine: Vec<&PendingCopy> = pieces.iter().filter(|p| p.dst >= c.dst && p.dst < c.dst + c.bytes.max(1) as u64).collect();
            mine.sort_by_key(|p| p.dst);
            let mut next = c.dst;
            for p in &mine {
                assert_eq!(p.dst, next, "contiguous");
                assert_eq!(p.src - c.src, p.dst - c.dst, "source follows destination");
                next = p.dst + p.bytes as u64;
            }
            (next - c.dst) as usize
        };
        for sizes in [vec![256usize << 20], vec![100], vec![1], vec![0], vec![4096, 12345], vec![(96 << 20) + 3, 5, 64 << 20]] {
            let copies: Vec<PendingCopy> = sizes.iter().enumerate().map(|(k, &b)| copy((k as u64) << 32, (1 << 40) + ((k as u64) << 32), b)).collect();
            for max_piece in [4096usize, 1 << 20, 32 << 20] {
                let pieces = ce_pieces(&copies, max_piece);
                for c in &copies {
                    assert_eq!(covered(&pieces, c), c.bytes, "{sizes:?} {max_piece}");
                }
                assert!(pieces.iter().all(|p| p.bytes <= max_piece.max(4096)), "{sizes:?} {max_piece}: {pieces:?}");
                let total: usize = sizes.iter().sum();
                if total >= 2 {
                    assert!(pieces.len() >= CE_MIN_PIECES, "{sizes:?}: {pieces:?}");
                }
            }
        }
        // One 256 MiB copy in 32 MiB pieces: 8 of them, 4 KiB-aligned.
        let p = ce_pieces(&[copy(1 << 32, 1 << 33, 256 << 20)], 32 << 20);
        assert_eq!(p.len(), 8);
        assert!(p.iter().all(|c| c.bytes == 32 << 20 && c.dst % 4096 == 0));
        // A small lone copy is halved: 5000 bytes -> 2304 + 2696 (256-byte unit).
        let p = ce_pieces(&[copy(0, 1 << 20, 5000)], 32 << 20);
        assert_eq!(p.iter().map(|c| c.bytes).collect::<Vec<_>>(), vec![2304, 2696]);
    }

    #[test]
    fn packing_matches_the_kernel_structs() {
        // Layout of TideCopyBatch / TideSumBatch in kernels/rs_sum.cu.
        assert_eq!(std::mem::size_of::<CopyBatch>(), COPY_BATCH * (3 * 8 + 4));
        assert_eq!(std::mem::size_of::<SumBatch>(), SUM_BATCH * (2 * 8 + MAX_SRCS * 8 + 3 * 4));
        assert!(std::mem::size_of::<SumBatch>() + 4 <= 4096, "kernel parameters stay under 4 KiB");
        let copies: Vec<PendingCopy> = (0..70u64).map(|k| copy(k * 4096, (1 << 30) + k * 4096 + 2, 100)).collect();
        let packed = pack_copies(&copies);
        assert_eq!(packed.iter().map(|p| p.1).collect::<Vec<_>>(), vec![32, 32, 6]);
        assert_eq!(packed[2].0.dst[5], 69 * 4096);
        assert_eq!(packed[2].0.width[5], 2);
        assert_eq!(packed[0].0.bytes[0], 100);
        let sums = vec![sum(0, &[64, 128, 192], 10, DType::F16), sum(4096, &[8192], 3, DType::F16)];
        let (b, n) = pack_sums(&sums).unwrap();
        assert_eq!(n, 2);
        assert_eq!((b.nsrc[0], b.nsrc[1], b.n[1], b.src[0][2]), (3, 1, 3, 192));
        assert!(pack_sums(&[sums[0], sum(8192, &[1], 1, DType::BF16)]).is_err());
    }
}
