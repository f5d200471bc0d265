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
//! Rerun `strided_emulated_ranks_match_the_cpu_engine` with TIDE_COPY2D=0, batch, bands and
//! batch-bands to cover every landing of a strided parameter (the default is 1);
//! `strided_gather_variants` (TIDE_STRIDED_BENCH=1) times them all in one process.

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
    // TIDE_FUSE_CE_MIN 2: a copy stream's small copies fused into SM launches (as before issue
    // #38); the default: a few stay on the copy engines.
    let ce_default = tide::config::Config::defaults().fuse_ce_min;
    for (piece, fuse, ce_min) in [(1usize << 32, 0usize, ce_default), (4096, 1 << 20, 2), (32 << 20, 1 << 20, ce_default)] {
        let mut c = tide::config::Config::from_env();
        c.ce_piece_bytes = piece;
        c.fuse_bytes = fuse;
        c.fuse_ce_min = ce_min;
        tide::config::set_override(Some(c));
        for world in [1usize, 2, 3, 8] {
            for rank in [0, world - 1].into_iter().collect::<std::collections::BTreeSet<_>>() {
                site += 1;
                in_place_gather_matches(&gpu, site, world, rank, site as u64);
            }
        }
        say(&format!(
            "cuda_engine: in-place gathers (TIDE_CE_PIECE_BYTES={piece}, TIDE_FUSE_BYTES={fuse}, TIDE_FUSE_CE_MIN={ce_min}): bitwise equal to the CPU engine"
        ));
    }
    tide::config::set_override(None);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn into_slices_match_the_cpu_engine() {
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let mut site = 7600;
    let ce_default = tide::config::Config::defaults().fuse_ce_min;
    for (cta, fuse, ce_min) in [(0usize, 0usize, ce_default), (4096, 1 << 20, 2), (512 << 10, 1 << 20, ce_default)] {
        let mut c = tide::config::Config::from_env();
        c.rs_cta_bytes = cta;
        c.fuse_bytes = fuse;
        c.fuse_ce_min = ce_min;
        tide::config::set_override(Some(c));
        for world in [1usize, 2, 3, 8] {
            for rank in [0, world - 1].into_iter().collect::<std::collections::BTreeSet<_>>() {
                for index in [0, 2, -1, 9, -7] {
                    site += 1;
                    into_slices_match(&gpu, site, world, rank, index, site as u64);
                }
            }
        }
        say(&format!(
            "cuda_engine: reduce-scatter into slices (TIDE_RS_CTA_BYTES={cta}, TIDE_FUSE_BYTES={fuse}, TIDE_FUSE_CE_MIN={ce_min}): \
             bitwise equal to the CPU engine, other slices untouched"
        ));
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

/// How the environment's TIDE_COPY2D ran on this driver, for the log lines: the value, and where
/// `batch` / `batch-bands` had to fall back (no cuMemcpy3DBatchAsync_v2).
fn copy2d_label(c: &tide::config::Config) -> String {
    let v = c.copy2d;
    if v.batched() && !tide::cuda::driver::batch_copy_3d_supported() {
        format!(
            "TIDE_COPY2D={} (no cuMemcpy3DBatchAsync_v2 in this driver: ran as {})",
            v.name(),
            if v.banded() { "bands" } else { "1" }
        )
    } else {
        format!("TIDE_COPY2D={}", v.name())
    }
}

/// Parameters along dims 1 and 2 beside dim-0 ones, emulated world 1/2/3/8, both ops, small and
/// default stage slots, bitwise against the CPU engine (outputs start as 0xa5, so a row landed at
/// a wrong place or not at all differs). Reads TIDE_COPY2D (and the rest) from the environment:
/// run it under each value (0, 1, batch, bands, batch-bands). Under `bands` / `batch-bands` it
/// runs once more with 40-byte bands and 4 KiB pieces, so every 2-D copy is cut into bands of 1-5
/// rows that do not divide its rows (the default band, 2 MiB, cuts none of these small copies).
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn strided_emulated_ranks_match_the_cpu_engine() {
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let env = tide::config::Config::from_env();
    let mut site = 9000;
    let mut runs = vec![(65536usize, env.copy2d_band_bytes, env.ce_piece_bytes), (32 << 20, env.copy2d_band_bytes, env.ce_piece_bytes)];
    if env.copy2d.banded() {
        runs.push((65536, 40, 4096));
    }
    for (slot, band, piece) in runs {
        let mut c = env.clone();
        c.rs_slot_bytes = slot;
        c.copy2d_band_bytes = band;
        c.ce_piece_bytes = piece;
        tide::config::set_override(Some(c.clone()));
        for world in [1usize, 2, 3, 8] {
            for op in [Op::AllGather, Op::ReduceScatter] {
                for rank in [0, world - 1].into_iter().collect::<std::collections::BTreeSet<_>>() {
                    site += 1;
                    emulated_group_matches(&gpu, op, site, world, rank, site as u64, &strided_specs(world));
                }
            }
        }
        say(&format!(
            "cuda_engine: strided parameters (dims 1 and 2), emulated ranks 1/2/3/8 (TIDE_RS_SLOT_BYTES={slot}, {}, \
             TIDE_COPY2D_BAND_BYTES={band}, TIDE_CE_PIECE_BYTES={piece}): bitwise equal to the CPU engine",
            copy2d_label(&c)
        ));
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

/// A host word a stream can wait on (mapped pinned memory): the stream holds at `hold(gen)` until
/// the host writes `gen` (`release`), so a call's work is all enqueued before the device starts it
/// and the events around it time the device alone. A watchdog thread releases a gate held for more
/// than 5 s (a full launch queue would block the issuing host thread while the gate blocks the
/// device) and says so; `bench_ops` keeps the gated calls far below that queue anyway.
struct Gate {
    host: *mut u32,
    dev: sys::CUdeviceptr,
    gen: std::sync::atomic::AtomicU32,
    born: std::time::Instant,
    /// Milliseconds since `born` at which the current hold began (+1); 0 when not held.
    held_since_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stuck: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Gate {
    fn new() -> Gate {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointers; 4 bytes of mapped pinned memory, never freed.
        unsafe {
            common::gpu::ck(sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc");
            common::gpu::ck(sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0), "cuMemHostGetDevicePointer");
            std::ptr::write_volatile(host as *mut u32, 0);
        }
        let held_since_ms = std::sync::Arc::new(AtomicU64::new(0));
        let stuck = std::sync::Arc::new(AtomicBool::new(false));
        let (held, st, word) = (held_since_ms.clone(), stuck.clone(), host as usize);
        let born = std::time::Instant::now();
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(250));
            let since = held.load(Ordering::Acquire);
            if since > 0 && born.elapsed().as_millis() as u64 > since + 5000 {
                st.store(true, Ordering::Release);
                // SAFETY: the pinned word, never freed; any value >= every generation releases.
                unsafe { std::ptr::write_volatile(word as *mut u32, u32::MAX >> 1) };
                held.store(0, Ordering::Release);
            }
        });
        Gate { host: host as *mut u32, dev, gen: std::sync::atomic::AtomicU32::new(0), born, held_since_ms, stuck }
    }
    /// Holds `stream` until `release` of the returned generation.
    fn hold(&self, stream: sys::CUstream) -> u32 {
        use std::sync::atomic::Ordering;
        let gen = self.gen.fetch_add(1, Ordering::AcqRel) + 1;
        self.held_since_ms.store(self.born.elapsed().as_millis() as u64 + 1, Ordering::Release);
        // SAFETY: mapped pinned memory; the stream belongs to the current context.
        common::gpu::ck(
            unsafe {
                sys::cuStreamWaitValue32_v2(stream, self.dev, gen, sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32)
            },
            "cuStreamWaitValue32",
        );
        gen
    }
    fn release(&self, gen: u32) {
        use std::sync::atomic::Ordering;
        // SAFETY: as in `new`.
        unsafe { std::ptr::write_volatile(self.host, gen) };
        std::sync::atomic::fence(Ordering::SeqCst);
        self.held_since_ms.store(0, Ordering::Release);
    }
}

fn timing_event() -> sys::CUevent {
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-pointer; timing enabled (flags 0).
    common::gpu::ck(unsafe { sys::cuEventCreate(&mut e, 0) }, "cuEventCreate");
    e
}

fn elapsed_us(a: sys::CUevent, b: sys::CUevent) -> f64 {
    let mut ms = 0f32;
    // SAFETY: both recorded and complete (the caller synchronized).
    common::gpu::ck(unsafe { sys::cuEventElapsedTime_v2(&mut ms, a, b) }, "cuEventElapsedTime");
    ms as f64 * 1e3
}

fn record(e: sys::CUevent, stream: usize) {
    // SAFETY: valid event and stream of the current context.
    common::gpu::ck(unsafe { sys::cuEventRecord(e, stream as sys::CUstream) }, "cuEventRecord");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Medians (us) of one call's cost: `wall` = host clock around the call and a stream sync (what
/// `strided_gather_bandwidth` reports), `issue` = until the call returned (host planning and
/// issuing), `gpu` = events on XLA's stream around the call (the device's time, with any gap the
/// host's issuing leaves in it), `gated` = the same with the stream held until the whole call was
/// enqueued (the device alone; `None` where the call has too many driver operations to hold).
struct Timing {
    wall: f64,
    issue: f64,
    gpu: f64,
    gated: Option<f64>,
}

fn time_call(gpu: &common::gpu::Gpu, gate: &Gate, call: &CallInfo, peers: &[tide::cuda::EmulatedPeer], gated: bool, reps: usize) -> Timing {
    let stream = call.stream;
    let (a, b) = (timing_event(), timing_event());
    let run = || tide::cuda::execute_emulated(call, peers).unwrap_or_else(|e| panic!("strided_bench: {e}"));
    for _ in 0..3 {
        run();
    }
    gpu.sync(stream);
    let (mut wall, mut issue, mut dev, mut held) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        gpu.set_current();
        record(a, stream);
        let t = std::time::Instant::now();
        run();
        issue.push(t.elapsed().as_secs_f64() * 1e6);
        record(b, stream);
        gpu.sync(stream);
        wall.push(t.elapsed().as_secs_f64() * 1e6);
        dev.push(elapsed_us(a, b));
    }
    if gated {
        for _ in 0..reps {
            gpu.set_current();
            let g = gate.hold(stream as sys::CUstream);
            record(a, stream);
            run();
            record(b, stream);
            gate.release(g);
            gpu.sync(stream);
            held.push(elapsed_us(a, b));
        }
    }
    Timing { wall: median(wall), issue: median(issue), gpu: median(dev), gated: gated.then(|| median(held)) }
}

/// A variant of the strided landing: TIDE_COPY2D's value, its band bytes, and the copy streams.
#[derive(Clone, Copy)]
struct Variant {
    via: tide::config::Copy2d,
    band: usize,
    streams: usize,
}

impl Variant {
    /// `NAME[:BAND][@STREAMS]`, NAME a TIDE_COPY2D value, BAND bytes (K and M suffixes).
    fn parse(s: &str) -> Variant {
        let (rest, streams) = match s.split_once('@') {
            Some((r, n)) => (r, n.parse().unwrap_or_else(|_| panic!("strided_bench: bad stream count in {s:?}"))),
            None => (s, 1),
        };
        let (name, band) = match rest.split_once(':') {
            Some((n, b)) => {
                let (digits, mult) = match b.chars().last() {
                    Some('K' | 'k') => (&b[..b.len() - 1], 1usize << 10),
                    Some('M' | 'm') => (&b[..b.len() - 1], 1 << 20),
                    _ => (b, 1),
                };
                (n, digits.parse::<usize>().unwrap_or_else(|_| panic!("strided_bench: bad band in {s:?}")) * mult)
            }
            None => (rest, tide::config::Config::defaults().copy2d_band_bytes),
        };
        let via = name.parse().unwrap_or_else(|e| panic!("strided_bench: {e}"));
        Variant { via, band, streams }
    }
    fn label(&self) -> String {
        let mut l = self.via.name().to_string();
        if self.via.banded() {
            l += &format!(" {}K", self.band >> 10);
        }
        if self.streams != 1 {
            l += &format!(" x{} streams", self.streams);
        }
        l
    }
}

/// Driver operations of one call under `v` beyond its fixed ~20 (events, waits): the 2-D
/// operations of `world` copies of `rows` rows of `width` bytes on `v.streams` streams.
fn bench_ops(v: &Variant, c: &tide::config::Config, world: usize, rows: usize, width: usize) -> usize {
    let one = tide::cuda::driver::StridedCopy { dst: 0, dst_pitch: width * world, src: 1 << 40, src_pitch: width, width, rows, dst_dev: 0, src_dev: 0 };
    let copies: Vec<_> = (0..world as u64).map(|q| tide::cuda::driver::StridedCopy { dst: q * width as u64, src: (1 << 40) + (q << 32), ..one }).collect();
    let ok = tide::cuda::driver::batch_copy_3d_supported();
    tide::cuda::copy2d::issue_plan(&copies, v.via, v.band, c.ce_piece_bytes, ok).len() + 20
}

/// Issue #37's bar: a strided gather (dim k > 0, 2-D copies) at >= 0.80 of the contiguous gather's
/// bytes/s for the same bytes. One rank of an emulated world-8 all-gather of one bf16 weight per
/// shape, gathered along dim 1 under each variant of the landing (TIDE_COPY2D = 1, batch, bands,
/// batch-bands; band sizes; 1 or 4 copy streams) and along dim 0 (contiguous, the defaults, before
/// and after the variants), each timed four ways (`Timing`: wall, issue, gpu, gated), medians of
/// 15 after 3 warm-ups, and the landed result checked bitwise against the CPU engine for every
/// variant. Then the driver alone per shape (`raw`): the 8 peer copies as 8 cuMemcpy2DAsync, as
/// 8 cuMemcpyAsync of the same bytes into a contiguous buffer, and one peer's cuMemcpy2DAsync,
/// gated, between events: what the copy engines give narrow rows without tide.
///
/// Lines start with `strided_bench:`; ratios are dim 0's time over dim 1's (= dim 1's bytes/s over
/// dim 0's). Only with TIDE_STRIDED_BENCH=1 (it takes ~30 s and the `engine` section of scripts/gpu
/// runs every ignored test); TIDE_STRIDED_SHAPES (`4096x14336,64x65536`) and TIDE_STRIDED_VARIANTS
/// (`1,batch,bands:2M@4`: NAME[:BAND][@STREAMS]) choose what runs.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn strided_gather_variants() {
    if std::env::var("TIDE_STRIDED_BENCH").ok().as_deref() != Some("1") {
        say("strided_bench: skipped (TIDE_STRIDED_BENCH=1 runs it: ~30 s on one H100)");
        return;
    }
    std::env::set_var("TIDE_TIMEOUT_S", "60");
    let gpu = common::gpu::Gpu::open();
    let gate = Gate::new();
    let world = 8;
    let reps = 15;
    let base = tide::config::Config::from_env();
    let driver = tide::cuda::driver::init().unwrap();
    let mut name = [0 as std::ffi::c_char; 128];
    let mut dev = 0;
    // SAFETY: valid out-pointers; device 0 exists (Gpu::open).
    unsafe {
        common::gpu::ck(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        common::gpu::ck(sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev), "cuDeviceGetName");
    }
    // SAFETY: the driver wrote a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    say(&format!(
        "strided_bench: {name}, CUDA driver {driver}, cuMemcpy3DBatchAsync_v2: {}, TIDE_CE_PIECE_BYTES={}, world {world} (emulated, rank 0), bf16, medians of {reps}",
        if tide::cuda::driver::batch_copy_3d_supported() { "yes" } else { "NO (batch runs as 1, batch-bands as bands)" },
        base.ce_piece_bytes
    ));
    let shapes: Vec<(usize, usize)> = std::env::var("TIDE_STRIDED_SHAPES")
        .unwrap_or_else(|_| "4096x14336,8192x2048,64x65536,8192x14336,14336x4096".into())
        .split(',')
        .map(|s| {
            let (r, c) = s.trim().split_once('x').expect("TIDE_STRIDED_SHAPES: ROWSxCOLS,...");
            (r.parse().unwrap(), c.parse().unwrap())
        })
        .collect();
    let variants: Vec<Variant> = std::env::var("TIDE_STRIDED_VARIANTS")
        .unwrap_or_else(|_| {
            "1,batch,bands:512K,bands:2M,bands:8M,batch-bands:64K,batch-bands:512K,batch-bands:2M,1@4,batch@4,bands:2M@4,batch-bands:512K@4".into()
        })
        .split(',')
        .map(|s| Variant::parse(s.trim()))
        .collect();
    let mut site = 9700;
    for (rows, cols) in shapes {
        let bytes = rows * cols * 2;
        let width = cols / world * 2;
        say(&format!(
            "strided_bench: [{rows}, {cols}]: {:.1} MB landed; along dim 1 each peer's {rows} rows of {width} B land {} B apart",
            bytes as f64 / 1e6,
            cols * 2
        ));
        let stream = gpu.stream();
        let ranks: Vec<(usize, usize)> = (0..world).map(|r| (r, stream)).collect();
        let mk = |site: i64, spec: ParamSpec| {
            let case = common::gpu::make_case(&gpu, Op::AllGather, site, 0, world, &ranks, &[spec], 1, &mut |b| gpu.upload(b));
            let peers = emulated_peers(&case, world, 0);
            (case, peers)
        };
        site += 1;
        let (flat, flat_peers) = mk(site, ParamSpec::new("w", &[cols, rows], DType::BF16));
        site += 1;
        let (strided, strided_peers) = mk(site, ParamSpec::new("w", &[rows, cols], DType::BF16).along(1));
        let line = |what: &str, t: &Timing, vs: Option<&Timing>| {
            let gb = |us: f64| bytes as f64 / us / 1e3;
            let mut l = format!(
                "strided_bench:   {what:<34} wall {:8.1} us {:5.0} GB/s | issue {:7.1} us | gpu {:8.1} us {:5.0} GB/s | gated {}",
                t.wall,
                gb(t.wall),
                t.issue,
                t.gpu,
                gb(t.gpu),
                t.gated.map(|g| format!("{g:8.1} us {:5.0} GB/s", gb(g))).unwrap_or_else(|| "     (too many operations to hold)".into())
            );
            if let Some(d0) = vs {
                l += &format!(" | dim1/dim0 wall {:.2} gpu {:.2}", d0.wall / t.wall, d0.gpu / t.gpu);
                if let (Some(a), Some(b)) = (d0.gated, t.gated) {
                    l += &format!(" gated {:.2}", a / b);
                }
            }
            l
        };
        tide::config::set_override(Some(base.clone()));
        let d0 = time_call(&gpu, &gate, &flat.calls[0], &flat_peers, true, reps);
        say(&line("dim 0 (contiguous, defaults)", &d0, None));
        for v in &variants {
            let mut c = base.clone();
            c.copy2d = v.via;
            c.copy2d_band_bytes = v.band;
            c.ag_streams = v.streams;
            tide::config::set_override(Some(c.clone()));
            let out = strided.outs[0][0];
            gpu.set_current();
            // SAFETY: the output buffer of rank 0 (out_bytes long); nothing runs on it now.
            common::gpu::ck(unsafe { sys::cuMemsetD8_v2(out, 0xa5, strided.out_bytes[0]) }, "cuMemsetD8");
            let ops = bench_ops(v, &c, world, rows, width);
            let t = time_call(&gpu, &gate, &strided.calls[0], &strided_peers, ops <= 256, reps);
            let ok = gpu.download(out, strided.out_bytes[0]) == strided.want[0][0];
            say(&format!("{} | {} ops | {}", line(&format!("dim 1 {}", v.label()), &t, Some(&d0)), ops - 20, if ok { "bitwise ok" } else { "MISMATCH vs the CPU engine" }));
            assert!(ok, "strided_bench: [{rows}, {cols}] {}: the landed result differs from the CPU engine", v.label());
        }
        tide::config::set_override(Some(base.clone()));
        let d0b = time_call(&gpu, &gate, &flat.calls[0], &flat_peers, true, reps);
        say(&line("dim 0 again (drift check)", &d0b, None));
        raw_landing(&gpu, &gate, &strided, &strided_peers, rows, width, world, reps);
    }
    if gate.stuck.load(std::sync::atomic::Ordering::Acquire) {
        say("strided_bench: WARNING: a gate was held over 5 s and released by the watchdog: some gated numbers include host time");
    }
    tide::config::set_override(None);
}

