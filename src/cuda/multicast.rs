//! NVLink multicast (NVLS) path of the CUDA all-gather: opt-in, off by default, gated.
//!
//! # What it does
//! On an NVSwitch system, a store to a *multicast address* is replicated by the switch into the
//! memory of every GPU bound to the multicast object. So each rank sends its shard over NVLink once,
//! whatever the number of GPUs, instead of each peer pulling it (P - 1 times out of its memory).
//! Per (call site, group), once: rank 0 creates a multicast object of `P x packed shard` bytes
//! (rounded up to the multicast granularity; `cuMulticastCreate`), every rank adds its device
//! (`cuMulticastAddDevice`), then, after a barrier, backs it with its own physical memory
//! (`cuMemCreate` + `cuMulticastBindMem`) and maps both the multicast address and a unicast view of
//! its backing (`cuMemAddressReserve` / `cuMemMap` / `cuMemSetAccess`). Per call, rank r:
//! 1. on XLA's stream (MAIN), after the usual rule 1 of the `cuda` module header, launches
//!    `tide_mc_store` (kernels/multicast.cu, `multimem.st`) once per parameter: its padded shard of
//!    parameter i goes to multicast offset `r * packed + prefix_offset(i)`, landing in every GPU;
//! 2. records its "pushed" event (phase event 0) on MAIN; host barrier;
//! 3. one side copy stream waits on every rank's pushed event, then copies (copy engine, local HBM)
//!    each rank q's valid rows of each parameter from its unicast backing to `Output(i)` at
//!    `q * shard_rows * row_bytes`; MAIN joins it; then rule 5 (done, exit barrier, peers' done).
//!
//! Ordering: a rank's stores into its peers' backings of call k+1 follow (on its MAIN) its wait on
//! every peer's `done` of call k, which follows their fan-out reads of call k. The backing is tide's
//! memory; XLA's buffers are touched only by the rank that owns them, as in the copy path.
//!
//! Memory: `P x packed shard` per GPU for the backing (the copy path needs none): one reason it is
//! opt-in. Kept for the life of the process, per (site, group, size). SMs: the store kernel uses at
//! most TIDE_RS_MAX_CTAS CTAs for a pure copy at NVLink speed.
//!
//! # The gate (checked before any multicast driver call, in this order)
//! `decide` returns `On(Granted)` only if: TIDE_MULTICAST=1 (`Config::multicast`); the environment
//! does not disable NVLink multicast (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 or
//! NVSHMEM_DISABLE_NVLS=1 — set by default on shared machines where multicast can take the GPUs
//! down); the plan is single-node; the world has at least 3 GPUs (with 2, each shard crosses NVLink
//! once either way: nothing to gain); every parameter's shard is a multiple of 16 bytes (the
//! store kernel's unit); and only then the device attribute CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
//! is read (a plain attribute query). Every function here that calls a multicast API or launches
//! multimem code takes a `Granted`, which only `decide` can make, so the gate cannot be skipped.
//! Each rank decides for its own device and publishes the result; the path runs only if every
//! rank of the call granted it (all ranks see the same published values, so all take the same path).
//!
//! Tests on CPU cover the decision (reasons, order, that the device query is not even made when an
//! earlier condition is off) and the plan (offsets, alignment, coverage); tests/kernels_nvrtc.rs
//! compiles the kernel. Nothing in the test suite or the benchmark calls a multicast API or
//! launches the kernel: never do so on the lent 2-GPU machines.
//!
//! Status: not yet run on multicast-capable hardware.

use super::driver::{self, CUdevice, CUfunction, CUstream};
use crate::error::{Result, TideError};
use crate::layout::GroupLayout;
use cudarc::driver::sys::CUdevice_attribute;
use once_cell::sync::Lazy;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

