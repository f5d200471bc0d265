//! How much tide's GPU work slows concurrent compute on one GPU: the TIDE paper's Table 4 method
//! (a victim on one stream, an aggressor looped on a second stream; medians of 9 overlapped
//! samples, alone and during interleaved), plus the aggressor's throughput alone, its SM time per
//! call (CTA lifetimes from %globaltimer) and an SM-id probe (the paper's Table 5: how many
//! one-CTA-per-SM probe CTAs a resident aggressor displaces past the first wave).
//!
//! Victims (own stream): a one-wave bf16 GEMM (cuBLAS, 2048 x 2048 x 16384, x10), a many-wave GEMM
//! (8192^3, x3), an fp32 elementwise pass over 1 GiB (x4). cuBLAS is loaded at run time
//! (libcublas.so.13 / .12 / libcublas.so: put NVIDIA's wheel folder on LD_LIBRARY_PATH); without
//! it the GEMM victims are skipped and said so.
//!
//! Modes (first argument):
//! - `explore`: raw kernels and copies, to choose the engine's launch shape: tide's reduction
//!   body and variants (more loads in flight, 1024 threads, Hopper bulk loads with thread or bulk
//!   stores), grid-stride at 4/16/132 CTAs or in short launches of 16 CTAs that each move a bounded
//!   number of bytes (with and without programmatic dependent launch); read-only, write-only and
//!   copy kernels (the per-SM ceilings); a full-grid upcast + add (XLA's fusion); 16 spinning
//!   CTAs; same-device cuMemcpyAsync, cuMemcpyBatchAsync of 1 and 8 pieces with and without
//!   PREFER_OVERLAP_WITH_COMPUTE, cuMemsetD8Async; the per-launch gap of back-to-back launches.
//! - `engine`: tide's calls as the engine issues them (world 1, and rank 0 of an emulated world P
//!   whose peers' inputs are buffers of the same GPU) over one Llama-3-8B layer.
//! - `sumphase`: what caps the sum phase under a bound of 16 resident CTAs: short launches spread
//!   over 2 or 4 streams (8 or 4 CTAs each) or replayed from a CUDA graph, with the sources (or
//!   every operand) in L2; streaming and TMA bulk stores; per-SM rates (sum, read-only, write-only)
//!   from HBM and from L2; the launch gap on one stream, from a graph, over two streams; and each
//!   short launch's timeline (CTA life, the spread of ends, the gap to the next launch); sums of
//!   2, 4 and 8 sources (the reduce-scatter at world 2, 4, 8) from HBM and from L2.
//! - `green`: the sum's CTAs confined to an SM partition of 8, 16 or 24 SMs (a green context,
//!   CUDA 12.4+): one launch of many short-lived CTAs (512 KiB or 1 MiB each, one per SM: their
//!   dynamic shared memory leaves room for no second) instead of back-to-back launches of 16, so
//!   the partition bounds residency and a finished CTA's successor starts without a launch gap;
//!   launches of 64 CTAs, and 16-CTA launches in the partition; 8 sources from L2; which SMs the
//!   CTAs ran on and how many were alive at once, from the trace; bitwise against one grid-stride
//!   launch of tide's kernel.
//! - `progress` (issue #38, the other half of `engine`: how much the victim slows tide): for the
//!   reduce-scatter and the all-gather at world 1 and emulated P = 2, 4, 8 (as `engine` issues
//!   them, under the environment's TIDE_* settings) and each victim, plus a persistent full-SM
//!   probe (one CTA per SM of 384 threads holding the device's opt-in maximum of shared memory,
//!   232448 B on H100, spinning 1 ms: what cuDNN's flash attention does there, so nothing else
//!   starts on its SMs until it ends; bursts of 4): the victim alone, the call alone, and both
//!   started together (a one-CTA spin on the victim's stream gates an event both streams wait on,
//!   so the host's enqueue time is outside every number), from the common start until both are
//!   done; each victim's burst sized to >= TIDE_BENCH_PROGRESS_RATIO (1.25) x the call alone.
//!   Medians of TIDE_BENCH_SAMPLES interleaved rounds; overlap = (victim + call - both) /
//!   min(victim, call), added latency = both - victim, each one's time inside `both` against
//!   alone. First, each tide kernel's resources as the engine loaded it (registers, shared
//!   memory, CTAs per SM at its launch shape). Rows are "CALL | VICTIM", e.g.
//!   "RS world 8 (emulated): default | gemm_1wave".
//! - `coresidence` (issue #38: does a tide CTA ever run on an SM beside a compute kernel's CTA?):
//!   a victim grid of one CTA per SM that spins 2 ms and traces each CTA ({smid, start, end} from
//!   %globaltimer), and 300 us after its launch (host wait, so the victim is resident) an aggressor
//!   of 16 CTAs of tide's sum body (2 bf16 sources, 64 Mi elements, the engine's 64-register bound),
//!   traced too. Victim shapes: XLA's Triton GEMM on H100 (256 threads, ~154 registers via 144 live
//!   floats, 196,640 B dynamic shared memory), the same with its preferred carveout at 100, the same
//!   registers without shared memory, cuDNN's attention (384 threads, 232,448 B: expected never), and
//!   a control that surely leaves room (256 threads, 14 registers, no shared memory). Aggressors:
//!   512 and 256 threads, stream priority 0 and the greatest, preferred carveout default and 100.
//!   Per (victim, aggressor): both kernels' registers, shared memory, carveout attribute and
//!   occupancy as the driver reports them; over TIDE_BENCH_SAMPLES runs, how many aggressor CTAs
//!   started before the victim's last CTA ended, how many of those ran on an SM while a victim CTA
//!   lived there, the aggressor's first start from the victim's start and last end from the
//!   victim's end (medians); first each kernel alone.
//! - `cecheck` (issue #38: which data movement within one GPU progresses beside a kernel holding
//!   every SM, i.e. runs on copy engines, and which the driver runs as SM kernels? The emulated
//!   peers are buffers of the same GPU, so this decides what the emulated all-gather can show):
//!   `progress`'s rows against the full-SM probe for cuMemcpyDtoDAsync (8 x 32 MiB, 1 x 256 MiB,
//!   64 x 4 MiB), cuMemcpyBatchAsync (8 x 32 MiB, PREFER_OVERLAP_WITH_COMPUTE), a strided
//!   cuMemcpy2DAsync (3.5 KiB rows to a pitch of 8 rows, 64 MiB), cuMemsetD32Async (256 MiB),
//!   pinned D2H and H2D (64 MiB, the control), a bf16 -> fp32 upcast by 2-D copy (16 Mi
//!   elements: 2-byte rows into the high halves of zeroed fp32 slots; checked bitwise first, and
//!   its rate alone) and same-context cuMemcpyPeerAsync (8 x 32 MiB); per row overlap, each one's
//!   time inside `both`, the rate alone (bytes written) and a verdict: copy engine (overlap >=
//!   0.8), SM (blocked) (<= 0.2) or partial.
//!
//! Output: one line per row on stdout; JSON at $TIDE_BENCH_OUT. Env: TIDE_BENCH_SAMPLES (9),
//! TIDE_BENCH_ROWS (comma-separated substrings of the row names to run; default all),
//! TIDE_BENCH_PROGRESS_RATIO (1.25; the victim's burst over the call alone in `progress` and
//! `cecheck`).
//! Build here: cargo build --release --example interference; run there (scripts/gpu interference).

#![allow(clippy::too_many_arguments)]

use cudarc::driver::sys;
use std::ffi::c_void;
use std::fmt::Write as _;
use std::time::{Duration, Instant};
use tide::call::{BufferView, CallInfo};
use tide::cuda::driver::check;
use tide::cuda::EmulatedPeer;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::Op;
use tide::topology::Topology;

macro_rules! ck {
    ($e:expr, $name:expr) => {
        check(unsafe { $e }, $name, String::new).unwrap_or_else(|e| panic!("{e}"))
    };
}

const KERNELS: &str = include_str!("interference_kernels.cu");
/// Elements of the reduction aggressors: 2 x 64 MiB bf16 in, 128 MiB fp32 out.
const N: u64 = 32 << 20;
/// Bytes read + written by one reduction of N elements from 2 bf16 sources.
const SUM_BYTES: f64 = (N * (2 + 2 + 4)) as f64;
/// The copy aggressors' bytes.
const COPY_BYTES: usize = 256 << 20;
const PROBE_TILE_ELEMS: u64 = 4096;
const PROBE_BULK_SMEM: u32 = 4 * 2 * 8192;
const PROBE_BULK_OUT_SMEM: u32 = 2 * 2 * 8192;
/// probe_st_tma_out's two buffer sets of 4 fp32 tiles of 4096 elements.
const TMA_OUT_SMEM: u32 = 2 * 4 * 4096 * 4;

// ----- cuBLAS, loaded at run time -----

type Handle = *mut c_void;
struct Cublas {
    _lib: libloading::Library,
    handle: Handle,
    set_stream: unsafe extern "C" fn(Handle, sys::CUstream) -> i32,
    gemm_ex: unsafe extern "C" fn(
        Handle,
        i32,
        i32,
        i32,
        i32,
        i32,
        *const c_void,
        *const c_void,
        i32,
        i32,
        *const c_void,
        i32,
        i32,
        *const c_void,
        *mut c_void,
        i32,
        i32,
        i32,
        i32,
    ) -> i32,
}

impl Cublas {
    fn load() -> Result<Cublas, String> {
        let mut last = String::new();
        for name in ["libcublas.so.13", "libcublas.so.12", "libcublas.so"] {
            // SAFETY: loading a shared library; its initializers are cuBLAS's own.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => unsafe {
                    let create: libloading::Symbol<unsafe extern "C" fn(*mut Handle) -> i32> =
                        lib.get(b"cublasCreate_v2\0").map_err(|e| e.to_string())?;
                    let set_stream = *lib
                        .get::<unsafe extern "C" fn(Handle, sys::CUstream) -> i32>(b"cublasSetStream_v2\0")
                        .map_err(|e| e.to_string())?;
                    let gemm_ex = *lib.get(b"cublasGemmEx\0").map_err(|e| e.to_string())?;
                    let mut handle = std::ptr::null_mut();
                    let r = create(&mut handle);
                    if r != 0 {
                        return Err(format!("cublasCreate_v2 -> {r}"));
                    }
                    return Ok(Cublas {
                        _lib: lib,
                        handle,
                        set_stream,
                        gemm_ex,
                    });
                },
                Err(e) => last = format!("{name}: {e}"),
            }
        }
        Err(last)
    }

    /// C (m x n, bf16) = A (m x k) B (k x n), column-major, fp32 accumulate, on `stream`.
    fn gemm(&self, stream: sys::CUstream, m: i32, n: i32, k: i32, a: u64, b: u64, c: u64) {
        const BF16: i32 = 14; // CUDA_R_16BF
        const COMPUTE_32F: i32 = 68; // CUBLAS_COMPUTE_32F
        let (alpha, beta) = (1f32, 0f32);
        unsafe {
            assert_eq!((self.set_stream)(self.handle, stream), 0, "cublasSetStream");
            let r = (self.gemm_ex)(
                self.handle,
                0,
                0,
                m,
                n,
                k,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                BF16,
                m,
                b as *const c_void,
                BF16,
                k,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                BF16,
                m,
                COMPUTE_32F,
                -1,
            );
            assert_eq!(r, 0, "cublasGemmEx -> {r}");
        }
    }
}

// ----- the device -----

struct Gpu {
    name: String,
    sms: u32,
    /// The victims' stream (green mode swaps in one of the highest priority for some rows).
    vic: std::cell::Cell<sys::CUstream>,
    agg: sys::CUstream,
    module: sys::CUmodule,
    /// The probe kernels' cubin (green mode loads it again where a partition needs its own module).
    cubin: Vec<u8>,
    cublas: Option<Cublas>,
    /// Timing events.
    ev: Vec<sys::CUevent>,
}

fn malloc(bytes: usize) -> u64 {
    let mut p = 0;
    ck!(sys::cuMemAlloc_v2(&mut p, bytes.max(1)), "cuMemAlloc");
    p
}

fn func(g: &Gpu, name: &str) -> sys::CUfunction {
    let mut f = std::ptr::null_mut();
    let c = std::ffi::CString::new(name).unwrap();
    ck!(sys::cuModuleGetFunction(&mut f, g.module, c.as_ptr()), "cuModuleGetFunction");
    f
}

fn sync_all() {
    ck!(sys::cuCtxSynchronize(), "cuCtxSynchronize");
}

fn elapsed_ms(a: sys::CUevent, b: sys::CUevent) -> f64 {
    let mut t = 0f32;
    ck!(sys::cuEventElapsedTime_v2(&mut t, a, b), "cuEventElapsedTime");
    t as f64
}

/// A kernel launch: grid x threads, dynamic shared memory, optional programmatic dependent launch.
fn launch(f: sys::CUfunction, grid: u32, threads: u32, smem: u32, stream: sys::CUstream, params: &mut [*mut c_void], pdl: bool) {
    if !pdl {
        ck!(
            sys::cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, smem, stream, params.as_mut_ptr(), std::ptr::null_mut()),
            "cuLaunchKernel"
        );
        return;
    }
    // SAFETY: a zeroed attribute is a valid C struct; id and value set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    ck!(
        sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()),
        "cuLaunchKernelEx"
    );
}

/// A trailing kernel argument past the common seven.
#[derive(Clone, Copy)]
enum Extra {
    None,
    I32(i32),
    U64(u64),
}

/// The arguments every aggressor kernel takes, (dst, a, b, n, trace, trace_base, pdl), and an
/// optional eighth; `launch` passes them by address as the driver wants (`pdl` != 0 also launches
/// with programmatic dependent launch).
#[derive(Clone, Copy)]
struct KArgs {
    d: u64,
    a: u64,
    b: u64,
    n: u64,
    trace: u64,
    base: u64,
    pdl: i32,
    extra: Extra,
}

impl KArgs {
    fn new(d: u64, a: u64, b: u64, n: u64) -> KArgs {
        KArgs { d, a, b, n, trace: 0, base: 0, pdl: 0, extra: Extra::None }
    }

    fn launch(mut self, f: sys::CUfunction, grid: u32, threads: u32, smem: u32, stream: sys::CUstream) {
        let pdl = self.pdl != 0;
        self.with_params(|params| launch(f, grid, threads, smem, stream, params, pdl));
    }

    /// `go` given the arguments as the driver wants them: the addresses of the fields (and of the
    /// optional eighth).
    fn with_params<R>(&mut self, go: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        let (mut xi, mut xu) = match self.extra {
            Extra::I32(v) => (v, 0u64),
            Extra::U64(v) => (0i32, v),
            Extra::None => (0, 0),
        };
        let mut params: Vec<*mut c_void> = vec![
            &mut self.d as *mut u64 as *mut c_void,
            &mut self.a as *mut u64 as *mut c_void,
            &mut self.b as *mut u64 as *mut c_void,
            &mut self.n as *mut u64 as *mut c_void,
            &mut self.trace as *mut u64 as *mut c_void,
            &mut self.base as *mut u64 as *mut c_void,
            &mut self.pdl as *mut i32 as *mut c_void,
        ];
        match self.extra {
            Extra::I32(_) => params.push(&mut xi as *mut i32 as *mut c_void),
            Extra::U64(_) => params.push(&mut xu as *mut u64 as *mut c_void),
            Extra::None => {}
        }
        go(&mut params)
    }
}

fn setup() -> Option<Gpu> {
    if let Err(e) = tide::cuda::driver::init() {
        println!("SKIPPED interference: {e}");
        return None;
    }
    let mut count = 0;
    ck!(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount");
    if count == 0 {
        println!("SKIPPED interference: no CUDA device");
        return None;
    }
    let mut dev = 0;
    let mut ctx = std::ptr::null_mut();
    ck!(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
    ck!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain");
    ck!(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    let attr = |a| {
        let mut v = 0;
        ck!(sys::cuDeviceGetAttribute(&mut v, a, dev), "cuDeviceGetAttribute");
        v
    };
    let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as u32;
    let (ma, mi) = (
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    );
    let mut name = [0i8; 128];
    ck!(sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev), "cuDeviceGetName");
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    let source = format!("{}\n{}", tide::cuda::kernels::SOURCE, KERNELS);
    let arch = tide::cuda::kernels::arch(ma, mi);
    let cubin = tide::cuda::nvrtc::compile(&source, "interference_kernels.cu", &arch, tide::cuda::nvrtc::Output::Cubin)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut module = std::ptr::null_mut();
    ck!(sys::cuModuleLoadData(&mut module, cubin.as_ptr() as *const c_void), "cuModuleLoadData");
    let mk_stream = || {
        let mut s = std::ptr::null_mut();
        ck!(
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            "cuStreamCreate"
        );
        s
    };
    let (vic, agg) = (mk_stream(), mk_stream());
    let ev = (0..8)
        .map(|_| {
            let mut e = std::ptr::null_mut();
            ck!(sys::cuEventCreate(&mut e, 0), "cuEventCreate");
            e
        })
        .collect();
    let cublas = match Cublas::load() {
        Ok(c) => Some(c),
        Err(e) => {
            println!("NOTE: cuBLAS not loaded ({e}): GEMM victims skipped");
            None
        }
    };
    let g = Gpu {
        name,
        sms,
        vic: std::cell::Cell::new(vic),
        agg,
        module,
        cubin,
        cublas,
        ev,
    };
    for (k, smem) in [("probe_bulk", PROBE_BULK_SMEM + PROBE_BULK_OUT_SMEM), ("probe_resident", 200 << 10), ("probe_st_tma_out", TMA_OUT_SMEM)] {
        let f = func(&g, k);
        ck!(
            sys::cuFuncSetAttribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32
            ),
            "cuFuncSetAttribute"
        );
    }
    println!("device: {} ({} SMs, {arch})", g.name, g.sms);
    Some(g)
}

/// Random finite bf16 bit patterns (|x| in [2^-7, 2^8)): 4 M random values, repeated.
fn fill_bf16(p: u64, elems: usize, seed: u64) {
    let mut x = seed | 1;
    let mut host = vec![0u16; elems.min(4 << 20)];
    for h in host.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let r = (x >> 20) as u32;
        *h = (((r & 1) << 15) | ((120 + (r >> 1) % 15) << 7) | ((r >> 5) & 0x7f)) as u16;
    }
    let mut done = 0;
    while done < elems {
        let n = host.len().min(elems - done);
        ck!(sys::cuMemcpyHtoD_v2(p + done as u64 * 2, host.as_ptr() as *const c_void, n * 2), "cuMemcpyHtoD");
        done += n;
    }
}

// ----- aggressors and victims -----

/// One aggressor: `call` enqueues one call's worth of work on the given stream; `bytes` moved per
/// call (read + written); `ctas`: CTAs per launch (0: copy engines); `trace`: whether its kernels
/// record CTA lifetimes (then `call` takes the trace buffer).
struct Aggressor<'a> {
    name: String,
    bytes: f64,
    traced: bool,
    /// tide's configuration while this row runs (engine rows); None: the environment's.
    config: Option<tide::config::Config>,
    /// SM time of one call is at most this many CTAs x the call's time (engine rows, untraced).
    ctas_bound: Option<u32>,
    call: Box<dyn Fn(sys::CUstream, u64) + 'a>,
}

