//! Tunables, in one place, read once from the environment. Each has a default; docs/design.md lists them.
//!
//! Parsing is strict (`parse`): a value outside a setting's accepted range is never clamped or
//! ignored. The setting keeps its default for code that reads `CONFIG`, and `check` reports it, so
//! every tide call fails with an error naming the variable, the value and the accepted range
//! (`call::check_attributes` calls `check` first). An empty value means unset (the default).
//! `tide_jax` asks the same question when it registers the FFI targets (`tide_settings_error`), so
//! the error shows at the first traced call.

use once_cell::sync::Lazy;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// TIDE_TIMEOUT_S (default 120; seconds, a decimal number in [0.001, 1e6]): how long a rank
    /// waits at a rendezvous or barrier for its peers before the call fails with an error naming the
    /// missing ranks. Never hang: `inf` (and `nan`, `0`, negatives, more than 1e6 s = 11.6 days) are
    /// refused, not clamped; a job that wants a very long wait says so with a number.
    pub timeout_s: f64,
    /// TIDE_RS_MAX_CTAS (default 16; an integer in [1, 1024]): upper bound on CTAs of one fp32
    /// reduction kernel launch.
    pub rs_max_ctas: u32,
    /// TIDE_SM_THREADS (default 512; 128, 256 or 512): threads per CTA of every tide kernel, with at
    /// most 64 registers per thread and no shared memory whatever the size. Read once per process
    /// (the kernels are compiled for it: `cuda::kernels::threads`). Smaller CTAs fit beside a
    /// compute kernel's CTA on the same SM: XLA's Triton GEMMs on an H100 (256 threads x 154
    /// registers, 196,640 B shared memory) leave 24,576 registers of 65,536, which a 256-thread CTA
    /// (16,384) fits and a 512-thread one (32,768) does not (issue #38, docs/design.md "Progress").
    pub sm_threads: u32,
    /// TIDE_SM_CARVEOUT (default -1: the driver's choice; an integer in [-1, 100]): every tide
    /// kernel's preferred shared-memory carveout, percent of the SM's unified L1/shared memory
    /// (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`). CTAs of two kernels share an SM only
    /// under one L1/shared split; a kernel that uses no shared memory otherwise prefers the largest
    /// L1, unlike a GEMM's or attention's, so 100 (the largest shared memory, theirs) lets tide's
    /// CTAs join an SM a compute kernel holds (issue #38, docs/design.md "Progress").
    pub sm_carveout: i32,
    /// TIDE_RS_CTA_BYTES (default 524288; an integer in [0, 2^32], 0 = one grid-stride launch per
    /// reduction): bytes one CTA of a reduction launch reads and writes. Each reduction is issued as
    /// launches of at most TIDE_RS_MAX_CTAS x TIDE_RS_CTA_BYTES bytes, so a CTA lives a few
    /// microseconds and a compute kernel launched meanwhile waits at most that long for the SMs tide
    /// holds (issue #22: on one H200, 16 CTAs of 512 KiB: a one-wave GEMM beside it +2 %, resident
    /// CTAs +49 to +68 %). Smaller: less interference, more launches (each loses ~3 us: the
    /// slowest CTA's tail and the gap before the next launch, bench/RESULTS.md runs 29-31); 0: fastest alone.
    pub rs_cta_bytes: usize,
    /// TIDE_HIGH_PRIORITY (default 0; a flag): 1 creates each in-flight slot's tide stream (where a
    /// call's reductions and their waits run, in-process) with the device's greatest stream
    /// priority, so when SMs free up a pending reduction CTA is placed before a pending compute CTA.
    /// Consecutive launches on one stream still leave a ~2 us gap in which compute takes the SMs
    /// back. Measured on one H200 (bench/RESULTS.md, issue #22).
    pub high_priority: bool,
    /// TIDE_RS_STAGE_SLOTS (default 3; an integer in [1, 64]): number of staging slots in the
    /// reduce-scatter pipeline (3 beat 2 on 2 H200s: bench/results/2026-11-30-cuda-bench.md).
    pub rs_stage_slots: usize,
    /// TIDE_RS_SLOT_BYTES (default 16 MiB; an integer in [4096, 2^32]): bytes of one staging slot.
    /// The reduce-scatter's scratch per rank is rs_stage_slots * rs_slot_bytes, independent of the
    /// group size. 16, not 32: with a chunk's staged slices in one copy batch, 16 MiB slots keep an
    /// emulated world-8 reduce-scatter within issue #22's bars beside a one-wave GEMM (+3.0 %) and
    /// still move more per second than 32 MiB slots did before (942 vs 826 GB/s; 32 MiB now: 1385
    /// GB/s at +3.9 %), bench/results/2026-12-05-1h200 runs 47-48.
    pub rs_slot_bytes: usize,
    /// TIDE_AG_STREAMS (default 1; an integer in [1, 16]; 1 was fastest on 2 H200s, more streams
    /// only add event and host overhead: bench/results/2026-11-30-cuda-bench.md): copy streams the
    /// CUDA all-gather spreads peer copies over (its local copy-engine copies go on one more stream
    /// of their own, overlapping them).
    pub ag_streams: usize,
    /// TIDE_MULTICAST (default off; a flag: 0/1, false/true, off/on, no/yes): allow the NVLink multicast all-gather (`cuda::multicast`) when
    /// the whole gate passes: the environment does not disable NVLink multicast (NCCL_NVLS_ENABLE=0
    /// etc.), single node, at least 3 GPUs, 16-byte shards, and the device reports
    /// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED. Never set on shared machines.
    pub multicast: bool,
    /// TIDE_RS_COPY_STREAMS (default 1, fastest on 2 H200s; an integer in [1, 16]): copy streams the CUDA reduce-scatter spreads each chunk's
    /// staging copies over (pieces of at least 1 MiB).
    pub rs_copy_streams: usize,
    /// TIDE_LOCAL_COPY (default `ce-peers`): how the CUDA engine copies between two buffers of the
    /// same GPU (the plain all-gather's own shard; everything at world 1): `ce-peers` = copy engine,
    /// balanced with the peer copies over their streams and batches (zero SMs; fewer copies at once,
    /// so less HBM bandwidth taken beside compute: issue #22, a one-wave GEMM beside an emulated
    /// world-8 all-gather +1.2 % against +3.3 % with `ce`, medians of eight runs, the gather alone
    /// 11 % slower); `ce` = copy engine, on a copy stream of its own, overlapping the peer copies
    /// (fastest alone); `sm` = the `tide_copy` kernel on XLA's stream (at most TIDE_RS_MAX_CTAS CTAs).
    pub local_copy: LocalCopy,
    /// TIDE_NVRTC_LIB_DIR (default unset; any path, checked when NVRTC is loaded): a folder holding libnvrtc.so.* (and libnvrtc-builtins),
    /// e.g. site-packages/nvidia/cu13/lib of the nvidia-cuda-nvrtc wheel; loaded before the system's.
    pub nvrtc_lib_dir: Option<String>,
    /// TIDE_COPY_BATCH (default 1; a flag as TIDE_MULTICAST): when on, the CUDA engine issues consecutive copy-engine copies of
    /// one stream as one cuMemcpyBatchAsync (CUDA 13 drivers) instead of one cuMemcpyAsync each.
    /// On: 1.2-1.6x faster all-gathers on 2 H200s (bench/results/2026-11-30-cuda-bench.md); the engine
    /// falls back to single copies where the driver lacks the symbol.
    pub copy_batch: bool,
    /// TIDE_COPY2D (default `1`; one of `0`, `1`, `batch`, `bands`, `batch-bands`; `0` and `1`
    /// also as false/true, off/on, no/yes, and `flat` / `2d`): how the in-process CUDA engine lands
    /// a plan's 2-D copies (a parameter sharded along a dimension other than its first: each peer's
    /// rows landing in the gathered result, a strided gradient slice staged; `Copy2d`). Every value
    /// but `0` keeps them 2-D copies on the copy engines (never an SM kernel); they differ only in
    /// how the copies of one stream are handed to the driver (`cuda::copy2d`):
    /// `1` = one cuMemcpy2DAsync per piece of at most TIDE_CE_PIECE_BYTES, issued as it comes;
    /// `batch` = a stream's consecutive independent pieces as one cuMemcpy3DBatchAsync_v2 of 2-D
    /// (depth 1) operations (CUDA 12.8+ drivers; where the driver lacks it, `1`, logged once);
    /// `bands` = those pieces cut into row bands of about TIDE_COPY2D_BAND_BYTES, issued band-major
    /// (band b of every piece, then band b + 1), one cuMemcpy2DAsync each, so the copies in flight
    /// write neighbouring rows of the result; `batch-bands` = the bands, band-major, as one
    /// cuMemcpy3DBatchAsync_v2 (where the driver lacks it, `bands`, logged once);
    /// `0` = as its blocks, one 1-D copy each (`Plan::flattened`, batched), as before 2-D copies.
    /// Issue #37 measures them (tests/cuda_engine.rs `strided_gather_variants`). The multi-process
    /// path always runs the 1-D copies.
    pub copy2d: Copy2d,
    /// TIDE_COPY2D_BAND_BYTES (default 2097152; an integer in [1, 2^32]): bytes of one band of a
    /// 2-D copy under TIDE_COPY2D=bands / batch-bands: each band is `max(1, this / row bytes)` rows
    /// of its piece (the last band shorter). Smaller: more copies in flight on neighbouring rows,
    /// and more driver operations (one call each under `bands`).
    pub copy2d_band_bytes: usize,
    /// TIDE_CE_PIECE_BYTES (default 33554432; an integer in [4096, 2^32]): the largest piece of a
    /// copy-engine batch: each batch's copies go in pieces of at most this many bytes, and at least
    /// two pieces (`cuda::fuse::ce_pieces`). One H200 copies a 256 MiB piece on the same device with
    /// SMs, pieces of 32 MiB with copy engines (issue #22).
    pub ce_piece_bytes: usize,
    /// TIDE_MAX_IN_FLIGHT (default 4, an integer in [1, 16]): CUDA calls of one op (all-gather,
    /// reduce-scatter) that may be started and not yet done at once per device. Each owns an
    /// in-flight slot: a tide stream, side streams, events and (reduce-scatter) its own stage slots,
    /// so staging memory per device is at most TIDE_MAX_IN_FLIGHT x TIDE_RS_STAGE_SLOTS x
    /// TIDE_RS_SLOT_BYTES (default 4 x 48 MiB, allocated only when that many reduce-scatters were in
    /// flight at once, then kept); the all-gather needs none. A start beyond it fails with an error
    /// naming it. 4, not 2: XLA may issue a layer loop's next start before the previous done
    /// (tide_jax's prefetch=2 then has 3 gathers in flight).
    pub max_in_flight: usize,
    /// TIDE_FUSE_BYTES (default 524288; an integer in [0, 2^30], 0 = off): on the in-process CUDA
    /// path, runs of independent copies (copy-engine or SM) and reductions on one stream whose
    /// segments are each smaller than this go as batched kernel launches (`tide_copy_batch`,
    /// `rs_sum_batch_*`: up to 32 copies or 16 sums per launch, one CTA per segment, at most
    /// TIDE_RS_MAX_CTAS CTAs) instead of one driver operation each, so a group of many small
    /// parameters costs a few launches, not one per parameter (issue #9: 5-7 us per parameter
    /// before). Small copies then use SMs briefly. A sum's size is its fp32 output (a 128 KiB bf16
    /// gradient shard on one GPU: 256 KiB).
    pub fuse_bytes: usize,
    /// TIDE_FUSE_CE_MIN (default 32; an integer in [0, 2^20], 0 = never): the fewest small copies
    /// (under TIDE_FUSE_BYTES) pending on one *copy* stream that go as one batched SM launch
    /// (`tide_copy_batch`) instead of staying on the copy engines; at least 2 in any case. Issue
    /// #38: copy-engine copies progress beside a kernel that holds every SM (cuDNN's persistent
    /// flash attention), an SM launch waits for it to end, and one such launch holds up the whole
    /// call: on one H100 the all-gather beside the full-SM probe went from overlap 0.01 (the
    /// layer's two norms fused, as with 2) to 1.00 (all on copy engines), while a copy-engine copy
    /// costs about 3 us more than a fused one (emulated world-8 all-gather of a Llama-3-8B layer,
    /// 14 small copies: 0.458 -> 0.502 ms alone; bench/results/2026-12-06c-1h100). So a few small
    /// copies stay on the copy engines and a group of many small parameters (issue #9) still costs
    /// a few launches. Copies on tide's own stream (SM copies) are fused whenever TIDE_FUSE_BYTES
    /// says.
    pub fuse_ce_min: usize,
    /// TIDE_NCCL_LIB (default unset: `libnccl.so.2` from the loader's path; any path, checked when
    /// NCCL is loaded): the NCCL library the multi-process CUDA path's rail loads (once per process).
    pub nccl_lib: Option<String>,
    /// TIDE_STALL_MS (default 250; an integer in [0, 3600000], 0 = off): on XLA:CPU, how long the
    /// ranks of a call may wait for a device that never started the program while the process is
    /// idle before the call fails naming XLA:CPU's launch stall (`deadlock`, "Stalls"), instead of
    /// at TIDE_TIMEOUT_S. Programs launched from several threads without waiting can fill a
    /// device's admission (32 executions) so that one of them never starts there.
    pub stall_ms: u64,
    /// TIDE_DEBUG_MP (default off; a flag as TIDE_MULTICAST): trace the multi-process CUDA path's
    /// rail (NCCL groups, aborts) to stderr.
    pub debug_mp: bool,
}

