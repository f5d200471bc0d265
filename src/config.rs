//! Tunables, in one place, read once from the environment. Each has a default; docs/design.md lists them.

use once_cell::sync::Lazy;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// TIDE_TIMEOUT_S (default 120): how long a rank waits at a rendezvous or barrier for its peers
    /// before the call fails with an error naming the missing ranks. Never hang.
    pub timeout_s: f64,
    /// TIDE_RS_MAX_CTAS (default 16): upper bound on CTAs of one fp32 reduction kernel launch.
    pub rs_max_ctas: u32,
    /// TIDE_RS_STAGE_SLOTS (default 3): number of staging slots in the reduce-scatter pipeline
    /// (3 beat 2 on 2 H200s: bench/results/2026-11-30-cuda-bench.md).
    pub rs_stage_slots: usize,
    /// TIDE_RS_SLOT_BYTES (default 32 MiB): bytes of one staging slot. The reduce-scatter's scratch per
    /// rank is rs_stage_slots * rs_slot_bytes, independent of the group size.
    pub rs_slot_bytes: usize,
    /// TIDE_AG_STREAMS (default 1; 1 was fastest on 2 H200s, more streams only add event and host
    /// overhead: bench/results/2026-11-30-cuda-bench.md): copy streams the CUDA all-gather spreads peer copies over (its
    /// local copy-engine copies go on one more stream of their own, overlapping them).
    pub ag_streams: usize,
    /// TIDE_MULTICAST (default off): allow the NVLink multicast all-gather (`cuda::multicast`) when
    /// the whole gate passes: the environment does not disable NVLink multicast (NCCL_NVLS_ENABLE=0
    /// etc.), single node, at least 3 GPUs, 16-byte shards, and the device reports
    /// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED. Never set on shared machines.
    pub multicast: bool,
    /// TIDE_RS_COPY_STREAMS (default 1, fastest on 2 H200s): copy streams the CUDA reduce-scatter spreads each chunk's
    /// staging copies over (pieces of at least 1 MiB).
    pub rs_copy_streams: usize,
    /// TIDE_LOCAL_COPY (default `ce`): how the CUDA engine copies between two buffers of the same GPU
    /// (the all-gather's own shard): `ce` = copy engine (cuMemcpyAsync on a copy stream, zero SMs),
    /// `sm` = the `tide_copy` kernel on XLA's stream (at most TIDE_RS_MAX_CTAS CTAs).
    pub local_copy: LocalCopy,
    /// TIDE_NVRTC_LIB_DIR (default unset): a folder holding libnvrtc.so.* (and libnvrtc-builtins),
    /// e.g. site-packages/nvidia/cu13/lib of the nvidia-cuda-nvrtc wheel; loaded before the system's.
    pub nvrtc_lib_dir: Option<String>,
    /// TIDE_COPY_BATCH (default 1): when 1, the CUDA engine issues consecutive copy-engine copies of
    /// one stream as one cuMemcpyBatchAsync (CUDA 13 drivers) instead of one cuMemcpyAsync each.
    /// On: 1.2-1.6x faster all-gathers on 2 H200s (bench/results/2026-11-30-cuda-bench.md); the engine
    /// falls back to single copies where the driver lacks the symbol.
    pub copy_batch: bool,
    /// TIDE_RS_KERNEL (default `st`: 2.2x faster than `ld` at 16 CTAs on one H200, faster than
    /// `bulk` at every size measured, /work/shared/measurements/2026-12-01/rs-kernels.md): the
    /// reduce-scatter's fp32 reduction kernel: `st` = 8-byte source loads and one contiguous
    /// 16-byte fp32 store per thread, `ld` = LSU 16-byte loads (`rs_sum_*_f32`), `bulk` = Hopper bulk async copies into a shared-memory ring
    /// (`rs_sum_*_f32_bulk`; compute capability >= 9.0, 16-byte aligned, at most 4 sources per launch,
    /// otherwise the `ld` kernel). Both give bitwise identical results.
    pub rs_kernel: RsKernel,
    /// TIDE_MAX_IN_FLIGHT (default 4, 1..=16): CUDA calls of one op (all-gather, reduce-scatter)
    /// that may be started and not yet done at once per device. Each owns an in-flight slot: a tide
    /// stream, side streams, events and (reduce-scatter) its own stage slots, so staging memory per
    /// device is at most TIDE_MAX_IN_FLIGHT x TIDE_RS_STAGE_SLOTS x TIDE_RS_SLOT_BYTES (default
    /// 4 x 96 MiB, allocated only when that many reduce-scatters were in flight at once, then kept);
    /// the all-gather needs none. A start beyond it fails with an error naming it. 4, not 2: XLA
    /// may issue a layer loop's next start before the previous done (tide_jax's prefetch=2 then has
    /// 3 gathers in flight).
    pub max_in_flight: usize,
    /// TIDE_FUSE_BYTES (default 524288; 0 = off): on the in-process CUDA path, runs of independent
    /// copies (copy-engine or SM) and reductions on one stream whose segments are each smaller than
    /// this go as batched kernel launches (`tide_copy_batch`, `rs_sum_batch_*`: up to 32 copies or
    /// 16 sums per launch, one CTA per segment, at most TIDE_RS_MAX_CTAS CTAs) instead of one
    /// driver operation each, so a group of many small parameters costs a few launches, not one
    /// per parameter (issue #9: 5-7 us per parameter before). Small copies then use SMs briefly.
    /// A sum's size is its fp32 output (a 128 KiB bf16 gradient shard on one GPU: 256 KiB).
    pub fuse_bytes: usize,
}

