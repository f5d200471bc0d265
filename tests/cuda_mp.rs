//! The CUDA engine across processes (`tide::cuda::execute` / `execute_phase` with `call.job` != 0), without JAX:
//! this binary re-runs itself as 2 child processes, one GPU each (`CUDA_VISIBLE_DEVICES`, like the
//! launcher), which run all-gathers and reduce-scatters of an odd-shaped group and compare their
//! outputs bitwise with the CPU engine running the same plan over all ranks in-process (every child
//! generates every rank's inputs from the same seed).
//! - flat 1x2: copy engines over peer memory mapped across processes (inputs live in a VMM pool
//!   exported by POSIX fd, as XLA's do; the stage buffer goes through legacy CUDA IPC);
//! - forced 2x1: the hierarchical plans, cross-node copies over NCCL (libnccl.so.2 or TIDE_NCCL_LIB);
//! - a process that exits while its peer is inside a call: the peer fails within seconds, naming it.
//!
//! TIDE_CUDA_MP_SPLIT=1 runs every call as start + done.
//! Needs 2 GPUs (`processes_share_one_gpu`: one): `#[ignore]`d (run with --ignored; panics without a driver or with
//! fewer GPUs). Built here by `scripts/gpu bundle` (.carry/cuda_mp), run on the GPU machine (no Rust there) by
//! `scripts/gpu run OUT engine` (bounded; on 2+ GPUs the whole binary), or by hand:
//!   .carry/cuda_mp --ignored --nocapture --test-threads=1
//! NCCL: libnccl.so.2 from the loader's path, or TIDE_NCCL_LIB (scripts/gpu sets the nvidia wheel's).

use cudarc::driver::sys;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tide::call::{BufferView, CallInfo};
use tide::cuda::driver::check;
use tide::engine::cpu::run_threads;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Op, Plan};
use tide::topology::Topology;

mod common;
use common::{fill, say};

const CHILD_ENV: &str = "TIDE_CUDA_MP_CHILD";

fn specs() -> Vec<ParamSpec> {
    let mut specs = common::odd_group();
    specs.push(ParamSpec::new("one_row", &[1, 7], DType::F32));
    specs
}

fn ck(r: sys::CUresult, call: &str) {
    check(r, call, String::new).unwrap();
}

/// A VMM pool like XLA's (one cuMemCreate allocation, POSIX-fd exportable), bump-allocated.
fn set_ctx(c: &Child) {
    // SAFETY: retained primary context.
    ck(unsafe { sys::cuCtxSetCurrent(c.ctx) }, "cuCtxSetCurrent");
}

struct Pool {
    base: u64,
    size: usize,
    used: usize,
}

impl Pool {
    fn new(bytes: usize, device: i32) -> Pool {
        // SAFETY: plain driver calls with valid arguments; device 0 of this process.
        unsafe {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            prop.location = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
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
            ck(
                sys::cuMemAddressReserve(&mut p, size, 0, 0, 0),
                "cuMemAddressReserve",
            );
            ck(sys::cuMemMap(p, size, 0, h, 0), "cuMemMap");
            let desc = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ck(sys::cuMemSetAccess(p, size, &desc, 1), "cuMemSetAccess");
            Pool {
                base: p,
                size,
                used: 0,
            }
        }
    }

    fn upload(&mut self, data: &[u8]) -> u64 {
        let off = self.used.div_ceil(256) * 256;
        assert!(off + data.len() <= self.size, "pool too small");
        self.used = off + data.len().max(1);
        let p = self.base + off as u64;
        if !data.is_empty() {
            // SAFETY: p holds data.len() bytes.
            ck(
                unsafe { sys::cuMemcpyHtoD_v2(p, data.as_ptr() as *const _, data.len()) },
                "cuMemcpyHtoD",
            );
        }
        p
    }
}

fn alloc_fill(len: usize, byte: u8) -> u64 {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ck(
        unsafe { sys::cuMemAlloc_v2(&mut p, len.max(1)) },
        "cuMemAlloc",
    );
    ck(
        unsafe { sys::cuMemsetD8_v2(p, byte, len.max(1)) },
        "cuMemsetD8",
    );
    p
}