/// How the CUDA engine performs a copy whose source and destination are on the same GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalCopy {
    CopyEngine,
    /// Copy engine, on the peer copies' streams (balanced with them).
    CopyEnginePeers,
    Sm,
}

impl std::str::FromStr for LocalCopy {
    type Err = String;
    fn from_str(s: &str) -> Result<LocalCopy, String> {
        match s.to_ascii_lowercase().as_str() {
            "ce" | "copy_engine" => Ok(LocalCopy::CopyEngine),
            "ce-peers" => Ok(LocalCopy::CopyEnginePeers),
            "sm" | "kernel" => Ok(LocalCopy::Sm),
            other => Err(format!("{other:?}: expected ce, ce-peers or sm")),
        }
    }
}

/// How the in-process CUDA engine lands a plan's 2-D copies (TIDE_COPY2D; the `Config::copy2d`
/// field says what each does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copy2d {
    /// `0`: the plan flattened into 1-D copies, one per block (`Plan::flattened`).
    Flat,
    /// `1` (default): one cuMemcpy2DAsync per piece.
    PerPiece,
    /// `batch`: a stream's pieces as one cuMemcpy3DBatchAsync_v2.
    Batch,
    /// `bands`: pieces cut into row bands issued band-major, one cuMemcpy2DAsync each.
    Bands,
    /// `batch-bands`: the bands, band-major, as one cuMemcpy3DBatchAsync_v2.
    BatchBands,
}

