//! The Rust half of the FFI edge without XLA: decoding a call frame (`FfiCall`) into a `CallInfo`,
//! status codes, and the CPU path end to end with ranks as threads over host buffers, including a
//! rank that fails validation while its peers are fine.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use tide::error::TideError;
use tide::ffi::{decode, run_cpu, FfiBuffer, FfiCall, StatusCode};
use tide::plan::Op;

const F32: i32 = 11;
const BF16: i32 = 16;

fn buf(data: usize, dtype: i32, dims: &[i64]) -> FfiBuffer {
    FfiBuffer {
        data,
        dtype,
        dims: dims.to_vec(),
    }
}

/// A call on device `ordinal` of a 1-D mesh whose devices have ordinals 10, 11, ... (rank order).
fn call(
    site: i64,
    world: usize,
    ordinal: i64,
    inputs: Vec<FfiBuffer>,
    outputs: Vec<FfiBuffer>,
) -> FfiCall {
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("p{i}")).collect();
    FfiCall {
        site,
        world: world as i64,
        nodes: 1,
        gpus_per_node: world as i64,
        device_ordinal: ordinal,
        device_ordinals: (0..world as i64).map(|r| 10 + r).collect(),
        device_ranks: (0..world as i64).collect(),
        device_groups: vec![0; world],
        names: names.join("\n").into_bytes(),
        inputs,
        outputs,
        stream: 0,
        run_id: 0,
        job: 0,
        urgent: 0,
    }
}

#[test]
fn decode_maps_ordinal_to_rank_and_group() {
    // A 2 x 2 mesh: world 2 along the axis, groups 0 and 1 over the other axis.
    let mut c = call(
        1,
        4,
        12,
        vec![buf(8, F32, &[4, 3])],
        vec![buf(16, F32, &[7, 3])],
    );
    (c.world, c.gpus_per_node) = (2, 2);
    c.device_ranks = vec![1, 0, 0, 1];
    c.device_groups = vec![0, 0, 1, 1];
    let info = decode(Op::AllGather, &c).unwrap();
    assert_eq!(
        (info.rank, info.group, info.world, info.device_ordinal),
        (0, 1, 2, 12)
    );
    assert_eq!(info.names, vec!["p0".to_string()]);
    assert_eq!(info.inputs[0].dims, vec![4, 3]);
    assert_eq!(info.outputs[0].ptr, 16);
    info.layout().unwrap();
}

#[test]
fn decode_errors_name_the_attribute() {
    let base = || call(2, 4, 10, vec![buf(8, F32, &[2])], vec![buf(16, F32, &[8])]);
    let err = |c: FfiCall| {
        decode(Op::AllGather, &c)
            .expect_err("must fail")
            .to_string()
    };

    let mut c = base();
    c.device_ordinal = 3;
    let e = err(c);
    assert!(e.contains("tide all_gather site 2 on device 3: device ordinal 3 is not in attribute 'device_ordinals' [10, 11, 12, 13]"), "{e}");

    let mut c = base();
    c.device_groups.pop();
    assert!(err(c).contains("must have equal lengths, got 4, 4, 3"));

    let mut c = base();
    c.nodes = 3;
    let e = decode(Op::AllGather, &c).err().unwrap();
    assert!(matches!(e, TideError::InvalidTopology(_)), "{e}");
    assert!(e.to_string().contains("'nodes' x 'gpus_per_node'"), "{e}");

    let mut c = base();
    c.world = 0;
    assert!(err(c).contains("attribute 'world' is 0"));

    let mut c = base();
    c.device_ranks[0] = 9;
    assert!(err(c).contains("rank 9 in attribute 'device_ranks', outside world size 4"));

    let mut c = base();
    c.device_ordinals[2] = 10;
    assert!(err(c).contains("device ordinal 10 appears twice"));

    let mut c = base();
    c.inputs[0].dims = vec![-1];
    assert!(err(c).contains("operand 0 dims [-1]: must be non-negative"));

    let mut c = base();
    c.outputs[0].dtype = 99;
    assert!(err(c).contains("result 0: invalid argument: unknown dtype code 99"));
}

