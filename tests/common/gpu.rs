//! Helpers of the GPU test binaries that run on GPU 0 of this process (`cuda_failure`): the
//! device, streams, buffers (plain and in a VMM pool exportable by POSIX fd, as XLA's are),
//! calls with the CPU engine's expected outputs, and what a process holds (device memory,
//! threads, file descriptors). Everything panics with the failing driver call.

use super::fill;
use cudarc::driver::sys;
use std::time::Duration;
use tide::call::{BufferView, CallInfo};
use tide::cuda::driver::check;
use tide::engine::cpu::run_threads;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Op, Plan};
use tide::topology::Topology;

pub const NEEDS_GPU: &str = "needs a CUDA GPU: run with --ignored on the GPU machine";

pub fn ck(r: sys::CUresult, what: &str) {
    check(r, what, String::new).unwrap_or_else(|e| panic!("{e}"));
}

/// GPU 0's primary context, current on the calling thread (`set_current` on other threads).
#[derive(Clone, Copy)]
pub struct Gpu {
    pub ctx: sys::CUcontext,
}
// SAFETY: a retained primary context, usable from any thread.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    /// GPU 0 of this process; panics without a driver or a GPU (the tests are run on request).
    pub fn open() -> Gpu {
        if let Err(e) = tide::cuda::driver::init() {
            panic!("{NEEDS_GPU}: {e}");
        }
        let mut count = 0;
        // SAFETY: valid out-pointer, driver initialized.
        ck(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount");
        assert!(count > 0, "{NEEDS_GPU}: no CUDA device");
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: ordinal 0 exists; valid out-pointers.
        unsafe {
            ck(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
            ck(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain");
        }
        let g = Gpu { ctx };
        g.set_current();
        g
    }

    pub fn set_current(&self) {
        // SAFETY: retained primary context.
        ck(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent");
    }

    /// A non-blocking stream, like XLA's compute stream.
    pub fn stream(&self) -> usize {
        self.set_current();
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current.
        ck(
            unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        );
        s as usize
    }

    pub fn sync(&self, stream: usize) {
        self.set_current();
        // SAFETY: our stream.
        ck(unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) }, "cuStreamSynchronize");
    }

    /// Free device memory in bytes (cuMemGetInfo).
    pub fn free_bytes(&self) -> usize {
        self.set_current();
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; context current.
        ck(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo");
        free
    }

    /// Whether everything enqueued on the device finishes within `within` (cuCtxSynchronize on a
    /// thread of its own, so a device that never drains cannot hang the test). `None`: still busy.
    pub fn drains_within(&self, within: Duration) -> Option<sys::CUresult> {
        let (tx, rx) = std::sync::mpsc::channel();
        let g = *self;
        std::thread::spawn(move || {
            g.set_current();
            // SAFETY: our context.
            let r = unsafe { sys::cuCtxSynchronize() };
            let _ = tx.send(r);
        });
        rx.recv_timeout(within).ok()
    }

    /// `len` bytes (at least 1) set to `byte`.
    pub fn alloc_fill(&self, len: usize, byte: u8) -> u64 {
        self.set_current();
        let mut p = 0;
        // SAFETY: valid out-pointer; then the allocation just made.
        unsafe {
            ck(sys::cuMemAlloc_v2(&mut p, len.max(1)), "cuMemAlloc");
            ck(sys::cuMemsetD8_v2(p, byte, len.max(1)), "cuMemsetD8");
        }
        p
    }

    pub fn upload(&self, data: &[u8]) -> u64 {
        let p = self.alloc_fill(data.len(), 0);
        if !data.is_empty() {
            // SAFETY: p holds data.len() bytes.
            ck(unsafe { sys::cuMemcpyHtoD_v2(p, data.as_ptr() as *const _, data.len()) }, "cuMemcpyHtoD");
        }
        p
    }

    pub fn download(&self, p: u64, len: usize) -> Vec<u8> {
        self.set_current();
        let mut v = vec![0u8; len];
        if len > 0 {
            // SAFETY: p holds len bytes.
            ck(unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut _, p, len) }, "cuMemcpyDtoH");
        }
        v
    }
}

/// A VMM pool like XLA's (one cuMemCreate allocation, POSIX-fd exportable), bump-allocated: the
/// inputs of multi-process calls, which peers import.
pub struct Pool {
    base: u64,
    size: usize,
    used: usize,
}

impl Pool {
    pub fn new(gpu: &Gpu, bytes: usize) -> Pool {
        gpu.set_current();
        // SAFETY: plain driver calls with valid arguments on device 0 of this process.
        unsafe {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            prop.location = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            };
            let mut gran = 0usize;
            ck(
                sys::cuMemGetAllocationGranularity(
                    &mut gran,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
                "cuMemGetAllocationGranularity",
            );
            let size = bytes.div_ceil(gran) * gran;
            let mut h = 0;
            ck(sys::cuMemCreate(&mut h, size, &prop, 0), "cuMemCreate");
            let mut p = 0;
            ck(sys::cuMemAddressReserve(&mut p, size, 0, 0, 0), "cuMemAddressReserve");
            ck(sys::cuMemMap(p, size, 0, h, 0), "cuMemMap");
            let desc = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ck(sys::cuMemSetAccess(p, size, &desc, 1), "cuMemSetAccess");
            Pool { base: p, size, used: 0 }
        }
    }

    pub fn upload(&mut self, data: &[u8]) -> u64 {
        let off = self.used.div_ceil(256) * 256;
        assert!(off + data.len() <= self.size, "pool too small");
        self.used = off + data.len().max(1);
        let p = self.base + off as u64;
        if !data.is_empty() {
            // SAFETY: p holds data.len() bytes of the pool.
            ck(unsafe { sys::cuMemcpyHtoD_v2(p, data.as_ptr() as *const _, data.len()) }, "cuMemcpyHtoD");
        }
        p
    }
}