impl Copy2d {
    /// Whether the plan keeps its 2-D copies (every value but `0`).
    pub fn keeps_2d(self) -> bool {
        self != Copy2d::Flat
    }
    /// Whether pieces are cut into row bands.
    pub fn banded(self) -> bool {
        matches!(self, Copy2d::Bands | Copy2d::BatchBands)
    }
    /// Whether a stream's pieces go as one cuMemcpy3DBatchAsync_v2.
    pub fn batched(self) -> bool {
        matches!(self, Copy2d::Batch | Copy2d::BatchBands)
    }
    /// The value of TIDE_COPY2D that selects it.
    pub fn name(self) -> &'static str {
        match self {
            Copy2d::Flat => "0",
            Copy2d::PerPiece => "1",
            Copy2d::Batch => "batch",
            Copy2d::Bands => "bands",
            Copy2d::BatchBands => "batch-bands",
        }
    }
}

impl std::str::FromStr for Copy2d {
    type Err = String;
    fn from_str(s: &str) -> Result<Copy2d, String> {
        match s.to_ascii_lowercase().as_str() {
            "0" | "false" | "off" | "no" | "flat" => Ok(Copy2d::Flat),
            "1" | "true" | "on" | "yes" | "2d" => Ok(Copy2d::PerPiece),
            "batch" => Ok(Copy2d::Batch),
            "bands" => Ok(Copy2d::Bands),
            "batch-bands" => Ok(Copy2d::BatchBands),
            other => Err(format!("{other:?}: expected {COPY2D_ACCEPTED}")),
        }
    }
}

