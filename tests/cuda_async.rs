//! The CUDA engine's start/done driver on real GPUs, without JAX (`tide::cuda::execute_phase`,
//! the module header's rules A1-A4). Every test needs a CUDA GPU and is `#[ignore]`d, so a machine
//! without one reports them as ignored, never as passed. On the GPU machine (no Rust there):
//! `scripts/gpu bundle` here, `scripts/gpu run OUT engine` (and `percall`) there, or by hand
//!   .carry/cuda_async --ignored --nocapture --test-threads=1     # from the repository root
//!
//! - `start_returns_before_tide_runs_and_done_holds_xla`: one GPU. Tide's stream of the call's
//!   in-flight slot is held on a host flag (cuStreamWaitValue32 on mapped pinned memory, released by
//!   the test or by a watchdog after 20 s, so never a hang). XLA's stream (the test's) must pass
//!   the start at once and be held by the done until the flag is released; then the results equal
//!   the CPU engine's.
//! - `ranks_on_one_gpu_with_calls_in_flight`: 2 and 3 ranks as threads sharing GPU 0 (distinct
//!   buffers), and one rank per GPU when there are several: every call is start/done with 2 (and 3)
//!   calls in flight per rank, a synchronous call in between, both ops, copy batching on and off,
//!   SM and copy-engine local copies, 64 KiB stage slots; every call's outputs bitwise equal to the
//!   CPU engine.
//! - `start_done_errors_are_clear`: done without start, done with other buffers, a start beyond
//!   TIDE_MAX_IN_FLIGHT: each an error naming the problem; the calls in flight still complete.
//! - `per_call_cost`: host time of one start/done pair and device time per call (XLA's stream held
//!   on a host flag while the calls are enqueued) vs the number of parameters (P=1, and P=2 as two
//!   ranks on GPU 0), TIDE_FUSE_BYTES on and off, printed as rows (`percall:`); no assertion.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use cudarc::driver::sys;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tide::call::{BufferView, CallInfo};
use tide::cuda::driver::check;
use tide::engine::cpu::run_threads;
use tide::call::Phase;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Op, Plan};
use tide::topology::Topology;

mod common;
use common::{fill, say};

const NEEDS_GPU: &str = "needs a CUDA GPU: run with --ignored on the GPU machine";

fn specs() -> Vec<ParamSpec> {
    common::odd_group()
}

struct Dev {
    ordinal: i64,
    ctx: sys::CUcontext,
}
// SAFETY: raw CUDA handles, usable from any thread.
unsafe impl Send for Dev {}
unsafe impl Sync for Dev {}

fn ck(r: sys::CUresult, what: &str) {
    check(r, what, String::new).unwrap_or_else(|e| panic!("{e}"));
}

fn set_ctx(d: &Dev) {
    // SAFETY: retained primary context.
    ck(unsafe { sys::cuCtxSetCurrent(d.ctx) }, "cuCtxSetCurrent");
}

fn new_stream(d: &Dev) -> usize {
    set_ctx(d);
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-pointer; context current. Non-blocking, like XLA's compute stream.
    ck(
        unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
        "cuStreamCreate",
    );
    s as usize
}

fn sync(d: &Dev, stream: usize) {
    set_ctx(d);
    // SAFETY: our stream.
    ck(unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) }, "cuStreamSynchronize");
}

fn alloc_upload(d: &Dev, data: &[u8]) -> u64 {
    set_ctx(d);
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; at least 1 byte.
    ck(unsafe { sys::cuMemAlloc_v2(&mut p, data.len().max(1)) }, "cuMemAlloc");
    if !data.is_empty() {
        // SAFETY: p holds data.len() bytes.
        ck(
            unsafe { sys::cuMemcpyHtoD_v2(p, data.as_ptr() as *const _, data.len()) },
            "cuMemcpyHtoD",
        );
    }
    p
}

fn download(d: &Dev, p: u64, len: usize) -> Vec<u8> {
    set_ctx(d);
    let mut v = vec![0u8; len];
    if len > 0 {
        // SAFETY: p holds len bytes.
        ck(unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut _, p, len) }, "cuMemcpyDtoH");
    }
    v
}