fn download(p: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    if len > 0 {
        // SAFETY: p holds len bytes.
        ck(
            unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut _, p, len) },
            "cuMemcpyDtoH",
        );
    }
    v
}

struct Child {
    topo: Topology,
    job: u64,
    rank: usize,
    device: i64,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
}
// SAFETY: raw CUDA handles, usable from any thread.
unsafe impl Send for Child {}
unsafe impl Sync for Child {}

fn open_device(ordinal: i32) -> (sys::CUcontext, sys::CUstream) {
    let mut dev = 0;
    let mut ctx = std::ptr::null_mut();
    let mut stream = std::ptr::null_mut();
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        ck(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet");
        ck(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            "cuDevicePrimaryCtxRetain",
        );
        ck(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        ck(
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            ),
            "cuStreamCreate",
        );
    }
    (ctx, stream)
}

fn setup_child(spec: &str) -> (String, Child) {
    // scenario:nodes:gpus:job:rank
    let p: Vec<&str> = spec.split(':').collect();
    let topo = Topology::new(p[1].parse().unwrap(), p[2].parse().unwrap()).unwrap();
    let job: u64 = p[3].parse().unwrap();
    let rank: usize = p[4].parse().unwrap();
    tide::cuda::driver::init().unwrap();
    if let Ok(dir) = std::env::var("TIDE_CUDA_MP_NODE_LOCAL_DIR") {
        node_local_bootstrap(&dir, job, rank, topo);
    }
    // Device 0 of this process (CUDA_VISIBLE_DEVICES picks the GPU).
    let (ctx, stream) = open_device(0);
    (
        p[0].to_string(),
        Child {
            topo,
            job,
            rank,
            device: 0,
            ctx,
            stream,
        },
    )
}