pub const SOURCE: &str = include_str!("../../kernels/multicast.cu");
pub const SOURCE_NAME: &str = "tide/kernels/multicast.cu";
pub const KERNEL: &str = "tide_mc_store";
/// Threads per CTA of the store kernel (TIDE_MC_THREADS in the source).
pub const THREADS: u32 = 512;
/// The smallest world for which the path is considered.
pub const MIN_WORLD: usize = 3;
/// Environment settings under which tide never uses multicast (variable, value that disables).
pub const DENY_VARS: [(&str, &str); 3] = [
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

/// Permission to call multicast APIs and launch multimem code: made only by `decide`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    _private: (),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    On(Granted),
    /// Why not, as "off: ...".
    Off(String),
}

impl Decision {
    pub fn granted(&self) -> Option<Granted> {
        match self {
            Decision::On(g) => Some(*g),
            Decision::Off(_) => None,
        }
    }
    pub fn describe(&self) -> &str {
        match self {
            Decision::On(_) => "on",
            Decision::Off(why) => why,
        }
    }
}

/// The reason when TIDE_MULTICAST is not set (the default).
pub const OFF_NOT_SET: &str = "off: TIDE_MULTICAST not set";
/// The reason when the device reports no multicast support.
pub const OFF_UNSUPPORTED: &str = "off: device reports no multicast support";

/// What the gate looks at besides the device.
#[derive(Debug, Clone)]
pub struct GateInputs<'a> {
    /// TIDE_MULTICAST=1.
    pub requested: bool,
    /// `env_denial` of the process environment.
    pub env_denial: Option<String>,
    pub nodes: usize,
    pub world: usize,
    /// Padded shard bytes of each parameter.
    pub shard_bytes: &'a [usize],
}

/// "NCCL_NVLS_ENABLE=0" if the environment (read through `get`) disables NVLink multicast.
pub fn env_denial(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    DENY_VARS.iter().find_map(|(k, deny)| {
        get(k)
            .filter(|v| v.trim() == *deny)
            .map(|_| format!("{k}={deny}"))
    })
}

/// The gate. `device_supports` (the attribute query) is called last, and only if everything
/// before it allows multicast.
pub fn decide(inp: &GateInputs, device_supports: &mut dyn FnMut() -> Result<bool>) -> Decision {
    if !inp.requested {
        return Decision::Off(OFF_NOT_SET.into());
    }
    if let Some(v) = &inp.env_denial {
        return Decision::Off(format!(
            "off: the environment disables NVLink multicast ({v})"
        ));
    }
    if inp.nodes != 1 {
        return Decision::Off(format!(
            "off: {} nodes; the multicast path is single-node",
            inp.nodes
        ));
    }
    if inp.world < MIN_WORLD {
        return Decision::Off(format!(
            "off: world {}: with fewer than {MIN_WORLD} GPUs every shard crosses NVLink once either way",
            inp.world
        ));
    }
    if let Some((i, b)) = inp
        .shard_bytes
        .iter()
        .enumerate()
        .find(|(_, b)| !b.is_multiple_of(16))
    {
        return Decision::Off(format!(
            "off: param {i}'s shard is {b} bytes, not a multiple of 16"
        ));
    }
    match device_supports() {
        Ok(true) => Decision::On(Granted { _private: () }),
        Ok(false) => Decision::Off(OFF_UNSUPPORTED.into()),
        Err(e) => Decision::Off(format!("off: multicast support query failed: {e}")),
    }
}

/// One store of the executing rank: its padded shard of `param` to multicast offset `mc_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct McStore {
    pub param: usize,
    pub mc_offset: usize,
    pub bytes: usize,
}

/// One fan-out copy: rank `src_rank`'s valid rows of `param`, from the backing at
/// `backing_offset` to `Output(param)` at `out_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct McFan {
    pub param: usize,
    pub src_rank: usize,
    pub backing_offset: usize,
    pub out_offset: usize,
    pub bytes: usize,
}