impl<'a> Aggressor<'a> {
    /// A row whose kernels trace their CTAs, under the environment's configuration.
    fn traced(name: String, bytes: f64, call: Box<dyn Fn(sys::CUstream, u64) + 'a>) -> Aggressor<'a> {
        Aggressor { name, bytes, traced: true, config: None, ctas_bound: None, call }
    }

    /// A row whose work is not traced (copies, fills, foreign kernels), under the environment's
    /// configuration.
    fn plain(name: String, bytes: f64, call: Box<dyn Fn(sys::CUstream, u64) + 'a>) -> Aggressor<'a> {
        Aggressor { name, bytes, traced: false, config: None, ctas_bound: None, call }
    }
}

struct Victim<'a> {
    name: &'static str,
    /// One repetition: one GEMM, one elementwise pass, one launch of the full-SM probe.
    unit: Box<dyn Fn(sys::CUstream) + 'a>,
    /// Repetitions in one burst of `explore` and `engine` (the header's x10, x3, x4); `progress`
    /// sizes its bursts itself.
    count: usize,
}

impl Victim<'_> {
    /// The victim's burst: `count` repetitions on `stream`.
    fn run(&self, stream: sys::CUstream) {
        self.burst(stream, self.count);
    }

    fn burst(&self, stream: sys::CUstream, reps: usize) {
        for _ in 0..reps {
            (self.unit)(stream);
        }
    }
}

#[derive(Default, Clone)]
struct Row {
    alone_ms: f64,
    /// Host time to enqueue one call (ms).
    host_ms: f64,
    gbps: f64,
    /// SM time of one call (sum of CTA lifetimes, ms) and the most CTAs alive at once.
    sm_ms: Option<f64>,
    max_resident: Option<usize>,
    launches: Option<usize>,
    /// Upper bound of SM time per call (ms): CTAs at most resident x the call's time.
    sm_bound: Option<f64>,
    /// Victim name -> (alone ms, during ms, slowdown %, samples).
    victims: Vec<(String, f64, f64, f64, usize)>,
    displaced: Option<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn spin(g: &Gpu, stream: sys::CUstream, ns: u64, ctas: u32) {
    let f = func(g, "probe_spin");
    let mut t = ns;
    let mut p = [&mut t as *mut u64 as *mut c_void];
    launch(f, ctas, 32, 0, stream, &mut p, false);
}

/// The aggressor alone: 3 warm-up calls, then `reps` calls behind a 1-CTA spin of 2 ms (the host
/// enqueues ahead), timed by events: (GPU ms per call, host ms to enqueue one call into an idle
/// stream, the median of 5). A host time near the GPU time means the host sets the pace.
fn aggressor_alone(g: &Gpu, a: &Aggressor, reps: usize) -> (f64, f64) {
    for _ in 0..3 {
        (a.call)(g.agg, 0);
    }
    let mut host = Vec::new();
    for _ in 0..5 {
        sync_all();
        let t = Instant::now();
        (a.call)(g.agg, 0);
        host.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let host_ms = median(&mut host);
    sync_all();
    spin(g, g.agg, 2_000_000, 1);
    ck!(sys::cuEventRecord(g.ev[0], g.agg), "cuEventRecord");
    for _ in 0..reps {
        (a.call)(g.agg, 0);
    }
    ck!(sys::cuEventRecord(g.ev[1], g.agg), "cuEventRecord");
    sync_all();
    (elapsed_ms(g.ev[0], g.ev[1]) / reps as f64, host_ms)
}

/// CTA lifetimes of one call: (sum of lifetimes in ms, most alive at once, CTAs).
fn trace_call(g: &Gpu, a: &Aggressor, trace: u64, cap: usize) -> (f64, usize, usize) {
    ck!(sys::cuMemsetD8_v2(trace, 0, cap * 24), "cuMemsetD8");
    spin(g, g.agg, 1_000_000, 1);
    (a.call)(g.agg, trace);
    sync_all();
    let mut host = vec![0u64; cap * 3];
    ck!(sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, trace, cap * 24), "cuMemcpyDtoH");
    let mut total = 0u64;
    let mut edges = Vec::new();
    let mut ctas = 0;
    for r in host.chunks(3) {
        if r[1] == 0 && r[2] == 0 {
            continue;
        }
        ctas += 1;
        total += r[2].saturating_sub(r[1]);
        edges.push((r[1], 1i64));
        edges.push((r[2], -1i64));
    }
    edges.sort();
    let (mut cur, mut most) = (0i64, 0i64);
    for (_, d) in edges {
        cur += d;
        most = most.max(cur);
    }
    (total as f64 / 1e6, most as usize, ctas)
}

fn victim_alone(g: &Gpu, v: &Victim) -> f64 {
    ck!(sys::cuEventRecord(g.ev[2], g.vic.get()), "cuEventRecord");
    v.run(g.vic.get());
    ck!(sys::cuEventRecord(g.ev[3], g.vic.get()), "cuEventRecord");
    sync_all();
    elapsed_ms(g.ev[2], g.ev[3])
}

/// Medians of `samples` victim bursts alone and during the aggressor (interleaved); a sample
/// counts only if the burst lies inside the aggressor's span.
fn interference(g: &Gpu, v: &Victim, a: &Aggressor, agg_ms: f64, samples: usize) -> (f64, f64, usize) {
    for _ in 0..2 {
        victim_alone(g, v);
    }
    let v_ms = victim_alone(g, v);
    let reps = ((3.0 * v_ms / agg_ms.max(1e-3)) as usize + 4).min(20_000);
    let (mut al, mut du) = (Vec::new(), Vec::new());
    // Lead-in: the victim's stream waits for the first calls of the aggressor (about 0.3 ms),
    // so the burst starts with the aggressor running, and is enqueued before the rest of it.
    let lead = ((0.3 / agg_ms.max(1e-3)) as usize + 1).min(reps);
    for _ in 0..samples {
        al.push(victim_alone(g, v));
        ck!(sys::cuEventRecord(g.ev[4], g.agg), "cuEventRecord");
        for _ in 0..lead {
            (a.call)(g.agg, 0);
        }
        ck!(sys::cuEventRecord(g.ev[6], g.agg), "cuEventRecord");
        ck!(sys::cuStreamWaitEvent(g.vic.get(), g.ev[6], 0), "cuStreamWaitEvent");
        ck!(sys::cuEventRecord(g.ev[2], g.vic.get()), "cuEventRecord");
        v.run(g.vic.get());
        ck!(sys::cuEventRecord(g.ev[3], g.vic.get()), "cuEventRecord");
        for _ in lead..reps {
            (a.call)(g.agg, 0);
        }
        ck!(sys::cuEventRecord(g.ev[5], g.agg), "cuEventRecord");
        sync_all();
        let start_gap = elapsed_ms(g.ev[4], g.ev[2]);
        let end_gap = elapsed_ms(g.ev[3], g.ev[5]);
        if start_gap > 0.0 && end_gap > 0.0 {
            du.push(elapsed_ms(g.ev[2], g.ev[3]));
        }
    }
    let n = du.len();
    (median(&mut al), median(&mut du), n)
}

/// The SM-id probe during the aggressor: one CTA per SM (200 KiB of shared memory each), spinning
/// 30 us; probe CTAs starting more than 3 us after the first are displaced (waited for an SM the
/// aggressor held). Median over `samples` launches.
fn displaced(g: &Gpu, a: &Aggressor, agg_ms: f64, samples: usize) -> f64 {
    let f = func(g, "probe_resident");
    let rec = malloc(g.sms as usize * 16);
    let mut counts = Vec::new();
    let reps = ((0.5 / agg_ms.max(1e-3)) as usize + 4).min(20_000);
    for _ in 0..samples {
        for _ in 0..reps {
            (a.call)(g.agg, 0);
        }
        std::thread::sleep(Duration::from_micros(200));
        let (mut r, mut ns) = (rec, 30_000u64);
        let mut p = [&mut r as *mut u64 as *mut c_void, &mut ns as *mut u64 as *mut c_void];
        launch(f, g.sms, 32, 200 << 10, g.vic.get(), &mut p, false);
        sync_all();
        let mut host = vec![0u64; g.sms as usize * 2];
        ck!(sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, rec, host.len() * 8), "cuMemcpyDtoH");
        let first = host.chunks(2).map(|c| c[1]).min().unwrap_or(0);
        counts.push(host.chunks(2).filter(|c| c[1] > first + 3_000).count() as f64);
    }
    median(&mut counts)
}

/// Buffers of the reduction and copy aggressors.
struct Bufs {
    a: u64,
    b: u64,
    d: u64,
    d2: u64,
    cs: u64,
    cd: u64,
}

fn sum_aggressor<'a>(g: &'a Gpu, bufs: &'a Bufs, kernel: &str, ctas: u32, threads: u32, cta_bytes: u64, pdl: bool, smem: u32, tma_store: Option<i32>) -> Aggressor<'a> {
    let f = func(g, kernel);
    // Elements per launch: ctas x cta_bytes / 8 bytes per element (2 bf16 in, fp32 out), whole
    // bulk tiles; 0 = one grid-stride launch over everything.
    let per_launch = if cta_bytes == 0 {
        N
    } else {
        (ctas as u64 * cta_bytes / 8).div_ceil(PROBE_TILE_ELEMS).max(1) * PROBE_TILE_ELEMS
    };
    let name = format!(
        "{kernel}{} {ctas} CTAs{}{}",
        if threads != 512 { format!("x{threads}") } else { String::new() },
        if cta_bytes == 0 {
            " grid-stride".to_string()
        } else {
            format!(", {} KiB/CTA/launch ({} launches)", cta_bytes >> 10, N.div_ceil(per_launch))
        },
        if pdl { ", PDL" } else { "" }
    ) + match tma_store {
        Some(1) => ", bulk stores",
        Some(_) => ", thread stores",
        None => "",
    };
    Aggressor {
        name,
        bytes: SUM_BYTES,
        traced: true,
        config: None,
        ctas_bound: None,
        call: Box::new(move |stream, trace| {
            let mut off = 0u64;
            let mut launch_no = 0u64;
            while off < N {
                let n = per_launch.min(N - off);
                KArgs {
                    trace,
                    base: launch_no * ctas as u64,
                    pdl: pdl as i32,
                    extra: tma_store.map_or(Extra::None, Extra::I32),
                    ..KArgs::new(bufs.d + off * 4, bufs.a + off * 2, bufs.b + off * 2, n)
                }
                .launch(f, ctas, threads, smem, stream);
                off += n;
                launch_no += 1;
            }
        }),
    }
}

impl Bufs {
    fn new() -> Bufs {
        let b = Bufs {
            a: malloc(N as usize * 2),
            b: malloc(N as usize * 2),
            d: malloc(N as usize * 4),
            d2: malloc(N as usize * 4),
            cs: malloc(COPY_BYTES),
            cd: malloc(COPY_BYTES),
        };
        fill_bf16(b.a, N as usize, 11);
        fill_bf16(b.b, N as usize, 29);
        b
    }
}

/// The rows that are not tide's: a full-grid upcast + add (XLA's fusion), 16 resident spinning
/// CTAs, and the copy paths of the driver (`pieces` lists the cuMemcpyBatchAsync shapes).
fn baseline_aggressors<'a>(g: &'a Gpu, bufs: &'a Bufs, pieces: &[(usize, usize, bool)]) -> Vec<Aggressor<'a>> {
    let mut aggs: Vec<Aggressor> = Vec::new();
    {
        let f = func(g, "probe_xla_sum2");
        let sms = g.sms;
        aggs.push(Aggressor::plain(
            "full-grid upcast + add (XLA's fusion), 32 M elements".into(),
            SUM_BYTES,
            Box::new(move |stream, _| {
                let (mut d, mut a, mut b, mut n) = (bufs.d2, bufs.a, bufs.b, N);
                let mut p = [
                    &mut d as *mut u64 as *mut c_void,
                    &mut a as *mut u64 as *mut c_void,
                    &mut b as *mut u64 as *mut c_void,
                    &mut n as *mut u64 as *mut c_void,
                ];
                launch(f, sms * 16, 256, 0, stream, &mut p, false);
            }),
        ));
    }
    aggs.push(Aggressor::plain("16 spinning CTAs, 100 us per launch".into(), 0.0, Box::new(move |stream, _| spin(g, stream, 100_000, 16))));
    for bytes in [COPY_BYTES, 32 << 20] {
        aggs.push(Aggressor::plain(
            format!("cuMemcpyAsync D2D {} MiB", bytes >> 20),
            2.0 * bytes as f64,
            Box::new(move |stream, _| {
                ck!(sys::cuMemcpyAsync(bufs.cd, bufs.cs, bytes, stream), "cuMemcpyAsync");
            }),
        ));
    }
    for &(bytes, n, flag) in pieces {
        aggs.push(Aggressor::plain(
            format!(
                "cuMemcpyBatchAsync D2D {} MiB, {n} piece{}, {}",
                bytes >> 20,
                if n > 1 { "s" } else { "" },
                if flag { "PREFER_OVERLAP_WITH_COMPUTE" } else { "no flag" }
            ),
            2.0 * bytes as f64,
            Box::new(move |stream, _| batch_copy(bufs.cd, bufs.cs, bytes, n, flag, stream)),
        ));
    }
    aggs.push(Aggressor::plain(
        "cuMemsetD8Async 256 MiB".into(),
        COPY_BYTES as f64,
        Box::new(move |stream, _| {
            ck!(sys::cuMemsetD8Async(bufs.cd, 0, COPY_BYTES, stream), "cuMemsetD8Async");
        }),
    ));
    aggs
}

/// Every row: the aggressor alone (and its CTA trace), then, unless `alone_only(i)`, against each
/// victim and the SM-id probe.
fn measure_rows(g: &Gpu, aggs: &[Aggressor], samples: usize, alone_only: &dyn Fn(usize) -> bool, json: &mut String) {
    let trace_cap = 1 << 16;
    let trace = malloc(trace_cap * 24);
    let victims = victims(g);
    let run_row = row_filter();
    for (i, a) in aggs.iter().enumerate() {
        if !run_row(&a.name) {
            continue;
        }
        tide::config::set_override(a.config.clone());
        let (ms, host_ms) = aggressor_alone(g, a, 20);
        let mut row = Row {
            alone_ms: ms,
            host_ms,
            gbps: a.bytes / ms / 1e6,
            ..Default::default()
        };
        if a.traced {
            let (sm_ms, most, ctas) = trace_call(g, a, trace, trace_cap);
            row.sm_ms = Some(sm_ms);
            row.max_resident = Some(most);
            row.launches = Some(ctas);
        }
        row.sm_bound = a.ctas_bound.map(|c| c as f64 * ms);
        if !alone_only(i) {
            for v in &victims {
                let (al, du, n) = interference(g, v, a, ms, samples);
                row.victims.push((v.name.to_string(), al, du, 100.0 * (du / al - 1.0), n));
            }
            row.displaced = Some(displaced(g, a, ms, samples));
        }
        tide::config::set_override(None);
        print_row(&a.name, &row, json);
    }
}

/// Each of `checks` (sum aggressors over the N elements of `bufs`) against one grid-stride launch
/// of tide's kernel: the results bitwise, one line per check ("bitwise NAME: OK").
fn bitwise_against_tide(g: &Gpu, bufs: &Bufs, checks: &[Aggressor], json: &mut String) {
    let want = call_result(g, &sum_aggressor(g, bufs, "probe_st", 16, 512, 0, false, 0, None), bufs.d, N as usize);
    for a in checks {
        report_bitwise(a, &call_result(g, a, bufs.d, N as usize), &want, json);
    }
}

/// The `elems` fp32 words at `dst` after one call of `a` (poisoned with NaNs before it).
fn call_result(g: &Gpu, a: &Aggressor, dst: u64, elems: usize) -> Vec<u32> {
    ck!(sys::cuMemsetD8_v2(dst, 0xff, elems * 4), "cuMemsetD8");
    (a.call)(g.agg, 0);
    sync_all();
    let mut got = vec![0u32; elems];
    ck!(sys::cuMemcpyDtoH_v2(got.as_mut_ptr() as *mut c_void, dst, elems * 4), "cuMemcpyDtoH");
    got
}

/// "bitwise NAME: OK" (or how many elements differ from `want`), and its JSON record.
fn report_bitwise(a: &Aggressor, got: &[u32], want: &[u32], json: &mut String) {
    let bad = got.iter().zip(want).filter(|(x, y)| x != y).count();
    println!("bitwise {}: {}", a.name, if bad == 0 { "OK".to_string() } else { format!("{bad} elements differ") });
    let _ = write!(json, "{{\"bitwise\":{:?},\"differ\":{bad}}},", a.name);
}