/// What `tide_jax.setup_nccl` does for processes on several hosts, with files in `dir` standing in
/// for JAX's key-value store: the job's control plane per node, and each rail's ncclUniqueId made
/// by its node-0 rank and registered by every member (nothing read from another node's memory).
fn node_local_bootstrap(dir: &str, job: u64, rank: usize, topo: Topology) {
    tide::cuda::multiproc::set_node_local(job);
    let g = topo.gpus_per_node;
    let rail = rank % g;
    let path = format!("{dir}/{job:016x}-rail{rail}.id");
    if rank / g == 0 {
        let id = tide::cuda::nccl::unique_id().expect("ncclGetUniqueId");
        let tmp = format!("{path}.tmp{rank}");
        std::fs::write(&tmp, id).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let id = loop {
        if let Ok(b) = std::fs::read(&path) {
            if b.len() == 128 {
                break b;
            }
        }
        assert!(
            Instant::now() < deadline,
            "rail {rail}'s id never appeared at {path}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    tide::cuda::nccl::set_unique_id(job, 0, rail, id.try_into().unwrap());
}

/// Runs `op` over the child's topology `reps` times back to back (no host sync in between), then
/// checks this rank's outputs bitwise against the CPU engine. Returns the call's error, if any.
fn run_case(
    c: &Child,
    pool: &mut Pool,
    op: Op,
    site: i64,
    seed: u64,
    reps: usize,
) -> Result<(), String> {
    run_case_with(c, pool, op, site, seed, reps, true)
}

/// One call ready to run: buffers allocated and filled, expected outputs computed.
struct Case {
    call: CallInfo,
    optrs: Vec<u64>,
    want: Vec<Vec<Vec<u8>>>,
    layout: GroupLayout,
    plan: Plan,
}

#[allow(clippy::needless_range_loop)] // i indexes the layout, inputs and outputs
fn prepare_case(c: &Child, pool: &mut Pool, op: Op, site: i64, seed: u64) -> Case {
    set_ctx(c);
    let world = c.topo.world();
    let layout = GroupLayout::new(&specs(), world).unwrap();
    let plan: Plan = match op {
        Op::AllGather => plan::all_gather(&layout, c.topo).unwrap(),
        Op::ReduceScatter => {
            plan::reduce_scatter(&layout, c.topo, plan::RsOptions::from_config()).unwrap()
        }
    };
    let n = layout.len();
    let inputs: Vec<Vec<Vec<u8>>> = (0..world)
        .map(|r| {
            (0..n)
                .map(|i| {
                    let mut b = vec![0u8; plan.input_bytes(i)];
                    fill(
                        &mut b,
                        layout.params[i].dtype,
                        seed ^ ((r as u64) << 32) ^ (i as u64 * 7919),
                    );
                    b
                })
                .collect()
        })
        .collect();
    let want = run_threads(&plan, &inputs).unwrap();
    let shard_dims = |i: usize| {
        let p = &layout.params[i];
        let mut d = vec![p.shard_rows];
        d.extend(p.shape.iter().skip(1));
        d
    };
    let mut ins = Vec::new();
    let mut outs = Vec::new();
    let mut optrs = Vec::new();
    for i in 0..n {
        let p = &layout.params[i];
        let ip = pool.upload(&inputs[c.rank][i]);
        let o = alloc_fill(plan.output_bytes(i), 0xa5);
        optrs.push(o);
        let (idims, odims, odt) = match op {
            Op::AllGather => (shard_dims(i), p.shape.clone(), p.dtype),
            Op::ReduceScatter => (p.shape.clone(), shard_dims(i), DType::F32),
        };
        ins.push(BufferView {
            ptr: ip as usize,
            dtype: p.dtype,
            dims: idims,
        });
        outs.push(BufferView {
            ptr: o as usize,
            dtype: odt,
            dims: odims,
        });
    }
    let call = CallInfo {
        op,
        site,
        run_id: 0,
        rank_devices: Default::default(),
        job: c.job,
        device_ordinal: c.device,
        rank: c.rank,
        group: 0,
        world,
        topology: c.topo,
        names: specs().iter().map(|s| s.name.clone()).collect(),
        inputs: ins,
        outputs: outs,
        stream: c.stream as usize,
        at: None,
        cast: None,
        urgent: false,
    };
    Case {
        call,
        optrs,
        want,
        layout,
        plan,
    }
}

/// `run_case`; `check: false` only enqueues (no host synchronization, no comparison).
fn run_case_with(
    c: &Child,
    pool: &mut Pool,
    op: Op,
    site: i64,
    seed: u64,
    reps: usize,
    check: bool,
) -> Result<(), String> {
    let Case {
        call,
        optrs,
        want,
        layout,
        plan,
    } = prepare_case(c, pool, op, site, seed);
    let n = layout.len();
    // TIDE_CUDA_MP_SPLIT=1: every call as start + done (`execute_phase`), the done's operands
    // being the start's results then its operands, as XLA passes them.
    let split = std::env::var("TIDE_CUDA_MP_SPLIT").is_ok_and(|v| v == "1");
    for rep in 0..reps {
        let r = if split {
            let mut done = call.clone();
            done.inputs = call.outputs.iter().chain(call.inputs.iter()).cloned().collect();
            tide::cuda::execute_phase(&call, tide::call::Phase::Start)
                .and_then(|()| tide::cuda::execute_phase(&done, tide::call::Phase::Done))
        } else {
            tide::cuda::execute(&call)
        };
        r.map_err(|e| format!("{op:?} {} rank {} rep {rep}: {e}", c.topo, c.rank))?;
    }
    if !check {
        return Ok(());
    }
    // SAFETY: our stream.
    ck(
        unsafe { sys::cuStreamSynchronize(c.stream) },
        "cuStreamSynchronize",
    );
    for i in 0..n {
        let got = download(optrs[i], plan.output_bytes(i));
        if got != want[c.rank][i] {
            let first = got
                .iter()
                .zip(&want[c.rank][i])
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(format!(
                "{op:?} {} rank {}: {} differs from the CPU engine at byte {first} of {}",
                c.topo,
                c.rank,
                layout.params[i].describe(),
                got.len()
            ));
        }
    }
    println!(
        "cuda_mp: {op:?} {} rank {} x{reps}: bitwise equal to the CPU engine",
        c.topo, c.rank
    );
    Ok(())
}

/// Child entry point: does nothing unless run by `spawn`.
#[test]
fn child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (what, c) = setup_child(&spec);
    let mut pool = Pool::new(64 << 20, 0);
    match what.as_str() {
        "match" => {
            let mut site = 100;
            for (k, op) in [
                Op::AllGather,
                Op::ReduceScatter,
                Op::AllGather,
                Op::ReduceScatter,
            ]
            .into_iter()
            .enumerate()
            {
                site += 1;
                run_case(&c, &mut pool, op, site, 17 + k as u64, 1).unwrap();
                site += 1;
                run_case(&c, &mut pool, op, site, 99 + k as u64, 20).unwrap();
            }
            let st = tide::cuda::ipc::stats();
            println!("cuda_mp: rank {} ipc {st:?}", c.rank);
            if c.topo.nodes == 1 {
                // Peers read our inputs from the VMM pool: mapped once, whatever the call count.
                assert_eq!(st.vmm_imports, 1, "{st:?}");
            } else {
                assert_eq!(
                    st.vmm_imports + st.legacy_opens,
                    0,
                    "{st:?}"
                );
            }
            println!("cuda_mp child rank {} done", c.rank);
        }
        "die" => {
            run_case(&c, &mut pool, Op::AllGather, 1, 5, 1).unwrap();
            if c.rank == 1 {
                // Leave while rank 0 is already inside its next call, waiting for us.
                std::thread::sleep(Duration::from_millis(500));
                std::process::exit(7);
            }
            let start = Instant::now();
            let err = run_case(&c, &mut pool, Op::ReduceScatter, 2, 6, 1)
                .expect_err("the peer died: the call must fail");
            let took = start.elapsed();
            println!("rank 0 error after {took:?}: {err}");
            assert!(
                err.contains("rank 1 (pid") && err.contains("died"),
                "unclear error: {err}"
            );
            assert!(
                took < Duration::from_secs(10),
                "took {took:?} to notice the dead peer"
            );
            let again =
                run_case(&c, &mut pool, Op::AllGather, 3, 7, 1).expect_err("sticky failure");
            assert!(again.contains("earlier tide call"), "{again}");
            println!("cuda_mp child rank 0 saw the dead peer");
        }
        "interleaved" => {
            // Two programs reaching the processes in opposite orders (issue #17 across processes:
            // two threads of each process launching them): rank 0 issues the all-gather (site
            // 201) first, rank 1 the reduce-scatter (site 202). Calls meet by launch order in the
            // group, so both must fail at once naming the other's call and the fix, not wait out
            // the timeout; the job's later calls fail at once (sticky, as after any error).
            // One matched call first: both processes started and warm, so the time below is the
            // meeting's, not a peer's start-up.
            run_case(&c, &mut pool, Op::AllGather, 200, 7, 1).unwrap();
            let order = if c.rank == 0 {
                [(Op::AllGather, 201), (Op::ReduceScatter, 202)]
            } else {
                [(Op::ReduceScatter, 202), (Op::AllGather, 201)]
            };
            let start = Instant::now();
            let err = run_case(&c, &mut pool, order[0].0, order[0].1, 8, 1)
                .expect_err("programs in opposite orders: the call must fail");
            let took = start.elapsed();
            println!("rank {} error after {took:?}: {err}", c.rank);
            assert!(
                err.contains("is in a different call") && err.contains("dispatch_lock") && err.contains("one thread per process"),
                "unclear error: {err}"
            );
            assert!(took < Duration::from_secs(1), "took {took:?} to fail");
            let start = Instant::now();
            let again = run_case(&c, &mut pool, order[1].0, order[1].1, 9, 1).expect_err("sticky failure");
            assert!(again.contains("earlier tide call"), "{again}");
            assert!(start.elapsed() < Duration::from_secs(1), "later call took {:?}", start.elapsed());
            println!("cuda_mp child rank {} failed fast on interleaved programs", c.rank);
        }
        "kill" => {
            // Rank 1 is SIGKILLed at a random point of a stream of calls; rank 0 must fail soon,
            // naming it. Then: does rank 0's stream drain (GPU waits on the dead peer's events)?
            if c.rank == 1 {
                let ms: u64 = std::env::var("TIDE_CUDA_MP_KILL_MS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(400);
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(ms));
                    // SAFETY: signalling ourselves.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                });
            }
            // Buffers made once: nothing in the loop allocates or synchronizes (cuMemAlloc may
            // synchronize the device, which a stream waiting on the dead peer would block).
            let cases = [
                prepare_case(&c, &mut pool, Op::ReduceScatter, 1, 1),
                prepare_case(&c, &mut pool, Op::AllGather, 2, 2),
            ];
            let start = Instant::now();
            let mut site = 0;
            let err = loop {
                site += 1;
                let case = &cases[site % 2];
                if let Err(e) = tide::cuda::execute(&case.call) {
                    break format!("{:?} {} rank {}: {e}", case.call.op, c.topo, c.rank);
                }
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "rank {} never failed",
                    c.rank
                );
            };
            let took = start.elapsed();
            println!("rank {} error after {took:?} ({site} calls): {err}", c.rank);
            assert!(
                err.contains("rank 1 (pid") && err.contains("died"),
                "unclear error: {err}"
            );
            assert!(took < Duration::from_secs(20), "took {took:?}");
            let (tx, rx) = std::sync::mpsc::channel();
            let (ctx, stream) = (c.ctx as usize, c.stream as usize);
            std::thread::spawn(move || {
                // SAFETY: our context and stream.
                unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
                let r = unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) };
                let _ = tx.send(r);
            });
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(r) => println!("cuda_mp kill: rank 0's stream drained after the failure ({r:?})"),
                Err(_) => println!("cuda_mp kill: rank 0's stream still busy 10 s after the failure (GPU waits on the dead peer)"),
            }
            println!("cuda_mp child rank 0 saw the killed peer");
            let _ = std::io::stdout().flush();
            std::process::exit(0);
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn gpu_count() -> Option<i32> {
    if let Err(e) = tide::cuda::driver::init() {
        panic!("needs 2 CUDA GPUs: {e}");
    }
    let mut count = 0;
    // SAFETY: valid out-pointer.
    ck(
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    );
    if count < 2 {
        panic!("needs 2 CUDA GPUs, found {count}");
    }
    Some(count)
}

fn fresh_job(salt: u64) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    ((t ^ (std::process::id() as u64) << 20 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 2).max(1)
}

fn visible() -> Vec<String> {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) if !v.trim().is_empty() => v.split(',').map(|s| s.trim().to_string()).collect(),
        _ => (0..2).map(|i| i.to_string()).collect(),
    }
}

