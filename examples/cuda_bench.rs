//! Engine-level benchmark of the CUDA engine on the GPUs of one process, without JAX: picks the
//! defaults (TIDE_AG_STREAMS, TIDE_LOCAL_COPY, TIDE_COPY_BATCH, TIDE_RS_*) and shows where time goes.
//!
//! For the two Llama-like groups of shared/reference/gpu-facts.md (9 bf16 params q, k, v, o, gate,
//! up, down, norm1, norm2 scaled by h, dim-0 sharded; h = 1664 and 3328, the shapes of
//! baselines/jax_probe.py) on 2 GPUs, one host thread per GPU calling `tide::cuda::execute` on its
//! own stream as XLA does:
//!   (a) floor: the bytes each GPU must receive from its peer (one shard), pure peer copies
//!       (cuMemcpyAsync on 1 and 4 streams, and one copy per parameter), both GPUs at once;
//!   (b) tide all-gather: TIDE_AG_STREAMS x TIDE_LOCAL_COPY x TIDE_COPY_BATCH;
//!   (c) tide reduce-scatter (bf16 in, fp32 out): rs_max_ctas x slot bytes x stage slots x RS copy
//!       streams; and the reduction kernel alone (2 local bf16 sources -> fp32, no copies) per CTA count;
//!   (d) the all-gather's local-shard copy: copy engine vs the tide_copy SM kernel;
//!   then one bitwise check against the CPU engine (fresh random data) of the fastest all-gather and
//!   the fastest reduce-scatter variant of each group.
//!
//! Timing: each device's stream is gated on a host flag (cuStreamWaitValue32), all reps are enqueued,
//! then the gate opens: so the numbers are device time, not host issue time. CUDA events on each
//! device's stream between reps; per rep the slower device counts; median, p10, p90 of >= 20 reps
//! after warm-up. Host time per `execute` call is reported separately.
//!
//! Output: markdown tables on stdout; JSON at $TIDE_BENCH_OUT (if set). Env: TIDE_BENCH_REPS
//! (default 25), TIDE_BENCH_QUICK=1 (small sweep), TIDE_BENCH_TIMEOUT_S (default 220: exits 3).
//! Prints SKIPPED without a CUDA driver or GPU.
//!
//! TIDE_BENCH_RSKERNEL=1: only the fp32 reduction: a bitwise check of the rs_sum kernels against a
//! sequential host sum (1-8 sources, bf16/f32, accumulate, tails, unaligned sources), kernel-alone
//! rows (16/64/132 CTAs), full reduce-scatter rows at 16 and 64 CTAs, and the CPU-engine bitwise
//! check of those reduce-scatters (< 60 s).
//!
//! Build here: cargo build --release --example cuda_bench  -> target/release/examples/cuda_bench
//! Run on the GPU machine: TIDE_BENCH_OUT=$OUT/cuda_bench.json <binary>

#![allow(clippy::needless_range_loop)] // ranks index several tables at once

use cudarc::driver::sys;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};
use tide::call::{BufferView, CallInfo};
use tide::config::{Config, LocalCopy};
use tide::cuda::driver::check;
use tide::cuda::kernels;
use tide::engine::cpu::run_threads;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Op, RsOptions};
use tide::topology::Topology;

const MIB: usize = 1 << 20;

macro_rules! ck {
    ($e:expr, $name:expr) => {
        check(unsafe { $e }, $name, String::new).unwrap_or_else(|e| panic!("{e}"))
    };
}

fn layer_specs(h: usize) -> Vec<ParamSpec> {
    let f = h * 7 / 2;
    let b = DType::BF16;
    vec![
        ParamSpec::new("q", &[h, h], b),
        ParamSpec::new("k", &[h / 8, h], b),
        ParamSpec::new("v", &[h / 8, h], b),
        ParamSpec::new("o", &[h, h], b),
        ParamSpec::new("gate", &[f, h], b),
        ParamSpec::new("up", &[f, h], b),
        ParamSpec::new("down", &[h, f], b),
        ParamSpec::new("norm1", &[h], b),
        ParamSpec::new("norm2", &[h], b),
    ]
}

struct Dev {
    ord: i64,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    side: Vec<sys::CUstream>,
    fork: sys::CUevent,
    joins: Vec<sys::CUevent>,
    tev: Vec<sys::CUevent>,
    flag: *mut u32,
    flag_d: u64,
    sum_bf16: sys::CUfunction,
    copy_fn: sys::CUfunction,
    /// rs_sum_{bf16,f16,f32}_f32.
    sum_fns: [sys::CUfunction; 3],
}
// SAFETY: raw CUDA handles and a pinned host word, usable from any thread.
unsafe impl Send for Dev {}
unsafe impl Sync for Dev {}

fn set_ctx(d: &Dev) {
    ck!(sys::cuCtxSetCurrent(d.ctx), "cuCtxSetCurrent");
}

fn sync(d: &Dev) {
    set_ctx(d);
    ck!(sys::cuStreamSynchronize(d.stream), "cuStreamSynchronize");
}

fn alloc(d: &Dev, bytes: usize) -> u64 {
    set_ctx(d);
    let mut p = 0;
    ck!(sys::cuMemAlloc_v2(&mut p, bytes.max(1)), "cuMemAlloc");
    p
}

fn upload(d: &Dev, p: u64, data: &[u8]) {
    set_ctx(d);
    ck!(
        sys::cuMemcpyHtoD_v2(p, data.as_ptr() as *const _, data.len()),
        "cuMemcpyHtoD"
    );
}

fn download(d: &Dev, p: u64, len: usize) -> Vec<u8> {
    set_ctx(d);
    let mut v = vec![0u8; len];
    ck!(
        sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut _, p, len),
        "cuMemcpyDtoH"
    );
    v
}

/// Random finite bf16 values (|x| in [2^-7, 2^8)), never zeros.
fn fill_bf16(bytes: &mut [u8], mut x: u64) {
    x |= 1;
    for c in bytes.chunks_mut(2) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let r = (x >> 20) as u32;
        let sign = (r & 1) << 15;
        let exp = 120 + (r >> 1) % 15;
        let man = (r >> 5) & 0x7f;
        let h = (sign | (exp << 7) | man) as u16;
        c.copy_from_slice(&h.to_le_bytes());
    }
}

