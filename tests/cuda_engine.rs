//! The CUDA engine on real GPUs, without JAX: one host thread per device calls `tide::cuda::execute`
//! on its own stream (as XLA does), and the outputs are compared bitwise with the CPU engine running
//! the same plan (`engine::cpu::run_threads`): the all-gather byte for byte, the reduce-scatter
//! bitwise too (the same fp32 summation order). Odd shapes and all three gradient dtypes; small
//! stage slots (TIDE_RS_SLOT_BYTES=65536) so the reduce-scatter runs many chunks through 2 slots;
//! back-to-back calls with no host synchronization in between (event and stage reuse).
//!
//! Runs on every visible GPU (world = device count, and world = 1). Needs a GPU, so `#[ignore]`d:
//! a machine without one reports it ignored, never passed; run with `--ignored` (it panics without
//! a CUDA driver or GPU). Built here by `scripts/gpu bundle`, run on the GPU machine (it has no Rust
//! toolchain) by `scripts/gpu run OUT engine`, or by hand from the repo root:
//!   .carry/cuda_engine --ignored --nocapture
//! Rerun with TIDE_LOCAL_COPY=sm (the SM local copy) and =ce (own shard on a copy stream of its own) to
//! cover the other local-copy paths (the default is ce-peers).

use cudarc::driver::sys;
use tide::call::{BufferView, CallInfo};
use tide::cuda::driver::check;
use tide::engine::cpu::run_threads;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Op, Plan};
use tide::topology::Topology;

mod common;
use common::{fill, say};

fn specs() -> Vec<ParamSpec> {
    common::odd_group()
}

struct Dev {
    ordinal: i64,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
}
// SAFETY: raw CUDA handles, usable from any thread.
unsafe impl Send for Dev {}
unsafe impl Sync for Dev {}

fn set_ctx(d: &Dev) {
    // SAFETY: retained primary context.
    check(
        unsafe { sys::cuCtxSetCurrent(d.ctx) },
        "cuCtxSetCurrent",
        || format!("device {}", d.ordinal),
    )
    .unwrap();
}

fn alloc_upload(d: &Dev, data: &[u8]) -> u64 {
    set_ctx(d);
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; at least 1 byte.
    check(
        unsafe { sys::cuMemAlloc_v2(&mut p, data.len().max(1)) },
        "cuMemAlloc",
        String::new,
    )
    .unwrap();
    if !data.is_empty() {
        // SAFETY: p holds data.len() bytes.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(p, data.as_ptr() as *const _, data.len()) },
            "cuMemcpyHtoD",
            String::new,
        )
        .unwrap();
    }
    p
}

fn download(d: &Dev, p: u64, len: usize) -> Vec<u8> {
    set_ctx(d);
    let mut v = vec![0u8; len];
    if len > 0 {
        // SAFETY: p holds len bytes.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut _, p, len) },
            "cuMemcpyDtoH",
            String::new,
        )
        .unwrap();
    }
    v
}

fn gpus() -> Option<Vec<Dev>> {
    if let Err(e) = tide::cuda::driver::init() {
        panic!("needs a CUDA GPU: {e}");
    }
    let mut count = 0;
    // SAFETY: valid out-pointer, driver initialized.
    check(
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
        String::new,
    )
    .unwrap();
    if count == 0 {
        panic!("needs a CUDA GPU: no CUDA device");
    }
    let mut devs = Vec::new();
    for ord in 0..count.min(8) {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid ordinal and out-pointers.
        unsafe {
            check(sys::cuDeviceGet(&mut dev, ord), "cuDeviceGet", String::new).unwrap();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
                String::new,
            )
            .unwrap();
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent", String::new).unwrap();
            check(
                sys::cuStreamCreate(&mut stream, 0),
                "cuStreamCreate",
                String::new,
            )
            .unwrap();
        }
        devs.push(Dev {
            ordinal: ord as i64,
            ctx,
            stream,
        });
    }
    Some(devs)
}