/// Rank `rank`'s part of the multicast all-gather of `layout`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McPlan {
    /// Bytes of the multicast buffer: world x packed shard (before granularity rounding).
    pub bytes: usize,
    pub stores: Vec<McStore>,
    pub fanout: Vec<McFan>,
}

/// Rank q's shard of parameter i lives at `q * packed + prefix_offset(i)` in the buffer.
pub fn plan(layout: &GroupLayout, rank: usize) -> McPlan {
    let packed = layout.shard_bytes;
    let mut stores = Vec::new();
    let mut fanout = Vec::new();
    for p in &layout.params {
        if p.shard_bytes > 0 {
            stores.push(McStore {
                param: p.index,
                mc_offset: rank * packed + p.prefix_offset,
                bytes: p.shard_bytes,
            });
        }
    }
    for q in 0..layout.world {
        for p in &layout.params {
            let bytes = p.valid_rows(q) * p.row_bytes();
            if bytes > 0 {
                fanout.push(McFan {
                    param: p.index,
                    src_rank: q,
                    backing_offset: q * packed + p.prefix_offset,
                    out_offset: q * p.shard_rows * p.row_bytes(),
                    bytes,
                });
            }
        }
    }
    McPlan {
        bytes: layout.world * packed,
        stores,
        fanout,
    }
}

pub fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to.max(1)) * to.max(1)
}

/// Reads CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (an attribute query; no multicast call). Cached
/// per device.
pub fn device_supports(dev: CUdevice, ordinal: i64) -> Result<bool> {
    static CACHE: Lazy<Mutex<HashMap<i64, bool>>> = Lazy::new(|| Mutex::new(HashMap::new()));
    if let Some(v) = CACHE.lock().ok().and_then(|c| c.get(&ordinal).copied()) {
        return Ok(v);
    }
    let v = driver::device_attribute(
        dev,
        ordinal,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,
        "multicast supported",
    )?;
    if let Ok(mut c) = CACHE.lock() {
        c.insert(ordinal, v != 0);
    }
    Ok(v != 0)
}

/// Logs a decision once per (device, site) at info level (warn when requested but off).
pub fn log_once(ordinal: i64, site: i64, d: &Decision) {
    static SEEN: Lazy<Mutex<HashSet<(i64, i64)>>> = Lazy::new(|| Mutex::new(HashSet::new()));
    if SEEN
        .lock()
        .map(|mut s| s.insert((ordinal, site)))
        .unwrap_or(false)
    {
        match d {
            Decision::On(_) => {
                log::info!("tide: device {ordinal} site {site}: NVLink multicast all-gather on")
            }
            Decision::Off(why) => log::warn!(
                "tide: device {ordinal} site {site}: TIDE_MULTICAST=1 but multicast {why}"
            ),
        }
    }
}

/// This device's view of one multicast buffer.
#[derive(Debug, Clone, Copy)]
pub struct McRank {
    /// Unicast address of this device's backing.
    pub uc: u64,
    /// The multicast address (stores land in every member's backing).
    pub mc: u64,
    pub size: usize,
}

/// One multicast buffer shared by the ranks of (site, group).
pub struct McShared {
    state: Mutex<McState>,
}

#[derive(Default)]
struct McState {
    handle: Option<(u64, usize)>,
    ranks: HashMap<usize, McRank>,
    complete: bool,
}

impl McShared {
    pub fn complete(&self) -> bool {
        self.state.lock().map(|s| s.complete).unwrap_or(false)
    }
    pub fn mark_complete(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.complete = true;
        }
    }
    pub fn set_handle(&self, h: (u64, usize)) {
        if let Ok(mut s) = self.state.lock() {
            s.handle = Some(h);
        }
    }
    pub fn handle(&self) -> Result<(u64, usize)> {
        self.state
            .lock()
            .ok()
            .and_then(|s| s.handle)
            .ok_or_else(|| TideError::Internal("multicast object not created".into()))
    }
    pub fn set_rank(&self, rank: usize, r: McRank) {
        if let Ok(mut s) = self.state.lock() {
            s.ranks.insert(rank, r);
        }
    }
    pub fn rank(&self, rank: usize) -> Result<McRank> {
        self.state
            .lock()
            .ok()
            .and_then(|s| s.ranks.get(&rank).copied())
            .ok_or_else(|| {
                TideError::Internal(format!("multicast buffer not mapped on rank {rank}"))
            })
    }
}

