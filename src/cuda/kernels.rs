//! The kernels of `kernels/rs_sum.cu` as the host sees them: embedded source, names, launch shapes
//! and the host-side decisions (how a Reduce step becomes launches, when 16-byte vectors are
//! allowed, the copy width). Pure; unit-tested here. Compilation is `cuda::nvrtc`, launching is
//! `cuda::exec`.

use crate::error::{Result, TideError};
use crate::layout::DType;

/// The kernel source, compiled by NVRTC at run time.
pub const SOURCE: &str = include_str!("../../kernels/rs_sum.cu");
/// The file name NVRTC reports in diagnostics.
pub const SOURCE_NAME: &str = "tide/kernels/rs_sum.cu";
/// Threads per CTA of every kernel (`TIDE_THREADS` in the source, its `__launch_bounds__`).
pub const THREADS: u32 = 512;
/// Sources one `rs_sum_*` launch sums (`TIDE_MAX_SRCS`, the size of `TideSrcs`).
pub const MAX_SRCS: usize = 8;
/// Every kernel the module must export.
pub const KERNEL_NAMES: [&str; 8] = [
    "rs_sum_bf16_f32",
    "rs_sum_f16_f32",
    "rs_sum_f32_f32",
    "tide_copy",
    "tide_copy_batch",
    "rs_sum_batch_bf16_f32",
    "rs_sum_batch_f16_f32",
    "rs_sum_batch_f32_f32",
];

/// Segments per batched launch (`TIDE_COPY_BATCH`, `TIDE_SUM_BATCH` in kernels/rs_sum.cu).
pub const COPY_BATCH: usize = 32;
pub const SUM_BATCH: usize = 16;

/// `TideCopyBatch` of kernels/rs_sum.cu, passed by value to `tide_copy_batch`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CopyBatch {
    pub dst: [u64; COPY_BATCH],
    pub src: [u64; COPY_BATCH],
    pub bytes: [u64; COPY_BATCH],
    pub width: [i32; COPY_BATCH],
}

/// `TideSumBatch` of kernels/rs_sum.cu, passed by value to `rs_sum_batch_*`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SumBatch {
    pub dst: [u64; SUM_BATCH],
    pub n: [u64; SUM_BATCH],
    pub src: [[u64; MAX_SRCS]; SUM_BATCH],
    pub nsrc: [i32; SUM_BATCH],
    pub accumulate: [i32; SUM_BATCH],
    pub vectorized: [i32; SUM_BATCH],
}

impl Default for CopyBatch {
    fn default() -> CopyBatch {
        CopyBatch {
            dst: [0; COPY_BATCH],
            src: [0; COPY_BATCH],
            bytes: [0; COPY_BATCH],
            width: [0; COPY_BATCH],
        }
    }
}

impl Default for SumBatch {
    fn default() -> SumBatch {
        SumBatch {
            dst: [0; SUM_BATCH],
            n: [0; SUM_BATCH],
            src: [[0; MAX_SRCS]; SUM_BATCH],
            nsrc: [0; SUM_BATCH],
            accumulate: [0; SUM_BATCH],
            vectorized: [0; SUM_BATCH],
        }
    }
}

/// The Hopper bulk-copy (TMA) variants of the `rs_sum_*` kernels (same parameters, same results),
/// exported by the module on every architecture but only launched on compute capability >= 9.0.
pub const BULK_KERNEL_NAMES: [&str; 3] = [
    "rs_sum_bf16_f32_bulk",
    "rs_sum_f16_f32_bulk",
    "rs_sum_f32_f32_bulk",
];
/// Source bytes of one bulk tile (`TIDE_BULK_TILE`).
pub const BULK_TILE: u64 = 16384;
/// Sources one bulk launch may sum (`TIDE_BULK_MAX_SRCS`); more go to the LSU kernel.
pub const BULK_MAX_SRCS: usize = 4;

/// Ring stages of the bulk kernel for `nsrc` sources (`TIDE_BULK_STAGES_2` / `_4`).
pub fn bulk_stages(nsrc: usize) -> u32 {
    if nsrc <= 2 {
        6
    } else {
        3
    }
}

/// Dynamic shared memory of a bulk launch with `nsrc` sources (at most `BULK_SMEM_MAX`).
pub fn bulk_smem(nsrc: usize) -> u32 {
    bulk_stages(nsrc) * nsrc.max(1) as u32 * BULK_TILE as u32
}

/// The largest `bulk_smem`: set once as CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.
pub const BULK_SMEM_MAX: u32 = 6 * 2 * 16384;

/// Whole bulk tiles of an `rs_sum` over `elems` elements of `dtype` (the rest is LSU code).
pub fn bulk_tiles(elems: u64, dtype: DType) -> u64 {
    elems * dtype.size_bytes() as u64 / BULK_TILE
}

/// Whether a launch may use the bulk kernel: 16-byte aligned, few sources, at least one tile.
pub fn bulk_eligible(vectorized: bool, nsrc: usize, elems: u64, dtype: DType) -> bool {
    vectorized && (1..=BULK_MAX_SRCS).contains(&nsrc) && bulk_tiles(elems, dtype) > 0
}