fn explore(g: &Gpu, samples: usize, json: &mut String) {
    let bufs = Bufs::new();
    // Correctness of the probe bodies against tide's kernel (bitwise): st, u16, 1024, bulk x2.
    let checks: Vec<Aggressor> = [
        ("probe_st_u16", 512, 0, 0, None),
        ("probe_st_1024", 1024, 0, 0, None),
        ("probe_st", 512, 512 << 10, 0, None),
        ("probe_bulk", 512, 0, PROBE_BULK_SMEM, Some(0)),
        ("probe_bulk", 512, 512 << 10, PROBE_BULK_SMEM + PROBE_BULK_OUT_SMEM, Some(1)),
    ]
    .into_iter()
    .map(|(k, th, cb, smem, ts)| sum_aggressor(g, &bufs, k, 16, th, cb, false, smem, ts))
    .collect();
    bitwise_against_tide(g, &bufs, &checks, json);

    let mut aggs: Vec<Aggressor> = Vec::new();
    for ctas in [4, 16, g.sms] {
        aggs.push(sum_aggressor(g, &bufs, "probe_st", ctas, 512, 0, false, 0, None));
    }
    for kib in [128u64, 256, 512, 1024, 2048] {
        aggs.push(sum_aggressor(g, &bufs, "probe_st", 16, 512, kib << 10, false, 0, None));
    }
    for kib in [256u64, 512, 1024] {
        aggs.push(sum_aggressor(g, &bufs, "probe_st", 16, 512, kib << 10, true, 0, None));
    }
    aggs.push(sum_aggressor(g, &bufs, "probe_st_u16", 16, 512, 0, false, 0, None));
    aggs.push(sum_aggressor(g, &bufs, "probe_st_u16", 16, 512, 512 << 10, false, 0, None));
    aggs.push(sum_aggressor(g, &bufs, "probe_st_1024", 16, 1024, 0, false, 0, None));
    aggs.push(sum_aggressor(g, &bufs, "probe_st_1024", 16, 1024, 512 << 10, false, 0, None));
    for ts in [0, 1] {
        let smem = PROBE_BULK_SMEM + if ts == 1 { PROBE_BULK_OUT_SMEM } else { 0 };
        aggs.push(sum_aggressor(g, &bufs, "probe_bulk", 16, 512, 0, false, smem, Some(ts)));
        aggs.push(sum_aggressor(g, &bufs, "probe_bulk", 16, 512, 512 << 10, false, smem, Some(ts)));
        aggs.push(sum_aggressor(g, &bufs, "probe_bulk", 16, 512, 512 << 10, true, smem, Some(ts)));
    }
    let ceilings_from = aggs.len();
    for (k, bytes) in [("probe_read", N as f64 * 4.0), ("probe_write", N as f64 * 4.0), ("probe_copy", N as f64 * 4.0)] {
        for ctas in [1u32, 16] {
            let mut a = sum_aggressor(g, &bufs, k, ctas, 512, 0, false, 0, None);
            a.bytes = bytes;
            aggs.push(a);
        }
    }
    let ceilings_to = aggs.len();
    // Back-to-back launch gap: 2000 one-CTA launches that do nothing, with and without PDL.
    for pdl in [false, true] {
        let f = func(g, "probe_write");
        sync_all();
        spin(g, g.agg, 3_000_000, 1);
        ck!(sys::cuEventRecord(g.ev[0], g.agg), "cuEventRecord");
        for _ in 0..2000 {
            KArgs { pdl: pdl as i32, ..KArgs::new(bufs.d, 0, 0, 0) }.launch(f, 16, 512, 0, g.agg);
        }
        ck!(sys::cuEventRecord(g.ev[1], g.agg), "cuEventRecord");
        sync_all();
        let us = elapsed_ms(g.ev[0], g.ev[1]) * 1000.0 / 2000.0;
        println!("launch gap (empty 16-CTA launches back to back{}): {us:.2} us per launch", if pdl { ", PDL" } else { "" });
        let _ = write!(json, "{{\"launch_gap_us\":{us:.3},\"pdl\":{pdl}}},");
    }

    aggs.extend(baseline_aggressors(
        g,
        &bufs,
        &[
            (COPY_BYTES, 1, true),
            (COPY_BYTES, 1, false),
            (COPY_BYTES, 2, true),
            (COPY_BYTES, 4, true),
            (COPY_BYTES, 8, true),
            (COPY_BYTES, 8, false),
            (32 << 20, 1, true),
            (32 << 20, 2, true),
            (4 << 20, 2, true),
        ],
    ));
    measure_rows(g, &aggs, samples, &|i| (ceilings_from..ceilings_to).contains(&i), json);
}


// ----- sumphase mode: hiding the gap between short launches; L2-resident operands -----

/// Streams a call's launches are spread over (lane 0 is the call's own stream; the others fork
/// from it at the call's start and join back at its end) and the events that fork and join them.
struct Lanes {
    extra: Vec<sys::CUstream>,
    fork: sys::CUevent,
    joins: Vec<sys::CUevent>,
}

impl Lanes {
    fn new(n: usize) -> Lanes {
        let mk_event = || {
            let mut e = std::ptr::null_mut();
            ck!(sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32), "cuEventCreate");
            e
        };
        let extra = (1..n)
            .map(|_| {
                let mut s = std::ptr::null_mut();
                ck!(sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "cuStreamCreate");
                s
            })
            .collect();
        Lanes {
            extra,
            fork: mk_event(),
            joins: (1..n).map(|_| mk_event()).collect(),
        }
    }
    fn fork(&self, stream: sys::CUstream) {
        if self.extra.is_empty() {
            return;
        }
        ck!(sys::cuEventRecord(self.fork, stream), "cuEventRecord");
        for &s in &self.extra {
            ck!(sys::cuStreamWaitEvent(s, self.fork, 0), "cuStreamWaitEvent");
        }
    }
    fn lane(&self, stream: sys::CUstream, i: usize) -> sys::CUstream {
        let k = i % (self.extra.len() + 1);
        if k == 0 { stream } else { self.extra[k - 1] }
    }
    fn join(&self, stream: sys::CUstream) {
        for (&s, &e) in self.extra.iter().zip(&self.joins) {
            ck!(sys::cuEventRecord(e, s), "cuEventRecord");
            ck!(sys::cuStreamWaitEvent(stream, e, 0), "cuStreamWaitEvent");
        }
    }
}

/// tide's reduction (probe_st) over N elements in launches of `ctas` CTAs moving `cta_bytes`
/// each, launch i on lane i % lanes (so at most lanes x ctas CTAs are resident), the sources read
/// at offsets modulo `src_window` elements and the destination written modulo `dst_window` (a
/// window that fits in L2 keeps those operands there). With `graph` the whole call is captured
/// once into a CUDA graph and replayed (untraced).
fn lane_aggressor<'a>(g: &'a Gpu, bufs: &'a Bufs, kernel: &str, smem: u32, ctas: u32, cta_bytes: u64, lanes: usize, src_window: u64, dst_window: u64, graph: bool) -> Aggressor<'a> {
    lane_aggressor_traced(g, bufs, kernel, smem, ctas, cta_bytes, lanes, src_window, dst_window, graph, 0)
}

/// lane_aggressor; a graph captured with `graph_trace` != 0 writes CTA lifetimes there on every replay.
fn lane_aggressor_traced<'a>(g: &'a Gpu, bufs: &'a Bufs, kernel: &str, smem: u32, ctas: u32, cta_bytes: u64, lanes: usize, src_window: u64, dst_window: u64, graph: bool, graph_trace: u64) -> Aggressor<'a> {
    let f = func(g, kernel);
    let per_launch = (ctas as u64 * cta_bytes / 8).div_ceil(PROBE_TILE_ELEMS).max(1) * PROBE_TILE_ELEMS;
    assert!(src_window.is_multiple_of(per_launch) && dst_window.is_multiple_of(per_launch), "windows are whole launches");
    let ls = Lanes::new(lanes);
    let issue = move |stream: sys::CUstream, trace: u64| {
        ls.fork(stream);
        let (mut off, mut i) = (0u64, 0u64);
        while off < N {
            let n = per_launch.min(N - off);
            let (s, d) = (off % src_window, off % dst_window);
            KArgs { trace, base: i * ctas as u64, ..KArgs::new(bufs.d + d * 4, bufs.a + s * 2, bufs.b + s * 2, n) }
                .launch(f, ctas, 512, smem, ls.lane(stream, i as usize));
            off += n;
            i += 1;
        }
        ls.join(stream);
    };
    let where_ = match (src_window < N, dst_window < N) {
        (false, false) => String::new(),
        (true, false) => format!(", sources in L2 ({} MiB window)", (src_window * 2) >> 20),
        (true, true) => format!(", all in L2 ({} MiB window)", (src_window * 2) >> 20),
        (false, true) => format!(", destination in L2 ({} MiB)", (dst_window * 4) >> 20),
    };
    let name = format!(
        "{kernel}, {}{} x {ctas} CTAs, {} KiB/CTA/launch ({} launches){where_}",
        if graph { "graph, " } else { "" },
        if lanes > 1 { format!("{lanes} streams") } else { "1 stream".into() },
        cta_bytes >> 10,
        N.div_ceil(per_launch)
    );
    if !graph {
        return Aggressor { name, bytes: SUM_BYTES, traced: true, config: None, ctas_bound: None, call: Box::new(issue) };
    }
    let exec = capture(g.agg, || issue(g.agg, graph_trace));
    Aggressor {
        name,
        bytes: SUM_BYTES,
        traced: false,
        config: None,
        ctas_bound: Some(lanes as u32 * ctas),
        call: Box::new(move |stream, _| {
            ck!(sys::cuGraphLaunch(exec, stream), "cuGraphLaunch");
        }),
    }
}