/// What TIDE_COPY2D accepts.
pub const COPY2D_ACCEPTED: &str = "0 (flat), 1 (2d), batch, bands or batch-bands (0 and 1 also as false/true, off/on, no/yes)";

/// A setting whose value tide cannot use: the variable, the value (at most 64 characters of it)
/// and what the variable accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingError {
    pub variable: &'static str,
    pub value: String,
    pub accepted: String,
}

impl std::fmt::Display for SettingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}={:?} is not a valid setting: expected {}",
            self.variable, self.value, self.accepted
        )
    }
}

/// TIDE_RS_KERNEL chose the reduce-scatter's fp32 reduction kernel (`ld`, `bulk` or `st`) until
/// issue #9: `st` (8-byte source loads, one coalesced 16-byte fp32 store per thread) was 2.2x `ld` at
/// 16 CTAs and faster than `bulk` at every size measured on one H200, so it is the only one left.
const REMOVED_RS_KERNEL: &str = "it unset: TIDE_RS_KERNEL was removed (issue #9); the reduction \
                                 kernel is always st (coalesced fp32 stores)";

/// Shortest and longest TIDE_TIMEOUT_S, in seconds.
pub const TIMEOUT_RANGE_S: (f64, f64) = (0.001, 1e6);

fn bounded_value(v: &str) -> String {
    match v.char_indices().nth(64) {
        Some((at, _)) => format!("{}...", &v[..at]),
        None => v.to_string(),
    }
}

/// Reads settings through `lookup` (the environment, or a test's map), collecting every error.
struct Reader<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
    errors: Vec<SettingError>,
}