fn gpus() -> Option<Vec<Dev>> {
    if let Err(e) = tide::cuda::driver::init() {
        println!("SKIPPED cuda_bench: {e}");
        return None;
    }
    let mut count = 0;
    ck!(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount");
    if count == 0 {
        println!("SKIPPED cuda_bench: no CUDA device");
        return None;
    }
    let mut devs = Vec::new();
    for ord in 0..count.min(2) {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        ck!(sys::cuDeviceGet(&mut dev, ord), "cuDeviceGet");
        ck!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            "cuDevicePrimaryCtxRetain"
        );
        ck!(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        let mk_stream = || {
            let mut s = std::ptr::null_mut();
            ck!(
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                "cuStreamCreate"
            );
            s
        };
        let mk_event = |timing: bool| {
            let mut e = std::ptr::null_mut();
            let f = if timing {
                0
            } else {
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            };
            ck!(sys::cuEventCreate(&mut e, f), "cuEventCreate");
            e
        };
        let stream = mk_stream();
        let side = (0..4).map(|_| mk_stream()).collect();
        let fork = mk_event(false);
        let joins = (0..4).map(|_| mk_event(false)).collect();
        let tev = (0..257).map(|_| mk_event(true)).collect();
        let mut hp: *mut std::ffi::c_void = std::ptr::null_mut();
        ck!(
            sys::cuMemHostAlloc(&mut hp, 64, 0x01 | 0x02),
            "cuMemHostAlloc"
        ); // PORTABLE | DEVICEMAP
        let flag = hp as *mut u32;
        // SAFETY: 64 bytes of pinned host memory.
        unsafe { std::ptr::write_volatile(flag, 0) };
        let mut flag_d = 0;
        ck!(
            sys::cuMemHostGetDevicePointer_v2(&mut flag_d, hp, 0),
            "cuMemHostGetDevicePointer"
        );
        // The engine's kernels (NVRTC), through its own device state.
        let (sum_bf16, copy_fn, sum_fns) = {
            let st = tide::cuda::device::get(ord as i64).unwrap_or_else(|e| panic!("{e}"));
            let mut st = st.lock().unwrap();
            let m = st.ensure_module().unwrap_or_else(|e| panic!("{e}"));
            (m.sum_bf16, m.copy, [m.sum_bf16, m.sum_f16, m.sum_f32])
        };
        ck!(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        devs.push(Dev {
            ord: ord as i64,
            ctx,
            stream,
            side,
            fork,
            joins,
            tev,
            flag,
            flag_d,
            sum_bf16,
            copy_fn,
            sum_fns,
        });
    }
    // Peer access both ways (the engine enables it too; "already enabled" is fine).
    for a in &devs {
        for b in &devs {
            if a.ord != b.ord {
                set_ctx(a);
                let r = unsafe { sys::cuCtxEnablePeerAccess(b.ctx, 0) };
                if r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                    check(r, "cuCtxEnablePeerAccess", String::new).unwrap();
                }
            }
        }
    }
    Some(devs)
}

#[derive(Debug, Clone)]
struct Stat {
    median: f64,
    p10: f64,
    p90: f64,
    per_dev_median: Vec<f64>,
    host_us: f64,
}

fn pct(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((s.len() - 1) as f64 * q).round() as usize;
    s[i]
}

/// Gate generations; 1 is the start-up self-test's.
static GEN: AtomicU32 = AtomicU32::new(1);
/// False when the start-up self-test found that a stream does not see the host flag (then reps
/// run ungated and the numbers may include host issue gaps; the output says so).
static GATE_OK: AtomicBool = AtomicBool::new(true);
/// Commands a gated stream may hold before the gate opens (launch queues are finite: a full queue
/// would block the issuing host thread while the gate blocks the device).
const GATE_CMDS: usize = 384;

/// Checks once that a stream waiting on a device's host flag is released by a host write.
fn gate_selftest(devs: &[Dev]) {
    for d in devs {
        set_ctx(d);
        let mut s = std::ptr::null_mut();
        ck!(
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            "cuStreamCreate"
        );
        ck!(
            sys::cuStreamWaitValue32_v2(
                s,
                d.flag_d,
                1,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32
            ),
            "cuStreamWaitValue32"
        );
        std::thread::sleep(Duration::from_millis(2));
        // SAFETY: pinned host word the device polls.
        unsafe { std::ptr::write_volatile(d.flag, 1) };
        let t = Instant::now();
        loop {
            let r = unsafe { sys::cuStreamQuery(s) };
            if r == sys::CUresult::CUDA_SUCCESS {
                break;
            }
            if r != sys::CUresult::CUDA_ERROR_NOT_READY {
                check(r, "cuStreamQuery", String::new).unwrap();
            }
            if t.elapsed() > Duration::from_secs(5) {
                println!(
                    "WARNING: device {}: a stream waiting on the host flag was not released in 5 s; \
                     timing ungated (numbers include host issue time)",
                    d.ord
                );
                GATE_OK.store(false, Ordering::SeqCst);
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Commands per call of a prepared tide site on device `ord` (after its first call).
fn sched_cmds(ord: i64, site: i64, op: Op) -> usize {
    let st = tide::cuda::device::get(ord).unwrap();
    let st = st.lock().unwrap();
    st.plans
        .find(site, op)
        .map(|p| {
            p.schedule
                .phases
                .iter()
                .map(|ph| ph.cmds.len())
                .sum::<usize>()
                + 4
        })
        .unwrap_or(64)
}

/// Runs `f(rank)` `warm` times, then `reps` times on devs[0..world] at once, one thread each, each
/// device's stream gated until both host threads have issued the first reps (as many as fit in
/// GATE_CMDS commands, `cmds()` per rep, evaluated after the warm-up): the device runs from a full
/// queue, so host issue time shows only where the host falls behind. Per rep: the slower device's
/// event interval.
fn measure(
    devs: &[Dev],
    world: usize,
    warm: usize,
    reps: usize,
    cmds: &(dyn Fn() -> usize + Sync),
    f: &(dyn Fn(usize) + Sync),
) -> Stat {
    assert!(reps < 256);
    let gen = GEN.fetch_add(1, Ordering::SeqCst) + 1;
    let gated = GATE_OK.load(Ordering::SeqCst);
    let barrier = Barrier::new(world);
    let results: Vec<(Vec<f64>, Vec<f64>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let d = &devs[r];
                let barrier = &barrier;
                s.spawn(move || {
                    set_ctx(d);
                    for _ in 0..warm {
                        f(r);
                    }
                    sync(d);
                    let open_after = (GATE_CMDS / cmds().max(1)).clamp(1, reps);
                    barrier.wait();
                    set_ctx(d);
                    if gated {
                        ck!(
                            sys::cuStreamWaitValue32_v2(
                                d.stream,
                                d.flag_d,
                                gen,
                                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32
                            ),
                            "cuStreamWaitValue32"
                        );
                    }
                    ck!(sys::cuEventRecord(d.tev[0], d.stream), "cuEventRecord");
                    let mut host = Vec::with_capacity(reps);
                    for k in 0..reps {
                        let t = Instant::now();
                        f(r);
                        host.push(t.elapsed().as_secs_f64() * 1e6);
                        set_ctx(d);
                        ck!(sys::cuEventRecord(d.tev[k + 1], d.stream), "cuEventRecord");
                        if k + 1 == open_after {
                            barrier.wait();
                            // SAFETY: pinned host word the device polls.
                            unsafe { std::ptr::write_volatile(d.flag, gen) };
                        }
                    }
                    sync(d);
                    let mut ms = Vec::with_capacity(reps);
                    for k in 0..reps {
                        let mut t = 0f32;
                        ck!(
                            sys::cuEventElapsedTime_v2(&mut t, d.tev[k], d.tev[k + 1]),
                            "cuEventElapsedTime"
                        );
                        ms.push(t as f64);
                    }
                    (ms, host)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let per_rep: Vec<f64> = (0..reps)
        .map(|k| results.iter().map(|(ms, _)| ms[k]).fold(0.0, f64::max))
        .collect();
    let host: Vec<f64> = (0..reps)
        .map(|k| results.iter().map(|(_, h)| h[k]).fold(0.0, f64::max))
        .collect();
    Stat {
        median: pct(&per_rep, 0.5),
        p10: pct(&per_rep, 0.1),
        p90: pct(&per_rep, 0.9),
        per_dev_median: results.iter().map(|(ms, _)| pct(ms, 0.5)).collect(),
        host_us: pct(&host, 0.5),
    }
}

/// One group's buffers on each device.
struct Bufs {
    layout: GroupLayout,
    /// Per rank, per param: AG input (bf16 shard), AG output (bf16 full), RS input (bf16 full),
    /// RS output (fp32 shard).
    ag_in: Vec<Vec<u64>>,
    ag_out: Vec<Vec<u64>>,
    rs_in: Vec<Vec<u64>>,
    rs_out: Vec<Vec<u64>>,
    /// Floor: a packed shard per rank (source) and a receive buffer.
    fl_src: Vec<u64>,
    fl_dst: Vec<u64>,
}

fn make_bufs(devs: &[Dev], world: usize, h: usize) -> Bufs {
    let layout = GroupLayout::new(&layer_specs(h), world).unwrap();
    let mut b = Bufs {
        layout,
        ag_in: vec![],
        ag_out: vec![],
        rs_in: vec![],
        rs_out: vec![],
        fl_src: vec![],
        fl_dst: vec![],
    };
    let mut host = Vec::new();
    for (r, d) in devs.iter().enumerate().take(world) {
        let (mut ai, mut ao, mut ri, mut ro) = (vec![], vec![], vec![], vec![]);
        for (i, p) in b.layout.params.iter().enumerate() {
            let full = p.full_bytes();
            let shard = p.shard_rows * p.row_bytes();
            host.resize(full, 0);
            fill_bf16(&mut host, 1 + (r as u64) * 1000 + i as u64 * 7 + h as u64);
            let x = alloc(d, shard);
            upload(d, x, &host[..shard]);
            ai.push(x);
            let x = alloc(d, full);
            upload(d, x, &host);
            ao.push(x);
            fill_bf16(&mut host, 77 + (r as u64) * 1000 + i as u64 * 7 + h as u64);
            let x = alloc(d, full);
            upload(d, x, &host);
            ri.push(x);
            let x = alloc(d, shard * 2);
            upload(d, x, &host[..shard]);
            upload(d, x + shard as u64, &host[..shard]);
            ro.push(x);
        }
        b.ag_in.push(ai);
        b.ag_out.push(ao);
        b.rs_in.push(ri);
        b.rs_out.push(ro);
        let sb = b.layout.shard_bytes;
        host.resize(sb, 0);
        fill_bf16(&mut host, 5 + r as u64);
        let x = alloc(d, sb);
        upload(d, x, &host);
        b.fl_src.push(x);
        b.fl_dst.push(alloc(d, sb));
    }
    b
}

fn call_of(devs: &[Dev], b: &Bufs, op: Op, site: i64, r: usize, world: usize) -> CallInfo {
    let d = &devs[r];
    let mut ins = vec![];
    let mut outs = vec![];
    for (i, p) in b.layout.params.iter().enumerate() {
        let full = p.shape.clone();
        let mut shard = vec![p.shard_rows];
        shard.extend(p.shape.iter().skip(1));
        match op {
            Op::AllGather => {
                ins.push(BufferView {
                    ptr: b.ag_in[r][i] as usize,
                    dtype: p.dtype,
                    dims: shard,
                });
                outs.push(BufferView {
                    ptr: b.ag_out[r][i] as usize,
                    dtype: p.dtype,
                    dims: full,
                });
            }
            Op::ReduceScatter => {
                ins.push(BufferView {
                    ptr: b.rs_in[r][i] as usize,
                    dtype: p.dtype,
                    dims: full,
                });
                outs.push(BufferView {
                    ptr: b.rs_out[r][i] as usize,
                    dtype: DType::F32,
                    dims: shard,
                });
            }
        }
    }
    CallInfo {
        op,
        site,
        run_id: 0,
        rank_devices: Default::default(),
        job: 0,
        device_ordinal: d.ord,
        rank: r,
        group: 0,
        world,
        topology: Topology::single_node(world),
        names: b.layout.params.iter().map(|p| p.name.clone()).collect(),
        inputs: ins,
        outputs: outs,
        stream: d.stream as usize,
        at: None,
        cast: None,
        urgent: false,
    }
}

fn base_config() -> Config {
    let mut c = Config::from_env();
    c.timeout_s = 60.0;
    c.multicast = false;
    c
}

#[derive(Default)]
struct Report {
    md: String,
    /// (section, group, variant, median ms, GB/s) of every row, for the summary.
    rows: Vec<(String, String, String, f64, f64)>,
}

/// JSON rows so far (also what the watchdog writes if the run overruns).
static JSON_ROWS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn write_json(path: &str, head: &str, checks: &str) {
    let rows = JSON_ROWS.lock().map(|r| r.join(",\n")).unwrap_or_default();
    let json = format!("{{{head}\"rows\":[\n{rows}\n],\"checks\":[{checks}]}}\n");
    if let Err(e) = std::fs::write(path, json) {
        println!("cannot write {path}: {e}");
    }
}

impl Report {
    fn row(&mut self, section: &str, group: &str, variant: &str, s: &Stat, bytes: usize) {
        let gbs = bytes as f64 / (s.median * 1e-3) / 1e9;
        println!(
            "row {section} {group} {variant}: median {:.3} ms (p10 {:.3}, p90 {:.3}), {gbs:.0} GB/s, host {:.0} us",
            s.median, s.p10, s.p90, s.host_us
        );
        self.rows.push((
            section.to_string(),
            group.to_string(),
            variant.to_string(),
            s.median,
            gbs,
        ));
        let _ = writeln!(
            self.md,
            "| {section} | {group} | {variant} | {:.3} | {:.3} | {:.3} | {:.0} | {} | {:.0} |",
            s.median,
            s.p10,
            s.p90,
            gbs,
            s.per_dev_median
                .iter()
                .map(|x| format!("{x:.3}"))
                .collect::<Vec<_>>()
                .join(" / "),
            s.host_us
        );
        JSON_ROWS.lock().unwrap().push(format!(
            "{{\"section\":\"{section}\",\"group\":\"{group}\",\"variant\":\"{variant}\",\"median_ms\":{:.5},\"p10_ms\":{:.5},\"p90_ms\":{:.5},\"gbps\":{:.1},\"per_dev_median_ms\":[{}],\"host_us\":{:.1},\"bytes\":{bytes}}}",
            s.median, s.p10, s.p90, gbs,
            s.per_dev_median.iter().map(|x| format!("{x:.5}")).collect::<Vec<_>>().join(","),
            s.host_us
        ));
    }
    fn header(&mut self, title: &str) {
        let _ = writeln!(
            self.md,
            "\n### {title}\n| section | group | variant | median ms | p10 | p90 | GB/s (per GPU recv or moved) | per-device median | host us/call |\n|---|---|---|---|---|---|---|---|---|"
        );
    }
}

fn launch(
    f: sys::CUfunction,
    grid: u32,
    stream: sys::CUstream,
    params: &mut [*mut std::ffi::c_void],
) {
    ck!(
        sys::cuLaunchKernel(
            f,
            grid,
            1,
            1,
            kernels::THREADS,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut()
        ),
        "cuLaunchKernel"
    );
}

/// One rs_sum launch (`f`, the kernel for the sources' dtype): dst = sum of srcs (or += when acc),
/// n elements, in the vectorized mode the engine would pick for these addresses.
fn sum_launch(
    f: sys::CUfunction,
    grid: u32,
    stream: sys::CUstream,
    dst: u64,
    srcs: &[u64],
    n: u64,
    acc: bool,
) {
    let mut ptrs = kernels::SrcPtrs {
        p: [0; kernels::MAX_SRCS],
    };
    ptrs.p[..srcs.len()].copy_from_slice(srcs);
    let mut d = dst;
    let mut nsrc = srcs.len() as i32;
    let mut n = n;
    let mut a = acc as i32;
    let mut vec = kernels::sum_mode(kernels::sum_vectorized(dst, srcs));
    let mut params: [*mut std::ffi::c_void; 6] = [
        &mut d as *mut u64 as *mut _,
        &mut ptrs as *mut kernels::SrcPtrs as *mut _,
        &mut nsrc as *mut i32 as *mut _,
        &mut n as *mut u64 as *mut _,
        &mut a as *mut i32 as *mut _,
        &mut vec as *mut i32 as *mut _,
    ];
    launch(f, grid, stream, &mut params);
}

/// The rs_sum kernels against a sequential host sum, bitwise, on device 0: bf16 and f32 sources, 1
/// to 8 sources, write and accumulate, sizes with quad or vector and scalar tails, 16-byte aligned
/// and unaligned sources (the scalar body), several grids. The host adds in the kernels' order,
/// `((dst or s0) + s1) + ...`, in fp32 (finite normal values only). Returns (cases, mismatches);
/// prints one line per mismatch.
fn sum_vs_host_check(d: &Dev) -> (usize, usize) {
    set_ctx(d);
    let max_n: usize = 8192 * 7 + 8 * 5 + 3;
    let bytes = max_n * 4 + 16;
    let mut host = vec![0u8; bytes];
    let mut srcs_host = Vec::new();
    let srcs: Vec<u64> = (0..kernels::MAX_SRCS)
        .map(|i| {
            let p = alloc(d, bytes);
            fill_bf16(&mut host, 900 + i as u64);
            upload(d, p, &host);
            srcs_host.push(host.clone());
            p
        })
        .collect();
    let dst = alloc(d, max_n * 4);
    fill_bf16(&mut host, 4242);
    let init = host[..max_n * 4].to_vec();
    let value = |dtype: DType, b: &[u8], i: usize| -> f32 {
        match dtype {
            DType::BF16 => {
                f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
            }
            _ => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
        }
    };
    let (mut cases, mut bad) = (0, 0);
    for (ti, dtype) in [(0usize, DType::BF16), (2, DType::F32)] {
        let esize = dtype.size_bytes();
        for nsrc in 1..=kernels::MAX_SRCS {
            for n in [8192usize, 4096 * 3 + 2, 8192 * 7 + 8 * 5 + 3, 100, 3] {
                for offset in [0usize, 1] {
                    let src_ptrs: Vec<u64> = srcs[..nsrc]
                        .iter()
                        .map(|&p| p + (offset * esize) as u64)
                        .collect();
                    let src_bytes: Vec<&[u8]> = srcs_host[..nsrc]
                        .iter()
                        .map(|h| &h[offset * esize..])
                        .collect();
                    for acc in [false, true] {
                        let want: Vec<u8> = (0..n)
                            .flat_map(|i| {
                                let (mut sum, first) = if acc {
                                    (value(DType::F32, &init, i), 0)
                                } else {
                                    (value(dtype, src_bytes[0], i), 1)
                                };
                                for b in &src_bytes[first..] {
                                    sum += value(dtype, b, i);
                                }
                                sum.to_le_bytes()
                            })
                            .collect();
                        for grid in [1u32, 3, 16] {
                            upload(d, dst, &init);
                            sum_launch(
                                d.sum_fns[ti],
                                grid,
                                d.stream,
                                dst,
                                &src_ptrs,
                                n as u64,
                                acc,
                            );
                            sync(d);
                            cases += 1;
                            if download(d, dst, n * 4) != want {
                                bad += 1;
                                println!(
                                    "MISMATCH rs_sum vs host: {} nsrc={nsrc} n={n} offset={offset} acc={acc} grid={grid}",
                                    dtype.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    (cases, bad)
}

fn main() {
    let timeout_s: u64 = std::env::var("TIDE_BENCH_TIMEOUT_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(220);
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(timeout_s));
        println!("TIMEOUT: cuda_bench ran past {timeout_s} s; exiting");
        if let Ok(path) = std::env::var("TIDE_BENCH_OUT") {
            write_json(&path, "\"partial\":true,", "");
            println!("wrote partial {path}");
        }
        std::process::exit(3);
    });
    let t_start = Instant::now();
    let reps: usize = std::env::var("TIDE_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25)
        .clamp(20, 250);
    let quick = std::env::var("TIDE_BENCH_QUICK")
        .map(|v| v == "1")
        .unwrap_or(false);
    let warm = 3;
    // TIDE_BENCH_RSKERNEL=1: only the reduction kernel: kernel-alone rows, reduce-scatter rows at 16
    // and 64 CTAs, kernel-vs-host and CPU-engine bitwise checks (< 60 s).
    let rsk = std::env::var("TIDE_BENCH_RSKERNEL")
        .map(|v| v == "1")
        .unwrap_or(false);
    if std::env::var("TIDE_BENCH_SELFTEST").is_ok() {
        return selftest();
    }
    let Some(devs) = gpus() else { return };
    let world = devs.len();
    let dev0 = devs[0].ord;
    gate_selftest(&devs);
    println!("cuda_bench: {world} GPU(s), {reps} reps after {warm} warm-up, quick={quick}");
    tide::config::set_override(Some(base_config()));
    let mut rep = Report::default();
    let mut site = 50_000i64;
    // Fastest variants per group, for the checks: (group h, config, median).
    let mut best_ag: Vec<(usize, Config, f64)> = vec![];
    let mut best_rs: Vec<(usize, Config, f64)> = vec![];
    let (kcases, kbad) = sum_vs_host_check(&devs[0]);
    let kernel_check = if kbad == 0 {
        format!("- rs_sum kernels vs host sum: bitwise equal in all {kcases} cases")
    } else {
        format!("- rs_sum kernels vs host sum: MISMATCH in {kbad} of {kcases} cases")
    };
    println!("check {kernel_check}");

    let groups: &[usize] = &[1664, 3328];
    for &h in groups {
        let g = format!("h={h}");
        let b = make_bufs(&devs, world, h);
        let shard = b.layout.shard_bytes;
        println!(
            "group {g}: shard {:.1} MiB per rank",
            shard as f64 / MIB as f64
        );
        let recv = if world > 1 { shard } else { 0 };

        if !rsk {
            // (a) floor.
            rep.header(&format!(
                "(a) copy-engine floor, {g}: {:.1} MiB from the peer, both GPUs at once",
                shard as f64 / MIB as f64
            ));
            if world > 1 {
                for k in [1usize, 4] {
                    let s = measure(&devs, world, warm, reps, &|| 20, &|r| {
                        let d = &devs[r];
                        let peer = 1 - r;
                        set_ctx(d);
                        ck!(sys::cuEventRecord(d.fork, d.stream), "cuEventRecord");
                        let per = shard.div_ceil(k).div_ceil(4096) * 4096;
                        for j in 0..k {
                            let off = j * per;
                            if off >= shard {
                                break;
                            }
                            let len = per.min(shard - off);
                            ck!(
                                sys::cuStreamWaitEvent(d.side[j], d.fork, 0),
                                "cuStreamWaitEvent"
                            );
                            ck!(
                                sys::cuMemcpyAsync(
                                    b.fl_dst[r] + off as u64,
                                    b.fl_src[peer] + off as u64,
                                    len,
                                    d.side[j]
                                ),
                                "cuMemcpyAsync"
                            );
                            ck!(sys::cuEventRecord(d.joins[j], d.side[j]), "cuEventRecord");
                            ck!(
                                sys::cuStreamWaitEvent(d.stream, d.joins[j], 0),
                                "cuStreamWaitEvent"
                            );
                        }
                    });
                    rep.row(
                        "floor",
                        &g,
                        &format!("one copy over {k} stream(s)"),
                        &s,
                        recv,
                    );
                }
                // One copy per parameter (the all-gather's peer copies), on 1 stream.
                let s = measure(&devs, world, warm, reps, &|| 9, &|r| {
                    let d = &devs[r];
                    let peer = 1 - r;
                    set_ctx(d);
                    for (i, p) in b.layout.params.iter().enumerate() {
                        let sb = p.shard_rows * p.row_bytes();
                        ck!(
                            sys::cuMemcpyAsync(
                                b.ag_out[r][i] + (peer * sb) as u64,
                                b.ag_in[peer][i],
                                sb,
                                d.stream
                            ),
                            "cuMemcpyAsync"
                        );
                    }
                });
                rep.row("floor", &g, "per-param peer copies, 1 stream", &s, recv);
            }

            // (d) local-shard copy: CE vs SM.
            rep.header(&format!(
            "(d) all-gather local-shard copy, {g}: {:.1} MiB (read + write counted as moved x2)",
            shard as f64 / MIB as f64
        ));
            let s = measure(&devs, world, warm, reps, &|| 9, &|r| {
                let d = &devs[r];
                set_ctx(d);
                for (i, p) in b.layout.params.iter().enumerate() {
                    let sb = p.shard_rows * p.row_bytes();
                    ck!(
                        sys::cuMemcpyAsync(
                            b.ag_out[r][i] + (r * sb) as u64,
                            b.ag_in[r][i],
                            sb,
                            d.stream
                        ),
                        "cuMemcpyAsync"
                    );
                }
            });
            rep.row("local_copy", &g, "ce cuMemcpyAsync", &s, 2 * shard);
            let cta_list: &[u32] = if quick {
                &[16, 132]
            } else {
                &[8, 16, 32, 64, 132, 264]
            };
            for &ctas in cta_list {
                let s = measure(&devs, world, warm, reps, &|| 9, &|r| {
                    let d = &devs[r];
                    set_ctx(d);
                    for (i, p) in b.layout.params.iter().enumerate() {
                        let sb = p.shard_rows * p.row_bytes();
                        let mut da = b.ag_out[r][i] + (r * sb) as u64;
                        let mut sa = b.ag_in[r][i];
                        let mut w = kernels::copy_width(da, sa);
                        let grid = kernels::grid((sb as u64).div_ceil(w as u64), ctas);
                        let mut n = sb as u64;
                        let mut params: [*mut std::ffi::c_void; 4] = [
                            &mut da as *mut u64 as *mut _,
                            &mut sa as *mut u64 as *mut _,
                            &mut n as *mut u64 as *mut _,
                            &mut w as *mut i32 as *mut _,
                        ];
                        launch(d.copy_fn, grid, d.stream, &mut params);
                    }
                });
                rep.row(
                    "local_copy",
                    &g,
                    &format!("sm tide_copy {ctas} CTAs"),
                    &s,
                    2 * shard,
                );
            }

            // (b) all-gather sweep.
            rep.header(&format!(
                "(b) tide all-gather, {g} (GB/s: peer bytes received per GPU)"
            ));
            let streams_list: &[usize] = if quick { &[1, 4] } else { &[1, 2, 4, 8] };
            let mut best: Option<(Config, f64)> = None;
            for &streams in streams_list {
                for local in [LocalCopy::CopyEngine, LocalCopy::Sm] {
                    for batch in [false, true] {
                        let mut c = base_config();
                        c.ag_streams = streams;
                        c.local_copy = local;
                        c.copy_batch = batch;
                        tide::config::set_override(Some(c.clone()));
                        site += 1;
                        let calls: Vec<CallInfo> = (0..world)
                            .map(|r| call_of(&devs, &b, Op::AllGather, site, r, world))
                            .collect();
                        let s = measure(
                            &devs,
                            world,
                            warm,
                            reps,
                            &|| sched_cmds(dev0, site, Op::AllGather),
                            &|r| {
                                tide::cuda::execute(&calls[r])
                                    .unwrap_or_else(|e| panic!("all-gather: {e}"));
                            },
                        );
                        let v = format!(
                            "streams={streams} local={} batch={}",
                            if local == LocalCopy::Sm { "sm" } else { "ce" },
                            batch as u8
                        );
                        rep.row("all_gather", &g, &v, &s, recv);
                        if best.as_ref().map(|x| s.median < x.1).unwrap_or(true) {
                            best = Some((c, s.median));
                        }
                    }
                }
            }
            if let Some((c, m)) = best {
                best_ag.push((h, c, m));
            }

            // (c) reduce-scatter sweep.
            rep.header(&format!(
            "(c) tide reduce-scatter bf16 -> fp32, {g} (GB/s: peer bf16 bytes received per GPU)"
        ));
            let ctas_list: &[u32] = if quick { &[16, 64] } else { &[8, 16, 32, 64] };
            let slot_list: &[usize] = if quick { &[32] } else { &[8, 32, 64] };
            let slots_list: &[usize] = if quick { &[2] } else { &[2, 3] };
            let rs_streams: &[usize] = if quick { &[1, 2] } else { &[1, 2, 4] };
            let mut best: Option<(Config, f64)> = None;
            for &slot_mib in slot_list {
                for &slots in slots_list {
                    for &ctas in ctas_list {
                        for &streams in rs_streams {
                            let mut c = base_config();
                            c.rs_max_ctas = ctas;
                            c.rs_slot_bytes = slot_mib * MIB;
                            c.rs_stage_slots = slots;
                            c.rs_copy_streams = streams;
                            tide::config::set_override(Some(c.clone()));
                            site += 1;
                            let calls: Vec<CallInfo> = (0..world)
                                .map(|r| call_of(&devs, &b, Op::ReduceScatter, site, r, world))
                                .collect();
                            let s = measure(
                                &devs,
                                world,
                                warm,
                                reps,
                                &|| sched_cmds(dev0, site, Op::ReduceScatter),
                                &|r| {
                                    tide::cuda::execute(&calls[r])
                                        .unwrap_or_else(|e| panic!("reduce-scatter: {e}"));
                                },
                            );
                            let v = format!(
                                "ctas={ctas} slot={slot_mib}MiB slots={slots} streams={streams}"
                            );
                            rep.row("reduce_scatter", &g, &v, &s, recv);
                            if best.as_ref().map(|x| s.median < x.1).unwrap_or(true) {
                                best = Some((c, s.median));
                            }
                        }
                    }
                }
            }
            if let Some((c, m)) = best {
                best_rs.push((h, c, m));
            }
        }
        // Reduction kernel alone: own rows + the other half of the same (local) gradient -> fp32.
        rep.header(&format!("(c') reduction kernel alone, {g}: 2 local bf16 sources -> fp32 (GB/s: bytes read + written)"));
        let moved: usize = b
            .layout
            .params
            .iter()
            .map(|p| p.shard_rows * p.row_elems * (2 + 2 + 4))
            .sum();
        let kctas: &[u32] = if quick || rsk {
            &[16, 64, 132]
        } else {
            &[8, 16, 32, 64, 132, 264]
        };
        for &ctas in kctas {
            let s = measure(&devs, world, warm, reps, &|| 9, &|r| {
                let d = &devs[r];
                set_ctx(d);
                for (i, p) in b.layout.params.iter().enumerate() {
                    let elems = p.shard_rows * p.row_elems;
                    let sb = (elems * 2) as u64;
                    let own = b.rs_in[r][i] + r as u64 * sb;
                    let other = b.rs_in[r][i] + if world > 1 { (1 - r) as u64 * sb } else { 0 };
                    let dst = b.rs_out[r][i];
                    let srcs = [own, other];
                    let vecd = kernels::sum_vectorized(dst, &srcs);
                    let grid = kernels::grid(kernels::sum_units(elems as u64, vecd), ctas);
                    sum_launch(d.sum_bf16, grid, d.stream, dst, &srcs, elems as u64, false);
                }
            });
            rep.row(
                "reduce_kernel",
                &g,
                &format!("rs_sum_bf16_f32 {ctas} CTAs"),
                &s,
                moved,
            );
        }
        // Full reduce-scatter at 16 and 64 reduction CTAs, at the default slots/streams.
        rep.header(&format!(
            "(c'') tide reduce-scatter, 16 and 64 reduction CTAs, {g} (GB/s: peer bf16 bytes received per GPU)"
        ));
        for ctas in [16u32, 64] {
            let mut c = base_config();
            c.rs_max_ctas = ctas;
            tide::config::set_override(Some(c.clone()));
            site += 1;
            let calls: Vec<CallInfo> = (0..world)
                .map(|r| call_of(&devs, &b, Op::ReduceScatter, site, r, world))
                .collect();
            let s = measure(
                &devs,
                world,
                warm,
                reps,
                &|| sched_cmds(dev0, site, Op::ReduceScatter),
                &|r| {
                    tide::cuda::execute(&calls[r])
                        .unwrap_or_else(|e| panic!("reduce-scatter: {e}"));
                },
            );
            let v = format!(
                "ctas={ctas} slot={}MiB slots={} streams={}",
                c.rs_slot_bytes / MIB,
                c.rs_stage_slots,
                c.rs_copy_streams
            );
            rep.row("reduce_scatter_kernel", &g, &v, &s, recv);
            best_rs.push((h, c, s.median));
        }
        tide::config::set_override(Some(base_config()));
        println!("group {g} done at {:.1} s", t_start.elapsed().as_secs_f64());
        drop(b); // device memory is not freed (a benchmark process); 2 groups fit easily
    }

    // Bitwise checks of the fastest variants against the CPU engine, fresh data.
    let mut checks = String::new();
    let mut check_json = Vec::new();
    for (op, list) in [(Op::AllGather, &best_ag), (Op::ReduceScatter, &best_rs)] {
        for (h, c, m) in list.iter() {
            tide::config::set_override(Some(c.clone()));
            site += 1;
            let b = make_bufs(&devs, world, *h);
            let layout = b.layout.clone();
            let topo = Topology::single_node(world);
            let plan = match op {
                Op::AllGather => plan::all_gather(&layout, topo).unwrap(),
                Op::ReduceScatter => plan::reduce_scatter(
                    &layout,
                    topo,
                    RsOptions {
                        stage_slots: c.rs_stage_slots,
                        slot_bytes: c.rs_slot_bytes,
                    },
                )
                .unwrap(),
            };
            // Fresh random inputs, poisoned outputs.
            let mut inputs: Vec<Vec<Vec<u8>>> = vec![];
            for r in 0..world {
                let mut per = vec![];
                for (i, _) in layout.params.iter().enumerate() {
                    let mut v = vec![0u8; plan.input_bytes(i)];
                    fill_bf16(
                        &mut v,
                        0xfeed + (r as u64) * 131 + i as u64 * 17 + *h as u64,
                    );
                    let (ip, op_) = match op {
                        Op::AllGather => (b.ag_in[r][i], b.ag_out[r][i]),
                        Op::ReduceScatter => (b.rs_in[r][i], b.rs_out[r][i]),
                    };
                    upload(&devs[r], ip, &v);
                    upload(&devs[r], op_, &vec![0xa5u8; plan.output_bytes(i)]);
                    per.push(v);
                }
                inputs.push(per);
            }
            let want = run_threads(&plan, &inputs).unwrap();
            let calls: Vec<CallInfo> = (0..world)
                .map(|r| call_of(&devs, &b, op, site, r, world))
                .collect();
            std::thread::scope(|s| {
                for r in 0..world {
                    let call = &calls[r];
                    let d = &devs[r];
                    s.spawn(move || {
                        set_ctx(d);
                        tide::cuda::execute(call).unwrap_or_else(|e| panic!("check {op:?}: {e}"));
                        sync(d);
                    });
                }
            });
            let mut ok = true;
            for r in 0..world {
                for i in 0..layout.len() {
                    let op_ = match op {
                        Op::AllGather => b.ag_out[r][i],
                        Op::ReduceScatter => b.rs_out[r][i],
                    };
                    if download(&devs[r], op_, plan.output_bytes(i)) != want[r][i] {
                        ok = false;
                        println!(
                            "MISMATCH {op:?} h={h} rank {r} {}",
                            layout.params[i].describe()
                        );
                    }
                }
            }
            let v = match op {
                Op::AllGather => format!(
                    "streams={} local={:?} batch={}",
                    c.ag_streams, c.local_copy, c.copy_batch as u8
                ),
                Op::ReduceScatter => format!(
                    "ctas={} slot={}MiB slots={} streams={}",
                    c.rs_max_ctas,
                    c.rs_slot_bytes / MIB,
                    c.rs_stage_slots,
                    c.rs_copy_streams
                ),
            };
            let _ = writeln!(
                checks,
                "- {op:?} h={h} fastest ({v}, {m:.3} ms): {}",
                if ok {
                    "bitwise equal to the CPU engine"
                } else {
                    "MISMATCH"
                }
            );
            check_json.push(format!(
                "{{\"op\":\"{op:?}\",\"group\":\"h={h}\",\"variant\":\"{v}\",\"median_ms\":{m:.5},\"bitwise_equal\":{ok}}}"
            ));
        }
    }
    tide::config::set_override(None);

    let _ = writeln!(checks, "{kernel_check}");
    let summary = summarize(&rep, groups);
    let full = format!(
        "{}\n\n### Fastest variants, checked\n{checks}\n{summary}",
        rep.md
    );
    if let Ok(path) = std::env::var("TIDE_BENCH_OUT") {
        let head = format!(
            "\"world\":{world},\"reps\":{reps},\"warmup\":{warm},\"gated\":{},",
            GATE_OK.load(Ordering::SeqCst)
        );
        write_json(&path, &head, &check_json.join(","));
        let md = path.strip_suffix(".json").unwrap_or(&path).to_string() + ".md";
        if let Err(e) = std::fs::write(&md, &full) {
            println!("cannot write {md}: {e}");
        }
        println!("wrote {path} and {md} (all tables)");
    } else {
        println!("{}", rep.md);
    }
    println!("\n### Fastest variants, checked\n{checks}");
    println!("{summary}");
    if !GATE_OK.load(Ordering::SeqCst) {
        println!("NOTE: timed ungated (the stream gate failed its self-test): times include host issue gaps");
    }
    println!("total {:.1} s", t_start.elapsed().as_secs_f64());
}

/// The defaults as of this build (Config::from_env without TIDE_* set), as the sweep names them.
const AG_DEFAULT: &str = "streams=4 local=ce batch=0";
const RS_DEFAULT: &str = "ctas=16 slot=32MiB slots=2 streams=2";

/// A compact summary: per group, the floor, default and fastest AG and RS (ratios to the floor),
/// the reduction kernel and the local copy by CTA count.
fn summarize(rep: &Report, groups: &[usize]) -> String {
    let mut out = String::from("### Summary (median ms; x = over the copy-engine floor)\n");
    for &h in groups {
        let g = format!("h={h}");
        let rows: Vec<_> = rep.rows.iter().filter(|r| r.1 == g).collect();
        let of = |sec: &str| rows.iter().filter(|r| r.0 == sec).collect::<Vec<_>>();
        let best = |sec: &str| {
            of(sec)
                .into_iter()
                .min_by(|a, b| a.3.partial_cmp(&b.3).unwrap())
                .map(|r| (r.2.clone(), r.3))
        };
        let named = |sec: &str, v: &str| of(sec).into_iter().find(|r| r.2 == v).map(|r| r.3);
        let floor = best("floor").map(|x| x.1);
        let ratio = |t: f64| match floor {
            Some(f) if f > 0.0 => format!(" ({:.2}x)", t / f),
            _ => String::new(),
        };
        let _ = writeln!(out, "- {g}:");
        if let Some((v, t)) = best("floor") {
            let _ = writeln!(out, "  - floor {t:.3} ({v})");
        }
        for (sec, def) in [("all_gather", AG_DEFAULT), ("reduce_scatter", RS_DEFAULT)] {
            let d = named(sec, def)
                .map(|t| format!("{t:.3}{}", ratio(t)))
                .unwrap_or_else(|| "-".into());
            let b = best(sec)
                .map(|(v, t)| format!("{t:.3}{} [{v}]", ratio(t)))
                .unwrap_or_else(|| "-".into());
            let _ = writeln!(out, "  - {sec}: default {d}; fastest {b}");
        }
        for sec in ["reduce_kernel", "reduce_scatter_kernel", "local_copy"] {
            let line: Vec<String> = of(sec)
                .iter()
                .map(|r| {
                    let short =
                        r.2.replace("rs_sum_bf16_f32 ", "")
                            .replace("tide_copy ", "");
                    format!("{short} {:.3} ({:.0} GB/s)", r.3, r.4)
                })
                .collect();
            let _ = writeln!(out, "  - {sec}: {}", line.join("; "));
        }
    }
    out
}

/// TIDE_BENCH_SELFTEST=1: the reporting (rows, summary, JSON and markdown files) on made-up
/// numbers, without a GPU.
fn selftest() {
    let mut rep = Report::default();
    let st = |m: f64| Stat {
        median: m,
        p10: m * 0.9,
        p90: m * 1.1,
        per_dev_median: vec![m, m],
        host_us: 12.0,
    };
    for h in [1664usize, 3328] {
        let g = format!("h={h}");
        rep.header("floor");
        rep.row("floor", &g, "one copy over 4 stream(s)", &st(0.1), 1 << 25);
        rep.row("local_copy", &g, "ce cuMemcpyAsync", &st(0.03), 1 << 26);
        rep.row("local_copy", &g, "sm tide_copy 16 CTAs", &st(0.05), 1 << 26);
        rep.row("all_gather", &g, AG_DEFAULT, &st(0.13), 1 << 25);
        rep.row(
            "all_gather",
            &g,
            "streams=2 local=ce batch=1",
            &st(0.11),
            1 << 25,
        );
        rep.row("reduce_scatter", &g, RS_DEFAULT, &st(0.2), 1 << 25);
        rep.row(
            "reduce_kernel",
            &g,
            "rs_sum_bf16_f32 16 CTAs",
            &st(0.04),
            1 << 27,
        );
    }
    let summary = summarize(&rep, &[1664, 3328]);
    println!("{summary}");
    let path =
        std::env::var("TIDE_BENCH_OUT").unwrap_or_else(|_| "/tmp/cuda_bench_selftest.json".into());
    write_json(&path, "\"selftest\":true,", "");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with('{') && text.trim_end().ends_with('}'));
    assert_eq!(text.matches("\"section\"").count(), 14);
    assert!(summary.contains("(1.30x)") && summary.contains("fastest 0.110 (1.10x) [streams=2"));
    println!("selftest ok: {path}");
}