/// What `work` enqueues on `stream`, captured into an instantiated CUDA graph.
fn capture(stream: sys::CUstream, work: impl FnOnce()) -> sys::CUgraphExec {
    sync_all();
    ck!(sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture");
    work();
    let mut graph = std::ptr::null_mut();
    ck!(sys::cuStreamEndCapture(stream, &mut graph), "cuStreamEndCapture");
    let mut exec = std::ptr::null_mut();
    ck!(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate");
    exec
}

/// A long-lived kernel (probe_st_rep / probe_read_rep) of `ctas` CTAs over the first `window`
/// elements, repeated so one call moves N elements' bytes: the per-SM rate with L2-resident
/// operands (window small) or from HBM (window N).
fn rep_aggressor<'a>(g: &'a Gpu, bufs: &'a Bufs, kernel: &str, ctas: u32, window: u64) -> Aggressor<'a> {
    let f = func(g, kernel);
    let reps = N / window;
    let name = format!("{kernel} {ctas} CTA{} grid-stride, {} MiB window x {reps}", if ctas > 1 { "s" } else { "" }, (window * 2) >> 20);
    let bytes = if kernel == "probe_read_rep" { N as f64 * 4.0 } else { SUM_BYTES };
    Aggressor {
        name,
        bytes,
        traced: true,
        config: None,
        ctas_bound: None,
        call: Box::new(move |stream, trace| {
            KArgs { trace, extra: Extra::U64(reps), ..KArgs::new(bufs.d, bufs.a, bufs.b, window) }.launch(f, ctas, 512, 0, stream);
        }),
    }
}

/// Sums of k = 2, 4, 8 bf16 sources into fp32 (the reduce-scatter's sum at world k: the own
/// gradient slice and k - 1 staged ones), 8 M elements per call: the per-SM and 16-CTA rates with
/// the sources in HBM or in L2 (a 1 M-element window per source, as a chunk the copy engines just
/// staged), one grid-stride launch or the engine's short launches (16 CTAs, 512 KiB each), and
/// beside the victims at k = 8; every variant bitwise against one grid-stride launch.
fn sources_rows(g: &Gpu, samples: usize, json: &mut String) {
    const M: u64 = 8 << 20;
    const HOT: u64 = 1 << 20;
    let src = malloc(8 * M as usize * 2);
    let dst = malloc(M as usize * 4);
    for i in 0..8u64 {
        fill_bf16(src + i * M * 2, M as usize, 101 + 2 * i);
    }
    let stride = M * 2;
    let mk = |k: u64, ctas: u32, cta_bytes: u64, window: u64, graph: bool| -> Aggressor {
        let f = func(g, &format!("probe_stk{k}"));
        let per_el = 2 * k + 4;
        let where_ = if window < M { "sources in L2 (1 M-element window)" } else { "sources in HBM" };
        let (name, call): (String, Box<dyn Fn(sys::CUstream, u64)>) = if cta_bytes == 0 {
            (
                format!(
                    "sum of {k} sources, {ctas} CTA{} grid-stride, {}",
                    if ctas > 1 { "s" } else { "" },
                    if window < M { "sources and destination in L2 (1 M-element window, x8)" } else { "sources in HBM" }
                ),
                Box::new(move |stream, trace| {
                    KArgs { trace, extra: Extra::U64(M / window), ..KArgs::new(dst, src, stride, window) }.launch(f, ctas, 512, 0, stream);
                }),
            )
        } else {
            let per_launch = (ctas as u64 * cta_bytes / per_el).div_ceil(4096) * 4096;
            // In L2: the sources' window is at least one launch (launches longer than the window
            // re-read one launch's sources; past ~50 MB of them they no longer fit).
            let w = if window < M { window.max(per_launch) } else { M };
            let issue = move |stream: sys::CUstream, trace: u64| {
                let (mut off, mut i) = (0u64, 0u64);
                while off < M {
                    let n = per_launch.min(M - off);
                    let s = off % w;
                    KArgs { trace, base: i * ctas as u64, extra: Extra::U64(1), ..KArgs::new(dst + off * 4, src + s * 2, stride, n) }
                        .launch(f, ctas, 512, 0, stream);
                    off += n;
                    i += 1;
                }
            };
            let where_ = if w < M { format!("sources in L2 ({} MiB of them)", (w * 2 * k) >> 20) } else { where_.to_string() };
            let name = format!(
                "sum of {k} sources, {}{ctas} CTAs, {} KiB/CTA/launch ({} launches), {where_}",
                if graph { "graph, " } else { "" },
                cta_bytes >> 10,
                M.div_ceil(per_launch)
            );
            if graph {
                let exec = capture(g.agg, || issue(g.agg, 0));
                (name, Box::new(move |stream, _| ck!(sys::cuGraphLaunch(exec, stream), "cuGraphLaunch")))
            } else {
                (name, Box::new(issue))
            }
        };
        Aggressor { name, bytes: (M * per_el) as f64, traced: !graph, config: None, ctas_bound: graph.then_some(ctas), call }
    };
    // Bitwise: every shape against one grid-stride launch over the same (HBM) sources.
    for k in [2u64, 4, 8] {
        let want = call_result(g, &mk(k, 16, 0, M, false), dst, M as usize);
        for a in [mk(k, 1, 0, M, false), mk(k, 16, 512 << 10, M, false), mk(k, 16, 512 << 10, M, true)] {
            report_bitwise(&a, &call_result(g, &a, dst, M as usize), &want, json);
        }
    }
    let mut aggs = vec![
        mk(8, 16, 512 << 10, HOT, false),
        mk(8, 16, 512 << 10, M, false),
        mk(8, 16, 512 << 10, HOT, true),
        mk(8, 16, 2 << 20, HOT, false),
    ];
    let alone_from = aggs.len();
    for k in [2u64, 4, 8] {
        for window in [M, HOT] {
            aggs.push(mk(k, 1, 0, window, false));
            aggs.push(mk(k, 16, 0, window, false));
            aggs.push(mk(k, 16, 512 << 10, window, false));
            aggs.push(mk(k, 16, 512 << 10, window, true));
        }
    }
    // Longer-lived CTAs (tens of microseconds): what TIDE_RS_CTA_BYTES buys alone.
    for k in [2u64, 8] {
        for window in [M, HOT] {
            for cta in [1u64 << 20, 2 << 20, 4 << 20] {
                aggs.push(mk(k, 16, cta, window, false));
                aggs.push(mk(k, 16, cta, window, true));
            }
        }
    }
    measure_rows(g, &aggs, samples, &|i| i >= alone_from, json);
}

/// The timeline of one call of short launches (`launches` x `ctas` CTAs, CTA b of launch k at
/// trace record k * ctas + b): medians over launches of the CTA lifetime, the spread of the CTAs'
/// starts and ends within a launch (the tail: the launch ends with its slowest CTA), and the gap
/// from a launch's last end to the next launch's first start; the period is the call's span per
/// launch. `call` enqueues the call on the stream, tracing into `trace` (a graph ignores it and
/// writes where it was captured to: pass the same buffer).
fn timeline(g: &Gpu, name: &str, call: &dyn Fn(sys::CUstream, u64), trace: u64, ctas: usize, launches: usize, json: &mut String) {
    let cap = ctas * launches;
    ck!(sys::cuMemsetD8_v2(trace, 0, cap * 24), "cuMemsetD8");
    spin(g, g.agg, 1_000_000, 1);
    call(g.agg, trace);
    sync_all();
    let mut host = vec![0u64; cap * 3];
    ck!(sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, trace, cap * 24), "cuMemcpyDtoH");
    let rec = |k: usize, b: usize| (host[3 * (k * ctas + b) + 1] as f64, host[3 * (k * ctas + b) + 2] as f64);
    let (mut life, mut start_spread, mut tail, mut gap) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut bounds = Vec::new();
    for k in 0..launches {
        let (mut s0, mut s1, mut e0, mut e1) = (f64::MAX, 0f64, f64::MAX, 0f64);
        for b in 0..ctas {
            let (s, e) = rec(k, b);
            life.push((e - s) / 1e3);
            s0 = s0.min(s);
            s1 = s1.max(s);
            e0 = e0.min(e);
            e1 = e1.max(e);
        }
        start_spread.push((s1 - s0) / 1e3);
        tail.push((e1 - e0) / 1e3);
        bounds.push((s0, e1));
    }
    for k in 1..launches {
        gap.push((bounds[k].0 - bounds[k - 1].1) / 1e3);
    }
    let period = (bounds[launches - 1].1 - bounds[0].0) / 1e3 / launches as f64;
    let (l, ss, t, gp) = (median(&mut life), median(&mut start_spread), median(&mut tail), median(&mut gap));
    println!("timeline {name}: per launch {period:.2} us; CTA life {l:.2} us, starts spread {ss:.2} us, ends spread (tail) {t:.2} us, gap to the next launch {gp:.2} us (medians)");
    let _ = write!(json, "{{\"timeline\":{name:?},\"period_us\":{period:.3},\"life_us\":{l:.3},\"start_spread_us\":{ss:.3},\"tail_us\":{t:.3},\"gap_us\":{gp:.3}}},");
}

/// The sum phase's launch shape under a bound of 16 resident CTAs (issue #22: >= 1.5 TB/s with
/// short-lived CTAs): the back-to-back launch gap on one stream, in a CUDA graph and over two
/// streams; short launches spread over 2 or 4 streams (8 or 4 CTAs each, so still <= 16 resident)
/// or replayed from a graph; L2-resident sources (what the copy engines just staged) and
/// destinations; the per-SM rate from L2 and from HBM.
fn sumphase(g: &Gpu, samples: usize, json: &mut String) {
    let bufs = Bufs::new();
    // The lanes and graph rows give tide's bits (bitwise against one grid-stride launch).
    let checks: Vec<Aggressor> = [
        ("probe_st", 0, 2usize, 8u32, 512u64 << 10, false),
        ("probe_st", 0, 4, 4, 512 << 10, false),
        ("probe_st", 0, 2, 8, 512 << 10, true),
        ("probe_st_cs", 0, 1, 16, 512 << 10, true),
        ("probe_st_tma_out", TMA_OUT_SMEM, 1, 16, 512 << 10, true),
        ("probe_st_tma_out", TMA_OUT_SMEM, 1, 16, 0, false),
        ("probe_st_tma_out", TMA_OUT_SMEM, 1, 1, 0, false),
    ]
    .into_iter()
    .map(|(k, smem, lanes, ctas, cta_bytes, graph)| {
        if cta_bytes == 0 {
            sum_aggressor(g, &bufs, k, ctas, 512, 0, false, smem, None)
        } else {
            lane_aggressor(g, &bufs, k, smem, ctas, cta_bytes, lanes, N, N, graph)
        }
    })
    .collect();
    bitwise_against_tide(g, &bufs, &checks, json);
    // Launch gaps: 2000 empty launches (probe_write with n = 0) on one stream, replayed from a
    // graph, and alternating over two streams of 8 CTAs.
    {
        let f = func(g, "probe_write");
        let empty = |stream: sys::CUstream, ctas: u32| KArgs::new(bufs.d, 0, 0, 0).launch(f, ctas, 512, 0, stream);
        let two = Lanes::new(2);
        let graph = capture(g.agg, || {
            for _ in 0..2000 {
                empty(g.agg, 16);
            }
        });
        for how in ["1 stream, 16 CTAs", "graph, 16 CTAs", "2 streams, 8 CTAs each"] {
            sync_all();
            spin(g, g.agg, 3_000_000, 1);
            ck!(sys::cuEventRecord(g.ev[0], g.agg), "cuEventRecord");
            match how {
                "graph, 16 CTAs" => ck!(sys::cuGraphLaunch(graph, g.agg), "cuGraphLaunch"),
                "2 streams, 8 CTAs each" => {
                    two.fork(g.agg);
                    for i in 0..2000 {
                        empty(two.lane(g.agg, i), 8);
                    }
                    two.join(g.agg);
                }
                _ => {
                    for _ in 0..2000 {
                        empty(g.agg, 16);
                    }
                }
            }
            ck!(sys::cuEventRecord(g.ev[1], g.agg), "cuEventRecord");
            sync_all();
            let us = elapsed_ms(g.ev[0], g.ev[1]) * 1000.0 / 2000.0;
            println!("launch gap (empty launches back to back, {how}): {us:.2} us per launch");
            let _ = write!(json, "{{\"launch_gap_us\":{us:.3},\"how\":{how:?}}},");
        }
    }

    // Where a short launch's time goes (stream and graph, 512 KiB and 1 MiB per CTA).
    {
        let trace = malloc(4096 * 24);
        for (kib, graph) in [(512u64, false), (512, true), (1024, false), (1024, true), (2048, true)] {
            let a = lane_aggressor_traced(g, &bufs, "probe_st", 0, 16, kib << 10, 1, N, N, graph, if graph { trace } else { 0 });
            let launches = (N / (16 * (kib << 10) / 8)) as usize;
            (a.call)(g.agg, if graph { 0 } else { trace });
            sync_all();
            timeline(g, &a.name, &*a.call, trace, 16, launches, json);
        }
    }
    let hot = 2u64 << 20; // elements: 4 + 4 MiB of sources, 8 MiB of destination
    let st = |ctas, kib: u64, lanes, src, dst, graph| lane_aggressor(g, &bufs, "probe_st", 0, ctas, kib << 10, lanes, src, dst, graph);
    let tma = |ctas, kib: u64, lanes, src, dst, graph| lane_aggressor(g, &bufs, "probe_st_tma_out", TMA_OUT_SMEM, ctas, kib << 10, lanes, src, dst, graph);
    // Rows with victims first.
    let mut aggs: Vec<Aggressor> = vec![
        st(16, 512, 1, N, N, false),
        st(16, 512, 1, N, N, true),
        st(16, 1024, 1, N, N, true),
        tma(16, 512, 1, N, N, false),
        tma(16, 512, 1, N, N, true),
        st(16, 512, 1, hot, N, true),
    ];
    let alone_from = aggs.len();
    aggs.push(st(8, 512, 2, N, N, false));
    aggs.push(st(8, 1024, 2, N, N, false));
    aggs.push(st(8, 512, 2, N, N, true));
    aggs.push(st(16, 256, 1, N, N, true));
    aggs.push(st(16, 2048, 1, N, N, true));
    aggs.push(tma(16, 1024, 1, N, N, true));
    aggs.push(tma(16, 512, 1, hot, N, true));
    aggs.push(st(16, 512, 1, hot, hot, true));
    aggs.push(lane_aggressor(g, &bufs, "probe_st_cs", 0, 16, 512 << 10, 1, N, N, true));
    for (k, smem) in [("probe_st", 0), ("probe_st_cs", 0), ("probe_st_tma_out", TMA_OUT_SMEM), ("probe_write", 0), ("probe_write_cs", 0), ("probe_write_bulk", 16 << 10)] {
        for ctas in [1u32, 16] {
            let mut a = sum_aggressor(g, &bufs, k, ctas, 512, 0, false, smem, None);
            if k.starts_with("probe_write") {
                a.bytes = N as f64 * 4.0;
            }
            aggs.push(a);
        }
    }
    for (k, ctas, window) in [
        ("probe_st_rep", 16, hot),
        ("probe_st_rep", 1, hot),
        ("probe_read_rep", 1, hot),
        ("probe_read_rep", 1, N),
    ] {
        aggs.push(rep_aggressor(g, &bufs, k, ctas, window));
    }
    measure_rows(g, &aggs, samples, &|i| i >= alone_from, json);
    sources_rows(g, samples, json);
}

// ----- green mode: the sum's CTAs confined to an SM partition (a green context) -----

/// A CUdevResource with room to spare: the struct grew within CUDA 13.x and the driver writes its
/// own version's; the SM fields (count, minimum partition, alignment) sit at byte 96 in each.
#[repr(C, align(8))]
struct DevResource([u8; 512]);

impl DevResource {
    fn zeroed() -> DevResource {
        DevResource([0; 512])
    }
    fn ptr(&mut self) -> *mut sys::CUdevResource {
        self.0.as_mut_ptr() as *mut sys::CUdevResource
    }
    fn word(&self, i: usize) -> u32 {
        u32::from_ne_bytes(self.0[96 + 4 * i..100 + 4 * i].try_into().unwrap())
    }
}

/// An SM partition: a green context of `sms` SMs, a stream of it, the events that fork a call
/// from the caller's stream onto it and join it back, and the module its launches use (the
/// primary context's where the partition's stream accepts those functions, else the cubin loaded
/// again in the green context).
struct Partition {
    sms: u32,
    stream: sys::CUstream,
    fork: sys::CUevent,
    join: sys::CUevent,
    module: sys::CUmodule,
}

fn try_cu(r: sys::CUresult, call: &str) -> Result<(), String> {
    check(r, call, String::new).map_err(|e| e.to_string())
}

impl Partition {
    fn new(g: &Gpu, want: u32) -> Result<Partition, String> {
        unsafe {
            let mut dev = 0;
            try_cu(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet")?;
            let mut all = DevResource::zeroed();
            try_cu(sys::cuDeviceGetDevResource(dev, all.ptr(), sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")?;
            let (mut part, mut rest) = (DevResource::zeroed(), DevResource::zeroed());
            let mut groups = 1u32;
            try_cu(sys::cuDevSmResourceSplitByCount(part.ptr(), &mut groups, all.ptr(), rest.ptr(), 0, want), "cuDevSmResourceSplitByCount")?;
            let sms = part.word(0);
            println!(
                "partition: asked {want} SMs of {} (minimum partition {}, alignment {}): got {groups} group of {sms}, {} left",
                all.word(0),
                all.word(1),
                all.word(2),
                rest.word(0)
            );
            let mut desc = std::ptr::null_mut();
            try_cu(sys::cuDevResourceGenerateDesc(&mut desc, part.ptr(), 1), "cuDevResourceGenerateDesc")?;
            let mut green = std::ptr::null_mut();
            try_cu(
                sys::cuGreenCtxCreate(&mut green, desc, dev, sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32),
                "cuGreenCtxCreate",
            )?;
            let mut stream = std::ptr::null_mut();
            try_cu(
                sys::cuGreenCtxStreamCreate(&mut stream, green, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32, 0),
                "cuGreenCtxStreamCreate",
            )?;
            let mut ctx = std::ptr::null_mut();
            try_cu(sys::cuCtxFromGreenCtx(&mut ctx, green), "cuCtxFromGreenCtx")?;
            let mut fork = std::ptr::null_mut();
            try_cu(sys::cuEventCreate(&mut fork, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32), "cuEventCreate")?;
            // The join event is the green context's (an event is recorded on a stream of its own
            // context; any stream may wait on it).
            try_cu(sys::cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")?;
            let mut join = std::ptr::null_mut();
            let r = sys::cuEventCreate(&mut join, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32);
            let mut popped = std::ptr::null_mut();
            try_cu(sys::cuCtxPopCurrent_v2(&mut popped), "cuCtxPopCurrent")?;
            try_cu(r, "cuEventCreate (green context)")?;
            // Does the partition's stream run the primary context's functions?
            let f = func(g, "probe_write");
            let r = KArgs::new(0, 0, 0, 0).with_params(|params| {
                sys::cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, params.as_mut_ptr(), std::ptr::null_mut())
            });
            let module = if r == sys::CUresult::CUDA_SUCCESS && sys::cuStreamSynchronize(stream) == sys::CUresult::CUDA_SUCCESS {
                println!("partition: the primary context's functions launch on its stream");
                g.module
            } else {
                println!("partition: the primary context's functions do not launch on its stream ({r:?}): module loaded in the green context");
                try_cu(sys::cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")?;
                let mut m = std::ptr::null_mut();
                let r = sys::cuModuleLoadData(&mut m, g.cubin.as_ptr() as *const c_void);
                try_cu(sys::cuCtxPopCurrent_v2(&mut popped), "cuCtxPopCurrent")?;
                try_cu(r, "cuModuleLoadData (green context)")?;
                m
            };
            let p = Partition { sms, stream, fork, join, module };
            for k in ["probe_st", "probe_stk8"] {
                try_cu(
                    sys::cuFuncSetAttribute(p.func(k), sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ONE_PER_SM_SMEM as i32),
                    "cuFuncSetAttribute",
                )?;
            }
            Ok(p)
        }
    }

    fn func(&self, name: &str) -> sys::CUfunction {
        let mut f = std::ptr::null_mut();
        let c = std::ffi::CString::new(name).unwrap();
        ck!(sys::cuModuleGetFunction(&mut f, self.module, c.as_ptr()), "cuModuleGetFunction");
        f
    }

    /// `work` enqueued on the partition's stream, ordered after what `stream` holds and before
    /// what it is given next.
    fn run(&self, stream: sys::CUstream, work: impl FnOnce(sys::CUstream)) {
        ck!(sys::cuEventRecord(self.fork, stream), "cuEventRecord");
        ck!(sys::cuStreamWaitEvent(self.stream, self.fork, 0), "cuStreamWaitEvent");
        work(self.stream);
        ck!(sys::cuEventRecord(self.join, self.stream), "cuEventRecord");
        ck!(sys::cuStreamWaitEvent(stream, self.join, 0), "cuStreamWaitEvent");
    }
}

/// Dynamic shared memory that leaves room for one such CTA per SM (228 KiB per SM on Hopper):
/// the partition of S SMs then holds at most S of tide's CTAs.
const ONE_PER_SM_SMEM: u32 = 120 << 10;

/// tide's 2-source sum (probe_st) over the N elements in launches of `ctas` CTAs of `cta_bytes`
/// each (ctas = 0: one launch of every CTA), in the partition; `one_per_sm`: each CTA asks for
/// ONE_PER_SM_SMEM of shared memory.
fn green_aggressor<'a>(bufs: &'a Bufs, p: &'a Partition, cta_bytes: u64, ctas: u32, one_per_sm: bool) -> Aggressor<'a> {
    green_aggressor_pdl(bufs, p, cta_bytes, ctas, one_per_sm, false)
}

/// green_aggressor; `pdl`: each launch with programmatic dependent launch (its CTAs signal at
/// their end, so the next launch is made ready while this one drains).
fn green_aggressor_pdl<'a>(bufs: &'a Bufs, p: &'a Partition, cta_bytes: u64, ctas: u32, one_per_sm: bool, pdl: bool) -> Aggressor<'a> {
    let f = p.func("probe_st");
    let all = (N * 8).div_ceil(cta_bytes) as u32;
    let per = if ctas == 0 { all } else { ctas };
    let per_launch = per as u64 * cta_bytes / 8;
    let smem = if one_per_sm { ONE_PER_SM_SMEM } else { 0 };
    let name = format!(
        "green {} SMs: probe_st, {} KiB/CTA, {}{}",
        p.sms,
        cta_bytes >> 10,
        if ctas == 0 { format!("one launch of {all} CTAs") } else { format!("launches of {per} CTAs ({})", N.div_ceil(per_launch)) },
        if one_per_sm { ", one CTA per SM" } else { ", CTAs share SMs" }
    ) + if pdl { ", PDL" } else { "" };
    Aggressor::traced(
        name,
        SUM_BYTES,
        partition_call(p, f, N, per_launch, per, 8, cta_bytes, smem, pdl, move |off, n| {
            KArgs::new(bufs.d + off * 4, bufs.a + off * 2, bufs.b + off * 2, n)
        }),
    )
}

/// A partition aggressor's call: `total` elements in launches of `per_launch` elements on the
/// partition's stream, `cta_bytes` per CTA at `per_el` bytes per element (CTA b of launch i traces
/// at record i * per + b); `args(off, n)`: the kernel's arguments for elements off .. off + n.
fn partition_call<'a>(
    p: &'a Partition,
    f: sys::CUfunction,
    total: u64,
    per_launch: u64,
    per: u32,
    per_el: u64,
    cta_bytes: u64,
    smem: u32,
    pdl: bool,
    args: impl Fn(u64, u64) -> KArgs + 'a,
) -> Box<dyn Fn(sys::CUstream, u64) + 'a> {
    Box::new(move |stream, trace| {
        p.run(stream, |s| {
            let (mut off, mut i) = (0u64, 0u64);
            while off < total {
                let n = per_launch.min(total - off);
                let grid = (n * per_el).div_ceil(cta_bytes) as u32;
                KArgs { trace, base: i * per as u64, pdl: pdl as i32, ..args(off, n) }.launch(f, grid, 512, smem, s);
                off += n;
                i += 1;
            }
        })
    })
}

/// The sum of 8 sources (the reduce-scatter at world 8: `m` elements, 20 bytes each) in the
/// partition, `cta_bytes` per CTA, one CTA per SM: one launch (ctas = 0; sources in HBM) or
/// launches of `ctas` CTAs whose sources are re-read from one launch-sized window (in L2, as
/// chunks the copy engines just staged); `pdl` as in green_aggressor_pdl.
fn green_k8<'a>(p: &'a Partition, src: u64, dst: u64, m: u64, cta_bytes: u64, ctas: u32, pdl: bool) -> Aggressor<'a> {
    let f = p.func("probe_stk8");
    let all = (m * 20).div_ceil(cta_bytes) as u32;
    let per = if ctas == 0 { all } else { ctas };
    let per_launch = (per as u64 * cta_bytes / 20).div_ceil(4096) * 4096;
    let window = if ctas == 0 { m } else { per_launch };
    let name = format!(
        "green {} SMs: sum of 8 sources, {} KiB/CTA, {}, one CTA per SM{}",
        p.sms,
        cta_bytes >> 10,
        if ctas == 0 { format!("one launch of {all} CTAs, sources in HBM") } else { format!("launches of {per} CTAs, sources in L2 ({} MiB of them)", (window * 16) >> 20) },
        if pdl { ", PDL" } else { "" }
    );
    Aggressor::traced(
        name,
        (m * 20) as f64,
        partition_call(p, f, m, per_launch, per, 20, cta_bytes, ONE_PER_SM_SMEM, pdl, move |off, n| KArgs {
            extra: Extra::U64(1),
            ..KArgs::new(dst + off * 4, src + (off % window) * 2, m * 2, n)
        }),
    )
}

/// Which SMs one traced call of `a` ran on and how many of its CTAs were alive at once.
fn sm_census(g: &Gpu, a: &Aggressor, json: &mut String) {
    let cap = 1 << 14;
    let trace = malloc(cap * 24);
    ck!(sys::cuMemsetD8_v2(trace, 0, cap * 24), "cuMemsetD8");
    (a.call)(g.agg, trace);
    sync_all();
    let mut host = vec![0u64; cap * 3];
    ck!(sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, trace, cap * 24), "cuMemcpyDtoH");
    let recs: Vec<&[u64]> = host.chunks(3).filter(|r| r[1] != 0 || r[2] != 0).collect();
    let mut sms: Vec<u64> = recs.iter().map(|r| r[0]).collect();
    sms.sort_unstable();
    sms.dedup();
    let mut life: Vec<f64> = recs.iter().map(|r| r[2].saturating_sub(r[1]) as f64 / 1e3).collect();
    let mut edges: Vec<(u64, i64)> = recs.iter().flat_map(|r| [(r[1], 1), (r[2], -1)]).collect();
    edges.sort();
    let (mut cur, mut most) = (0i64, 0i64);
    for (_, d) in edges {
        cur += d;
        most = most.max(cur);
    }
    let l = median(&mut life);
    println!("census {}: {} CTAs on {} SMs {:?}, at most {most} alive at once, CTA life {l:.2} us (median)", a.name, recs.len(), sms.len(), sms);
    let _ = write!(json, "{{\"census\":{:?},\"ctas\":{},\"sms\":{},\"max_alive\":{most},\"life_us\":{l:.3}}},", a.name, recs.len(), sms.len());
    ck!(sys::cuMemFree_v2(trace), "cuMemFree");
}