impl Reader<'_> {
    /// The trimmed value of `variable`; `None` when unset or empty.
    fn raw(&self, variable: &str) -> Option<String> {
        (self.lookup)(variable)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    /// `parse(value)`, or `default` and an error naming `accepted`.
    fn get<T>(
        &mut self,
        variable: &'static str,
        default: T,
        accepted: &dyn Fn() -> String,
        parse: &dyn Fn(&str) -> Option<T>,
    ) -> T {
        let Some(v) = self.raw(variable) else {
            return default;
        };
        match parse(&v) {
            Some(x) => x,
            None => {
                self.errors.push(SettingError {
                    variable,
                    value: bounded_value(&v),
                    accepted: accepted(),
                });
                default
            }
        }
    }

    fn int(&mut self, variable: &'static str, default: u64, lo: u64, hi: u64) -> u64 {
        self.get(
            variable,
            default,
            &|| format!("an integer in [{lo}, {hi}]"),
            &|v| v.parse::<u64>().ok().filter(|x| (lo..=hi).contains(x)),
        )
    }

    fn flag(&mut self, variable: &'static str, default: bool) -> bool {
        self.get(
            variable,
            default,
            &|| "0 or 1 (also false/true, off/on, no/yes)".to_string(),
            &|v| match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "on" | "yes" => Some(true),
                "0" | "false" | "off" | "no" => Some(false),
                _ => None,
            },
        )
    }

    /// A variable whose setting was removed: unset, or one of `still_true` (what tide now always
    /// does), else an error saying so, so a job that asked for the old behaviour learns it is gone.
    fn removed(&mut self, variable: &'static str, still_true: &[&str], why: &str) {
        self.get(variable, (), &|| why.to_string(), &|v| {
            still_true
                .iter()
                .any(|t| t.eq_ignore_ascii_case(v))
                .then_some(())
        })
    }

    fn choice<T: std::str::FromStr>(
        &mut self,
        variable: &'static str,
        default: T,
        accepted: &str,
    ) -> T {
        self.get(variable, default, &|| accepted.to_string(), &|v| {
            v.parse().ok()
        })
    }
}

/// A TIDE_SM_THREADS value: 128, 256 or 512.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SmThreads(u32);

impl std::str::FromStr for SmThreads {
    type Err = ();
    fn from_str(s: &str) -> std::result::Result<SmThreads, ()> {
        match s.trim() {
            "128" => Ok(SmThreads(128)),
            "256" => Ok(SmThreads(256)),
            "512" => Ok(SmThreads(512)),
            _ => Err(()),
        }
    }
}

/// A TIDE_SM_CARVEOUT value: -1 (the driver's choice) or a percentage 0..=100.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Carveout(i32);

impl std::str::FromStr for Carveout {
    type Err = ();
    fn from_str(s: &str) -> std::result::Result<Carveout, ()> {
        match s.trim().parse::<i32>() {
            Ok(v) if (-1..=100).contains(&v) => Ok(Carveout(v)),
            _ => Err(()),
        }
    }
}

/// Whether `s` is an accepted TIDE_TIMEOUT_S value: a finite decimal number of seconds in
/// `TIMEOUT_RANGE_S` (so `inf`, `nan`, `0` and negatives are refused).
pub fn parse_timeout_s(s: &str) -> Option<f64> {
    let x: f64 = s.trim().parse().ok()?;
    (x.is_finite() && x >= TIMEOUT_RANGE_S.0 && x <= TIMEOUT_RANGE_S.1).then_some(x)
}

impl Config {
    /// The defaults (no variable set).
    pub fn defaults() -> Config {
        Config::parse(&|_| None).expect("the defaults are valid")
    }