/// One collective call of `ranks` (those of this process, with their streams), its buffers on
/// GPU 0 and the CPU engine's expected outputs of every rank.
pub struct Case {
    pub calls: Vec<CallInfo>,
    /// Output addresses per call (rank of this process) and parameter.
    pub outs: Vec<Vec<u64>>,
    pub want: Vec<Vec<Vec<u8>>>,
    pub ranks: Vec<usize>,
    pub out_bytes: Vec<usize>,
}

pub fn make_plan(layout: &GroupLayout, op: Op, topo: Topology) -> Plan {
    match op {
        Op::AllGather => plan::all_gather(layout, topo).unwrap(),
        Op::ReduceScatter => plan::reduce_scatter(layout, topo, plan::RsOptions::from_config()).unwrap(),
    }
}

#[allow(clippy::needless_range_loop)] // i indexes the layout, inputs and buffer lists
/// Every rank's inputs generated from `seed` (so every process computes the same expected
/// outputs), the calls of `ranks` (rank, stream) with inputs from `input` and 0xa5-filled outputs.
#[allow(clippy::too_many_arguments)]
pub fn make_case(
    gpu: &Gpu,
    op: Op,
    site: i64,
    job: u64,
    world: usize,
    ranks: &[(usize, usize)],
    specs: &[ParamSpec],
    seed: u64,
    input: &mut dyn FnMut(&[u8]) -> u64,
) -> Case {
    let topo = Topology::single_node(world);
    let layout = GroupLayout::new(specs, world).unwrap();
    let plan = make_plan(&layout, op, topo);
    let n = layout.len();
    let inputs: Vec<Vec<Vec<u8>>> = (0..world)
        .map(|r| {
            (0..n)
                .map(|i| {
                    let mut b = vec![0u8; plan.input_bytes(i)];
                    fill(&mut b, layout.params[i].dtype, seed ^ ((r as u64) << 32) ^ (i as u64 * 7919));
                    b
                })
                .collect()
        })
        .collect();
    let want = run_threads(&plan, &inputs).unwrap();
    let (mut calls, mut outs) = (Vec::new(), Vec::new());
    for &(r, stream) in ranks {
        let (mut ins, mut os, mut optrs) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let p = &layout.params[i];
            let shard = p.shard_shape();
            let (idims, odims, odt) = match op {
                Op::AllGather => (shard, p.shape.clone(), p.dtype),
                Op::ReduceScatter => (p.shape.clone(), shard, DType::F32),
            };
            let ip = input(&inputs[r][i]);
            let opp = gpu.alloc_fill(plan.output_bytes(i), 0xa5);
            optrs.push(opp);
            ins.push(BufferView { ptr: ip as usize, dtype: p.dtype, dims: idims });
            os.push(BufferView { ptr: opp as usize, dtype: odt, dims: odims });
        }
        outs.push(optrs);
        calls.push(CallInfo {
            op,
            site,
            run_id: 0,
            rank_devices: Default::default(),
            job,
            device_ordinal: 0,
            rank: r,
            group: 0,
            world,
            topology: topo,
            names: specs.iter().map(|s| s.name.clone()).collect(),
            inputs: ins,
            outputs: os,
            stream,
            at: None,
            cast: None,
            urgent: false,
        });
    }
    Case {
        calls,
        outs,
        want,
        ranks: ranks.iter().map(|r| r.0).collect(),
        out_bytes: (0..n).map(|i| plan.output_bytes(i)).collect(),
    }
}

/// The done of `call`: operands are start's results then start's operands.
pub fn done_of(call: &CallInfo) -> CallInfo {
    let mut d = call.clone();
    d.inputs = call.outputs.iter().chain(call.inputs.iter()).cloned().collect();
    d
}

/// Every output of the case's ranks against the CPU engine, bitwise (after the streams synced).
pub fn verify(gpu: &Gpu, case: &Case) -> Result<(), String> {
    for (k, optrs) in case.outs.iter().enumerate() {
        let r = case.ranks[k];
        for (i, &p) in optrs.iter().enumerate() {
            let got = gpu.download(p, case.out_bytes[i]);
            if got != case.want[r][i] {
                let first = got.iter().zip(&case.want[r][i]).position(|(a, b)| a != b).unwrap_or(0);
                return Err(format!(
                    "rank {r} param {i} differs from the CPU engine at byte {first} of {}",
                    got.len()
                ));
            }
        }
    }
    Ok(())
}

/// Threads of this process (/proc/self/task).
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// Threads of this process once those that were joined have left /proc/self/task: a joined
/// thread can still be listed for a moment after `join` returns (its exit is not finished), so
/// this polls for up to a second until the count is at most `expect`, then reports it.
pub fn threads_settled(expect: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        let n = threads();
        if n <= expect || std::time::Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Open file descriptors of this process (/proc/self/fd, less the one reading it).
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count().saturating_sub(1)).unwrap_or(0)
}

/// What tide holds on GPU 0 of this process: staging bytes (device-wide and in-flight slots) and
/// bytes of peers' allocations mapped.
pub fn tide_held() -> (usize, u64) {
    let staging = tide::cuda::device::get(0).map(|d| d.lock().unwrap().staging_bytes()).unwrap_or(0);
    (staging, tide::cuda::ipc::stats().mapped_bytes)
}

pub fn mib(b: usize) -> f64 {
    b as f64 / (1u64 << 20) as f64
}