/// The sum phase in an SM partition (issue #22): does a green context of 16 SMs give one-launch
/// throughput (no launch gaps) with short-lived CTAs, and what does it cost the victims?
fn green(g: &Gpu, samples: usize, json: &mut String) {
    let bufs = Bufs::new();
    let parts: Vec<Partition> = [16u32, 8, 24]
        .into_iter()
        .filter_map(|n| match Partition::new(g, n) {
            Ok(p) => Some(p),
            Err(e) => {
                println!("NOTE: no partition of {n} SMs: {e}");
                None
            }
        })
        .collect();
    let Some(p16) = parts.iter().find(|p| p.sms == 16) else {
        println!("SKIPPED green: no 16-SM partition");
        return;
    };
    // k = 8 operands: 8 M elements of 8 sources, 8 M fp32.
    const M: u64 = 8 << 20;
    let src = malloc(8 * M as usize * 2);
    let dst = malloc(M as usize * 4);
    for i in 0..8u64 {
        fill_bf16(src + i * M * 2, M as usize, 101 + 2 * i);
    }
    // Bitwise: the partition's shapes against one grid-stride launch of tide's kernel.
    let checks = vec![
        green_aggressor(&bufs, p16, 512 << 10, 0, true),
        green_aggressor(&bufs, p16, 512 << 10, 64, true),
        green_aggressor(&bufs, p16, 1 << 20, 0, false),
        green_aggressor_pdl(&bufs, p16, 512 << 10, 16, true, true),
    ];
    bitwise_against_tide(g, &bufs, &checks, json);
    {
        let f = func(g, "probe_stk8");
        let reference = Aggressor {
            name: "sum of 8 sources, 16 CTAs grid-stride".into(),
            bytes: 0.0,
            traced: false,
            config: None,
            ctas_bound: None,
            call: Box::new(move |stream, _| KArgs { extra: Extra::U64(1), ..KArgs::new(dst, src, M * 2, M) }.launch(f, 16, 512, 0, stream)),
        };
        let want = call_result(g, &reference, dst, M as usize);
        let a = green_k8(p16, src, dst, M, 512 << 10, 0, false);
        report_bitwise(&a, &call_result(g, &a, dst, M as usize), &want, json);
    }
    for a in [green_aggressor(&bufs, p16, 512 << 10, 0, true), green_aggressor(&bufs, p16, 512 << 10, 0, false), green_k8(p16, src, dst, M, 512 << 10, 0, false)] {
        sm_census(g, &a, json);
    }
    // Rows with victims first: today's engine shape (16-CTA launches on the caller's stream) and
    // XLA's full-grid fusion beside the partition's shapes, in the same run.
    let mut aggs: Vec<Aggressor> = vec![
        sum_aggressor(g, &bufs, "probe_st", 16, 512, 512 << 10, false, 0, None),
        green_aggressor(&bufs, p16, 512 << 10, 0, true),
        green_aggressor(&bufs, p16, 512 << 10, 64, true),
        green_aggressor(&bufs, p16, 512 << 10, 16, true),
        green_aggressor(&bufs, p16, 1 << 20, 0, true),
        green_k8(p16, src, dst, M, 512 << 10, 0, false),
    ];
    aggs.extend(baseline_aggressors(g, &bufs, &[]).into_iter().take(1));
    // Programmatic dependent launch inside the partition: the next 16-CTA launch is ready when
    // this one's CTAs end, and can only take the partition's SMs.
    aggs.push(green_aggressor_pdl(&bufs, p16, 512 << 10, 16, true, true));
    aggs.push(green_aggressor_pdl(&bufs, p16, 1 << 20, 16, true, true));
    aggs.push(green_k8(p16, src, dst, M, 2 << 20, 16, false));
    let alone_from = aggs.len();
    aggs.push(sum_aggressor(g, &bufs, "probe_st", 16, 512, 0, false, 0, None));
    aggs.push(green_aggressor(&bufs, p16, 512 << 10, 0, false));
    aggs.push(green_aggressor(&bufs, p16, 256 << 10, 0, true));
    aggs.push(green_aggressor(&bufs, p16, 2 << 20, 0, true));
    aggs.push(green_k8(p16, src, dst, M, 512 << 10, 64, false));
    aggs.push(green_aggressor(&bufs, p16, 2 << 20, 16, true));
    aggs.push(green_aggressor_pdl(&bufs, p16, 2 << 20, 16, true, true));
    aggs.push(green_k8(p16, src, dst, M, 2 << 20, 16, true));
    aggs.push(green_k8(p16, src, dst, M, 1 << 20, 32, false));
    for p in parts.iter().filter(|p| p.sms != 16) {
        aggs.push(green_aggressor(&bufs, p, 512 << 10, 0, true));
    }
    measure_rows(g, &aggs, samples, &|i| i >= alone_from, json);
    // The block scheduler gives a freed SM to a pending CTA of the running grid before the
    // victim's (one launch in the partition: the one-wave GEMM waits for all of it). Does it
    // follow stream priority? The victims on a stream of the highest priority (XLA's compute
    // stream has the default, the lowest, so tide cannot go below it).
    let (mut least, mut greatest) = (0, 0);
    ck!(sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest), "cuCtxGetStreamPriorityRange");
    let mut hi = std::ptr::null_mut();
    ck!(sys::cuStreamCreateWithPriority(&mut hi, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32, greatest), "cuStreamCreateWithPriority");
    let normal = g.vic.replace(hi);
    println!("priority: victims on a stream of priority {greatest} (range {least} least .. {greatest} greatest); aggressors at 0");
    let mut prio: Vec<Aggressor> = vec![
        sum_aggressor(g, &bufs, "probe_st", 16, 512, 512 << 10, false, 0, None),
        green_aggressor(&bufs, p16, 512 << 10, 0, true),
        green_aggressor(&bufs, p16, 512 << 10, 64, true),
        green_aggressor(&bufs, p16, 2 << 20, 0, true),
        sum_aggressor(g, &bufs, "probe_st", 16, 512, 0, false, 0, None),
    ];
    for a in prio.iter_mut() {
        a.name = format!("victims high-priority, {}", a.name);
    }
    measure_rows(g, &prio, samples, &|_| false, json);
    g.vic.set(normal);
}

// ----- engine mode: tide's calls as the engine issues them -----

/// A Llama-3-8B layer (d 4096, ffn 14336, 8 KV heads of 128): 218 M bf16 parameters, 436 MB.
/// `strided`: every matrix sharded along its dim 1 instead (what `tide_jax.lax.all_gather(w,
/// axis=1, tiled=True)` gathers: 2-D copies, [Note: strided parameters]).
fn layer_specs(strided: bool) -> Vec<ParamSpec> {
    let specs = dim0_layer_specs();
    if !strided {
        return specs;
    }
    specs.into_iter().map(|s| if s.shape.len() == 2 { s.along(1) } else { s }).collect()
}

fn dim0_layer_specs() -> Vec<ParamSpec> {
    let (h, f, kv) = (4096, 14336, 1024);
    let b = DType::BF16;
    vec![
        ParamSpec::new("q", &[h, h], b),
        ParamSpec::new("k", &[kv, h], b),
        ParamSpec::new("v", &[kv, h], b),
        ParamSpec::new("o", &[h, h], b),
        ParamSpec::new("gate", &[f, h], b),
        ParamSpec::new("up", &[f, h], b),
        ParamSpec::new("down", &[h, f], b),
        ParamSpec::new("norm1", &[h], b),
        ParamSpec::new("norm2", &[h], b),
    ]
}

/// Rank 0's call of a world-`world` collective over the layer and its emulated peers' buffers.
#[derive(Clone)]
struct EngineCall {
    call: CallInfo,
    peers: Vec<EmulatedPeer>,
    /// Bytes rank 0's work reads and writes per call.
    bytes: f64,
}

fn engine_call(op: Op, world: usize, site: i64) -> EngineCall {
    engine_call_of(op, world, site, false)
}

fn engine_call_of(op: Op, world: usize, site: i64, strided: bool) -> EngineCall {
    let layout = GroupLayout::new(&layer_specs(strided), world).unwrap();
    let (mut ins, mut outs) = (Vec::new(), Vec::new());
    let mut peers = vec![EmulatedPeer::default(); world - 1];
    let mut bytes = 0f64;
    for (i, p) in layout.params.iter().enumerate() {
        let shard_elems = p.shard_elems();
        let full_elems = p.full_bytes() / 2;
        let shard_dims = p.shard_shape();
        let (in_elems, in_dims, out_bytes, out_dims, out_dt) = match op {
            Op::AllGather => (shard_elems, shard_dims, p.full_bytes(), p.shape.clone(), p.dtype),
            Op::ReduceScatter => (full_elems, p.shape.clone(), shard_elems * 4, shard_dims, DType::F32),
        };
        let x = malloc(in_elems * 2);
        fill_bf16(x, in_elems, 7 + i as u64);
        ins.push(BufferView { ptr: x as usize, dtype: p.dtype, dims: in_dims });
        outs.push(BufferView { ptr: malloc(out_bytes) as usize, dtype: out_dt, dims: out_dims });
        for (q, peer) in peers.iter_mut().enumerate() {
            let y = malloc(in_elems * 2);
            fill_bf16(y, in_elems, 1000 * (q as u64 + 1) + i as u64);
            peer.inputs.push((y, in_elems * 2));
        }
        bytes += match op {
            // Every shard read once and written once into the output.
            Op::AllGather => 2.0 * p.full_bytes() as f64,
            // Rank 0's rows: the world's slices read (peers' staged: read, written, read again),
            // the fp32 sum written.
            Op::ReduceScatter => {
                let mine = p.valid_elems(0) as f64;
                mine * (2.0 * world as f64 + 4.0 * (world as f64 - 1.0) + 4.0)
            }
        };
    }
    let call = CallInfo {
        op,
        site,
        run_id: 0,
        rank_devices: Default::default(),
        job: 0,
        device_ordinal: 0,
        rank: 0,
        group: 0,
        world,
        topology: Topology::single_node(world),
        names: layout.params.iter().map(|p| p.name.clone()).collect(),
        inputs: ins,
        outputs: outs,
        stream: 0,
        at: None,
        cast: None,
        urgent: false,
    };
    EngineCall { call, peers, bytes }
}

/// The all-gather `ec` as the casting all-gather issues it (`cast::views`): rank 0's operands are
/// its own rows of its results (where the rounding left them), so its own copy is skipped and only
/// the peers' rows move. Bytes: the peers' rows, read and written.
fn in_place(ec: &EngineCall) -> EngineCall {
    let mut ec = ec.clone();
    let layout = ec.call.layout().expect("layout");
    let mut bytes = 0f64;
    for (p, (input, output)) in layout.params.iter().zip(ec.call.inputs.iter_mut().zip(&ec.call.outputs)) {
        let (offset, elems) = tide::cast::own_rows(p, 0);
        input.ptr = output.ptr + if elems > 0 { offset } else { 0 };
        bytes += 2.0 * (p.full_bytes() - elems * p.dtype.size_bytes()) as f64;
    }
    ec.bytes = bytes;
    ec
}

fn engine_aggressor<'a>(name: String, ec: &'a EngineCall, config: tide::config::Config) -> Aggressor<'a> {
    let ctas = config.rs_max_ctas;
    Aggressor {
        name,
        bytes: ec.bytes,
        traced: false,
        ctas_bound: (ec.call.op == Op::ReduceScatter).then_some(ctas),
        config: Some(config),
        call: Box::new(move |stream, _| {
            let mut call = ec.call.clone();
            call.stream = stream as usize;
            let r = if call.world == 1 {
                tide::cuda::execute(&call)
            } else {
                tide::cuda::execute_emulated(&call, &ec.peers)
            };
            r.unwrap_or_else(|e| panic!("{e}"));
        }),
    }
}

fn engine(g: &Gpu, samples: usize, json: &mut String) {
    let base = {
        let mut c = tide::config::Config::from_env();
        c.timeout_s = 60.0;
        c.multicast = false;
        c
    };
    let with = |f: &dyn Fn(&mut tide::config::Config)| {
        let mut c = base.clone();
        f(&mut c);
        c
    };
    let calls: Vec<(Op, usize, EngineCall)> = [(Op::ReduceScatter, 1), (Op::ReduceScatter, 2), (Op::ReduceScatter, 4), (Op::ReduceScatter, 8), (Op::AllGather, 1), (Op::AllGather, 2), (Op::AllGather, 8)]
        .into_iter()
        .enumerate()
        .map(|(k, (op, world))| (op, world, engine_call(op, world, 9000 + k as i64)))
        .collect();
    let find = |op: Op, world: usize| &calls.iter().find(|c| c.0 == op && c.1 == world).unwrap().2;
    let strided_ag8 = engine_call_of(Op::AllGather, 8, 9100, true);
    let strided_rs8 = engine_call_of(Op::ReduceScatter, 8, 9101, true);
    let in_place_calls: Vec<(usize, EngineCall)> = [2usize, 8].iter().map(|&w| (w, in_place(find(Op::AllGather, w)))).collect();
    println!(
        "engine: Llama-3-8B layer, 9 bf16 parameters, 436 MB; rank 0 of world P, peers emulated by buffers of GPU 0 \
         (TIDE_RS_MAX_CTAS {}, TIDE_RS_CTA_BYTES {}, TIDE_CE_PIECE_BYTES {})",
        base.rs_max_ctas, base.rs_cta_bytes, base.ce_piece_bytes
    );
    let bufs = Bufs::new();
    let mut aggs: Vec<Aggressor> = Vec::new();
    let rs_name = |world: usize, what: &str| call_name(Op::ReduceScatter, world, what);
    for (cta, what) in [(0usize, "one grid-stride launch per sum (before)"), (256 << 10, "256 KiB/CTA"), (base.rs_cta_bytes, "default"), (1 << 20, "1 MiB/CTA")] {
        aggs.push(engine_aggressor(
            rs_name(1, &format!("{what}, TIDE_RS_CTA_BYTES={cta}")),
            find(Op::ReduceScatter, 1),
            with(&|c| c.rs_cta_bytes = cta),
        ));
    }
    for world in [2, 4, 8] {
        aggs.push(engine_aggressor(rs_name(world, "default"), find(Op::ReduceScatter, world), base.clone()));
    }
    aggs.push(engine_aggressor(
        rs_name(8, "one grid-stride launch per sum (before), TIDE_RS_CTA_BYTES=0"),
        find(Op::ReduceScatter, 8),
        with(&|c| c.rs_cta_bytes = 0),
    ));
    let ag_name = |world: usize, what: &str| call_name(Op::AllGather, world, what);
    aggs.push(engine_aggressor(ag_name(1, "default"), find(Op::AllGather, 1), base.clone()));
    aggs.push(engine_aggressor(
        ag_name(1, "pieces up to 4 GiB, TIDE_CE_PIECE_BYTES=4294967296"),
        find(Op::AllGather, 1),
        with(&|c| c.ce_piece_bytes = 1 << 32),
    ));
    aggs.push(engine_aggressor(
        ag_name(1, "8 MiB pieces, TIDE_CE_PIECE_BYTES=8388608"),
        find(Op::AllGather, 1),
        with(&|c| c.ce_piece_bytes = 8 << 20),
    ));
    aggs.push(engine_aggressor(
        ag_name(1, "cuMemcpyAsync per copy (before, for a lone copy), TIDE_COPY_BATCH=0"),
        find(Op::AllGather, 1),
        with(&|c| c.copy_batch = false),
    ));
    for world in [2, 8] {
        aggs.push(engine_aggressor(ag_name(world, "default"), find(Op::AllGather, world), base.clone()));
        aggs.push(engine_aggressor(
            ag_name(world, "own shard on a stream of its own (before), TIDE_LOCAL_COPY=ce"),
            find(Op::AllGather, world),
            with(&|c| c.local_copy = tide::config::LocalCopy::CopyEngine),
        ));
    }
    // Every matrix gathered / reduce-scattered along dim 1 (tide_jax.lax with axis=1): 2-D copies.
    aggs.push(engine_aggressor(ag_name(8, "strided (dim 1, 2-D copies)"), &strided_ag8, base.clone()));
    aggs.push(engine_aggressor(rs_name(8, "strided (dim 1, staged by 2-D copies)"), &strided_rs8, base.clone()));
    // The casting all-gather's copies (scan_layers' gathers): the own rows are already in place.
    for (world, ec) in &in_place_calls {
        aggs.push(engine_aggressor(ag_name(*world, "in place (the casting all-gather's copies)"), ec, base.clone()));
        aggs.push(engine_aggressor(
            ag_name(*world, "in place, 8 MiB pieces, TIDE_CE_PIECE_BYTES=8388608"),
            ec,
            with(&|c| c.ce_piece_bytes = 8 << 20),
        ));
    }
    aggs.extend(baseline_aggressors(
        g,
        &bufs,
        &[(COPY_BYTES, 1, true), (COPY_BYTES, 2, true), (COPY_BYTES, 8, true), (32 << 20, 1, true), (32 << 20, 2, true), (4 << 20, 2, true)],
    ));
    aggs.push(sum_aggressor(g, &bufs, "probe_st", 16, 512, 0, false, 0, None));
    measure_rows(g, &aggs, samples, &|_| false, json);
}

// ----- progress mode: how much the victim slows tide (issue #38) -----

/// The engine rows' name of a call: "RS world 8 (emulated): default".
fn call_name(op: Op, world: usize, what: &str) -> String {
    let op = if op == Op::ReduceScatter { "RS" } else { "AG" };
    format!("{op} world {world}{}: {what}", if world > 1 { " (emulated)" } else { "" })
}

/// TIDE_BENCH_ROWS as a filter: comma-separated substrings; a row runs if its name contains one
/// of them (all rows when unset or empty).
fn row_filter() -> impl Fn(&str) -> bool {
    let only: Vec<String> = std::env::var("TIDE_BENCH_ROWS")
        .map(|v| v.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect())
        .unwrap_or_default();
    move |name: &str| only.is_empty() || only.iter().any(|o| name.contains(o.as_str()))
}

/// The persistent full-SM victim (`probe_fullsm`): one CTA per SM of 384 threads with the device's
/// opt-in maximum of dynamic shared memory (232448 B on H100, as cuDNN's flash attention), each
/// spinning 1 ms; a burst of 4 launches back to back.
fn fullsm_victim(g: &Gpu) -> (Victim<'_>, u32) {
    let f = func(g, "probe_fullsm");
    let smem = device_attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    ck!(
        sys::cuFuncSetAttribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
        "cuFuncSetAttribute"
    );
    let smem = smem as u32;
    let sms = g.sms;
    let victim = Victim {
        name: "fullsm_persistent_1ms",
        unit: Box::new(move |s| {
            let (mut out, mut ns, mut never) = (0u64, 1_000_000u64, 0x9e37_79b9u32);
            let mut p = [
                &mut out as *mut u64 as *mut c_void,
                &mut ns as *mut u64 as *mut c_void,
                &mut never as *mut u32 as *mut c_void,
            ];
            launch(f, sms, 384, smem, s, &mut p, false);
        }),
        count: 4,
    };
    (victim, smem)
}