    /// Strict parsing of every setting through `lookup` (`std::env::var`, or a test's map): the
    /// configuration, or every setting that is invalid.
    pub fn parse(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Config, Vec<SettingError>> {
        let (config, errors) = Config::parse_lenient(lookup);
        if errors.is_empty() {
            Ok(config)
        } else {
            Err(errors)
        }
    }

    /// `parse`, keeping the default of each invalid setting: the configuration and the errors.
    fn parse_lenient(lookup: &dyn Fn(&str) -> Option<String>) -> (Config, Vec<SettingError>) {
        let mut r = Reader {
            lookup,
            errors: Vec::new(),
        };
        let (lo, hi) = TIMEOUT_RANGE_S;
        let config = Config {
            timeout_s: r.get(
                "TIDE_TIMEOUT_S",
                120.0,
                &|| {
                    format!(
                        "seconds, a number in [{lo}, {hi}] (tide never waits forever: inf, nan, 0 and \
                         negatives are refused)"
                    )
                },
                &parse_timeout_s,
            ),
            rs_max_ctas: r.int("TIDE_RS_MAX_CTAS", 16, 1, 1024) as u32,
            sm_threads: r.choice("TIDE_SM_THREADS", SmThreads(512), "128, 256 or 512").0,
            sm_carveout: r.choice("TIDE_SM_CARVEOUT", Carveout(-1), "an integer in [-1, 100]").0,
            rs_cta_bytes: r.int("TIDE_RS_CTA_BYTES", 512 << 10, 0, 1 << 32) as usize,
            rs_stage_slots: r.int("TIDE_RS_STAGE_SLOTS", 3, 1, 64) as usize,
            rs_slot_bytes: r.int("TIDE_RS_SLOT_BYTES", 16 << 20, 4096, 1 << 32) as usize,
            ag_streams: r.int("TIDE_AG_STREAMS", 1, 1, 16) as usize,
            multicast: r.flag("TIDE_MULTICAST", false),
            rs_copy_streams: r.int("TIDE_RS_COPY_STREAMS", 1, 1, 16) as usize,
            local_copy: r.choice("TIDE_LOCAL_COPY", LocalCopy::CopyEnginePeers, "ce, ce-peers or sm"),
            copy_batch: r.flag("TIDE_COPY_BATCH", true),
            copy2d: r.choice("TIDE_COPY2D", Copy2d::PerPiece, COPY2D_ACCEPTED),
            copy2d_band_bytes: r.int("TIDE_COPY2D_BAND_BYTES", 2 << 20, 1, 1 << 32) as usize,
            high_priority: r.flag("TIDE_HIGH_PRIORITY", false),
            ce_piece_bytes: r.int("TIDE_CE_PIECE_BYTES", 32 << 20, 4096, 1 << 32) as usize,
            max_in_flight: r.int("TIDE_MAX_IN_FLIGHT", 4, 1, 16) as usize,
            fuse_bytes: r.int("TIDE_FUSE_BYTES", 512 << 10, 0, 1 << 30) as usize,
            fuse_ce_min: r.int("TIDE_FUSE_CE_MIN", 32, 0, 1 << 20) as usize,
            nvrtc_lib_dir: r.raw("TIDE_NVRTC_LIB_DIR"),
            nccl_lib: r.raw("TIDE_NCCL_LIB"),
            debug_mp: r.flag("TIDE_DEBUG_MP", false),
            stall_ms: r.int("TIDE_STALL_MS", 250, 0, 3_600_000),
        };
        r.removed("TIDE_RS_KERNEL", &["st", "coalesced"], REMOVED_RS_KERNEL);
        (config, r.errors)
    }

    /// The environment's configuration, every invalid setting at its default (see `check`).
    pub fn from_env() -> Config {
        Config::parse_lenient(&|k| std::env::var(k).ok()).0
    }

    /// TIDE_TIMEOUT_S as a `Duration`. Total even on a configuration built by hand (a test's
    /// override): a value outside `TIMEOUT_RANGE_S`, or nan, becomes the nearest bound.
    pub fn timeout(&self) -> Duration {
        let (lo, hi) = TIMEOUT_RANGE_S;
        let s = if self.timeout_s.is_nan() {
            lo
        } else {
            self.timeout_s.clamp(lo, hi)
        };
        Duration::from_secs_f64(s)
    }
}

/// The environment as read once: the configuration and the invalid settings.
static LOADED: Lazy<(Config, Vec<SettingError>)> =
    Lazy::new(|| Config::parse_lenient(&|k| std::env::var(k).ok()));

/// The invalid settings of the environment, if any, as one error naming each variable, its value
/// and its accepted range. `Ok` while a test override is set (it replaces the environment).
/// Every tide call checks this first (`call::check_attributes`).
pub fn check() -> crate::error::Result<()> {
    if OVERRIDDEN.load(Ordering::Acquire) || LOADED.1.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = LOADED.1.iter().map(|e| e.to_string()).collect();
    Err(crate::error::TideError::InvalidArgument(format!(
        "tide setting: {} (fix or unset it; settings are read once, when the process first uses tide)",
        list.join("; ")
    )))
}

/// For `tide_jax` (ctypes): writes the message of `check`'s error, if any, into `buf` (at most
/// `cap` bytes, not NUL-terminated) and returns its full length; 0 when every setting is valid.
///
/// # Safety
/// `buf` must be valid for writes of `cap` bytes (or `cap` 0).
#[no_mangle]
pub unsafe extern "C" fn tide_settings_error(buf: *mut u8, cap: usize) -> usize {
    let msg = match std::panic::catch_unwind(check) {
        Ok(Ok(())) => return 0,
        Ok(Err(crate::error::TideError::InvalidArgument(m))) => m,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "tide setting: panic while reading the settings (a tide bug)".to_string(),
    };
    let n = msg.len().min(cap);
    if n > 0 && !buf.is_null() {
        // SAFETY: the caller gives `cap` writable bytes at `buf`; n <= cap.
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), buf, n) };
    }
    msg.len()
}

/// The process-wide configuration, read on first use.
pub static CONFIG: Lazy<Config> = Lazy::new(|| LOADED.0.clone());