/// The buffer of (site, group) of `bytes` bytes (created empty on first use).
pub fn shared(site: i64, group: usize, bytes: usize) -> Arc<McShared> {
    type Buffers = HashMap<(i64, usize, usize), Arc<McShared>>;
    static MAP: Lazy<Mutex<Buffers>> = Lazy::new(|| Mutex::new(HashMap::new()));
    let mut m = MAP.lock().unwrap_or_else(|p| p.into_inner());
    m.entry((site, group, bytes))
        .or_insert_with(|| {
            Arc::new(McShared {
                state: Mutex::new(McState::default()),
            })
        })
        .clone()
}

/// Rank 0: creates the multicast object for `world` devices, at least `bytes` bytes. Returns
/// (handle, size).
pub fn create(_g: Granted, world: usize, bytes: usize, ordinal: i64) -> Result<(u64, usize)> {
    let gran = driver::multicast_granularity(world, bytes.max(1), || format!("device {ordinal}"))?;
    let pg = driver::mem_allocation_granularity(ordinal)?;
    let size = round_up(round_up(bytes.max(1), gran.max(1)), pg.max(1));
    // The gate was passed (`Granted`).
    let h = driver::multicast_create(world, size, || format!("device {ordinal}, {size} bytes for {world} devices"))?;
    Ok((h, size))
}

/// Every rank: adds its device to the object (all before anyone binds memory).
pub fn add_device(_g: Granted, handle: u64, dev: CUdevice, ordinal: i64) -> Result<()> {
    // SAFETY: a multicast handle from `create`; the gate was passed.
    unsafe { driver::multicast_add_device(handle, dev, || format!("device {ordinal}")) }
}

fn map(va: u64, size: usize, handle: u64, ordinal: i64, what: &str) -> Result<()> {
    // SAFETY: va reserved for `size` bytes; handle valid; then the mapped range.
    unsafe {
        driver::mem_map(va, size, handle, || format!("device {ordinal}, {what}"))?;
        driver::mem_set_access(va, size, ordinal, || format!("device {ordinal}, {what}"))
    }
}

fn reserve(size: usize, ordinal: i64) -> Result<u64> {
    driver::mem_address_reserve(size, || format!("device {ordinal}, {size} bytes"))
}

/// Every rank, after all devices were added: backs the object with this device's memory and maps
/// the multicast and unicast views. The device's context must be current.
pub fn bind_and_map(_g: Granted, handle: u64, size: usize, ordinal: i64) -> Result<McRank> {
    // Size is a multiple of the allocation granularity.
    let mem = driver::mem_create(size, ordinal, || format!("device {ordinal}, {size} bytes of multicast backing"))?;
    // SAFETY: handles from cuMulticastCreate / cuMemCreate; the gate was passed.
    unsafe { driver::multicast_bind_mem(handle, mem, size, || format!("device {ordinal}"))? };
    let mc = reserve(size, ordinal)?;
    map(mc, size, handle, ordinal, "multicast view")?;
    let uc = reserve(size, ordinal)?;
    map(uc, size, mem, ordinal, "unicast view of the backing")?;
    Ok(McRank { uc, mc, size })
}