/// Runs `plan` on devs[0..world] `reps` times back to back (one host thread per device, no host
/// synchronization between calls), then checks every rank's outputs against the CPU engine.
#[allow(clippy::needless_range_loop)] // ranks and params index several tables at once
fn run_and_check(devs: &[Dev], op: Op, site: i64, world: usize, seed: u64, reps: usize) {
    let layout = GroupLayout::new(&specs(), world).unwrap();
    let topo = Topology::single_node(world);
    let plan: Plan = match op {
        Op::AllGather => plan::all_gather(&layout, topo).unwrap(),
        Op::ReduceScatter => {
            plan::reduce_scatter(&layout, topo, plan::RsOptions::from_config()).unwrap()
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
    let dims_full = |i: usize| layout.params[i].shape.clone();
    let dims_shard = |i: usize| {
        let p = &layout.params[i];
        let mut d = vec![p.shard_rows];
        d.extend(p.shape.iter().skip(1));
        d
    };
    let mut calls = Vec::new();
    let mut out_ptrs = Vec::new();
    for r in 0..world {
        let d = &devs[r];
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        let mut optrs = Vec::new();
        for i in 0..n {
            let p = &layout.params[i];
            let ip = alloc_upload(d, &inputs[r][i]);
            let op_ = alloc_upload(d, &vec![0xa5u8; plan.output_bytes(i)]);
            optrs.push(op_);
            let (idims, odims, odt) = match op {
                Op::AllGather => (dims_shard(i), dims_full(i), p.dtype),
                Op::ReduceScatter => (dims_full(i), dims_shard(i), DType::F32),
            };
            ins.push(BufferView {
                ptr: ip as usize,
                dtype: p.dtype,
                dims: idims,
            });
            outs.push(BufferView {
                ptr: op_ as usize,
                dtype: odt,
                dims: odims,
            });
        }
        out_ptrs.push(optrs);
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
            topology: topo,
            names: specs().iter().map(|s| s.name.clone()).collect(),
            inputs: ins,
            outputs: outs,
            stream: d.stream as usize,
            at: None,
            cast: None,
            urgent: false,
        });
    }
    std::thread::scope(|s| {
        for r in 0..world {
            let call = &calls[r];
            let d = &devs[r];
            s.spawn(move || {
                for rep in 0..reps {
                    if let Err(e) = tide::cuda::execute(call) {
                        panic!("{op:?} world {world} rank {r} rep {rep}: {e}");
                    }
                }
                set_ctx(d);
                // SAFETY: our stream.
                check(
                    unsafe { sys::cuStreamSynchronize(d.stream) },
                    "cuStreamSynchronize",
                    || format!("device {} after {op:?}", d.ordinal),
                )
                .unwrap();
            });
        }
    });
    for r in 0..world {
        for i in 0..n {
            let got = download(&devs[r], out_ptrs[r][i], plan.output_bytes(i));
            if got != want[r][i] {
                let first = got
                    .iter()
                    .zip(&want[r][i])
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                panic!(
                    "{op:?} world {world} rank {r}: {} differs from the CPU engine at byte {first} of {}",
                    layout.params[i].describe(),
                    got.len()
                );
            }
        }
    }
    say(&format!(
        "cuda_engine: {op:?} world {world} x{reps}: bitwise equal to the CPU engine"
    ));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_engine_matches_cpu_engine() {
    // Before anything reads the configuration: small slots, so the reduce-scatter pipelines many
    // chunks through its 2 slots; a short timeout so a hang shows as an error.
    std::env::set_var("TIDE_RS_SLOT_BYTES", "65536");
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let Some(devs) = gpus() else { return };
    let all = devs.len();
    say(&format!("cuda_engine: {all} device(s)"));
    let mut site = 1000;
    for world in [1, all]
        .into_iter()
        .collect::<std::collections::BTreeSet<_>>()
    {
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
            run_and_check(&devs, op, site, world, 17 + k as u64, 1);
            site += 1;
            run_and_check(&devs, op, site, world, 99 + k as u64, 50);
        }
    }
    // The reduction kernel at few and many CTAs: 64 KiB slots (many small launches) and 1 MiB slots
    // (many quads per thread), 3 and 64 CTAs.
    for (slot, ctas) in [(65536usize, 3u32), (1 << 20, 3), (1 << 20, 64)] {
        let mut c = tide::config::Config::from_env();
        c.rs_slot_bytes = slot;
        c.rs_max_ctas = ctas;
        tide::config::set_override(Some(c));
        for world in [1, all]
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
        {
            say(&format!(
                "cuda_engine: reduce-scatter slot {slot} ctas {ctas}"
            ));
            site += 1;
            run_and_check(&devs, Op::ReduceScatter, site, world, 7 + ctas as u64, 1);
            site += 1;
            run_and_check(&devs, Op::ReduceScatter, site, world, 8 + slot as u64, 20);
        }
    }
    tide::config::set_override(None);
}