#[test]
fn status_codes() {
    let c = call(3, 1, 10, vec![buf(8, F32, &[2])], vec![buf(16, F32, &[3])]);
    let s = run_cpu(Op::AllGather, &c);
    assert_eq!(s.code, StatusCode::InvalidArgument);
    assert!(s.message.contains("param 0 'p0'"), "{}", s.message);
    let s = tide::ffi::status(Err(TideError::Rendezvous("x".into())));
    assert_eq!(s.code, StatusCode::Internal);
    let s = tide::ffi::status(Ok(()));
    assert_eq!(s.code, StatusCode::Ok);
}

/// Runs `f(rank)` on `world` threads.
fn on_ranks<R: Send + 'static>(
    world: usize,
    f: impl Fn(usize) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let f = f.clone();
            thread::spawn(move || f(r))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn cpu_all_gather_end_to_end() {
    // Two params over 5 ranks: (7, 3) f32 (shard_rows 2) and a 0-d f32 (shard_rows 1).
    const WORLD: usize = 5;
    for round in 0..3 {
        let out = on_ranks(WORLD, move |rank| {
            let shard0: Vec<f32> = (0..6).map(|e| (rank * 6 + e) as f32).collect();
            let shard1: Vec<f32> = vec![if rank == 0 { 42.0 } else { 0.0 }];
            let mut full0 = vec![-1f32; 21];
            let mut full1 = vec![-1f32; 1];
            let c = call(
                20,
                WORLD,
                10 + rank as i64,
                vec![
                    buf(shard0.as_ptr() as usize, F32, &[2, 3]),
                    buf(shard1.as_ptr() as usize, F32, &[1]),
                ],
                vec![
                    buf(full0.as_mut_ptr() as usize, F32, &[7, 3]),
                    buf(full1.as_mut_ptr() as usize, F32, &[]),
                ],
            );
            let s = run_cpu(Op::AllGather, &c);
            assert_eq!(
                s.code,
                StatusCode::Ok,
                "round {round} rank {rank}: {}",
                s.message
            );
            (full0, full1)
        });
        for (full0, full1) in out {
            assert_eq!(full0, (0..21).map(|e| e as f32).collect::<Vec<_>>());
            assert_eq!(full1, vec![42.0]);
        }
    }
}

#[test]
fn cpu_reduce_scatter_end_to_end() {
    // (5,) bf16 gradients over 3 ranks (shard_rows 2: rank 2 holds 1 row + 1 padding row).
    const WORLD: usize = 3;
    let out = on_ranks(WORLD, |rank| {
        let grad: Vec<u16> = (0..5)
            .map(|e| {
                ((e + 1) as f32 * (rank + 1) as f32)
                    .to_bits()
                    .wrapping_shr(16) as u16
            })
            .collect();
        let mut shard = vec![f32::NAN; 2];
        let c = call(
            21,
            WORLD,
            10 + rank as i64,
            vec![buf(grad.as_ptr() as usize, BF16, &[5])],
            vec![buf(shard.as_mut_ptr() as usize, F32, &[2])],
        );
        let s = run_cpu(Op::ReduceScatter, &c);
        assert_eq!(s.code, StatusCode::Ok, "{}", s.message);
        shard
    });
    // sum over ranks of (e + 1) * (rank + 1) = 6 * (e + 1).
    assert_eq!(
        out,
        vec![vec![6.0, 12.0], vec![18.0, 24.0], vec![30.0, 0.0]]
    );
}

