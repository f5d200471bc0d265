//! The kernels of `kernels/rs_sum.cu` as the host sees them: embedded source, names, launch shapes
//! and the host-side decisions (how a Reduce step becomes launches, when 16-byte vectors are
//! allowed, the copy width). Pure; unit-tested here. Compilation is `cuda::nvrtc`, launching is
//! `cuda::issue` (through `cuda::driver`).

use crate::error::{Result, TideError};
use crate::layout::DType;

/// The kernel source, compiled by NVRTC at run time.
pub const SOURCE: &str = include_str!("../../kernels/rs_sum.cu");
/// The file name NVRTC reports in diagnostics.
pub const SOURCE_NAME: &str = "tide/kernels/rs_sum.cu";
/// Threads per CTA of every kernel by default (`TIDE_THREADS` in the source, its
/// `__launch_bounds__`); TIDE_SM_THREADS sets another (`threads`).
pub const THREADS: u32 = 512;
/// Registers a thread of any tide kernel may use (`__launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)`
/// with TIDE_MIN_CTAS = 65536 / (TIDE_THREADS * 64)), whatever the CTA size: a CTA holds
/// `threads() * 64` of an SM's 65,536, so another kernel's CTA can share its SM (issue #38).
pub const MAX_REGISTERS: u32 = 64;

static PROCESS_THREADS: once_cell::sync::Lazy<u32> =
    once_cell::sync::Lazy::new(|| crate::config::CONFIG.sm_threads);

/// Threads per CTA of every kernel this process launches: TIDE_SM_THREADS as the environment had
/// it at first use (128, 256 or 512). Fixed for the process, since the module is compiled for it
/// (`nvrtc_options`) and a launch with more threads than its `__launch_bounds__` fails.
pub fn threads() -> u32 {
    *PROCESS_THREADS
}

/// The NVRTC options that compile the module for `threads` per CTA (`-DTIDE_THREADS=...`).
pub fn nvrtc_options(threads: u32) -> Vec<String> {
    vec![format!("-DTIDE_THREADS={threads}")]
}
/// Sources one `rs_sum_*` launch sums (`TIDE_MAX_SRCS`, the size of `TideSrcs`).
pub const MAX_SRCS: usize = 8;
/// Every kernel the module must export.
pub const KERNEL_NAMES: [&str; 13] = [
    "rs_sum_bf16_f32",
    "rs_sum_f16_f32",
    "rs_sum_f32_f32",
    "tide_copy",
    "tide_copy_batch",
    "rs_sum_batch_bf16_f32",
    "rs_sum_batch_f16_f32",
    "rs_sum_batch_f32_f32",
    "rs_sum_at_bf16_f32",
    "rs_sum_at_f16_f32",
    "rs_sum_at_f32_f32",
    "tide_zero_at",
    "tide_cast_at_f32_bf16",
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

/// CTAs for a launch covering `units` per-thread work items, at most `max_ctas`, at least 1, with
/// this process's `threads()` per CTA.
pub fn grid(units: u64, max_ctas: u32) -> u32 {
    grid_for(units, max_ctas, threads())
}

/// `grid` for CTAs of `threads` threads.
pub fn grid_for(units: u64, max_ctas: u32, threads: u32) -> u32 {
    let want = units.div_ceil(threads.max(1) as u64).max(1);
    want.min(max_ctas.max(1) as u64) as u32
}

/// Work items of an `rs_sum` launch over `elems` elements: when vectorized, every thread of either
/// body stores one 16-byte fp32 vector (2-byte sources: an 8-byte quad; fp32: a 16-byte vector), so
/// `elems / 4` of them, or the scalar tail's elements if more; else one element each.
pub fn sum_units(elems: u64, vectorized: bool) -> u64 {
    if vectorized {
        (elems / 4).max(elems % 4)
    } else {
        elems
    }
}

/// The `vectorized` argument of an `rs_sum` launch (`rs_sum_*` in kernels/rs_sum.cu): 0 scalar, 1
/// the 16-byte path (2-byte sources: 8-byte quads, one coalesced fp32 store per thread).
pub fn sum_mode(vectorized: bool) -> i32 {
    vectorized as i32
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
        // At most MAX_REGISTERS per thread at every CTA size (TIDE_SM_THREADS).
        assert!(SOURCE.contains(&format!("#define TIDE_MIN_CTAS (65536 / (TIDE_THREADS * {MAX_REGISTERS}))")));
        assert_eq!(nvrtc_options(256), vec!["-DTIDE_THREADS=256".to_string()]);
        assert_eq!(define("TIDE_MAX_SRCS"), MAX_SRCS.to_string());
        for k in KERNEL_NAMES {
            assert!(
                SOURCE.contains(&format!("\n{k}(")),
                "kernel {k} not in source"
            );
        }
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
        assert_eq!(sum_mode(false), 0);
        assert_eq!(sum_mode(true), 1);
        assert_eq!(sum_units(4099, true), 1024);
        assert_eq!(sum_units(3, true), 3);
        assert_eq!(sum_units(4099, false), 4099);
    }

    #[test]
    fn alignment_grid_and_width() {
        assert!(sum_vectorized(0x1000, &[0x2000, 0x3010]));
        assert!(!sum_vectorized(0x1004, &[0x2000]));
        assert!(!sum_vectorized(0x1000, &[0x2000, 0x2002]));
        for t in [128u32, 256, 512] {
            assert_eq!(grid_for(0, 16, t), 1);
            assert_eq!(grid_for(1, 16, t), 1);
            assert_eq!(grid_for(t as u64 * 3 + 1, 16, t), 4);
            assert_eq!(grid_for(t as u64 * 3, 16, t), 3);
            assert_eq!(grid_for(1 << 30, 16, t), 16);
            assert_eq!(grid_for(1 << 30, 0, t), 1);
        }
        assert_eq!(grid(1 << 30, 16), 16);
        assert_eq!(sum_units(80, true), 20);
        assert_eq!(sum_units(83, true), 20);
        assert_eq!(sum_units(3, true), 3);
        assert_eq!(sum_units(83, false), 83);
        assert_eq!(copy_width(0x1000, 0x2000), 16);
        assert_eq!(copy_width(0x1008, 0x2000), 8);
        assert_eq!(copy_width(0x1002, 0x2004), 2);
        assert_eq!(copy_width(0x1001, 0x2000), 1);
        assert_eq!(arch(9, 0), "sm_90");
    }
}