/// The landing without tide (see `strided_gather_variants`): rank 0's output, its peers' inputs
/// (rank 0's own too), on a fresh stream, gated, between events; medians of `reps`.
#[allow(clippy::too_many_arguments)]
fn raw_landing(
    gpu: &common::gpu::Gpu,
    gate: &Gate,
    case: &common::gpu::Case,
    peers: &[tide::cuda::EmulatedPeer],
    rows: usize,
    width: usize,
    world: usize,
    reps: usize,
) {
    let stream = gpu.stream();
    let out = case.outs[0][0];
    let srcs: Vec<u64> = std::iter::once(case.calls[0].inputs[0].ptr as u64).chain(peers.iter().map(|p| p.inputs[0].0)).collect();
    let flat_out = gpu.alloc_fill(rows * width * world, 0);
    let (a, b) = (timing_event(), timing_event());
    let time = |f: &dyn Fn()| {
        let mut v = Vec::new();
        for rep in 0..reps + 3 {
            gpu.set_current();
            let g = gate.hold(stream as sys::CUstream);
            record(a, stream);
            f();
            record(b, stream);
            gate.release(g);
            gpu.sync(stream);
            if rep >= 3 {
                v.push(elapsed_us(a, b));
            }
        }
        median(v)
    };
    let copy_2d = |q: usize| {
        // SAFETY: peer q's shard (rows x width) and its rows of the output, both on GPU 0.
        unsafe {
            tide::cuda::driver::memcpy_2d_async(out + (q * width) as u64, width * world, srcs[q], width, width, rows, stream as sys::CUstream, String::new)
                .unwrap()
        }
    };
    let t2d = time(&|| (0..world).for_each(copy_2d));
    let t1d = time(&|| {
        for (q, &src) in srcs.iter().enumerate() {
            // SAFETY: as above, into a contiguous buffer of the same bytes.
            unsafe { tide::cuda::driver::memcpy_async(flat_out + (q * rows * width) as u64, src, rows * width, stream as sys::CUstream, String::new).unwrap() };
        }
    });
    let tone = time(&|| copy_2d(1));
    let gb = |bytes: usize, us: f64| bytes as f64 / us / 1e3;
    let all = rows * width * world;
    say(&format!(
        "strided_bench:   raw driver, gated: {world} x cuMemcpy2DAsync {t2d:.1} us {:.0} GB/s | {world} x cuMemcpyAsync (same bytes, contiguous) {t1d:.1} us {:.0} GB/s | 2-D / 1-D {:.2} | one peer's cuMemcpy2DAsync {tone:.1} us {:.0} GB/s",
        gb(all, t2d),
        gb(all, t1d),
        t1d / t2d,
        gb(rows * width, tone)
    ));
}