/// One kernel's resources as the driver reports them for a CTA of `threads` and `smem` bytes of
/// dynamic shared memory: (registers per thread, max threads per CTA, static shared bytes, local
/// bytes per thread, CTAs per SM).
fn kernel_resources(f: sys::CUfunction, threads: u32, smem: u32) -> (i32, i32, i32, i32, i32) {
    use sys::CUfunction_attribute as A;
    let attr = |a| {
        let mut v = 0;
        ck!(sys::cuFuncGetAttribute(&mut v, a, f), "cuFuncGetAttribute");
        v
    };
    let mut per_sm = 0;
    ck!(
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, f, threads as i32, smem as usize),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor"
    );
    (
        attr(A::CU_FUNC_ATTRIBUTE_NUM_REGS),
        attr(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
        attr(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
        attr(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
        per_sm,
    )
}

/// An attribute of the current context's device.
fn device_attr(a: sys::CUdevice_attribute) -> i32 {
    let mut dev = 0;
    ck!(sys::cuCtxGetDevice(&mut dev), "cuCtxGetDevice");
    let mut v = 0;
    ck!(sys::cuDeviceGetAttribute(&mut v, a, dev), "cuDeviceGetAttribute");
    v
}

/// One line per kernel of tide's module as the engine loaded it (`cuda::device::Module`, launched
/// with `kernels::threads()` threads and no dynamic shared memory), and of the full-SM probe: what
/// decides whether a tide CTA fits on an SM beside a compute kernel's CTA.
fn print_kernel_resources(g: &Gpu, fullsm_smem: u32, json: &mut String) {
    use sys::CUdevice_attribute as D;
    let (regs_sm, smem_sm, threads_sm) = (
        device_attr(D::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
        device_attr(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        device_attr(D::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR),
    );
    println!("kernel resources: per SM {regs_sm} registers, {smem_sm} B shared memory, {threads_sm} threads");
    let state = tide::cuda::device::get(0).unwrap_or_else(|e| panic!("{e}"));
    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
    let m = state.ensure_module().unwrap_or_else(|e| panic!("{e}"));
    let threads = tide::cuda::kernels::threads();
    let mut list: Vec<(&str, sys::CUfunction, u32, u32)> =
        m.functions().into_iter().map(|(name, f)| (name, f, threads, 0)).collect();
    list.push(("probe_fullsm (victim)", func(g, "probe_fullsm"), 384, fullsm_smem));
    for (name, f, threads, smem) in list {
        let (regs, max_threads, static_smem, local, per_sm) = kernel_resources(f, threads, smem);
        println!(
            "kernel {name:24} {regs:3} regs/thread, max {max_threads} threads/CTA, {static_smem} B static + {smem} B dynamic shared, \
             {local} B local/thread; at {threads} threads: {} regs/CTA, {per_sm} CTAs/SM",
            regs * threads as i32
        );
        let _ = write!(
            json,
            "{{\"name\":\"kernel {name}\",\"kernel\":{name:?},\"regs\":{regs},\"max_threads\":{max_threads},\"static_smem\":{static_smem},\
             \"dynamic_smem\":{smem},\"local_bytes\":{local},\"threads\":{threads},\"ctas_per_sm\":{per_sm}}},"
        );
    }
}

/// Repetitions of a victim whose one repetition takes `unit_ms` so that its burst takes at least
/// `ratio` x `coll_ms` (the issue's bar: the victim alone >= 1.2x the collective alone).
fn burst_reps(unit_ms: f64, coll_ms: f64, ratio: f64) -> usize {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(unit_ms) || !positive(coll_ms) {
        return 1;
    }
    ((ratio * coll_ms / unit_ms).ceil() as usize).clamp(1, 100_000)
}

/// How long the gate spin must last (ns) for the host to enqueue a sample behind it that took
/// `host_ms` to enqueue last time: twice that plus 0.5 ms, within [1 ms, 500 ms].
fn gate_ns(host_ms: f64) -> u64 {
    ((2.0 * host_ms + 0.5).clamp(1.0, 500.0) * 1e6) as u64
}

/// TIDE_BENCH_PROGRESS_RATIO (1.25): each victim's burst over the call alone, in `progress` and
/// `cecheck`.
fn progress_ratio() -> f64 {
    std::env::var("TIDE_BENCH_PROGRESS_RATIO").ok().and_then(|v| v.parse().ok()).unwrap_or(1.25)
}

/// A number for the JSON output: null where not finite (a row whose samples all failed), as JSON
/// has no NaN.
fn json_num(x: f64) -> String {
    if x.is_finite() { format!("{x:.5}") } else { "null".into() }
}

/// One (call, victim) row of `progress`: the medians of the interleaved samples (ms).
#[derive(Debug, Clone, PartialEq)]
struct Progress {
    /// The victim's burst alone, the collective alone (one call), both started together (from the
    /// common start until both are done).
    victim_ms: f64,
    coll_ms: f64,
    both_ms: f64,
    /// Inside `both`: the victim's burst from the common start to its end, the collective's.
    victim_in_both_ms: f64,
    coll_in_both_ms: f64,
}

impl Progress {
    /// Medians of each column of `samples`: (victim, coll, both, victim in both, coll in both).
    fn of(samples: &[[f64; 5]]) -> Progress {
        let col = |i: usize| median(&mut samples.iter().map(|s| s[i]).collect::<Vec<_>>());
        Progress {
            victim_ms: col(0),
            coll_ms: col(1),
            both_ms: col(2),
            victim_in_both_ms: col(3),
            coll_in_both_ms: col(4),
        }
    }

    /// (victim + coll - both) / the shorter of the two: 1 when the shorter hides entirely behind
    /// the longer, 0 when the two take their sum.
    fn overlap(&self) -> f64 {
        (self.victim_ms + self.coll_ms - self.both_ms) / self.victim_ms.min(self.coll_ms)
    }

    /// both - victim: the collective's exposed time.
    fn added_ms(&self) -> f64 {
        self.both_ms - self.victim_ms
    }

    /// The victim's burst inside `both` against alone, in %.
    fn victim_slowdown_pct(&self) -> f64 {
        100.0 * (self.victim_in_both_ms / self.victim_ms - 1.0)
    }

    /// The collective inside `both` against alone, in %.
    fn coll_slowdown_pct(&self) -> f64 {
        100.0 * (self.coll_in_both_ms / self.coll_ms - 1.0)
    }
}

/// What one gated sample runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Victim,
    Coll,
    Both,
}

/// Gated samples: behind a one-CTA spin on the victim's stream (the host enqueues everything
/// while it spins) an event `start` there, which the collective's stream waits on; then the
/// victim's burst on its stream and one call on the collective's, so both start at `start`
/// whatever the host's enqueue time. A sample whose gate opened before the host was done
/// enqueueing (`start` already complete) is dropped and retried behind a gate twice as long.
struct Sampler {
    /// Events: start (victim's stream), the victim's end, the collective's end (its stream).
    start: sys::CUevent,
    victim_end: sys::CUevent,
    coll_end: sys::CUevent,
    gate_ns: u64,
    /// Samples dropped because the gate opened too early.
    late: usize,
}

impl Sampler {
    fn new() -> Sampler {
        let mk = || {
            let mut e = std::ptr::null_mut();
            ck!(sys::cuEventCreate(&mut e, 0), "cuEventCreate");
            e
        };
        Sampler { start: mk(), victim_end: mk(), coll_end: mk(), gate_ns: 1_000_000, late: 0 }
    }

    /// One sample of `part`: (the victim's burst from start to its end, the collective from start
    /// to its end) in ms, each NaN where not run. After 4 late tries the last is kept, counted late.
    fn take(&mut self, g: &Gpu, v: &Victim, reps: usize, a: &Aggressor, part: Part) -> (f64, f64) {
        let vic = g.vic.get();
        for attempt in 0..4 {
            sync_all();
            let t = Instant::now();
            spin(g, vic, self.gate_ns, 1);
            ck!(sys::cuEventRecord(self.start, vic), "cuEventRecord");
            ck!(sys::cuStreamWaitEvent(g.agg, self.start, 0), "cuStreamWaitEvent");
            if part != Part::Coll {
                v.burst(vic, reps);
                ck!(sys::cuEventRecord(self.victim_end, vic), "cuEventRecord");
            }
            if part != Part::Victim {
                (a.call)(g.agg, 0);
                ck!(sys::cuEventRecord(self.coll_end, g.agg), "cuEventRecord");
            }
            // SAFETY: an event recorded above; cuEventQuery only reads its state.
            let opened = match unsafe { sys::cuEventQuery(self.start) } {
                sys::CUresult::CUDA_SUCCESS => true,
                sys::CUresult::CUDA_ERROR_NOT_READY => false,
                r => panic!("cuEventQuery -> {r:?}"),
            };
            let host_ms = t.elapsed().as_secs_f64() * 1e3;
            sync_all();
            self.gate_ns = self.gate_ns.max(gate_ns(host_ms));
            if opened {
                self.late += 1;
                if attempt < 3 {
                    self.gate_ns = (self.gate_ns * 2).min(500_000_000);
                    continue;
                }
            }
            break;
        }
        let victim = if part != Part::Coll { elapsed_ms(self.start, self.victim_end) } else { f64::NAN };
        let coll = if part != Part::Victim { elapsed_ms(self.start, self.coll_end) } else { f64::NAN };
        (victim, coll)
    }
}

/// One (call, victim) row: warm-up, the burst sized to >= `ratio` x the collective alone, then
/// `samples` interleaved rounds of (victim alone, collective alone, both). Returns the medians and
/// the burst's repetitions (`sampler.late` counts the samples retried).
fn progress_row(g: &Gpu, sampler: &mut Sampler, v: &Victim, a: &Aggressor, samples: usize, ratio: f64) -> (Progress, usize) {
    let vic = g.vic.get();
    for _ in 0..3 {
        (a.call)(g.agg, 0);
    }
    v.run(vic);
    sync_all();
    let mut coll: Vec<f64> = (0..3).map(|_| sampler.take(g, v, 0, a, Part::Coll).1).collect();
    let coll_ms = median(&mut coll);
    let mut unit: Vec<f64> = (0..2).map(|_| sampler.take(g, v, v.count, a, Part::Victim).0 / v.count as f64).collect();
    let mut reps = burst_reps(median(&mut unit), coll_ms, ratio);
    // One correction: a burst's repetitions are not all as fast as the default burst's.
    let mut burst: Vec<f64> = (0..2).map(|_| sampler.take(g, v, reps, a, Part::Victim).0).collect();
    let burst_ms = median(&mut burst);
    if burst_ms < ratio * coll_ms {
        reps = burst_reps(burst_ms / reps as f64, coll_ms, ratio);
    }
    let mut rows = Vec::with_capacity(samples);
    for _ in 0..samples {
        let (victim, _) = sampler.take(g, v, reps, a, Part::Victim);
        let (_, coll) = sampler.take(g, v, reps, a, Part::Coll);
        let (victim_in_both, coll_in_both) = sampler.take(g, v, reps, a, Part::Both);
        rows.push([victim, coll, victim_in_both.max(coll_in_both), victim_in_both, coll_in_both]);
    }
    (Progress::of(&rows), reps)
}

/// `progress`: for each of tide's calls over one Llama-3-8B layer as the engine issues them
/// (reduce-scatter and all-gather, world 1 and rank 0 of emulated worlds 2, 4, 8) and each victim
/// (the GEMMs, the elementwise pass, the persistent full-SM probe): the victim alone, the
/// collective alone, both started together; overlap, added latency and each one's slowdown.
fn progress(g: &Gpu, samples: usize, json: &mut String) {
    let base = {
        let mut c = tide::config::Config::from_env();
        c.timeout_s = 60.0;
        c.multicast = false;
        c
    };
    let ratio = progress_ratio();
    let run_row = row_filter();
    let ops = [Op::ReduceScatter, Op::AllGather];
    let worlds = [1usize, 2, 4, 8];
    let names: Vec<(Op, usize, String)> =
        ops.iter().flat_map(|&op| worlds.iter().map(move |&w| (op, w, call_name(op, w, "default")))).collect();
    let mut victims = victims(g);
    let (fullsm, fullsm_smem) = fullsm_victim(g);
    victims.push(fullsm);
    print_kernel_resources(g, fullsm_smem, json);
    println!(
        "progress: Llama-3-8B layer, 9 bf16 parameters, 436 MB; rank 0 of world P, peers emulated by buffers of GPU 0; \
         each victim's burst sized to >= {ratio}x the call alone (TIDE_BENCH_PROGRESS_RATIO); medians of {samples} \
         interleaved samples (TIDE_RS_MAX_CTAS {}, TIDE_RS_CTA_BYTES {}, TIDE_HIGH_PRIORITY {}, TIDE_CE_PIECE_BYTES {}, \
         TIDE_LOCAL_COPY {:?}, TIDE_FUSE_BYTES {}, TIDE_FUSE_CE_MIN {}, TIDE_AG_STREAMS {})",
        base.rs_max_ctas,
        base.rs_cta_bytes,
        base.high_priority as u8,
        base.ce_piece_bytes,
        base.local_copy,
        base.fuse_bytes,
        base.fuse_ce_min,
        base.ag_streams
    );
    let _ = write!(
        json,
        "{{\"name\":\"progress config\",\"ratio\":{ratio},\"samples\":{samples},\"rs_max_ctas\":{},\"rs_cta_bytes\":{},\
         \"high_priority\":{},\"ce_piece_bytes\":{},\"fuse_bytes\":{}}},",
        base.rs_max_ctas, base.rs_cta_bytes, base.high_priority, base.ce_piece_bytes, base.fuse_bytes
    );
    let mut sampler = Sampler::new();
    let mut summary: Vec<String> = Vec::new();
    for (k, (op, world, name)) in names.iter().enumerate() {
        let rows: Vec<&Victim> = victims.iter().filter(|v| run_row(&format!("{name} | {}", v.name))).collect();
        if rows.is_empty() {
            continue;
        }
        // Only calls with rows to run get buffers (emulated world 8's reduce-scatter: 3.5 GB of
        // inputs; all eight calls: about 9 GB), never freed: the engine's cached plans name them.
        let ec = engine_call_of(*op, *world, 9200 + k as i64, false);
        let a = engine_aggressor(name.clone(), &ec, base.clone());
        tide::config::set_override(a.config.clone());
        // Each call's gate grows from 1 ms with its own enqueue time (a world-8 call's is longest).
        sampler.gate_ns = 1_000_000;
        let mut worst: Option<(f64, &str)> = None;
        for v in rows {
            let late_before = sampler.late;
            let (p, reps) = progress_row(g, &mut sampler, v, &a, samples, ratio);
            let late = sampler.late - late_before;
            let row = format!("{name} | {}", v.name);
            println!(
                "progress: {row:50} x{reps:<4} victim {:8.3} ms, coll {:7.3} ms ({:.2}x), both {:8.3} ms, overlap {:5.2}, \
                 added {:+7.3} ms, victim in both {:8.3} ms ({:+.1}%), coll in both {:7.3} ms ({:+.1}%) (n={samples}{}, gate {:.1} ms)",
                p.victim_ms,
                p.coll_ms,
                p.victim_ms / p.coll_ms,
                p.both_ms,
                p.overlap(),
                p.added_ms(),
                p.victim_in_both_ms,
                p.victim_slowdown_pct(),
                p.coll_in_both_ms,
                p.coll_slowdown_pct(),
                if late > 0 { format!(", {late} late retried") } else { String::new() },
                sampler.gate_ns as f64 / 1e6
            );
            let _ = write!(
                json,
                "{{\"name\":{row:?},\"progress\":{name:?},\"victim\":{:?},\"reps\":{reps},\"victim_ms\":{},\"coll_ms\":{},\
                 \"both_ms\":{},\"overlap\":{},\"added_ms\":{},\"victim_in_both_ms\":{},\"victim_slowdown_pct\":{},\
                 \"coll_in_both_ms\":{},\"coll_slowdown_pct\":{},\"samples\":{samples},\"late\":{late}}},",
                v.name,
                json_num(p.victim_ms),
                json_num(p.coll_ms),
                json_num(p.both_ms),
                json_num(p.overlap()),
                json_num(p.added_ms()),
                json_num(p.victim_in_both_ms),
                json_num(p.victim_slowdown_pct()),
                json_num(p.coll_in_both_ms),
                json_num(p.coll_slowdown_pct())
            );
            // The issue's bar excludes the HBM-bound elementwise pass.
            if !v.name.starts_with("elementwise") && worst.is_none_or(|(o, _)| p.overlap() < o) {
                worst = Some((p.overlap(), v.name));
            }
        }
        tide::config::set_override(None);
        if let Some((o, v)) = worst {
            summary.push(format!("progress summary: {name:40} lowest overlap {o:.2} ({v}; the bar: >= 0.9 at world 1 and 8, elementwise excepted)"));
        }
    }
    for line in summary {
        println!("{line}");
    }
}

// ----- coresidence mode (issue #38): does a tide CTA ever share an SM with a compute kernel's? -----

/// Aggressor CTAs per launch (the engine's short launches).
const CORES_AGG_CTAS: u32 = 16;
/// The aggressor's elements (2 bf16 sources, fp32 out: 512 MB moved, ~0.5 ms alone on 16 SMs).
const CORES_N: u64 = 64 << 20;
/// How long each victim CTA spins (ns).
const CORES_VICTIM_NS: u64 = 2_000_000;
/// Host wait between the victim's launch and the aggressor's, so the victim is resident first.
const CORES_GAP_US: u64 = 300;

/// One CTA's trace record: (smid, start ns, end ns; %globaltimer).
type Cta = (u64, u64, u64);

fn read_trace(p: u64, ctas: usize) -> Vec<Cta> {
    let mut host = vec![0u64; ctas * 3];
    ck!(sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, p, ctas * 24), "cuMemcpyDtoH");
    host.chunks(3).filter(|r| r[1] != 0 || r[2] != 0).map(|r| (r[0], r[1], r[2])).collect()
}

/// What one run of a victim grid and an aggressor beside it shows.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cores {
    victim_ctas: usize,
    /// Distinct SMs the victim's CTAs ran on.
    victim_sms: usize,
    aggressor_ctas: usize,
    /// Aggressor CTAs that started before the victim's last CTA ended.
    beside: usize,
    /// Of those, the ones whose SM had a victim CTA alive during their life (same smid,
    /// overlapping [start, end]): they shared an SM with it.
    shared_sm: usize,
    /// The aggressor's first start minus the victim's first start (us).
    first_start_us: f64,
    /// The aggressor's last end minus the victim's last end (us).
    last_end_us: f64,
    /// The victim's last CTA start minus its first (us): all resident at once when small.
    victim_spread_us: f64,
}

fn cores_of(victim: &[Cta], agg: &[Cta]) -> Option<Cores> {
    let v_start = victim.iter().map(|c| c.1).min()?;
    let v_last_start = victim.iter().map(|c| c.1).max()?;
    let v_end = victim.iter().map(|c| c.2).max()?;
    let a_start = agg.iter().map(|c| c.1).min()?;
    let a_end = agg.iter().map(|c| c.2).max()?;
    let mut sms: Vec<u64> = victim.iter().map(|c| c.0).collect();
    sms.sort_unstable();
    sms.dedup();
    let beside: Vec<&Cta> = agg.iter().filter(|a| a.1 < v_end).collect();
    let shared_sm = beside
        .iter()
        .filter(|a| victim.iter().any(|v| v.0 == a.0 && v.1 < a.2 && a.1 < v.2))
        .count();
    let us = |later: u64, earlier: u64| (later as f64 - earlier as f64) / 1e3;
    Some(Cores {
        victim_ctas: victim.len(),
        victim_sms: sms.len(),
        aggressor_ctas: agg.len(),
        beside: beside.len(),
        shared_sm,
        first_start_us: us(a_start, v_start),
        last_end_us: us(a_end, v_end),
        victim_spread_us: us(v_last_start, v_start),
    })
}

/// A victim grid of `grid` CTAs (probe_cores_* kernels: trace, ns, never, out).
fn cores_victim_launch(f: sys::CUfunction, grid: u32, threads: u32, smem: u32, stream: sys::CUstream, trace: u64, ns: u64) {
    let (mut trace, mut ns, mut never, mut out) = (trace, ns, 0x9e37_79b9u32, 0u64);
    let mut p = [
        &mut trace as *mut u64 as *mut c_void,
        &mut ns as *mut u64 as *mut c_void,
        &mut never as *mut u32 as *mut c_void,
        &mut out as *mut u64 as *mut c_void,
    ];
    launch(f, grid, threads, smem, stream, &mut p, false);
}

struct CoresVictim {
    name: &'static str,
    f: sys::CUfunction,
    threads: u32,
    smem: u32,
}

struct CoresAggressor {
    f: sys::CUfunction,
    threads: u32,
}

/// Registers per CTA as the SM allocates them (per warp, in units of 256: 8 per thread).
fn regs_allocated(regs: i32, threads: u32) -> i32 {
    let warps = (threads as i32 + 31) / 32;
    warps * ((regs + 7) / 8 * 8) * 32
}

/// A function attribute, or "?" where the driver refuses to report it.
fn func_attr(f: sys::CUfunction, a: sys::CUfunction_attribute) -> String {
    let mut v = 0;
    match unsafe { sys::cuFuncGetAttribute(&mut v, a, f) } {
        sys::CUresult::CUDA_SUCCESS => v.to_string(),
        e => format!("? ({e:?})"),
    }
}

fn coresidence(g: &Gpu, samples: usize, json: &mut String) {
    use sys::CUfunction_attribute as A;
    use sys::CUdevice_attribute as D;
    let optin = device_attr(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) as u32;
    println!(
        "coresidence: per SM {} registers, {} B shared memory ({} B opt-in per CTA, {} B reserved per CTA), {} threads; victim spin {} us, \
         aggressor {} CTAs x {} elements, launched {} us after the victim; {} runs per row",
        device_attr(D::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
        device_attr(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        optin,
        device_attr(D::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK),
        device_attr(D::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR),
        CORES_VICTIM_NS / 1000,
        CORES_AGG_CTAS,
        CORES_N,
        CORES_GAP_US,
        samples
    );
    let set_attr = |f: sys::CUfunction, a: A, v: i32, what: &str| {
        ck!(sys::cuFuncSetAttribute(f, a, v), what);
    };
    // The victims: each shape's dynamic shared memory capped at the device's opt-in maximum.
    let gemm_smem = 196_640u32.min(optin);
    let attn_smem = 232_448u32.min(optin);
    let victims = [
        CoresVictim { name: "triton_gemm (256 thr, 196640 B)", f: func(g, "probe_cores_gemm"), threads: 256, smem: gemm_smem },
        CoresVictim { name: "triton_gemm, victim carveout 100", f: func(g, "probe_cores_gemm_c100"), threads: 256, smem: gemm_smem },
        CoresVictim { name: "triton_gemm regs, no smem", f: func(g, "probe_cores_gemm"), threads: 256, smem: 0 },
        CoresVictim { name: "cudnn_attention (384 thr, 232448 B)", f: func(g, "probe_cores_attn"), threads: 384, smem: attn_smem },
        CoresVictim { name: "control: small (256 thr, 0 B)", f: func(g, "probe_cores_small"), threads: 256, smem: 0 },
    ];
    for v in victims.iter().filter(|v| v.smem > 0) {
        set_attr(v.f, A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, v.smem as i32, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED)");
    }
    set_attr(
        victims[1].f,
        A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
        "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)",
    );
    let aggs = [
        CoresAggressor { f: func(g, "probe_cores_st512"), threads: 512 },
        CoresAggressor { f: func(g, "probe_cores_st256"), threads: 256 },
    ];
    // Streams: the victim's (priority 0), the aggressor's at priority 0 and at the greatest.
    let (mut least, mut greatest) = (0i32, 0i32);
    ck!(sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest), "cuCtxGetStreamPriorityRange");
    let mut high = std::ptr::null_mut();
    ck!(
        sys::cuStreamCreateWithPriority(&mut high, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32, greatest),
        "cuStreamCreateWithPriority"
    );
    println!("coresidence: stream priorities: least {least}, greatest {greatest} (victim and normal aggressor: 0)");

    let describe = |f: sys::CUfunction, threads: u32, smem: u32| {
        let (regs, _, static_smem, local, per_sm) = kernel_resources(f, threads, smem);
        let carve = func_attr(f, A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT);
        (
            format!(
                "{regs} regs x {threads} thr = {} regs/CTA allocated, {static_smem} B static + {smem} B dynamic smem, {local} B local, \
                 carveout attr {carve}, occupancy {per_sm} CTAs/SM",
                regs_allocated(regs, threads)
            ),
            regs,
            per_sm,
        )
    };
    let vtrace = malloc(g.sms as usize * 24);
    let atrace = malloc(CORES_AGG_CTAS as usize * 24);
    let (a, b, d) = (malloc(CORES_N as usize * 2), malloc(CORES_N as usize * 2), malloc(CORES_N as usize * 4));
    ck!(sys::cuMemsetD8_v2(a, 0, CORES_N as usize * 2), "cuMemsetD8");
    ck!(sys::cuMemsetD8_v2(b, 0, CORES_N as usize * 2), "cuMemsetD8");
    let agg_launch = |ag: &CoresAggressor, stream: sys::CUstream, trace: u64| {
        let mut k = KArgs::new(d, a, b, CORES_N);
        k.trace = trace;
        k.launch(ag.f, CORES_AGG_CTAS, ag.threads, 0, stream);
    };
    let clear = || {
        ck!(sys::cuMemsetD8_v2(vtrace, 0, g.sms as usize * 24), "cuMemsetD8");
        ck!(sys::cuMemsetD8_v2(atrace, 0, CORES_AGG_CTAS as usize * 24), "cuMemsetD8");
        sync_all();
    };
    // Warm-up (lazy module loading happens at a function's first launch), then each kernel alone.
    for v in &victims {
        cores_victim_launch(v.f, g.sms, v.threads, v.smem, g.vic.get(), 0, 10_000);
    }
    for ag in &aggs {
        agg_launch(ag, g.agg, 0);
    }
    sync_all();
    for v in &victims {
        clear();
        cores_victim_launch(v.f, g.sms, v.threads, v.smem, g.vic.get(), vtrace, CORES_VICTIM_NS);
        sync_all();
        let tr = read_trace(vtrace, g.sms as usize);
        let (desc, _, _) = describe(v.f, v.threads, v.smem);
        let mut sms: Vec<u64> = tr.iter().map(|c| c.0).collect();
        sms.sort_unstable();
        sms.dedup();
        let start = tr.iter().map(|c| c.1).min().unwrap_or(0);
        let spread = tr.iter().map(|c| c.1).max().unwrap_or(0).saturating_sub(start) as f64 / 1e3;
        let span = tr.iter().map(|c| c.2).max().unwrap_or(0).saturating_sub(start) as f64 / 1e3;
        println!(
            "coresidence: victim alone: {} | {desc} | {} CTAs on {} SMs, start spread {spread:.1} us, span {span:.1} us",
            v.name,
            tr.len(),
            sms.len()
        );
    }
    for ag in &aggs {
        let mut spans = Vec::new();
        for _ in 0..3 {
            clear();
            agg_launch(ag, g.agg, atrace);
            sync_all();
            let tr = read_trace(atrace, CORES_AGG_CTAS as usize);
            let s = tr.iter().map(|c| c.1).min().unwrap_or(0);
            spans.push(tr.iter().map(|c| c.2).max().unwrap_or(0).saturating_sub(s) as f64 / 1e3);
        }
        let (desc, _, _) = describe(ag.f, ag.threads, 0);
        println!("coresidence: aggressor alone: tide_sum {} thr | {desc} | span {:.1} us (median of 3)", ag.threads, median(&mut spans));
    }

    for carve in [None, Some(100)] {
        if let Some(c) = carve {
            for ag in &aggs {
                set_attr(ag.f, A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, c, "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)");
            }
        }
        for v in &victims {
            let (vdesc, _, _) = describe(v.f, v.threads, v.smem);
            for ag in &aggs {
                let (adesc, _, _) = describe(ag.f, ag.threads, 0);
                for (prio, stream) in [("priority 0", g.agg), ("priority greatest", high)] {
                    let aname = format!(
                        "tide_sum {} thr, {prio}, carveout {}",
                        ag.threads,
                        carve.map_or("default".to_string(), |c| c.to_string())
                    );
                    let mut runs = Vec::new();
                    for _ in 0..samples.max(1) {
                        clear();
                        cores_victim_launch(v.f, g.sms, v.threads, v.smem, g.vic.get(), vtrace, CORES_VICTIM_NS);
                        let t = Instant::now();
                        while t.elapsed() < Duration::from_micros(CORES_GAP_US) {
                            std::hint::spin_loop();
                        }
                        agg_launch(ag, stream, atrace);
                        sync_all();
                        if let Some(c) = cores_of(&read_trace(vtrace, g.sms as usize), &read_trace(atrace, CORES_AGG_CTAS as usize)) {
                            runs.push(c);
                        }
                    }
                    if runs.is_empty() {
                        println!("coresidence: {} | {aname} | no trace recorded", v.name);
                        continue;
                    }
                    let range = |f: &dyn Fn(&Cores) -> usize| {
                        let lo = runs.iter().map(f).min().unwrap_or(0);
                        let hi = runs.iter().map(f).max().unwrap_or(0);
                        if lo == hi { format!("{lo}") } else { format!("{lo}..{hi}") }
                    };
                    let med = |f: &dyn Fn(&Cores) -> f64| median(&mut runs.iter().map(f).collect::<Vec<f64>>());
                    let (beside, shared) = (range(&|c| c.beside), range(&|c| c.shared_sm));
                    let (vctas, vsms, actas) = (range(&|c| c.victim_ctas), range(&|c| c.victim_sms), range(&|c| c.aggressor_ctas));
                    let (first, last, spread) = (med(&|c| c.first_start_us), med(&|c| c.last_end_us), med(&|c| c.victim_spread_us));
                    println!(
                        "coresidence: {} | {aname} | victim: {vdesc} | aggressor: {adesc} | victim {vctas} CTAs on {vsms} SMs, start spread {spread:.1} us | \
                         aggressor CTAs started before the victim's end: {beside} of {actas}; on an SM beside a live victim CTA: {shared} | \
                         aggressor first start {first:+.1} us from the victim's start, last end {last:+.1} us from the victim's end | {} runs",
                        v.name,
                        runs.len()
                    );
                    let _ = write!(
                        json,
                        "{{\"name\":{:?},\"victim\":{:?},\"aggressor\":{aname:?},\"victim_resources\":{vdesc:?},\"aggressor_resources\":{adesc:?},\
                         \"beside\":[{}],\"shared_sm\":[{}],\"aggressor_ctas\":[{}],\"victim_sms\":[{}],\"first_start_us\":[{}],\"last_end_us\":[{}],\"victim_spread_us\":[{}]}},",
                        format!("coresidence {} | {aname}", v.name),
                        v.name,
                        runs.iter().map(|c| c.beside.to_string()).collect::<Vec<_>>().join(","),
                        runs.iter().map(|c| c.shared_sm.to_string()).collect::<Vec<_>>().join(","),
                        runs.iter().map(|c| c.aggressor_ctas.to_string()).collect::<Vec<_>>().join(","),
                        runs.iter().map(|c| c.victim_sms.to_string()).collect::<Vec<_>>().join(","),
                        runs.iter().map(|c| format!("{:.2}", c.first_start_us)).collect::<Vec<_>>().join(","),
                        runs.iter().map(|c| format!("{:.2}", c.last_end_us)).collect::<Vec<_>>().join(","),
                        runs.iter().map(|c| format!("{:.2}", c.victim_spread_us)).collect::<Vec<_>>().join(","),
                    );
                }
            }
        }
    }
    sync_all();
    ck!(sys::cuStreamDestroy_v2(high), "cuStreamDestroy");
    for p in [vtrace, atrace, a, b, d] {
        ck!(sys::cuMemFree_v2(p), "cuMemFree");
    }
}

// ----- cecheck mode (issue #38): which same-device data movement progresses beside a full-SM kernel -----
//
// `engine` and `progress` emulate a world of P on one GPU: the peers' buffers are buffers of GPU 0,
// so every "peer" copy of the emulated all-gather is a device-to-device copy within one device.
// Across GPUs those are NVLink copies that the copy engines run beside any kernel; within one
// device the driver may instead run a copy, a fill or a 2-D copy as a kernel of its own on the
// SMs, which a kernel holding every SM (cuDNN's flash attention; `fullsm_victim`) keeps waiting
// until it ends. Which of these calls progress beside that kernel decides what the emulated
// all-gather can show beside it: a call that waits for the SMs here may not wait on a real world.
// Each call is one `progress_row` against the full-SM victim (gated samples: the victim alone, the
// call alone, both): overlap >= 0.8 reads as copy-engine work, <= 0.2 as work that waited for the
// SMs (the driver's kernel), between as partial. The pinned host copies are the control (copy
// engines by construction). The upcast row asks whether the copy engines can do a bf16 -> fp32
// upcast (2-byte rows into the high halves of zeroed fp32 slots), checked bitwise first.
// Measured on one H100 (bench/results/2026-12-06c-1h100/callA/cecheck.txt): every row on copy
// engines (overlap 0.99-1.00), the upcast exact but at 6.3 GB/s. So what held the emulated
// all-gather beside this kernel was tide's own SM launch (its fused small copies: TIDE_FUSE_CE_MIN).

/// The upcast row's bf16 elements (fp32 slots).
const UPCAST_N: usize = 16 << 20;
/// The strided 2-D row: rows of 3.5 KiB (a dim-1 slice's row) landing 8 rows' pitch apart (as
/// tide's dim-1 gather lands a peer's slice), 64 MiB in all.
const ROW2D: usize = 3584;
const ROW2D_ROWS: usize = (64usize << 20).div_ceil(ROW2D);
/// The host copies' bytes (pinned host memory).
const HOST_BYTES: usize = 64 << 20;

/// Where a call ran, from its overlap with the full-SM victim.
fn ce_verdict(overlap: f64) -> &'static str {
    match overlap {
        o if o >= 0.8 => "copy engine",
        o if o <= 0.2 => "SM (blocked)",
        o if o.is_nan() => "no result",
        _ => "partial",
    }
}

/// cecheck's buffers, allocated once: a 256 MiB source and destination (the copies, the fill, the
/// peer copies, the host copies' device ends), the strided 2-D copy's destination (8 x its 64
/// MiB), 64 MiB of pinned host memory, the upcast's bf16 source and fp32 destination, and the
/// context (both ends of the peer copies).
struct CeBufs {
    src: u64,
    dst: u64,
    dst2d: u64,
    host: *mut c_void,
    up_src: u64,
    up_dst: u64,
    ctx: sys::CUcontext,
    /// Rows per 2-D copy of the upcast (UPCAST_N unless the driver refused that height).
    up_rows: usize,
}

/// bf16 -> fp32 on the copy engines: zero the `n` fp32 slots at `dst`, then 2-D copies of at most
/// `rows` rows: row i is bf16 i (2 bytes, source pitch 2) landing at byte 2 of fp32 slot i
/// (destination pitch 4; dstXInBytes 2, passed as the address dst + 2 to tide's
/// memcpy_2d_async), the high half of a little-endian fp32: exactly that bf16's fp32 value. Stops
/// at the first 2-D copy the driver refuses.
fn upcast_2d(dst: u64, src: u64, n: usize, rows: usize, stream: sys::CUstream) -> tide::Result<()> {
    ck!(sys::cuMemsetD32Async(dst, 0, n, stream), "cuMemsetD32Async");
    for r0 in (0..n).step_by(rows) {
        let h = rows.min(n - r0);
        // SAFETY: rows r0..r0 + h of both ends lie inside their allocations (n slots, n bf16),
        // which live as long as the benchmark; source and destination are distinct buffers.
        unsafe {
            tide::cuda::driver::memcpy_2d_async(dst + 4 * r0 as u64 + 2, 4, src + 2 * r0 as u64, 2, 2, h, stream, || {
                format!("upcast rows {r0}..{}", r0 + h)
            })
        }?;
    }
    Ok(())
}

/// The upcast once, outside timing, on fresh random bf16 bits into a poisoned destination: each
/// fp32 slot against its bf16's bits << 16 (PASS, or how many differ); then its rate alone. Finds
/// the rows per 2-D copy the driver takes (halving from UPCAST_N while it refuses, and says so)
/// and returns them.
fn upcast_check(g: &Gpu, dst: u64, src: u64, json: &mut String) -> usize {
    // Every 16-bit pattern may come (the check compares bits), each element its own: fill_bf16's
    // values repeat every 4 Mi elements, which would hide a piece of a split copy landing off.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let host: Vec<u16> = (0..UPCAST_N)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u16
        })
        .collect();
    ck!(sys::cuMemcpyHtoD_v2(src, host.as_ptr() as *const c_void, UPCAST_N * 2), "cuMemcpyHtoD");
    ck!(sys::cuMemsetD8_v2(dst, 0xff, UPCAST_N * 4), "cuMemsetD8");
    // Both above are on the legacy stream, which the non-blocking g.agg does not wait for.
    sync_all();
    let mut rows = UPCAST_N;
    while let Err(e) = upcast_2d(dst, src, UPCAST_N, rows, g.agg) {
        assert!(rows > 1, "cecheck: upcast2d: the driver refuses even one-row 2-D copies: {e}");
        println!("cecheck: upcast2d: the driver refused Height {rows} ({e}); trying {}", rows.div_ceil(2));
        rows = rows.div_ceil(2);
    }
    sync_all();
    let mut got = vec![0u32; UPCAST_N];
    ck!(sys::cuMemcpyDtoH_v2(got.as_mut_ptr() as *mut c_void, dst, UPCAST_N * 4), "cuMemcpyDtoH");
    let bad = got.iter().zip(&host).filter(|&(&f, &h)| f != (h as u32) << 16).count();
    let copies = UPCAST_N.div_ceil(rows);
    let a = Aggressor::plain(
        "upcast2d".into(),
        (UPCAST_N * 4) as f64,
        Box::new(move |s, _| upcast_2d(dst, src, UPCAST_N, rows, s).unwrap_or_else(|e| panic!("{e}"))),
    );
    let (ms, host_ms) = aggressor_alone(g, &a, 5);
    let gbps = a.bytes / ms / 1e6;
    println!(
        "cecheck: upcast2d 16 Mi bf16 -> fp32 (cuMemsetD32Async + {}): {} ({bad} of {UPCAST_N} slots differ from bf16 << 16); \
         alone {ms:.3} ms, {gbps:.1} GB/s of fp32 written (host {host_ms:.3} ms)",
        if copies > 1 {
            format!("{copies} 2-D copies of {rows} rows: split, the driver refused Height {UPCAST_N}")
        } else {
            format!("one 2-D copy of Height {UPCAST_N}")
        },
        if bad == 0 { "PASS" } else { "FAIL" },
    );
    let _ = write!(
        json,
        "{{\"name\":\"cecheck upcast2d verify\",\"mismatches\":{bad},\"elements\":{UPCAST_N},\"rows_per_copy\":{rows},\
         \"copies\":{copies},\"alone_ms\":{},\"gbps\":{}}},",
        json_num(ms),
        json_num(gbps)
    );
    rows
}