/// The store kernel on device `ordinal` (compute capability `cc`), compiled and loaded on first
/// use. The device's context must be current.
pub fn kernel(_g: Granted, ordinal: i64, cc: (i32, i32)) -> Result<CUfunction> {
    static FNS: Lazy<Mutex<HashMap<i64, usize>>> = Lazy::new(|| Mutex::new(HashMap::new()));
    let mut fns = FNS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(f) = fns.get(&ordinal) {
        return Ok(*f as CUfunction);
    }
    let arch = super::kernels::arch(cc.0, cc.1);
    let cubin = super::nvrtc::compile(SOURCE, SOURCE_NAME, &arch, super::nvrtc::Output::Cubin)?;
    // Context current.
    let module = driver::module_load_data(&cubin, || format!("device {ordinal}, multicast kernel for {arch}"))?;
    // SAFETY: module loaded above, never unloaded.
    let f = unsafe { driver::module_get_function(module, KERNEL, || format!("device {ordinal}, {KERNEL}"))? };
    fns.insert(ordinal, f as usize);
    Ok(f)
}

/// Launches `tide_mc_store` on `stream`: `bytes` (a multiple of 16) from `src` to the multicast
/// address `mc_dst`, at most `max_ctas` CTAs.
pub(crate) fn launch_store(
    _g: Granted,
    f: CUfunction,
    stream: CUstream,
    mc_dst: u64,
    src: u64,
    bytes: usize,
    max_ctas: u32,
) -> Result<()> {
    if !bytes.is_multiple_of(16) || !mc_dst.is_multiple_of(16) || !src.is_multiple_of(16) {
        return Err(TideError::Internal(format!(
            "multicast store of {bytes} bytes from {src:#x} to {mc_dst:#x}: not 16-byte aligned"
        )));
    }
    let n16 = (bytes / 16) as u64;
    let grid = n16
        .div_ceil(THREADS as u64)
        .clamp(1, max_ctas.max(1) as u64) as u32;
    let (mut d, mut s, mut n) = (mc_dst, src, n16);
    let mut params: [*mut std::ffi::c_void; 3] = [
        &mut d as *mut u64 as *mut _,
        &mut s as *mut u64 as *mut _,
        &mut n as *mut u64 as *mut _,
    ];
    // SAFETY: params match tide_mc_store(unsigned long long, const TideU4*, unsigned long long);
    // the gate was passed.
    unsafe {
        driver::launch_kernel(f, grid, THREADS, stream, &mut params, "cuLaunchKernel(tide_mc_store)", || {
            format!("{bytes} bytes, grid {grid}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, ParamSpec};

    fn inputs(shards: &[usize]) -> GateInputs<'_> {
        GateInputs {
            requested: true,
            env_denial: None,
            nodes: 1,
            world: 4,
            shard_bytes: shards,
        }
    }

    /// A device query that must not be made.
    fn never() -> impl FnMut() -> Result<bool> {
        || panic!("the device was queried although an earlier condition is off")
    }

    #[test]
    fn off_unless_requested_and_no_device_query() {
        let mut i = inputs(&[64]);
        i.requested = false;
        let d = decide(&i, &mut never());
        assert_eq!(d, Decision::Off(OFF_NOT_SET.into()));
        assert_eq!(d.describe(), "off: TIDE_MULTICAST not set");
        assert!(d.granted().is_none());
    }

    #[test]
    fn off_when_the_environment_disables_it() {
        let env = |k: &str| match k {
            "NCCL_NVLS_ENABLE" => Some("0".to_string()),
            _ => None,
        };
        assert_eq!(env_denial(&env).as_deref(), Some("NCCL_NVLS_ENABLE=0"));
        assert_eq!(env_denial(&|_| None), None);
        assert_eq!(
            env_denial(&|k| (k == "NCCL_NVLS_ENABLE").then(|| "1".to_string())),
            None
        );
        assert_eq!(
            env_denial(&|k| (k == "NVSHMEM_DISABLE_NVLS").then(|| " 1 ".to_string())).as_deref(),
            Some("NVSHMEM_DISABLE_NVLS=1")
        );
        let mut i = inputs(&[64]);
        i.env_denial = env_denial(&env);
        let d = decide(&i, &mut never());
        assert_eq!(
            d.describe(),
            "off: the environment disables NVLink multicast (NCCL_NVLS_ENABLE=0)"
        );
    }

    #[test]
    fn off_for_two_gpus_multi_node_and_unaligned_shards() {
        let mut i = inputs(&[64]);
        i.world = 2;
        assert!(decide(&i, &mut never())
            .describe()
            .starts_with("off: world 2"));
        let mut i = inputs(&[64]);
        i.nodes = 2;
        assert!(decide(&i, &mut never()).describe().contains("single-node"));
        let i = inputs(&[64, 24]);
        assert_eq!(
            decide(&i, &mut never()).describe(),
            "off: param 1's shard is 24 bytes, not a multiple of 16"
        );
    }

    #[test]
    fn device_support_decides_last() {
        let i = inputs(&[64, 32]);
        let mut calls = 0;
        let d = decide(&i, &mut || {
            calls += 1;
            Ok(false)
        });
        assert_eq!(d.describe(), "off: device reports no multicast support");
        assert_eq!(calls, 1);
        let d = decide(&i, &mut || Err(TideError::Internal("boom".into())));
        assert!(d
            .describe()
            .starts_with("off: multicast support query failed"));
        let d = decide(&i, &mut || Ok(true));
        assert_eq!(d.describe(), "on");
        assert!(d.granted().is_some());
    }

    #[test]
    fn plan_covers_every_row_once_at_aligned_offsets() {
        let specs = [
            ParamSpec::new("a", &[10, 8], DType::BF16),
            ParamSpec::new("b", &[7, 16], DType::F32),
            ParamSpec::new("c", &[3], DType::BF16),
        ];
        let world = 4;
        let layout = GroupLayout::new(&specs, world).unwrap();
        for rank in 0..world {
            let p = plan(&layout, rank);
            assert_eq!(p.bytes, world * layout.shard_bytes);
            // Stores: this rank's padded shards, in its block, disjoint.
            assert_eq!(p.stores.len(), 3);
            for s in &p.stores {
                let pl = &layout.params[s.param];
                assert_eq!(s.bytes, pl.shard_bytes);
                assert_eq!(s.mc_offset, rank * layout.shard_bytes + pl.prefix_offset);
                assert!(s.mc_offset + s.bytes <= (rank + 1) * layout.shard_bytes);
            }
            // Fan-out: every valid byte of every output written exactly once.
            for pl in &layout.params {
                let mut covered = vec![0u8; pl.full_bytes()];
                for f in p.fanout.iter().filter(|f| f.param == pl.index) {
                    assert_eq!(
                        f.backing_offset,
                        f.src_rank * layout.shard_bytes + pl.prefix_offset
                    );
                    assert_eq!(f.bytes, pl.valid_rows(f.src_rank) * pl.row_bytes());
                    for b in &mut covered[f.out_offset..f.out_offset + f.bytes] {
                        *b += 1;
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "{}", pl.describe());
            }
        }
        // Shard sizes decide the 16-byte condition: "c" has 1 row of 2 bytes per shard.
        let sb: Vec<usize> = layout.params.iter().map(|p| p.shard_bytes).collect();
        assert!(decide(&inputs(&sb), &mut never())
            .describe()
            .contains("param 2's shard"));
    }

    #[test]
    fn kernel_source_is_separate() {
        assert!(SOURCE.contains("multimem.st"));
        assert!(SOURCE.contains(&format!("\n{KERNEL}(")));
        assert!(SOURCE.contains(&format!("#define TIDE_MC_THREADS {THREADS}")));
        assert!(!super::super::kernels::SOURCE.contains("multimem"));
        assert_eq!(round_up(5, 4), 8);
        assert_eq!(round_up(8, 4), 8);
    }
}