/// The bulk `rs_sum` kernel for sources of `dtype`.
pub fn bulk_kernel(dtype: DType) -> Result<&'static str> {
    Ok(match sum_kernel(dtype)? {
        "rs_sum_bf16_f32" => BULK_KERNEL_NAMES[0],
        "rs_sum_f16_f32" => BULK_KERNEL_NAMES[1],
        _ => BULK_KERNEL_NAMES[2],
    })
}

/// The `rs_sum` kernel for sources of `dtype`.
pub fn sum_kernel(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::BF16 => Ok("rs_sum_bf16_f32"),
        DType::F16 => Ok("rs_sum_f16_f32"),
        DType::F32 => Ok("rs_sum_f32_f32"),
        other => Err(TideError::UnsupportedDtype {
            dtype: other.name().to_string(),
            op: "reduce_scatter on CUDA (bfloat16, float16 or float32 sources)",
        }),
    }
}

/// `TideSrcs` of the kernel: passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrcPtrs {
    pub p: [u64; MAX_SRCS],
}

/// One `rs_sum_*` launch: sources `first..first + count` of the Reduce step, all of `dtype`;
/// `accumulate` adds onto dst (every launch after the first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumLaunch {
    pub dtype: DType,
    pub first: usize,
    pub count: usize,
    pub accumulate: bool,
}

/// How a Reduce with sources of these dtypes (in order) becomes launches: runs of one dtype, at
/// most `MAX_SRCS` each; the first writes dst, the others accumulate. Every launch adds its
/// sources in order onto the running fp32 value, so the sequence of fp32 additions is exactly the
/// plan's `((s0 + s1) + s2) + ...` whatever the split.
pub fn sum_launches(dtypes: &[DType]) -> Result<Vec<SumLaunch>> {
    if dtypes.is_empty() {
        return Err(TideError::Internal("reduce step without sources".into()));
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < dtypes.len() {
        sum_kernel(dtypes[i])?;
        let mut j = i + 1;
        while j < dtypes.len() && dtypes[j] == dtypes[i] && j - i < MAX_SRCS {
            j += 1;
        }
        out.push(SumLaunch {
            dtype: dtypes[i],
            first: i,
            count: j - i,
            accumulate: i > 0,
        });
        i = j;
    }
    Ok(out)
}

/// Whether the 16-byte vector path may be used: dst and every source 16-byte aligned.
pub fn sum_vectorized(dst: u64, srcs: &[u64]) -> bool {
    dst.is_multiple_of(16) && srcs.iter().all(|s| s.is_multiple_of(16))
}

/// CTAs for a launch covering `units` per-thread work items, at most `max_ctas`, at least 1.
pub fn grid(units: u64, max_ctas: u32) -> u32 {
    let want = units.div_ceil(THREADS as u64).max(1);
    want.min(max_ctas.max(1) as u64) as u32
}

/// Work items of an `rs_sum` launch over `elems` elements of `dtype` (vectors when vectorized).
pub fn sum_units(elems: u64, dtype: DType, vectorized: bool) -> u64 {
    if vectorized {
        let per_vec = (16 / dtype.size_bytes()) as u64;
        (elems / per_vec).max(elems % per_vec)
    } else {
        elems
    }
}

/// The `vectorized` argument of an `rs_sum` launch: 0 scalar, 1 16-byte vectors, 2 8-byte quads
/// with coalesced fp32 stores (`TIDE_RS_KERNEL=st`; 2-byte sources only, else 1).
pub fn sum_mode(vectorized: bool, dtype: DType, coalesced_stores: bool) -> i32 {
    match (vectorized, coalesced_stores && dtype.size_bytes() == 2) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    }
}

/// Work items of an `rs_sum` launch in `mode` (`sum_mode`).
pub fn sum_units_mode(elems: u64, dtype: DType, mode: i32) -> u64 {
    if mode == 2 {
        (elems / 4).max(elems % 4)
    } else {
        sum_units(elems, dtype, mode != 0)
    }
}

/// The copy unit of `tide_copy`: the largest of 16, 8, 4, 2, 1 dividing both addresses.
pub fn copy_width(dst: u64, src: u64) -> i32 {
    let both = dst | src;
    for w in [16u64, 8, 4, 2] {
        if both.is_multiple_of(w) {
            return w as i32;
        }
    }
    1
}