#[test]
fn one_rank_with_a_bad_shard_fails_everyone_fast() {
    const WORLD: usize = 4;
    let t0 = Instant::now();
    let out = on_ranks(WORLD, |rank| {
        let rows = if rank == 2 { 3 } else { 2 };
        let shard = vec![0f32; rows];
        let mut full = vec![0f32; 8];
        let c = call(
            22,
            WORLD,
            10 + rank as i64,
            vec![buf(shard.as_ptr() as usize, F32, &[rows as i64])],
            vec![buf(full.as_mut_ptr() as usize, F32, &[8])],
        );
        run_cpu(Op::AllGather, &c)
    });
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "peers must fail fast, not time out"
    );
    for (rank, s) in out.iter().enumerate() {
        if rank == 2 {
            assert_eq!(s.code, StatusCode::InvalidArgument);
            assert!(s.message.contains("rank 2 (device 12): param 0 'p0' (shape [8], float32): operand (local shard) has shape [3]"), "{}", s.message);
        } else {
            assert_eq!(s.code, StatusCode::Internal);
            assert!(
                s.message.contains(
                    "tide all_gather site 22 group 0 seq 0: rank 2 failed: invalid argument"
                ),
                "{}",
                s.message
            );
        }
    }
    // The next execution of the same site (next seq) works.
    let out = on_ranks(WORLD, |rank| {
        let shard = [rank as f32; 2];
        let mut full = vec![0f32; 8];
        let c = call(
            22,
            WORLD,
            10 + rank as i64,
            vec![buf(shard.as_ptr() as usize, F32, &[2])],
            vec![buf(full.as_mut_ptr() as usize, F32, &[8])],
        );
        let s = run_cpu(Op::AllGather, &c);
        (s.code, full)
    });
    for (code, full) in out {
        assert_eq!(code, StatusCode::Ok);
        assert_eq!(full, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    }
}

#[test]
fn ranks_that_disagree_on_the_layout_fail_without_touching_memory() {
    // Each rank's call is valid on its own, but rank 1's parameter has 6 rows, rank 0's 4.
    let out = on_ranks(2, |rank| {
        let rows = if rank == 0 { 4 } else { 6 };
        let shard = vec![1f32; rows / 2];
        let mut full = vec![0f32; rows];
        let c = call(
            23,
            2,
            10 + rank as i64,
            vec![buf(shard.as_ptr() as usize, F32, &[(rows / 2) as i64])],
            vec![buf(full.as_mut_ptr() as usize, F32, &[rows as i64])],
        );
        (run_cpu(Op::AllGather, &c), full)
    });
    for (s, full) in out {
        assert_eq!(s.code, StatusCode::InvalidArgument, "{}", s.message);
        assert!(
            s.message
                .contains("ranks [1] built a different plan than rank 0"),
            "{}",
            s.message
        );
        assert!(full.iter().all(|&x| x == 0.0), "nothing may be written");
    }
}