/// The peers of `rank` in a world-`world` case, emulated by buffers holding their inputs.
fn emulated_peers(case: &common::gpu::Case, world: usize, rank: usize) -> Vec<tide::cuda::EmulatedPeer> {
    let bytes = |v: &BufferView| v.dims.iter().product::<usize>() * v.dtype.size_bytes();
    (0..world)
        .filter(|&q| q != rank)
        .map(|q| tide::cuda::EmulatedPeer {
            inputs: case.calls[q].inputs.iter().map(|v| (v.ptr as u64, bytes(v))).collect(),
            outputs: Vec::new(),
        })
        .collect()
}

/// One rank of a world-`world` call alone on GPU 0, its peers emulated by buffers holding their
/// inputs (`tide::cuda::execute_emulated`, what examples/interference.rs measures at P = 2..8),
/// against the CPU engine's output of that rank, bitwise; twice back to back.
fn emulated_rank_matches(gpu: &common::gpu::Gpu, op: Op, site: i64, world: usize, rank: usize, seed: u64) {
    emulated_group_matches(gpu, op, site, world, rank, seed, &specs());
}

fn emulated_group_matches(
    gpu: &common::gpu::Gpu,
    op: Op,
    site: i64,
    world: usize,
    rank: usize,
    seed: u64,
    group: &[ParamSpec],
) {
    let specs = || group.to_vec();
    let stream = gpu.stream();
    // Every rank's buffers (inputs uploaded, outputs 0xa5) and the CPU engine's outputs.
    let ranks: Vec<(usize, usize)> = (0..world).map(|r| (r, stream)).collect();
    let case = common::gpu::make_case(gpu, op, site, 0, world, &ranks, &specs(), seed, &mut |b| gpu.upload(b));
    let peers = emulated_peers(&case, world, rank);
    for rep in 0..2 {
        tide::cuda::execute_emulated(&case.calls[rank], &peers)
            .unwrap_or_else(|e| panic!("{op:?} world {world} rank {rank} rep {rep}: {e}"));
    }
    gpu.sync(stream);
    for (i, &p) in case.outs[rank].iter().enumerate() {
        assert!(
            gpu.download(p, case.out_bytes[i]) == case.want[rank][i],
            "{op:?} world {world} rank {rank} (emulated peers): param {i} ({}) differs from the CPU engine",
            specs()[i].name
        );
    }
}

/// A reduce-scatter into slices (`CallInfo::at`, what scan_layers' gradient buffers take): rank
/// `rank` of world `world` (emulated peers) writes its shards into slice `slice(index)` of buffers of
/// 3 slices, bitwise the CPU engine's, every other byte of the buffers untouched.
fn into_slices_match(gpu: &common::gpu::Gpu, site: i64, world: usize, rank: usize, index: i32, seed: u64) {
    const COUNT: usize = 3;
    let stream = gpu.stream();
    let ranks: Vec<(usize, usize)> = (0..world).map(|r| (r, stream)).collect();
    let case = common::gpu::make_case(gpu, Op::ReduceScatter, site, 0, world, &ranks, &specs(), seed, &mut |b| gpu.upload(b));
    let peers = emulated_peers(&case, world, rank);
    let mut call = case.calls[rank].clone();
    let at = tide::call::OutputAt { index_ptr: gpu.upload(&index.to_le_bytes()) as usize, count: COUNT };
    let mut bufs = Vec::new();
    for (i, o) in call.outputs.iter_mut().enumerate() {
        let fill: Vec<u8> = (0..COUNT * case.out_bytes[i]).map(|k| (k as u8).wrapping_mul(31) ^ 0x5a).collect();
        let p = gpu.upload(&fill);
        o.ptr = p as usize;
        o.dims.insert(0, COUNT);
        bufs.push((p, fill));
    }
    call.at = Some(at);
    tide::cuda::execute_emulated(&call, &peers).unwrap_or_else(|e| panic!("into world {world} rank {rank}: {e}"));
    gpu.sync(stream);
    let s = at.slice(index);
    for (i, (p, fill)) in bufs.iter().enumerate() {
        let n = case.out_bytes[i];
        let got = gpu.download(*p, COUNT * n);
        let mut want = fill.clone();
        want[s * n..(s + 1) * n].copy_from_slice(&case.want[rank][i]);
        assert!(
            got == want,
            "into slices, world {world} rank {rank} index {index}: param {i} ({}) differs (slice {s} from the CPU engine, the rest untouched)",
            specs()[i].name
        );
    }
}