/// The calls cecheck measures, each enqueueing on the given stream with no host sync; `bytes`:
/// the bytes one call writes (for the host copies, those it moves over PCIe).
fn ce_aggressors(b: &CeBufs) -> Vec<Aggressor<'_>> {
    const PIECE: usize = 32 << 20;
    let mut aggs = Vec::new();
    for (count, mib) in [(8usize, 32usize), (1, 256), (64, 4)] {
        let bytes = mib << 20;
        aggs.push(Aggressor::plain(
            format!("memcpy {count}x{mib}MiB"),
            (count * bytes) as f64,
            Box::new(move |s, _| {
                for off in (0..count * bytes).step_by(bytes).map(|o| o as u64) {
                    ck!(sys::cuMemcpyDtoDAsync_v2(b.dst + off, b.src + off, bytes, s), "cuMemcpyDtoDAsync");
                }
            }),
        ));
    }
    if tide::cuda::driver::batch_copy_supported() {
        aggs.push(Aggressor::plain(
            "batch 8x32MiB".into(),
            COPY_BYTES as f64,
            Box::new(move |s, _| batch_copy(b.dst, b.src, COPY_BYTES, COPY_BYTES / PIECE, true, s)),
        ));
    } else {
        println!("cecheck: batch 8x32MiB skipped: the driver has no cuMemcpyBatchAsync_v2 (CUDA 12.8+ drivers)");
    }
    aggs.push(Aggressor::plain(
        "memcpy2d 3.5KiB rows".into(),
        (ROW2D * ROW2D_ROWS) as f64,
        Box::new(move |s, _| {
            // SAFETY: ROW2D_ROWS rows of ROW2D bytes lie inside src (256 MiB) at pitch ROW2D and
            // inside dst2d at pitch 8 x ROW2D; the buffers live as long as the benchmark.
            unsafe {
                tide::cuda::driver::memcpy_2d_async(b.dst2d, 8 * ROW2D, b.src, ROW2D, ROW2D, ROW2D_ROWS, s, || "memcpy2d".into())
            }
            .unwrap_or_else(|e| panic!("{e}"));
        }),
    ));
    aggs.push(Aggressor::plain(
        "memset 256MiB".into(),
        COPY_BYTES as f64,
        Box::new(move |s, _| {
            ck!(sys::cuMemsetD32Async(b.dst, 0, COPY_BYTES / 4, s), "cuMemsetD32Async");
        }),
    ));
    aggs.push(Aggressor::plain(
        "d2h pinned 64MiB".into(),
        HOST_BYTES as f64,
        Box::new(move |s, _| {
            ck!(sys::cuMemcpyDtoHAsync_v2(b.host, b.src, HOST_BYTES, s), "cuMemcpyDtoHAsync");
        }),
    ));
    aggs.push(Aggressor::plain(
        "h2d pinned 64MiB".into(),
        HOST_BYTES as f64,
        Box::new(move |s, _| {
            ck!(sys::cuMemcpyHtoDAsync_v2(b.dst, b.host, HOST_BYTES, s), "cuMemcpyHtoDAsync");
        }),
    ));
    aggs.push(Aggressor::plain(
        "upcast2d 16Mi bf16".into(),
        (UPCAST_N * 4) as f64,
        Box::new(move |s, _| upcast_2d(b.up_dst, b.up_src, UPCAST_N, b.up_rows, s).unwrap_or_else(|e| panic!("{e}"))),
    ));
    aggs.push(Aggressor::plain(
        "peer same-ctx 8x32MiB".into(),
        COPY_BYTES as f64,
        Box::new(move |s, _| {
            for off in (0..COPY_BYTES).step_by(PIECE).map(|o| o as u64) {
                ck!(sys::cuMemcpyPeerAsync(b.dst + off, b.ctx, b.src + off, b.ctx, PIECE, s), "cuMemcpyPeerAsync");
            }
        }),
    ));
    aggs
}