/// Every visible GPU (at most 8); panics without one (these tests are run only on request).
fn gpus() -> Vec<Dev> {
    if let Err(e) = tide::cuda::driver::init() {
        panic!("{NEEDS_GPU}: {e}");
    }
    let mut count = 0;
    // SAFETY: valid out-pointer, driver initialized.
    ck(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount");
    assert!(count > 0, "{NEEDS_GPU}: no CUDA device");
    (0..count.min(8))
        .map(|ord| {
            let mut dev = 0;
            let mut ctx = std::ptr::null_mut();
            // SAFETY: valid ordinal and out-pointers.
            unsafe {
                ck(sys::cuDeviceGet(&mut dev, ord), "cuDeviceGet");
                ck(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain");
            }
            Dev {
                ordinal: ord as i64,
                ctx,
            }
        })
        .collect()
}

fn make_plan(layout: &GroupLayout, op: Op, world: usize) -> Plan {
    let topo = Topology::single_node(world);
    match op {
        Op::AllGather => plan::all_gather(layout, topo).unwrap(),
        Op::ReduceScatter => plan::reduce_scatter(layout, topo, plan::RsOptions::from_config()).unwrap(),
    }
}

/// One call's buffers on every rank, its calls and the CPU engine's expected outputs.
struct Case {
    calls: Vec<CallInfo>,
    outs: Vec<Vec<u64>>,
    want: Vec<Vec<Vec<u8>>>,
    out_bytes: Vec<usize>,
}

/// Uploads fresh inputs (seeded) and 0xa5-filled outputs for every rank; `dev_of[r]` is rank r's
/// device, `streams[r]` its "XLA" stream.
fn make_case(devs: &[Dev], dev_of: &[usize], streams: &[usize], op: Op, site: i64, specs: &[ParamSpec], seed: u64) -> Case {
    let world = dev_of.len();
    let layout = GroupLayout::new(specs, world).unwrap();
    let plan = make_plan(&layout, op, world);
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
    let mut calls = Vec::new();
    let mut outs = Vec::new();
    for r in 0..world {
        let d = &devs[dev_of[r]];
        let (mut ins, mut os, mut optrs) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let p = &layout.params[i];
            let mut shard = vec![p.shard_rows];
            shard.extend(p.shape.iter().skip(1));
            let (idims, odims, odt) = match op {
                Op::AllGather => (shard, p.shape.clone(), p.dtype),
                Op::ReduceScatter => (p.shape.clone(), shard, DType::F32),
            };
            let ip = alloc_upload(d, &inputs[r][i]);
            let opp = alloc_upload(d, &vec![0xa5u8; plan.output_bytes(i)]);
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
            job: 0,
            device_ordinal: d.ordinal,
            rank: r,
            group: 0,
            world,
            topology: Topology::single_node(world),
            names: specs.iter().map(|s| s.name.clone()).collect(),
            inputs: ins,
            outputs: os,
            stream: streams[r],
            at: None,
            cast: None,
            urgent: false,
        });
    }
    Case {
        calls,
        outs,
        want,
        out_bytes: (0..n).map(|i| plan.output_bytes(i)).collect(),
    }
}

/// The done of `call`: operands are start's results then start's operands.
fn done_of(call: &CallInfo) -> CallInfo {
    let mut d = call.clone();
    d.inputs = call.outputs.iter().chain(call.inputs.iter()).cloned().collect();
    d
}

fn verify(devs: &[Dev], dev_of: &[usize], case: &Case, label: &str) {
    for (r, optrs) in case.outs.iter().enumerate() {
        for (i, &p) in optrs.iter().enumerate() {
            let got = download(&devs[dev_of[r]], p, case.out_bytes[i]);
            if got != case.want[r][i] {
                let first = got.iter().zip(&case.want[r][i]).position(|(a, b)| a != b).unwrap_or(0);
                panic!("{label}: rank {r} param {i} differs from the CPU engine at byte {first} of {}", got.len());
            }
        }
    }
}