static BASE: Lazy<Arc<Config>> = Lazy::new(|| Arc::new(CONFIG.clone()));
static OVERRIDDEN: AtomicBool = AtomicBool::new(false);
static OVERRIDE: Lazy<RwLock<Option<Arc<Config>>>> = Lazy::new(|| RwLock::new(None));

/// The configuration a call runs under: `CONFIG` (from the environment), unless a test or benchmark
/// replaced it with `set_override`. Engines take it once per call and pass it down, so one call
/// never mixes two configurations. Production code never sets an override, and then this is one
/// relaxed atomic load and a reference-count increment.
pub fn current() -> Arc<Config> {
    if OVERRIDDEN.load(Ordering::Acquire) {
        if let Ok(g) = OVERRIDE.read() {
            if let Some(c) = g.as_ref() {
                return c.clone();
            }
        }
    }
    BASE.clone()
}

/// CTAs of one reduction launch of an *urgent* call (`CallInfo::urgent`): the whole GPU (grid-stride).
pub const URGENT_MAX_CTAS: u32 = 1024;

/// The configuration a call runs under, given its `urgent` attribute (`CallInfo::urgent`):
/// `current()`, except that an urgent call (its caller's next step waits on its done: nothing runs
/// beside it to protect, docs/design.md "Stealing nothing") sums with the whole GPU in one
/// grid-stride launch per reduction (TIDE_RS_MAX_CTAS and TIDE_RS_CTA_BYTES do not apply to it).
pub fn for_call(urgent: bool) -> Arc<Config> {
    let c = current();
    if !urgent {
        return c;
    }
    Arc::new(Config {
        rs_max_ctas: URGENT_MAX_CTAS,
        rs_cta_bytes: 0,
        ..(*c).clone()
    })
}