/// The NVRTC architecture option value for compute capability `major.minor` ("sm_90").
pub fn arch(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn define(name: &str) -> String {
        let line = SOURCE
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("#define {name} missing from rs_sum.cu"));
        line.split_whitespace().nth(2).unwrap().to_string()
    }

    #[test]
    fn source_constants_match_the_host() {
        assert_eq!(define("TIDE_THREADS"), THREADS.to_string());
        assert_eq!(define("TIDE_MAX_SRCS"), MAX_SRCS.to_string());
        for k in KERNEL_NAMES {
            assert!(
                SOURCE.contains(&format!("\n{k}(")),
                "kernel {k} not in source"
            );
        }
        for k in BULK_KERNEL_NAMES {
            assert!(
                SOURCE.contains(&format!("\n{k}(")),
                "kernel {k} not in source"
            );
        }
        assert_eq!(define("TIDE_BULK_TILE"), BULK_TILE.to_string());
        assert_eq!(define("TIDE_BULK_MAX_SRCS"), BULK_MAX_SRCS.to_string());
        assert_eq!(define("TIDE_BULK_STAGES_2"), bulk_stages(2).to_string());
        assert_eq!(define("TIDE_BULK_STAGES_4"), bulk_stages(4).to_string());
        assert_eq!(std::mem::size_of::<SrcPtrs>(), 8 * MAX_SRCS);
        // No CUDA headers, no multicast.
        assert!(!SOURCE.contains("#include"));
        assert!(!SOURCE.contains("multimem"));
    }

    #[test]
    fn launches_split_by_dtype_and_size() {
        use DType::*;
        assert_eq!(
            sum_launches(&[BF16, BF16]).unwrap(),
            vec![SumLaunch {
                dtype: BF16,
                first: 0,
                count: 2,
                accumulate: false
            }]
        );
        let twenty = vec![BF16; 20];
        assert_eq!(
            sum_launches(&twenty).unwrap(),
            vec![
                SumLaunch {
                    dtype: BF16,
                    first: 0,
                    count: 8,
                    accumulate: false
                },
                SumLaunch {
                    dtype: BF16,
                    first: 8,
                    count: 8,
                    accumulate: true
                },
                SumLaunch {
                    dtype: BF16,
                    first: 16,
                    count: 4,
                    accumulate: true
                },
            ]
        );
        assert_eq!(
            sum_launches(&[F32, BF16, BF16, F32]).unwrap(),
            vec![
                SumLaunch {
                    dtype: F32,
                    first: 0,
                    count: 1,
                    accumulate: false
                },
                SumLaunch {
                    dtype: BF16,
                    first: 1,
                    count: 2,
                    accumulate: true
                },
                SumLaunch {
                    dtype: F32,
                    first: 3,
                    count: 1,
                    accumulate: true
                },
            ]
        );
        assert!(sum_launches(&[]).is_err());
        assert!(sum_launches(&[BF16, S32]).is_err());
    }

    #[test]
    fn store_modes() {
        use DType::*;
        assert_eq!(sum_mode(false, BF16, true), 0);
        assert_eq!(sum_mode(true, BF16, false), 1);
        assert_eq!(sum_mode(true, BF16, true), 2);
        assert_eq!(sum_mode(true, F16, true), 2);
        assert_eq!(sum_mode(true, F32, true), 1);
        assert_eq!(sum_units_mode(4099, BF16, 2), 1024);
        assert_eq!(sum_units_mode(3, BF16, 2), 3);
        assert_eq!(sum_units_mode(4099, BF16, 1), sum_units(4099, BF16, true));
    }

    #[test]
    fn alignment_grid_and_width() {
        assert!(sum_vectorized(0x1000, &[0x2000, 0x3010]));
        assert!(!sum_vectorized(0x1004, &[0x2000]));
        assert!(!sum_vectorized(0x1000, &[0x2000, 0x2002]));
        assert_eq!(grid(0, 16), 1);
        assert_eq!(grid(1, 16), 1);
        assert_eq!(grid(512 * 3 + 1, 16), 4);
        assert_eq!(grid(1 << 30, 16), 16);
        assert_eq!(grid(1 << 30, 0), 1);
        assert_eq!(sum_units(80, DType::BF16, true), 10);
        assert_eq!(sum_units(83, DType::BF16, true), 10);
        assert_eq!(sum_units(3, DType::F32, true), 3);
        assert_eq!(sum_units(83, DType::BF16, false), 83);
        assert_eq!(copy_width(0x1000, 0x2000), 16);
        assert_eq!(copy_width(0x1008, 0x2000), 8);
        assert_eq!(copy_width(0x1002, 0x2004), 2);
        assert_eq!(copy_width(0x1001, 0x2000), 1);
        assert_eq!(arch(9, 0), "sm_90");
        assert_eq!(bulk_smem(1), 6 * 16384);
        assert_eq!(bulk_smem(2), BULK_SMEM_MAX);
        assert_eq!(bulk_smem(4), 3 * 4 * 16384);
        assert!((1..=BULK_MAX_SRCS).all(|n| bulk_smem(n) <= BULK_SMEM_MAX));
        assert_eq!(bulk_tiles(8192, DType::BF16), 1);
        assert_eq!(bulk_tiles(8191, DType::BF16), 0);
        assert!(bulk_eligible(true, 2, 8192, DType::BF16));
        assert!(!bulk_eligible(false, 2, 8192, DType::BF16));
        assert!(!bulk_eligible(true, 5, 1 << 20, DType::BF16));
        assert!(!bulk_eligible(true, 2, 4095, DType::F32));
        assert_eq!(bulk_kernel(DType::F16).unwrap(), "rs_sum_f16_f32_bulk");
    }
}