fn config(f: impl FnOnce(&mut tide::config::Config)) {
    let mut c = tide::config::Config::from_env();
    c.timeout_s = 60.0;
    c.rs_slot_bytes = 65536;
    f(&mut c);
    tide::config::set_override(Some(c));
}

/// A host flag a stream can wait on: mapped pinned memory, 0 until released.
struct Gate {
    host: *mut u32,
    dev: sys::CUdeviceptr,
}
// SAFETY: pinned host memory valid for the process; written with volatile stores.
unsafe impl Send for Gate {}
unsafe impl Sync for Gate {}

impl Gate {
    fn new(d: &Dev) -> Gate {
        set_ctx(d);
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointers; 4 bytes of mapped pinned memory, never freed.
        unsafe {
            ck(sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc");
            ck(sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0), "cuMemHostGetDevicePointer");
            std::ptr::write_volatile(host as *mut u32, 0);
        }
        Gate { host: host as *mut u32, dev }
    }
    fn hold(&self, stream: sys::CUstream) {
        // SAFETY: mapped pinned memory; the stream belongs to the current context.
        ck(
            unsafe {
                sys::cuStreamWaitValue32_v2(
                    stream,
                    self.dev,
                    1,
                    sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                )
            },
            "cuStreamWaitValue32",
        );
    }
    fn release(&self) {
        // SAFETY: as in `new`.
        unsafe { std::ptr::write_volatile(self.host, 1) };
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

fn record(d: &Dev, stream: usize) -> sys::CUevent {
    set_ctx(d);
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-pointer and stream.
    unsafe {
        ck(sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32), "cuEventCreate");
        ck(sys::cuEventRecord(e, stream as sys::CUstream), "cuEventRecord");
    }
    e
}

fn timing_event(d: &Dev) -> sys::CUevent {
    set_ctx(d);
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-pointer; context current.
    ck(unsafe { sys::cuEventCreate(&mut e, 0) }, "cuEventCreate");
    e
}

fn complete(e: sys::CUevent) -> bool {
    // SAFETY: valid event.
    match unsafe { sys::cuEventQuery(e) } {
        sys::CUresult::CUDA_SUCCESS => true,
        sys::CUresult::CUDA_ERROR_NOT_READY => false,
        other => panic!("cuEventQuery: {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn start_returns_before_tide_runs_and_done_holds_xla() {
    let devs = gpus();
    let d = &devs[0];
    config(|_| {});
    for (k, op) in [Op::AllGather, Op::ReduceScatter].into_iter().enumerate() {
        let x = new_stream(d);
        // Warm-up: creates the op's in-flight slot 0 (free again afterwards), compiles kernels.
        let warm = make_case(&devs, &[0], &[x], op, 5000 + k as i64, &specs(), 3);
        tide::cuda::execute_phase(&warm.calls[0], Phase::Sync).unwrap();
        sync(d, x);
        verify(&devs, &[0], &warm, &format!("{op:?} warm-up"));
        let case = make_case(&devs, &[0], &[x], op, 5100 + k as i64, &specs(), 11 + k as u64);
        // Hold tide's stream of slot 0 (the slot the next start takes) on the flag.
        let gate = Gate::new(d);
        {
            let st = tide::cuda::device::get(0).unwrap();
            let st = st.lock().unwrap();
            set_ctx(d);
            gate.hold(st.slot(op, 0).unwrap().tide);
        }
        let released_by_test = std::sync::Arc::new(AtomicBool::new(false));
        let watchdog = {
            let flag = released_by_test.clone();
            let g = Gate { host: gate.host, dev: gate.dev };
            std::thread::spawn(move || {
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(20) && !flag.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                g.release();
            })
        };
        let t0 = Instant::now();
        tide::cuda::execute_phase(&case.calls[0], Phase::Start).unwrap();
        let start_host = t0.elapsed();
        let after_start = record(d, x);
        tide::cuda::execute_phase(&done_of(&case.calls[0]), Phase::Done).unwrap();
        let after_done = record(d, x);
        // XLA's stream passes the start although tide's stream is held...
        let t = Instant::now();
        while !complete(after_start) {
            assert!(t.elapsed() < Duration::from_secs(5), "{op:?}: XLA's stream did not pass the start while tide was held");
            std::thread::sleep(Duration::from_millis(1));
        }
        // ...and is held by the done.
        std::thread::sleep(Duration::from_millis(200));
        assert!(!complete(after_done), "{op:?}: XLA's stream passed the done while tide's stream was held");
        let before = download(d, case.outs[0][3], case.out_bytes[3]);
        assert!(before.iter().all(|&b| b == 0xa5), "{op:?}: outputs written while tide's stream was held");
        released_by_test.store(true, Ordering::SeqCst);
        gate.release();
        sync(d, x);
        watchdog.join().unwrap();
        assert!(complete(after_done));
        verify(&devs, &[0], &case, &format!("{op:?} gated start/done"));
        say(&format!(
            "cuda_async gate: {op:?}: start returned in {start_host:?} with tide's stream held; XLA's stream passed the start, \
             was held by the done until the release; results bitwise equal to the CPU engine"
        ));
    }
    tide::config::set_override(None);
}

/// Every rank (a thread) runs `calls` collectives as start/done with `depth` in flight, a
/// synchronous call after the first, then checks every call against the CPU engine.
fn in_flight_run(devs: &[Dev], dev_of: &[usize], op: Op, site: i64, depth: usize, calls: usize, seed: u64, label: &str) {
    let world = dev_of.len();
    let streams: Vec<usize> = dev_of.iter().map(|&g| new_stream(&devs[g])).collect();
    // Two sites alternating (two instructions of a program), each repeated (a loop).
    let cases: Vec<Case> = (0..calls)
        .map(|k| make_case(devs, dev_of, &streams, op, site + (k % 2) as i64, &specs(), seed + k as u64))
        .collect();
    let sync_case = make_case(devs, dev_of, &streams, op, site + 7, &specs(), seed ^ 0xfeed);
    std::thread::scope(|s| {
        for r in 0..world {
            let cases = &cases;
            let sync_case = &sync_case;
            s.spawn(move || {
                let mut in_flight = std::collections::VecDeque::new();
                for (k, c) in cases.iter().enumerate() {
                    tide::cuda::execute_phase(&c.calls[r], Phase::Start)
                        .unwrap_or_else(|e| panic!("{label}: rank {r} start {k}: {e}"));
                    in_flight.push_back(k);
                    if k == 0 {
                        tide::cuda::execute_phase(&sync_case.calls[r], Phase::Sync)
                            .unwrap_or_else(|e| panic!("{label}: rank {r} sync call: {e}"));
                    }
                    if in_flight.len() == depth {
                        let j = in_flight.pop_front().unwrap();
                        tide::cuda::execute_phase(&done_of(&cases[j].calls[r]), Phase::Done)
                            .unwrap_or_else(|e| panic!("{label}: rank {r} done {j}: {e}"));
                    }
                }
                for j in in_flight {
                    tide::cuda::execute_phase(&done_of(&cases[j].calls[r]), Phase::Done)
                        .unwrap_or_else(|e| panic!("{label}: rank {r} done {j}: {e}"));
                }
            });
        }
    });
    for (r, &g) in dev_of.iter().enumerate() {
        sync(&devs[g], streams[r]);
    }
    verify(devs, dev_of, &sync_case, &format!("{label} sync call"));
    for (k, c) in cases.iter().enumerate() {
        verify(devs, dev_of, c, &format!("{label} call {k}"));
    }
    say(&format!("cuda_async: {label}: {calls} calls, {depth} in flight: bitwise equal to the CPU engine"));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn ranks_on_one_gpu_with_calls_in_flight() {
    let devs = gpus();
    let mut layouts: Vec<(String, Vec<usize>)> = vec![
        ("1 rank".into(), vec![0]),
        ("2 ranks on GPU 0".into(), vec![0, 0]),
        ("3 ranks on GPU 0".into(), vec![0, 0, 0]),
    ];
    if devs.len() > 1 {
        layouts.push((format!("{} ranks, one per GPU", devs.len()), (0..devs.len()).collect()));
        layouts.push(("4 ranks on 2 GPUs".into(), vec![0, 1, 0, 1]));
    }
    let mut site = 6000;
    for (name, dev_of) in &layouts {
        // Ranks sharing a device share its slots: TIDE_MAX_IN_FLIGHT counts per device.
        let per_dev = dev_of.iter().filter(|&&g| g == 0).count();
        for (variant, depth, batch, local, fuse) in [
            ("batched copies, ce local copy, fused small work", 2usize, true, tide::config::LocalCopy::CopyEngine, 512usize << 10),
            ("single copies, sm local copy, fused small work", 2, false, tide::config::LocalCopy::Sm, 512 << 10),
            ("batched copies, nothing fused", 2, true, tide::config::LocalCopy::CopyEngine, 0),
            ("single copies, sm local copy, nothing fused", 2, false, tide::config::LocalCopy::Sm, 0),
            ("3 in flight, everything fused", 3, true, tide::config::LocalCopy::CopyEngine, 1 << 30),
        ] {
            config(|c| {
                c.copy_batch = batch;
                c.local_copy = local;
                c.fuse_bytes = fuse;
                // Everything fused: copy streams' small copies too, however few (TIDE_FUSE_CE_MIN 2).
                if fuse >= 1 << 30 {
                    c.fuse_ce_min = 2;
                }
                c.max_in_flight = depth * per_dev;
            });
            for op in [Op::AllGather, Op::ReduceScatter] {
                site += 10;
                in_flight_run(&devs, dev_of, op, site, depth, 5, site as u64, &format!("{name}, {op:?}, {variant}"));
            }
        }
    }
    tide::config::set_override(None);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn start_done_errors_are_clear() {
    let devs = gpus();
    let d = &devs[0];
    config(|c| c.max_in_flight = 2);
    let x = new_stream(d);
    let cases: Vec<Case> = (0..3)
        .map(|k| make_case(&devs, &[0], &[x], Op::AllGather, 7000, &specs(), 40 + k))
        .collect();
    // Done without start.
    let e = tide::cuda::execute_phase(&done_of(&cases[0].calls[0]), Phase::Done).unwrap_err();
    assert!(e.to_string().contains("no matching start"), "{e}");
    tide::cuda::execute_phase(&cases[0].calls[0], Phase::Start).unwrap();
    tide::cuda::execute_phase(&cases[1].calls[0], Phase::Start).unwrap();
    // A third start of the op on this device: over TIDE_MAX_IN_FLIGHT=2.
    let e = tide::cuda::execute_phase(&cases[2].calls[0], Phase::Start).unwrap_err();
    assert!(e.to_string().contains("TIDE_MAX_IN_FLIGHT"), "{e}");
    // Done with a result at another address than its start wrote.
    let mut moved = done_of(&cases[1].calls[0]);
    moved.outputs[2].ptr += 256;
    let e = tide::cuda::execute_phase(&moved, Phase::Done).unwrap_err();
    assert!(e.to_string().contains("site 7000") || e.to_string().contains("no matching start"), "{e}");
    // The calls in flight still complete.
    tide::cuda::execute_phase(&done_of(&cases[0].calls[0]), Phase::Done).unwrap();
    tide::cuda::execute_phase(&done_of(&cases[1].calls[0]), Phase::Done).unwrap();
    // A slot is free again.
    tide::cuda::execute_phase(&cases[2].calls[0], Phase::Start).unwrap();
    tide::cuda::execute_phase(&done_of(&cases[2].calls[0]), Phase::Done).unwrap();
    sync(d, x);
    for (k, c) in cases.iter().enumerate() {
        verify(&devs, &[0], c, &format!("error test call {k}"));
    }
    say("cuda_async errors: done without start, over TIDE_MAX_IN_FLIGHT, moved result: clear errors; calls completed");
    tide::config::set_override(None);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn per_call_cost() {
    let devs = gpus();
    let d = &devs[0];
    for (world, fuse) in [(1usize, 512usize << 10), (1, 0), (2, 512 << 10), (2, 0)] {
        config(|c| {
            c.rs_slot_bytes = 32 << 20;
            c.fuse_bytes = fuse;
        });
        let dev_of = vec![0usize; world];
        let streams: Vec<usize> = (0..world).map(|_| new_stream(d)).collect();
        for op in [Op::AllGather, Op::ReduceScatter] {
            for n in [1usize, 8, 64, 256] {
                let specs: Vec<ParamSpec> = (0..n)
                    .map(|i| ParamSpec::new(format!("p{i}"), &[64, 1024], DType::BF16))
                    .collect();
                let site = 8000 + (world * 10_000 + n) as i64 + if op == Op::AllGather { 0 } else { 500 } + if fuse == 0 { 3000 } else { 0 };
                let case = make_case(&devs, &dev_of, &streams, op, site, &specs, 5);
                // Device time is measured with XLA's stream held on a gate while the calls are
                // enqueued. A CUDA stream queues a bounded number of pending operations: beyond it
                // an enqueue blocks the host until the GPU drains, which the gate forbids (seen on
                // the H200: 30 calls x 64 unbatched copies hung). So few reps for big groups, and
                // no gate where even those exceed ~512 operations (host and device timed ungated).
                let ops_per_call = 2 * n;
                let reps = if ops_per_call * 30 <= 512 { 30 } else { (512 / ops_per_call).max(2) };
                let gated = ops_per_call * reps <= 512;
                let gate = Gate::new(d);
                let results: Vec<(Duration, f32)> = std::thread::scope(|s| {
                    let hs: Vec<_> = (0..world)
                        .map(|r| {
                            let case = &case;
                            let gate = &gate;
                            let streams = &streams;
                            s.spawn(move || {
                                let call = &case.calls[r];
                                let done = done_of(call);
                                for _ in 0..3 {
                                    tide::cuda::execute_phase(call, Phase::Start).unwrap();
                                    tide::cuda::execute_phase(&done, Phase::Done).unwrap();
                                }
                                sync(d, streams[r]);
                                // Device time: XLA's stream held on the gate while every call is
                                // enqueued, then timed between two events once released.
                                set_ctx(d);
                                if gated {
                                    gate.hold(streams[r] as sys::CUstream);
                                }
                                let (a, b) = (timing_event(d), timing_event(d));
                                // SAFETY: valid events and stream.
                                ck(unsafe { sys::cuEventRecord(a, streams[r] as sys::CUstream) }, "cuEventRecord");
                                let mut best = Duration::MAX;
                                for _ in 0..reps {
                                    let t = Instant::now();
                                    tide::cuda::execute_phase(call, Phase::Start).unwrap();
                                    tide::cuda::execute_phase(&done, Phase::Done).unwrap();
                                    best = best.min(t.elapsed());
                                }
                                // SAFETY: as above.
                                ck(unsafe { sys::cuEventRecord(b, streams[r] as sys::CUstream) }, "cuEventRecord");
                                (best, a as usize, b as usize)
                            })
                        })
                        .collect();
                    let out: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
                    gate.release();
                    out.into_iter()
                        .enumerate()
                        .map(|(r, (best, a, b))| {
                            sync(d, streams[r]);
                            let mut ms = 0f32;
                            // SAFETY: both events recorded and complete.
                            ck(
                                unsafe { sys::cuEventElapsedTime_v2(&mut ms, a as sys::CUevent, b as sys::CUevent) },
                                "cuEventElapsedTime",
                            );
                            (best, ms)
                        })
                        .collect()
                });
                let host = results.iter().map(|r| r.0).max().unwrap();
                let dev_us = results.iter().map(|r| r.1).fold(0f32, f32::max) as f64 * 1e3 / reps as f64;
                say(&format!(
                    "percall: {op:?} world {world} (ranks on GPU 0) TIDE_FUSE_BYTES={fuse} params {n}: host {:.1} us per start+done \
                     ({:.2} us/param, best of {reps}), device {dev_us:.1} us per call ({:.2} us/param{})",
                    host.as_secs_f64() * 1e6,
                    host.as_secs_f64() * 1e6 / n as f64,
                    dev_us / n as f64,
                    if gated { "" } else { ", ungated: includes host gaps" }
                ));
            }
        }
    }
    tide::config::set_override(None);
}