#[test]
fn cpu_programs_interleaved_across_devices_fail_fast_then_run() {
    // Issue #17 through the FFI edge (decode -> CPU engine): devices 10, 11, 12 of one mesh. Device
    // 10 runs program A (site 40, run 0x1a1) first, devices 11 and 12 run program B (site 41, run
    // 0x1b2) first, as when two threads launch A and B at once. Each program is one all-gather.
    // Every call must fail well inside a second naming the interleaving (the timeout is 120 s),
    // and the next run of A must be exact.
    const WORLD: usize = 3;
    let gather = |site: i64, run: i64, rank: usize| -> (tide::ffi::FfiStatus, Vec<f32>) {
        let shard: Vec<f32> = vec![rank as f32; 2];
        let mut full = vec![-1f32; 6];
        let mut c = call(
            site,
            WORLD,
            10 + rank as i64,
            vec![buf(shard.as_ptr() as usize, F32, &[2])],
            vec![buf(full.as_mut_ptr() as usize, F32, &[6])],
        );
        c.run_id = run;
        let s = run_cpu(Op::AllGather, &c);
        (s, full)
    };
    let t0 = Instant::now();
    let out = on_ranks(WORLD, move |rank| {
        let order = if rank == 0 { [(40, 0x1a1), (41, 0x1b2)] } else { [(41, 0x1b2), (40, 0x1a1)] };
        order.map(|(site, run)| {
            let (s, _) = gather(site, run, rank);
            (site, s.code, s.message, t0.elapsed())
        })
    });
    for (rank, calls) in out.iter().enumerate() {
        for (site, code, msg, at) in calls {
            assert_eq!(*code, StatusCode::Internal, "rank {rank} site {site}: {msg}");
            assert!(msg.contains("programs interleaved across devices"), "rank {rank} site {site}: {msg}");
            assert!(msg.contains("run 0x1a1") && msg.contains("run 0x1b2") && msg.contains("dispatch_lock"), "{msg}");
            assert!(*at < Duration::from_secs(1), "rank {rank} site {site} failed after {at:?}");
        }
    }
    let out = on_ranks(WORLD, move |rank| gather(40, 0x1a3, rank));
    for (rank, (s, full)) in out.into_iter().enumerate() {
        assert_eq!(s.code, StatusCode::Ok, "rank {rank}: {}", s.message);
        assert_eq!(full, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
    }
}

// ----- the reduce-scatter into slices (tide_reduce_scatter_into_start / _done) -----

const S32: i32 = 4;

/// An into start of world 2 (rank 0, device 10): gradients (5, 3) bf16 and (4,) f32 at 0x1000..,
/// buffers (3, 3, 3) and (3, 2) f32 at 0x2000.., the index at 0x3000; results aliased as the
/// contract says.
fn into_start() -> FfiCall {
    let ins = vec![
        buf(0x1000, BF16, &[5, 3]),
        buf(0x1100, F32, &[4]),
        buf(0x2000, F32, &[3, 3, 3]),
        buf(0x2100, F32, &[3, 2]),
        buf(0x3000, S32, &[]),
    ];
    let outs = vec![ins[2].clone(), ins[3].clone(), ins[0].clone(), ins[1].clone(), ins[4].clone()];
    call(1, 2, 10, ins, outs)
}

#[test]
fn into_start_decodes_gradients_buffers_and_index() {
    let info = tide::ffi::decode_start_into(&into_start(), 1).unwrap();
    assert_eq!(info.inputs.len(), 2);
    assert_eq!(info.outputs.len(), 2);
    assert_eq!(info.outputs[0].dims, vec![3, 3, 3]);
    assert_eq!(info.at, Some(tide::call::OutputAt { index_ptr: 0x3000, count: 3 }));
    let lay = info.layout().unwrap();
    assert_eq!(lay.params[0].shard_rows, 3);
    // done: start's results, in the same order; inputs as a plain done has them
    let s = into_start();
    let done = call(1, 2, 10, s.outputs.clone(), s.outputs[..2].to_vec());
    let d = tide::ffi::decode_done_into(&done, 1).unwrap();
    assert_eq!(d.inputs.len(), 4);
    assert_eq!(d.at, info.at);
    assert_eq!(d.outputs[1].ptr, 0x2100);
}

#[test]
fn into_start_refuses_what_breaks_the_contract() {
    let msg = |c: &FfiCall| tide::ffi::decode_start_into(c, 1).and_then(|i| i.layout().map(|_| ())).unwrap_err().to_string();
    // an even operand count
    let mut c = into_start();
    c.inputs.pop();
    c.outputs.pop();
    assert!(msg(&c).contains("2N + 1 operands"), "{}", msg(&c));
    // a buffer not aliased to its result
    let mut c = into_start();
    c.outputs[0].data = 0x9000;
    assert!(msg(&c).contains("input_output_aliases"), "{}", msg(&c));
    // the index not an int32 scalar
    for (dtype, dims) in [(F32, vec![]), (S32, vec![1i64])] {
        let mut c = into_start();
        c.inputs[4] = buf(0x3000, dtype, &dims);
        c.outputs[4] = c.inputs[4].clone();
        assert!(msg(&c).contains("int32 scalar"), "{}", msg(&c));
    }
    // buffers with different slice counts
    let mut c = into_start();
    c.inputs[3] = buf(0x2100, F32, &[2, 2]);
    c.outputs[1] = c.inputs[3].clone();
    assert!(msg(&c).contains("same leading slice dim"), "{}", msg(&c));
    // a slice of the wrong shape: the layout names the parameter and wants (3, shard)
    let mut c = into_start();
    c.inputs[2] = buf(0x2000, F32, &[3, 2, 3]);
    c.outputs[0] = c.inputs[2].clone();
    let m = msg(&c);
    assert!(m.contains("p0") && m.contains("[3, 3, 3]"), "{m}");
}

#[test]
fn output_at_slice_is_jax_dynamic_update_slice_rule() {
    let at = tide::call::OutputAt { index_ptr: 1, count: 4 };
    let got: Vec<usize> = [-9, -5, -4, -1, 0, 2, 3, 4, 100, i32::MIN, i32::MAX].iter().map(|&i| at.slice(i)).collect();
    assert_eq!(got, vec![0, 0, 0, 3, 0, 2, 3, 3, 3, 0, 3]);
    assert_eq!(tide::call::OutputAt { index_ptr: 1, count: 1 }.slice(-1), 0);
}

// ----- the casting all-gather (tide_all_gather_cast_start / _done) -----

/// A casting start of world 2, rank 1 (device 11): fp32 stacks (4, 3, 3) and (4, 2) at 0x1000..,
/// the index at 0x3000; results bf16 (5, 3) and (4,) at 0x2000.. (rows 5 and 4 over 2 ranks).
fn cast_start() -> FfiCall {
    let ins = vec![buf(0x1000, F32, &[4, 3, 3]), buf(0x1100, F32, &[4, 2]), buf(0x3000, S32, &[])];
    let outs = vec![buf(0x2000, BF16, &[5, 3]), buf(0x2100, BF16, &[4])];
    call(1, 2, 11, ins, outs)
}

#[test]
fn cast_start_decodes_views_of_the_own_rows() {
    let info = tide::ffi::decode_start_cast(&cast_start(), 1).unwrap();
    let cast = info.cast.as_ref().expect("cast set");
    assert_eq!((cast.index_ptr, cast.count, cast.srcs.len()), (0x3000, 4, 2));
    assert_eq!(cast.srcs[0].ptr, 0x1000);
    // rank 1 owns rows 3..5 of p0 (row of 3 bf16: 6 bytes) and 2..4 of p1
    assert_eq!((info.inputs[0].ptr, info.inputs[1].ptr), (0x2000 + 3 * 6, 0x2100 + 2 * 2));
    assert_eq!(info.inputs[0].dims, vec![3, 3]);
    assert!(info.layout().is_ok());
    assert!(info.held_operands().is_empty(), "a casting start holds no operand");
    // done: start's results in and out, aliased; it holds nothing either
    let s = cast_start();
    let done = call(1, 2, 11, s.outputs.clone(), s.outputs.clone());
    let d = tide::ffi::decode_done_cast(&done, 1).unwrap();
    assert!(d.cast.is_some() && d.inputs.len() == 2);
}

#[test]
fn cast_start_refuses_what_breaks_the_contract() {
    let msg = |c: &FfiCall| tide::ffi::decode_start_cast(c, 1).and_then(|i| i.layout().map(|_| ())).unwrap_err().to_string();
    // no index operand
    let mut c = cast_start();
    c.inputs.pop();
    assert!(msg(&c).contains("N + 1 operands"), "{}", msg(&c));
    // the index not an int32 scalar
    let mut c = cast_start();
    c.inputs[2] = buf(0x3000, S32, &[1]);
    assert!(msg(&c).contains("int32 scalar"), "{}", msg(&c));
    // a bf16 operand, a stack of the wrong shard shape, a result other than bf16
    let mut c = cast_start();
    c.inputs[0] = buf(0x1000, BF16, &[4, 3, 3]);
    let m = msg(&c);
    assert!(m.contains("p0") && m.contains("rank 1") && m.contains("float32[4, 3, 3]"), "{m}");
    let mut c = cast_start();
    c.inputs[1] = buf(0x1100, F32, &[4, 3]);
    assert!(msg(&c).contains("p1"), "{}", msg(&c));
    let mut c = cast_start();
    c.outputs[1] = buf(0x2100, F32, &[4]);
    assert!(msg(&c).contains("lands bfloat16"), "{}", msg(&c));
    // done not aliased
    let s = cast_start();
    let mut done = call(1, 2, 11, s.outputs.clone(), s.outputs.clone());
    done.outputs[1].data = 0x9000;
    assert!(tide::ffi::decode_done_cast(&done, 1).unwrap_err().to_string().contains("input_output_aliases"));
}