/// Which fp32 reduction kernel the CUDA reduce-scatter launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsKernel {
    Ld,
    Bulk,
    /// The ld kernel with 8-byte source loads and one contiguous 16-byte fp32 store per thread.
    St,
}

impl std::str::FromStr for RsKernel {
    type Err = String;
    fn from_str(s: &str) -> Result<RsKernel, String> {
        match s.to_ascii_lowercase().as_str() {
            "ld" | "lsu" => Ok(RsKernel::Ld),
            "bulk" | "tma" => Ok(RsKernel::Bulk),
            "st" | "coalesced" => Ok(RsKernel::St),
            other => Err(format!("{other:?}: expected ld, bulk or st")),
        }
    }
}

/// How the CUDA engine performs a copy whose source and destination are on the same GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalCopy {
    CopyEngine,
    Sm,
}

impl std::str::FromStr for LocalCopy {
    type Err = String;
    fn from_str(s: &str) -> Result<LocalCopy, String> {
        match s.to_ascii_lowercase().as_str() {
            "ce" | "copy_engine" => Ok(LocalCopy::CopyEngine),
            "sm" | "kernel" => Ok(LocalCopy::Sm),
            other => Err(format!("{other:?}: expected ce or sm")),
        }
    }
}

fn env_parse<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => match v.trim().parse() {
            Ok(x) => x,
            Err(_) => {
                log::warn!("tide: ignoring {name}={v:?}: not a valid value");
                default
            }
        },
        Err(_) => default,
    }
}

impl Config {
    pub fn from_env() -> Config {
        Config {
            timeout_s: env_parse("TIDE_TIMEOUT_S", 120.0),
            rs_max_ctas: env_parse("TIDE_RS_MAX_CTAS", 16u32).max(1),
            rs_stage_slots: env_parse("TIDE_RS_STAGE_SLOTS", 3usize).max(1),
            rs_slot_bytes: env_parse("TIDE_RS_SLOT_BYTES", 32usize << 20).max(4096),
            ag_streams: env_parse("TIDE_AG_STREAMS", 1usize).clamp(1, 16),
            multicast: env_parse("TIDE_MULTICAST", 0u32) != 0,
            rs_copy_streams: env_parse("TIDE_RS_COPY_STREAMS", 1usize).clamp(1, 16),
            local_copy: env_parse("TIDE_LOCAL_COPY", LocalCopy::CopyEngine),
            copy_batch: env_parse("TIDE_COPY_BATCH", 1u32) != 0,
            rs_kernel: env_parse("TIDE_RS_KERNEL", RsKernel::St),
            max_in_flight: env_parse("TIDE_MAX_IN_FLIGHT", 4usize).clamp(1, 16),
            fuse_bytes: env_parse("TIDE_FUSE_BYTES", 512usize << 10),
            nvrtc_lib_dir: std::env::var("TIDE_NVRTC_LIB_DIR")
                .ok()
                .filter(|s| !s.trim().is_empty()),
        }
    }
}

/// The process-wide configuration, read on first use.
pub static CONFIG: Lazy<Config> = Lazy::new(Config::from_env);

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

/// Test and benchmark hook: every call that starts after this returns runs under `config`
/// (`None`: back to the environment's). Process-wide, so every device thread of one collective sees
/// the same settings; change it only between calls (no call in flight), or ranks may disagree.
/// Prepared schedules are keyed by the settings they depend on, so a change takes effect at once.
pub fn set_override(config: Option<Config>) {
    let mut g = OVERRIDE.write().unwrap_or_else(|e| e.into_inner());
    OVERRIDDEN.store(config.is_some(), Ordering::Release);
    *g = config.map(Arc::new);
}