/// `cecheck`: each same-device copy, fill and 2-D copy (and the pinned host copies, the control)
/// against the persistent full-SM victim, as `progress` measures a call: the victim alone, the
/// call alone, both; overlap, and where the call ran (copy engine, SM (blocked), partial).
fn cecheck(g: &Gpu, samples: usize, json: &mut String) {
    let ratio = progress_ratio();
    let run_row = row_filter();
    let (victim, _) = fullsm_victim(g);
    println!(
        "cecheck: same-device copies, fills and 2-D copies beside {} ({} CTAs, one per SM, each with the SM's whole shared \
         memory, 1 ms per launch); its burst sized to >= {ratio}x the call alone (TIDE_BENCH_PROGRESS_RATIO); medians of \
         {samples} interleaved samples; overlap >= 0.8: copy engine, <= 0.2: SM (blocked), else partial",
        victim.name, g.sms
    );
    let mut ctx = std::ptr::null_mut();
    ck!(sys::cuCtxGetCurrent(&mut ctx), "cuCtxGetCurrent");
    let mut host = std::ptr::null_mut();
    ck!(sys::cuMemHostAlloc(&mut host, HOST_BYTES, 0), "cuMemHostAlloc");
    let (up_src, up_dst) = (malloc(UPCAST_N * 2), malloc(UPCAST_N * 4));
    let up_rows = upcast_check(g, up_dst, up_src, json);
    let b = CeBufs {
        src: malloc(COPY_BYTES),
        dst: malloc(COPY_BYTES),
        dst2d: malloc(8 * ROW2D * ROW2D_ROWS),
        host,
        up_src,
        up_dst,
        ctx,
        up_rows,
    };
    fill_bf16(b.src, COPY_BYTES / 2, 53);
    let mut sampler = Sampler::new();
    for a in ce_aggressors(&b).iter().filter(|a| run_row(&a.name)) {
        // Each call's gate grows from 1 ms with its own enqueue time.
        sampler.gate_ns = 1_000_000;
        let late_before = sampler.late;
        let (p, reps) = progress_row(g, &mut sampler, &victim, a, samples, ratio);
        let late = sampler.late - late_before;
        let gbps = a.bytes / p.coll_ms / 1e6;
        let verdict = ce_verdict(p.overlap());
        println!(
            "cecheck: {:22} | victim {:8.3} ms, coll {:7.3} ms, both {:8.3} ms, overlap {:5.2}, coll in both {:7.3} ms ({:+.1}%), \
             victim in both ({:+.1}%) -> {verdict} (alone {gbps:.1} GB/s written; x{reps}, n={samples}{})",
            a.name,
            p.victim_ms,
            p.coll_ms,
            p.both_ms,
            p.overlap(),
            p.coll_in_both_ms,
            p.coll_slowdown_pct(),
            p.victim_slowdown_pct(),
            if late > 0 { format!(", {late} late retried") } else { String::new() },
        );
        let _ = write!(
            json,
            "{{\"name\":{:?},\"cecheck\":{:?},\"victim\":{:?},\"reps\":{reps},\"bytes\":{},\"gbps\":{},\
             \"victim_ms\":{},\"coll_ms\":{},\"both_ms\":{},\"overlap\":{},\"victim_in_both_ms\":{},\"victim_slowdown_pct\":{},\
             \"coll_in_both_ms\":{},\"coll_slowdown_pct\":{},\"verdict\":{verdict:?},\"samples\":{samples},\"late\":{late}}},",
            format!("cecheck {}", a.name),
            a.name,
            victim.name,
            a.bytes,
            json_num(gbps),
            json_num(p.victim_ms),
            json_num(p.coll_ms),
            json_num(p.both_ms),
            json_num(p.overlap()),
            json_num(p.victim_in_both_ms),
            json_num(p.victim_slowdown_pct()),
            json_num(p.coll_in_both_ms),
            json_num(p.coll_slowdown_pct())
        );
    }
}


fn batch_copy(dst: u64, src: u64, bytes: usize, pieces: usize, flag: bool, stream: sys::CUstream) {
    let piece = bytes / pieces;
    let mut dsts: Vec<u64> = (0..pieces).map(|i| dst + (i * piece) as u64).collect();
    let mut srcs: Vec<u64> = (0..pieces).map(|i| src + (i * piece) as u64).collect();
    let mut sizes: Vec<usize> = (0..pieces).map(|i| if i + 1 == pieces { bytes - i * piece } else { piece }).collect();
    let loc = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: 0,
    };
    let mut attrs = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: loc,
        dstLocHint: loc,
        flags: if flag {
            sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32
        } else {
            0
        },
    }];
    let mut idx = [0usize];
    ck!(
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            pieces,
            attrs.as_mut_ptr(),
            idx.as_mut_ptr(),
            1,
            stream
        ),
        "cuMemcpyBatchAsync"
    );
}

fn victims(g: &Gpu) -> Vec<Victim<'_>> {
    let mut v: Vec<Victim> = Vec::new();
    if let Some(cb) = &g.cublas {
        for (name, m, n, k, count) in [("gemm_1wave", 2048, 2048, 16384, 10), ("gemm_manywave", 8192, 8192, 8192, 3)] {
            let a = malloc(m * k * 2);
            let b = malloc(k * n * 2);
            let c = malloc(m * n * 2);
            fill_bf16(a, m * k, 3);
            fill_bf16(b, k * n, 5);
            v.push(Victim {
                name,
                unit: Box::new(move |s| cb.gemm(s, m as i32, n as i32, k as i32, a, b, c)),
                count,
            });
        }
    }
    let elems = 256usize << 20;
    let x = malloc(elems * 4);
    let y = malloc(elems * 4);
    ck!(sys::cuMemsetD32_v2(x, 0x3f800000, elems), "cuMemsetD32");
    let f = func(g, "probe_scale");
    let sms = g.sms;
    v.push(Victim {
        name: "elementwise_1GiB",
        unit: Box::new(move |s| {
            let (mut yy, mut xx, mut n) = (y, x, (elems / 4) as u64);
            let mut p = [
                &mut yy as *mut u64 as *mut c_void,
                &mut xx as *mut u64 as *mut c_void,
                &mut n as *mut u64 as *mut c_void,
            ];
            launch(f, sms * 8, 256, 0, s, &mut p, false);
        }),
        count: 4,
    });
    v
}

fn print_row(name: &str, r: &Row, json: &mut String) {
    let mut line = format!("{name:70} alone {:.3} ms (host {:.3})", r.alone_ms, r.host_ms);
    if r.gbps > 0.0 {
        let _ = write!(line, ", {:.0} GB/s", r.gbps);
    }
    if let (Some(sm), Some(most), Some(ctas)) = (r.sm_ms, r.max_resident, r.launches) {
        let _ = write!(line, "; {sm:.3} SM-ms/call, {ctas} CTAs, at most {most} alive at once");
    }
    if let Some(b) = r.sm_bound {
        let _ = write!(line, "; <= {b:.3} SM-ms/call");
    }
    for (v, al, du, pct, n) in &r.victims {
        let _ = write!(line, " | {v} {al:.3} -> {du:.3} ms {pct:+.1}% (n={n})");
    }
    if let Some(d) = r.displaced {
        let _ = write!(line, " | displaced {d:.0}");
    }
    println!("{line}");
    let _ = write!(
        json,
        "{{\"name\":{name:?},\"alone_ms\":{:.5},\"host_ms\":{:.5},\"gbps\":{:.1},\"sm_ms\":{},\"max_resident\":{},\"ctas\":{},\"displaced\":{},\"sm_bound_ms\":{},\"victims\":[{}]}},",
        r.alone_ms,
        r.host_ms,
        r.gbps,
        r.sm_ms.map(|x| format!("{x:.5}")).unwrap_or("null".into()),
        r.max_resident.map(|x| x.to_string()).unwrap_or("null".into()),
        r.launches.map(|x| x.to_string()).unwrap_or("null".into()),
        r.displaced.map(|x| format!("{x}")).unwrap_or("null".into()),
        r.sm_bound.map(|x| format!("{x:.5}")).unwrap_or("null".into()),
        r.victims
            .iter()
            .map(|(v, al, du, pct, n)| format!("{{\"victim\":{v:?},\"alone_ms\":{al:.5},\"during_ms\":{du:.5},\"slowdown_pct\":{pct:.3},\"n\":{n}}}"))
            .collect::<Vec<_>>()
            .join(",")
    );
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "explore".into());
    if mode == "compile" {
        // No GPU needed: the probe kernels compile for sm_90 (CI, with the NVRTC wheel).
        let source = format!("{}\n{}", tide::cuda::kernels::SOURCE, KERNELS);
        let (cubin, log) = tide::cuda::nvrtc::compile_with(
            &source,
            "interference_kernels.cu",
            "sm_90",
            tide::cuda::nvrtc::Output::Cubin,
            &["--ptxas-options=-v"],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        println!("{log}");
        println!("interference kernels compiled for sm_90: {} bytes", cubin.len());
        return;
    }
    let samples: usize = std::env::var("TIDE_BENCH_SAMPLES").ok().and_then(|v| v.parse().ok()).unwrap_or(9);
    let t0 = Instant::now();
    let Some(g) = setup() else { return };
    let mut json = format!("{{\"device\":{:?},\"sms\":{},\"mode\":{mode:?},\"rows\":[", g.name, g.sms);
    match mode.as_str() {
        "explore" => explore(&g, samples, &mut json),
        "engine" => engine(&g, samples, &mut json),
        "sumphase" => sumphase(&g, samples, &mut json),
        "green" => green(&g, samples, &mut json),
        "progress" => progress(&g, samples, &mut json),
        "coresidence" => coresidence(&g, samples, &mut json),
        "cecheck" => cecheck(&g, samples, &mut json),
        other => panic!("unknown mode {other:?} (explore, engine, sumphase, green, progress, coresidence, cecheck, compile)"),
    }
    if json.ends_with(',') {
        json.pop();
    }
    json.push_str("]}");
    if let Ok(path) = std::env::var("TIDE_BENCH_OUT") {
        std::fs::write(&path, &json).unwrap_or_else(|e| panic!("{path}: {e}"));
        println!("wrote {path}");
    }
    println!("interference {mode}: done in {:.1} s", t0.elapsed().as_secs_f64());
}

#[cfg(test)]
mod tests {
    //! The pure arithmetic of `progress` (cargo test --release --example interference; no GPU).
    use super::*;

    #[test]
    fn coresidence_counts_ctas_beside_the_victim_and_on_its_sms() {
        // Victim CTAs on SMs 0 and 1 from t = 100 to 2100 ns (SM 1's starts at 150).
        let victim = [(0, 100, 2100), (1, 150, 2100)];
        // On SM 0 during the victim; on SM 5 during it; on SM 1 after it ended.
        let agg = [(0, 500, 900), (5, 600, 1000), (1, 2200, 2500)];
        let c = cores_of(&victim, &agg).unwrap();
        assert_eq!((c.victim_ctas, c.victim_sms, c.aggressor_ctas, c.beside, c.shared_sm), (2, 2, 3, 2, 1));
        assert!((c.first_start_us - 0.4).abs() < 1e-9 && (c.last_end_us - 0.4).abs() < 1e-9);
        assert!((c.victim_spread_us - 0.05).abs() < 1e-9);
        // Starting as the victim's CTA ends on that SM is not beside it.
        let c = cores_of(&victim, &[(0, 2100, 2300)]).unwrap();
        assert_eq!((c.beside, c.shared_sm), (0, 0));
        assert!(cores_of(&victim, &[]).is_none() && cores_of(&[], &agg).is_none());
    }

    #[test]
    fn registers_are_allocated_per_warp_in_units_of_eight_per_thread() {
        assert_eq!(regs_allocated(154, 256), 40_960); // XLA's Triton GEMM on H100
        assert_eq!(regs_allocated(156, 256), 40_960);
        assert_eq!(regs_allocated(64, 256), 16_384);
        assert_eq!(regs_allocated(14, 256), 4_096);
    }

    #[test]
    fn bursts_reach_the_ratio_with_the_fewest_repetitions() {
        // 0.38 ms GEMMs against a 2.1 ms reduce-scatter: 1.25 x 2.1 / 0.38 = 6.9 -> 7 (2.66 ms).
        assert_eq!(burst_reps(0.38, 2.1, 1.25), 7);
        assert!(7.0 * 0.38 >= 1.25 * 2.1 && 6.0 * 0.38 < 1.25 * 2.1);
        // A repetition longer than the target: one.
        assert_eq!(burst_reps(5.0, 1.0, 1.25), 1);
        // An exact multiple is not rounded up past it.
        assert_eq!(burst_reps(0.5, 2.0, 1.25), 5);
        // Nonsense timings (a failed pilot: NaN, zero) give one repetition, never a huge burst.
        assert_eq!(burst_reps(f64::NAN, 2.0, 1.25), 1);
        assert_eq!(burst_reps(0.0, 2.0, 1.25), 1);
        assert_eq!(burst_reps(0.1, f64::NAN, 1.25), 1);
        assert_eq!(burst_reps(1e-9, 1e3, 1.25), 100_000);
    }

    #[test]
    fn the_gate_covers_twice_the_enqueue_time_within_bounds() {
        assert_eq!(gate_ns(0.0), 1_000_000);
        assert_eq!(gate_ns(0.2), 1_000_000);
        assert_eq!(gate_ns(2.0), 4_500_000);
        assert_eq!(gate_ns(1e6), 500_000_000);
    }

    #[test]
    fn overlap_added_latency_and_slowdowns_follow_the_issue() {
        // Issue #38's many-wave attention row: 13.03 ms compute, 5.66 ms reduce-scatter, 18.17 ms
        // both: overlap (13.03 + 5.66 - 18.17) / 5.66 = 0.09.
        let p = Progress { victim_ms: 13.03, coll_ms: 5.66, both_ms: 18.17, victim_in_both_ms: 13.5, coll_in_both_ms: 18.17 };
        assert!((p.overlap() - 0.0919).abs() < 1e-3, "{}", p.overlap());
        assert!((p.added_ms() - 5.14).abs() < 1e-9);
        assert!((p.victim_slowdown_pct() - 100.0 * (13.5 / 13.03 - 1.0)).abs() < 1e-9);
        assert!((p.coll_slowdown_pct() - 100.0 * (18.17 / 5.66 - 1.0)).abs() < 1e-9);
        // Fully hidden: both = the longer one.
        let hidden = Progress { victim_ms: 3.0, coll_ms: 2.0, both_ms: 3.0, victim_in_both_ms: 3.0, coll_in_both_ms: 2.9 };
        assert_eq!(hidden.overlap(), 1.0);
        assert_eq!(hidden.added_ms(), 0.0);
        // Serialized: both = the sum.
        let serial = Progress { victim_ms: 3.0, coll_ms: 2.0, both_ms: 5.0, victim_in_both_ms: 3.0, coll_in_both_ms: 5.0 };
        assert_eq!(serial.overlap(), 0.0);
    }

    #[test]
    fn each_column_is_its_own_median() {
        let rows = [[1.0, 10.0, 12.0, 1.5, 12.0], [3.0, 30.0, 31.0, 3.5, 31.0], [2.0, 20.0, 22.0, 2.5, 22.0]];
        let p = Progress::of(&rows);
        assert_eq!(p, Progress { victim_ms: 2.0, coll_ms: 20.0, both_ms: 22.0, victim_in_both_ms: 2.5, coll_in_both_ms: 22.0 });
        // An even count: the mean of the middle two.
        let p = Progress::of(&rows[..2]);
        assert_eq!(p.victim_ms, 2.0);
        assert_eq!(p.both_ms, 21.5);
    }

    #[test]
    fn the_verdict_follows_the_overlap() {
        assert_eq!(ce_verdict(1.0), "copy engine");
        assert_eq!(ce_verdict(0.8), "copy engine");
        assert_eq!(ce_verdict(0.5), "partial");
        assert_eq!(ce_verdict(0.2), "SM (blocked)");
        assert_eq!(ce_verdict(-0.1), "SM (blocked)");
        assert_eq!(ce_verdict(f64::NAN), "no result");
        // The strided row's rows add up to (at least) 64 MiB.
        assert!(ROW2D * ROW2D_ROWS >= 64 << 20 && ROW2D * (ROW2D_ROWS - 1) < 64 << 20);
    }

    #[test]
    fn call_names_match_the_engine_rows() {
        assert_eq!(call_name(Op::ReduceScatter, 1, "default"), "RS world 1: default");
        assert_eq!(call_name(Op::AllGather, 8, "default"), "AG world 8 (emulated): default");
    }
}