/// The casting all-gather's data path (`tide::cast`): rank `rank`'s operand is a view of its own
/// rows of its result, already in place, so its own copy is one onto itself (skipped by the issuer)
/// and only the peers' rows move; the result is bitwise the CPU engine's (peers emulated).
fn in_place_gather_matches(gpu: &common::gpu::Gpu, site: i64, world: usize, rank: usize, seed: u64) {
    let stream = gpu.stream();
    let ranks: Vec<(usize, usize)> = (0..world).map(|r| (r, stream)).collect();
    let case = common::gpu::make_case(gpu, Op::AllGather, site, 0, world, &ranks, &specs(), seed, &mut |b| gpu.upload(b));
    let peers = emulated_peers(&case, world, rank);
    let mut call = case.calls[rank].clone();
    let layout = call.layout().expect("layout");
    for (i, p) in layout.params.iter().enumerate() {
        // the result: 0x5a everywhere but this rank's own rows, which hold its shard (as the cast left them)
        let (offset, elems) = tide::cast::own_rows(p, rank);
        let own = elems * p.dtype.size_bytes();
        let mut fill = vec![0x5au8; case.out_bytes[i]];
        fill[offset..offset + own].copy_from_slice(&case.want[rank][i][offset..offset + own]);
        let out = gpu.upload(&fill);
        call.outputs[i].ptr = out as usize;
        call.inputs[i].ptr = if own > 0 { out as usize + offset } else { out as usize };
    }
    for rep in 0..2 {
        tide::cuda::execute_emulated(&call, &peers).unwrap_or_else(|e| panic!("in place world {world} rank {rank} rep {rep}: {e}"));
    }
    gpu.sync(stream);
    for (i, o) in call.outputs.iter().enumerate() {
        assert!(
            gpu.download(o.ptr as u64, case.out_bytes[i]) == case.want[rank][i],
            "in-place gather, world {world} rank {rank}: param {i} ({}) differs from the CPU engine",
            specs()[i].name
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn in_place_gathers_match_the_cpu_engine() {
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let mut site = 7800;
    for (piece, fuse) in [(1usize << 32, 0usize), (4096, 1 << 20), (32 << 20, 1 << 20)] {
        let mut c = tide::config::Config::from_env();
        c.ce_piece_bytes = piece;
        c.fuse_bytes = fuse;
        tide::config::set_override(Some(c));
        for world in [1usize, 2, 3, 8] {
            for rank in [0, world - 1].into_iter().collect::<std::collections::BTreeSet<_>>() {
                site += 1;
                in_place_gather_matches(&gpu, site, world, rank, site as u64);
            }
        }
        say(&format!("cuda_engine: in-place gathers (TIDE_CE_PIECE_BYTES={piece}, TIDE_FUSE_BYTES={fuse}): bitwise equal to the CPU engine"));
    }
    tide::config::set_override(None);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn into_slices_match_the_cpu_engine() {
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let mut site = 7600;
    for (cta, fuse) in [(0usize, 0usize), (4096, 1 << 20), (512 << 10, 1 << 20)] {
        let mut c = tide::config::Config::from_env();
        c.rs_cta_bytes = cta;
        c.fuse_bytes = fuse;
        tide::config::set_override(Some(c));
        for world in [1usize, 2, 3, 8] {
            for rank in [0, world - 1].into_iter().collect::<std::collections::BTreeSet<_>>() {
                for index in [0, 2, -1, 9, -7] {
                    site += 1;
                    into_slices_match(&gpu, site, world, rank, index, site as u64);
                }
            }
        }
        say(&format!("cuda_engine: reduce-scatter into slices (TIDE_RS_CTA_BYTES={cta}, TIDE_FUSE_BYTES={fuse}): bitwise equal to the CPU engine, other slices untouched"));
    }
    tide::config::set_override(None);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn emulated_ranks_match_the_cpu_engine() {
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let mut site = 7000;
    // (TIDE_RS_CTA_BYTES, TIDE_CE_PIECE_BYTES, TIDE_RS_SLOT_BYTES): one grid-stride launch per sum
    // and whole copies; tiny sum pieces and 4 KiB copy pieces through small slots; the defaults.
    for (cta, piece, slot) in [(0usize, 1usize << 32, 32usize << 20), (4096, 4096, 65536), (512 << 10, 32 << 20, 65536)] {
        let mut c = tide::config::Config::from_env();
        c.rs_cta_bytes = cta;
        c.ce_piece_bytes = piece;
        c.rs_slot_bytes = slot;
        tide::config::set_override(Some(c));
        for world in [1usize, 2, 3, 8] {
            for op in [Op::AllGather, Op::ReduceScatter] {
                for rank in [0, world - 1].into_iter().collect::<std::collections::BTreeSet<_>>() {
                    site += 1;
                    emulated_rank_matches(&gpu, op, site, world, rank, site as u64);
                }
            }
        }
        say(&format!("cuda_engine: emulated ranks (TIDE_RS_CTA_BYTES={cta}, TIDE_CE_PIECE_BYTES={piece}, TIDE_RS_SLOT_BYTES={slot}): bitwise equal to the CPU engine"));
    }
    tide::config::set_override(None);
}

/// Parameters sharded along dims 1 and 2 ([Note: strided parameters]: what `tide_jax.lax` gathers
/// with `axis=k`), beside dim-0 ones, for `world` ranks: 2-D copies on the copy engines.
fn strided_specs(world: usize) -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("experts.up", &[4, 2 * world, 33], DType::BF16).along(1),
        ParamSpec::new("w_cols", &[64, 3 * world], DType::F32).along(1),
        ParamSpec::new("w7x5", &[7, 5], DType::BF16),
        ParamSpec::new("experts.down", &[3, 5, 4 * world], DType::F16).along(2),
        ParamSpec::new("big_cols", &[512, 8 * world], DType::BF16).along(1),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn strided_emulated_ranks_match_the_cpu_engine() {
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let mut site = 9000;
    for slot in [65536usize, 32 << 20] {
        let mut c = tide::config::Config::from_env();
        c.rs_slot_bytes = slot;
        tide::config::set_override(Some(c));
        for world in [1usize, 2, 3, 8] {
            for op in [Op::AllGather, Op::ReduceScatter] {
                for rank in [0, world - 1].into_iter().collect::<std::collections::BTreeSet<_>>() {
                    site += 1;
                    emulated_group_matches(&gpu, op, site, world, rank, site as u64, &strided_specs(world));
                }
            }
        }
        say(&format!("cuda_engine: strided parameters (dims 1 and 2), emulated ranks 1/2/3/8 (TIDE_RS_SLOT_BYTES={slot}): bitwise equal to the CPU engine"));
    }
    tide::config::set_override(None);
}

/// A benchmark run with the GPU tests (it asserts only that both gathers ran): one rank of an
/// emulated world-8 all-gather of one bf16 weight, gathered along dim 1 (2-D copies) and along dim
/// 0 (contiguous) with the same bytes; the median of 15 timed calls each after 3 warm-ups, as
/// GB/s of the full parameter landed. Lines start with `strided_bench:` (bench/RESULTS.md).
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn strided_gather_bandwidth() {
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let world = 8;
    let mut site = 9500;
    for (rows, cols) in [(4096usize, 14336usize), (8 * 1024, 2048), (64, 65536)] {
        let mut line = format!("strided_bench: bf16 [{rows}, {cols}] world {world} (emulated):");
        let mut rates = Vec::new();
        for (name, spec) in [
            ("dim 1", ParamSpec::new("w", &[rows, cols], DType::BF16).along(1)),
            ("dim 0", ParamSpec::new("w", &[cols, rows], DType::BF16)),
        ] {
            site += 1;
            let stream = gpu.stream();
            let ranks: Vec<(usize, usize)> = (0..world).map(|r| (r, stream)).collect();
            let case = common::gpu::make_case(&gpu, Op::AllGather, site, 0, world, &ranks, &[spec], 1, &mut |b| gpu.upload(b));
            let peers = emulated_peers(&case, world, 0);
            let mut times = Vec::new();
            for rep in 0..18 {
                let t = std::time::Instant::now();
                tide::cuda::execute_emulated(&case.calls[0], &peers).unwrap_or_else(|e| panic!("{name}: {e}"));
                gpu.sync(stream);
                if rep >= 3 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let med = times[times.len() / 2];
            let bytes = (rows * cols * 2) as f64;
            rates.push(bytes / med / 1e9);
            line += &format!(" {name} {:.1} us {:.0} GB/s;", med * 1e6, bytes / med / 1e9);
        }
        say(&format!("{line} dim 1 / dim 0 = {:.2}", rates[0] / rates[1]));
    }
}