fn spawn(what: &str, topo: Topology, job: u64) -> Vec<std::process::Output> {
    spawn_with(what, topo, job, &[])
}

fn spawn_with(
    what: &str,
    topo: Topology,
    job: u64,
    env: &[(&str, &str)],
) -> Vec<std::process::Output> {
    let exe = std::env::current_exe().unwrap();
    let gpus = visible();
    let children: Vec<_> = (0..topo.world())
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
                .env(
                    CHILD_ENV,
                    format!("{what}:{}:{}:{job}:{rank}", topo.nodes, topo.gpus_per_node),
                )
                .env("CUDA_VISIBLE_DEVICES", &gpus[rank % gpus.len()])
                .env("TIDE_RS_SLOT_BYTES", "65536")
                .env("TIDE_TIMEOUT_S", "60")
                .env("NCCL_NVLS_ENABLE", "0")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

fn report(out: &std::process::Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Two processes on ONE GPU (both children see GPU 0): the flat 1x2 plans through the VMM export
/// between processes, synchronous and as start + done (issue #9: what one GPU can show of the
/// multi-process driver). Bitwise vs the CPU engine, as `processes_match_cpu_engine`.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn processes_share_one_gpu() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    if let Err(e) = tide::cuda::driver::init() {
        panic!("needs a CUDA GPU: {e}");
    }
    let topo = Topology::new(1, 2).unwrap();
    for (k, split) in ["0", "1"].into_iter().enumerate() {
        let t0 = Instant::now();
        let outs = spawn_with(
            "match",
            topo,
            fresh_job(300 + k as u64),
            &[("CUDA_VISIBLE_DEVICES", "0"), ("TIDE_CUDA_MP_SPLIT", split)],
        );
        for (rank, out) in outs.iter().enumerate() {
            let text = report(out);
            assert!(out.status.success(), "{topo} on one GPU (split {split}): rank {rank} failed:\n{text}");
            assert!(text.contains(&format!("cuda_mp child rank {rank} done")), "{topo} on one GPU (split {split}): rank {rank} did not finish:\n{text}");
        }
        say(&format!(
            "cuda_mp: {topo} as 2 processes sharing GPU 0{}: bitwise equal to the CPU engine ({:.1?})",
            if split == "1" { ", every call as start + done" } else { "" },
            t0.elapsed()
        ));
    }
}

