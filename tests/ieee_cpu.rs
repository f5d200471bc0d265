//! The CPU reduce-scatter keeps subnormals and signed zeros as IEEE fp32 does (issue #8 part 4,
//! [Note: IEEE arithmetic] in src/engine/cpu.rs), even on threads that flush subnormals to zero
//! (XLA:CPU's threads set FTZ/DAZ, and threads they spawn inherit it), and gives the caller's
//! floating-point mode back unchanged.

use std::sync::Arc;
use std::thread;
use tide::engine::cpu::{f32_to_bf16, flushes_subnormals, set_flush_subnormals};
use tide::ffi::{run_cpu, FfiBuffer, FfiCall, StatusCode};
use tide::plan::Op;

const F32: i32 = 11;
const BF16: i32 = 16;
const F16: i32 = 10;

fn call(
    site: i64,
    world: usize,
    nodes: usize,
    rank: usize,
    input: FfiBuffer,
    output: FfiBuffer,
) -> FfiCall {
    FfiCall {
        site,
        world: world as i64,
        nodes: nodes as i64,
        gpus_per_node: (world / nodes) as i64,
        device_ordinal: rank as i64,
        device_ordinals: (0..world as i64).collect(),
        device_ranks: (0..world as i64).collect(),
        device_groups: vec![0; world],
        names: b"g".to_vec(),
        inputs: vec![input],
        outputs: vec![output],
        stream: 0,
        run_id: 0,
        job: 0,
        urgent: 0,
    }
}

/// Reduce-scatter of `world` equal gradients of 2 * world elements (`bits` per element in
/// `dtype`), each rank's thread in flush-to-zero mode; returns every rank's 2 fp32 results.
fn reduce_scatter_flushing(
    site: i64,
    world: usize,
    nodes: usize,
    dtype: i32,
    bits: u32,
) -> Vec<f32> {
    let bits = Arc::new(bits);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let bits = bits.clone();
            thread::spawn(move || {
                set_flush_subnormals(true);
                assert!(flushes_subnormals(), "the test thread flushes, as XLA's do");
                let n = 2 * world;
                let grad: Vec<u8> = match dtype {
                    F32 => (0..n).flat_map(|_| bits.to_le_bytes()).collect(),
                    _ => (0..n).flat_map(|_| (*bits as u16).to_le_bytes()).collect(),
                };
                let mut out = vec![f32::NAN; 2];
                let c = call(
                    site,
                    world,
                    nodes,
                    rank,
                    FfiBuffer {
                        data: grad.as_ptr() as usize,
                        dtype,
                        dims: vec![n as i64],
                    },
                    FfiBuffer {
                        data: out.as_mut_ptr() as usize,
                        dtype: F32,
                        dims: vec![2],
                    },
                );
                let s = run_cpu(Op::ReduceScatter, &c);
                assert_eq!(s.code, StatusCode::Ok, "{}", s.message);
                assert!(flushes_subnormals(), "the caller's mode is given back");
                out
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect()
}

#[test]
fn subnormals_are_summed_not_flushed() {
    let quarter_min = f32::MIN_POSITIVE / 4.0; // a subnormal, exact in bf16 too
    assert!(quarter_min.is_subnormal());
    let bf16_bits = f32_to_bf16(quarter_min) as u32;
    // f16: the smallest subnormal 2^-24 (bits 0x0001), exact in f32.
    let cases = [
        (F32, quarter_min.to_bits(), quarter_min),
        (BF16, bf16_bits, quarter_min),
        (F16, 1, 2f32.powi(-24)),
    ];
    let mut site = 1;
    for (world, nodes) in [(8, 1), (8, 2), (4, 4), (1, 1)] {
        for (dtype, bits, one) in cases {
            let got = reduce_scatter_flushing(site, world, nodes, dtype, bits);
            site += 1;
            let want = one * world as f32; // exact: world * 2^-128 or world * 2^-24
            assert!(want != 0.0);
            assert!(
                got.iter().all(|&x| x == want),
                "dtype {dtype} world {world}x{nodes}: {got:?}, want {want:e}"
            );
        }
    }
}

#[test]
fn signed_zeros_follow_ieee() {
    let mut site = 100;
    for (world, nodes) in [(8, 1), (8, 2), (3, 1), (1, 1)] {
        for (dtype, neg_zero) in [(F32, 0x8000_0000u32), (BF16, 0x8000), (F16, 0x8000)] {
            let got = reduce_scatter_flushing(site, world, nodes, dtype, neg_zero);
            site += 1;
            assert!(
                got.iter().all(|x| x.to_bits() == 0x8000_0000),
                "sum of -0.0 is -0.0: dtype {dtype} world {world}x{nodes}: {got:?}"
            );
        }
    }
}

#[test]
fn mixed_signed_zeros_sum_to_plus_zero() {
    // Rank 0 contributes +0.0, the others -0.0: -0 + +0 = +0 in IEEE round-to-nearest.
    let world = 4;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            thread::spawn(move || {
                let v: f32 = if rank == 0 { 0.0 } else { -0.0 };
                let grad = vec![v; world];
                let mut out = vec![f32::NAN; 1];
                let c = call(
                    500,
                    world,
                    1,
                    rank,
                    FfiBuffer {
                        data: grad.as_ptr() as usize,
                        dtype: F32,
                        dims: vec![world as i64],
                    },
                    FfiBuffer {
                        data: out.as_mut_ptr() as usize,
                        dtype: F32,
                        dims: vec![1],
                    },
                );
                let s = run_cpu(Op::ReduceScatter, &c);
                assert_eq!(s.code, StatusCode::Ok, "{}", s.message);
                out[0]
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap().to_bits(), 0, "+0.0");
    }
}