/// Test and benchmark hook: every call that starts after this returns runs under `config`
/// (`None`: back to the environment's). Process-wide, so every device thread of one collective sees
/// the same settings; change it only between calls (no call in flight), or ranks may disagree.
/// Prepared schedules are keyed by the settings they depend on, so a change takes effect at once.
pub fn set_override(config: Option<Config>) {
    let mut g = OVERRIDE.write().unwrap_or_else(|e| e.into_inner());
    OVERRIDDEN.store(config.is_some(), Ordering::Release);
    *g = config.map(Arc::new);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urgent_calls_sum_with_the_whole_gpu_and_others_as_configured() {
        let base = current();
        assert_eq!(*for_call(false), *base, "a call the step hides keeps the configuration");
        let u = for_call(true);
        assert_eq!((u.rs_max_ctas, u.rs_cta_bytes), (URGENT_MAX_CTAS, 0));
        assert_eq!(Config { rs_max_ctas: base.rs_max_ctas, rs_cta_bytes: base.rs_cta_bytes, ..(*u).clone() }, *base);
    }

    fn parse_one(variable: &str, value: &str) -> Result<Config, Vec<SettingError>> {
        let (variable, value) = (variable.to_string(), value.to_string());
        Config::parse(&move |k| (k == variable).then(|| value.clone()))
    }

    #[test]
    fn timeout_edge_values_are_refused_with_the_range() {
        for bad in [
            "inf", "-inf", "1e30", "0", "nan", "-1", "abc", "1e6.5", "0.0009", "1000001",
        ] {
            let errors = parse_one("TIDE_TIMEOUT_S", bad).expect_err(bad);
            assert_eq!(errors.len(), 1, "{bad}");
            let msg = errors[0].to_string();
            assert!(
                msg.starts_with(&format!("TIDE_TIMEOUT_S={bad:?} is not a valid setting")),
                "{msg}"
            );
            assert!(msg.contains("[0.001, 1000000]"), "{msg}");
        }
        for (good, want) in [("0.001", 0.001), ("2.5", 2.5), (" 30 ", 30.0), ("1e6", 1e6)] {
            assert_eq!(parse_one("TIDE_TIMEOUT_S", good).unwrap().timeout_s, want);
        }
        // Empty means unset: the default.
        assert_eq!(parse_one("TIDE_TIMEOUT_S", "  ").unwrap().timeout_s, 120.0);
    }

    #[test]
    fn every_setting_is_strict() {
        let cases = [
            ("TIDE_RS_MAX_CTAS", "0", "[1, 1024]"),
            ("TIDE_SM_THREADS", "1024", "128, 256 or 512"),
            ("TIDE_SM_THREADS", "64", "128, 256 or 512"),
            ("TIDE_SM_CARVEOUT", "101", "[-1, 100]"),
            ("TIDE_SM_CARVEOUT", "-2", "[-1, 100]"),
            ("TIDE_RS_MAX_CTAS", "4096", "[1, 1024]"),
            ("TIDE_RS_CTA_BYTES", "-1", "[0, 4294967296]"),
            ("TIDE_RS_CTA_BYTES", "512K", "[0, 4294967296]"),
            ("TIDE_CE_PIECE_BYTES", "0", "[4096, 4294967296]"),
            ("TIDE_RS_STAGE_SLOTS", "-1", "[1, 64]"),
            ("TIDE_RS_SLOT_BYTES", "100", "[4096, 4294967296]"),
            ("TIDE_RS_SLOT_BYTES", "32MiB", "[4096, 4294967296]"),
            ("TIDE_AG_STREAMS", "17", "[1, 16]"),
            ("TIDE_FUSE_CE_MIN", "-1", "[0, 1048576]"),
            ("TIDE_FUSE_CE_MIN", "2000000", "[0, 1048576]"),
            ("TIDE_RS_COPY_STREAMS", "1.5", "[1, 16]"),
            ("TIDE_MULTICAST", "2", "0 or 1"),
            ("TIDE_COPY_BATCH", "maybe", "0 or 1"),
            ("TIDE_COPY2D", "2", "0 (flat), 1 (2d), batch, bands or batch-bands"),
            ("TIDE_COPY2D", "band", "0 (flat), 1 (2d), batch, bands or batch-bands"),
            ("TIDE_COPY2D_BAND_BYTES", "0", "[1, 4294967296]"),
            ("TIDE_LOCAL_COPY", "dma", "ce, ce-peers or sm"),
            ("TIDE_RS_KERNEL", "fast", "TIDE_RS_KERNEL was removed"),
            ("TIDE_RS_KERNEL", "bulk", "TIDE_RS_KERNEL was removed"),
            ("TIDE_RS_KERNEL", "ld", "TIDE_RS_KERNEL was removed"),
        ];
        for (variable, value, accepted) in cases {
            let errors = parse_one(variable, value).expect_err(variable);
            assert_eq!(errors[0].variable, variable);
            assert!(errors[0].to_string().contains(accepted), "{}", errors[0]);
        }
        let c = parse_one("TIDE_MULTICAST", "On").unwrap();
        assert!(c.multicast);
        for (v, want) in [("ce", LocalCopy::CopyEngine), ("CE-Peers", LocalCopy::CopyEnginePeers), ("sm", LocalCopy::Sm)] {
            assert_eq!(parse_one("TIDE_LOCAL_COPY", v).unwrap().local_copy, want);
        }
        for (v, want) in [
            ("0", Copy2d::Flat),
            ("off", Copy2d::Flat),
            ("flat", Copy2d::Flat),
            ("1", Copy2d::PerPiece),
            ("Yes", Copy2d::PerPiece),
            ("2d", Copy2d::PerPiece),
            ("batch", Copy2d::Batch),
            (" Bands ", Copy2d::Bands),
            ("batch-bands", Copy2d::BatchBands),
        ] {
            assert_eq!(parse_one("TIDE_COPY2D", v).unwrap().copy2d, want, "{v}");
        }
        for c in [Copy2d::Flat, Copy2d::PerPiece, Copy2d::Batch, Copy2d::Bands, Copy2d::BatchBands] {
            assert_eq!(c.name().parse::<Copy2d>(), Ok(c), "the name of {c:?} selects it");
        }
        assert_eq!(Config::defaults().copy2d, Copy2d::PerPiece);
        assert_eq!(parse_one("TIDE_COPY2D_BAND_BYTES", "100").unwrap().copy2d_band_bytes, 100);
        // The removed TIDE_RS_KERNEL accepts what always runs now.
        for v in ["st", "ST", " coalesced ", ""] {
            assert_eq!(parse_one("TIDE_RS_KERNEL", v).unwrap(), Config::defaults());
        }
        assert_eq!(Config::parse(&|_| None).unwrap(), Config::defaults());
    }

    #[test]
    fn all_errors_are_reported_and_values_bounded() {
        let long = "9".repeat(10_000);
        let errors = Config::parse(&|k| match k {
            "TIDE_TIMEOUT_S" => Some("inf".into()),
            "TIDE_AG_STREAMS" => Some(long.clone()),
            _ => None,
        })
        .unwrap_err();
        assert_eq!(errors.len(), 2);
        assert!(errors[1].value.len() < 80, "{}", errors[1].value);
    }

    #[test]
    fn timeout_is_total_on_hand_built_configs() {
        let mut c = Config::defaults();
        for (s, want) in [
            (f64::INFINITY, 1e6),
            (f64::NAN, 0.001),
            (0.0, 0.001),
            (-5.0, 0.001),
        ] {
            c.timeout_s = s;
            assert_eq!(c.timeout(), Duration::from_secs_f64(want));
        }
    }
}