/// Two processes on ONE GPU issuing two programs in opposite orders (the child's "interleaved"):
/// both fail within a second naming the call the other is in and the fix, none waits for the
/// timeout (TIDE_TIMEOUT_S=60 here).
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn processes_interleaved_on_one_gpu() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    if let Err(e) = tide::cuda::driver::init() {
        panic!("needs a CUDA GPU: {e}");
    }
    let topo = Topology::new(1, 2).unwrap();
    let t0 = Instant::now();
    let outs = spawn_with(
        "interleaved",
        topo,
        fresh_job(310),
        &[("CUDA_VISIBLE_DEVICES", "0"), ("TIDE_TIMEOUT_S", "60")],
    );
    let mut lines = Vec::new();
    for (rank, out) in outs.iter().enumerate() {
        let text = report(out);
        assert!(out.status.success(), "rank {rank} failed:\n{text}");
        assert!(text.contains(&format!("cuda_mp child rank {rank} failed fast")), "rank {rank}:\n{text}");
        if let Some(l) = text.lines().find(|l| l.contains("error after")) {
            lines.push(l.chars().take(160).collect::<String>());
        }
    }
    say(&format!(
        "cuda_mp: 2 processes on GPU 0, programs in opposite orders: both failed fast ({:.1?} in all): {}",
        t0.elapsed(),
        lines.join(" | ")
    ));
}

#[test]
#[ignore = "needs 2 CUDA GPUs: run with --ignored on the GPU machine"]
fn processes_match_cpu_engine() {
    if std::env::var(CHILD_ENV).is_ok() || gpu_count().is_none() {
        return;
    }
    for (k, (nodes, g)) in [(1usize, 2usize), (2, 1)].into_iter().enumerate() {
        let topo = Topology::new(nodes, g).unwrap();
        let start = Instant::now();
        let outs = spawn("match", topo, fresh_job(10 + k as u64));
        for (rank, out) in outs.iter().enumerate() {
            let text = report(out);
            for line in text
                .lines()
                .filter(|l| l.starts_with("cuda_mp") || l.contains("error"))
            {
                say(&format!("[{topo} rank {rank}] {line}"));
            }
            assert!(out.status.success(), "{topo}: rank {rank} failed:\n{text}");
            assert!(
                text.contains("done"),
                "{topo}: rank {rank} did not finish:\n{text}"
            );
        }
        say(&format!(
            "cuda_mp: {topo} over 2 processes: bitwise equal to the CPU engine ({:.1?})",
            start.elapsed()
        ));
    }
    // The multi-host control plane (per node, NCCL ids registered up front) on forced 2x1.
    let topo = Topology::new(2, 1).unwrap();
    let dir = std::env::temp_dir().join(format!("tide-cuda-mp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let start = Instant::now();
    let outs = spawn_with(
        "match",
        topo,
        fresh_job(19),
        &[("TIDE_CUDA_MP_NODE_LOCAL_DIR", dir.to_str().unwrap())],
    );
    for (rank, out) in outs.iter().enumerate() {
        let text = report(out);
        assert!(
            out.status.success() && text.contains("done"),
            "{topo} node-local: rank {rank} failed:\n{text}"
        );
    }
    say(&format!(
        "cuda_mp: {topo} node-local control plane over 2 processes: bitwise equal to the CPU engine ({:.1?})",
        start.elapsed()
    ));
}

#[test]
#[ignore = "needs 2 CUDA GPUs: run with --ignored on the GPU machine"]
fn dead_peer_fails_fast() {
    if std::env::var(CHILD_ENV).is_ok() || gpu_count().is_none() {
        return;
    }
    let topo = Topology::new(1, 2).unwrap();
    let outs = spawn("die", topo, fresh_job(77));
    assert_eq!(
        outs[1].status.code(),
        Some(7),
        "rank 1 should exit with 7:\n{}",
        report(&outs[1])
    );
    let text = report(&outs[0]);
    say(&format!(
        "cuda_mp dead peer: {}",
        text.lines()
            .find(|l| l.contains("error after"))
            .unwrap_or("?")
    ));
    assert!(outs[0].status.success(), "rank 0:\n{text}");
    assert!(text.contains("saw the dead peer"), "{text}");
}

#[test]
#[ignore = "needs 2 CUDA GPUs: run with --ignored on the GPU machine"]
fn dead_peer_mid_stream_fails_fast() {
    if std::env::var(CHILD_ENV).is_ok() || gpu_count().is_none() {
        return;
    }
    // Flat (copy engines, IPC events) and forced 2x1 (NCCL rail: the survivor aborts its
    // communicator so its stream does not wait forever for the dead peer's sends).
    // 2x1 killed after 400 ms dies during ncclCommInitRank; after 2500 ms, amid rail transfers.
    for (k, (nodes, g, ms)) in [(1usize, 2usize, "400"), (2, 1, "400"), (2, 1, "2500")]
        .into_iter()
        .enumerate()
    {
        let topo = Topology::new(nodes, g).unwrap();
        let outs = spawn_with(
            "kill",
            topo,
            fresh_job(78 + k as u64),
            &[("TIDE_CUDA_MP_KILL_MS", ms)],
        );
        let text = report(&outs[0]);
        for line in text
            .lines()
            .filter(|l| l.starts_with("cuda_mp kill") || l.contains("error after"))
        {
            say(&format!("cuda_mp killed peer {topo} after {ms} ms: {line}"));
        }
        assert!(outs[0].status.success(), "{topo} rank 0:\n{text}");
        assert!(text.contains("saw the killed peer"), "{topo}: {text}");
    }
}

/// Two ranks of one multi-process job in the same process (e.g. 2 processes x 2 GPUs with the
/// sharded axis inside a process): raw addresses and events, peer access, no IPC.
#[test]
#[ignore = "needs 2 CUDA GPUs: run with --ignored on the GPU machine"]
fn same_process_ranks_of_a_job() {
    if std::env::var(CHILD_ENV).is_ok() || gpu_count().is_none() {
        return;
    }
    install_segv_report();
    let topo = Topology::new(1, 2).unwrap();
    let job = fresh_job(79);
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let (ctx, stream) = open_device(r as i32);
            Child {
                topo,
                job,
                rank: r,
                device: r as i64,
                ctx,
                stream,
            }
        })
        .collect();
    let before = tide::cuda::ipc::stats();
    std::thread::scope(|s| {
        for c in &children {
            s.spawn(move || {
                set_ctx(c);
                let mut pool = Pool::new(32 << 20, c.device as i32);
                for (k, op) in [Op::AllGather, Op::ReduceScatter].into_iter().enumerate() {
                    run_case(c, &mut pool, op, 1 + k as i64, 31 + k as u64, 5).unwrap();
                }
            });
        }
    });
    let after = tide::cuda::ipc::stats();
    assert_eq!(
        (after.vmm_imports, after.legacy_opens),
        (before.vmm_imports, before.legacy_opens)
    );
    say("cuda_mp: two ranks of a job in one process: bitwise equal to the CPU engine");
}

extern "C" fn segv_report(sig: i32) {
    let bt = std::backtrace::Backtrace::force_capture();
    let _ = writeln!(std::io::stderr(), "cuda_mp: signal {sig}; backtrace:\n{bt}");
    std::process::exit(139);
}

/// Debug aid: a crash in a test prints where (not async-signal-safe; the process ends anyway).
fn install_segv_report() {
    // SAFETY: installing a handler; the handler only runs on a crash.
    unsafe {
        libc::signal(libc::SIGSEGV, segv_report as *const () as usize);
        libc::signal(libc::SIGBUS, segv_report as *const () as usize);
    }
}
