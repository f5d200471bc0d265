//! CPU engine details: exact bf16/f16 widening, barrier discipline, errors instead of hangs.

use std::sync::Mutex;
use std::time::Duration;
use tide::engine::cpu::{
    bf16_to_f32, execute_rank, f16_to_f32, f32_to_bf16, run_threads, ThreadBarrier,
};
use tide::engine::{Barrier, RankBuffers};
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, RsOptions};
use tide::{Result, TideError, Topology};

fn f16_reference(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((bits >> 10) & 0x1f) as i32;
    let mant = (bits & 0x3ff) as f64;
    match exp {
        0 => sign * mant * 2f64.powi(-24),
        31 if mant == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * (1.0 + mant / 1024.0) * 2f64.powi(exp - 15),
    }
}

fn bf16_reference(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((bits >> 7) & 0xff) as i32;
    let mant = (bits & 0x7f) as f64;
    match exp {
        0 => sign * mant * 2f64.powi(-133),
        255 if mant == 0.0 => sign * f64::INFINITY,
        255 => f64::NAN,
        _ => sign * (1.0 + mant / 128.0) * 2f64.powi(exp - 127),
    }
}

#[test]
fn widening_is_exact_for_every_bit_pattern() {
    for bits in 0..=u16::MAX {
        let (h, want) = (f16_to_f32(bits), f16_reference(bits));
        if want.is_nan() {
            assert!(h.is_nan(), "f16 {bits:#06x}");
            assert_eq!(
                h.to_bits() & 0x807f_ffff,
                (((bits as u32) & 0x8000) << 16) | (((bits as u32) & 0x3ff) << 13)
            );
        } else {
            assert_eq!(h as f64, want, "f16 {bits:#06x}");
            assert_eq!(
                h.is_sign_negative(),
                bits & 0x8000 != 0,
                "f16 {bits:#06x} sign"
            );
        }
        let (b, want) = (bf16_to_f32(bits), bf16_reference(bits));
        if want.is_nan() {
            assert!(b.is_nan());
        } else {
            assert_eq!(b as f64, want, "bf16 {bits:#06x}");
            assert_eq!(b.is_sign_negative(), bits & 0x8000 != 0);
            assert_eq!(f32_to_bf16(b), bits, "bf16 round trip {bits:#06x}");
        }
    }
    assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80); // tie to even
    assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
}

/// Records the barrier calls.
struct Recorder(Mutex<Vec<(usize, usize)>>);
impl Barrier for Recorder {
    fn wait(&self, rank: usize, phase: usize) -> Result<()> {
        self.0.lock().unwrap().push((rank, phase));
        Ok(())
    }
}

#[test]
fn execute_rank_waits_after_every_phase() {
    // One rank, two nodes would need peers; a 1x1 plan has one phase, a 2x1 plan four.
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[3, 2], DType::BF16)], 1).unwrap();
    let plan =
        plan::reduce_scatter(&layout, Topology::single_node(1), RsOptions::default()).unwrap();
    let input: Vec<u8> = [1.0f32, 2.0, -3.0, 0.5, 0.25, 1e-3]
        .iter()
        .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
        .collect();
    let mut out = vec![0u8; 24];
    let bufs = vec![RankBuffers {
        inputs: vec![input.as_ptr() as usize],
        outputs: vec![out.as_mut_ptr() as usize],
        stages: vec![],
    }];
    let rec = Recorder(Mutex::new(Vec::new()));
    // SAFETY: buffers of the plan's sizes, alive for the call.
    unsafe { execute_rank(&plan, 0, &bufs, &rec) }.unwrap();
    assert_eq!(*rec.0.lock().unwrap(), vec![(0, 0)]);
    let vals: Vec<f32> = out
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want: Vec<f32> = input
        .chunks(2)
        .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    assert_eq!(vals, want);
}

#[test]
fn barrier_failure_is_an_error_not_a_hang() {
    struct Failing;
    impl Barrier for Failing {
        fn wait(&self, rank: usize, phase: usize) -> Result<()> {
            Err(TideError::Rendezvous(format!(
                "peer gone (rank {rank}, phase {phase})"
            )))
        }
    }
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[2], DType::F32)], 1).unwrap();
    let plan = plan::all_gather(&layout, Topology::single_node(1)).unwrap();
    let input = [0u8; 8];
    let mut out = vec![0u8; 8];
    let bufs = vec![RankBuffers {
        inputs: vec![input.as_ptr() as usize],
        outputs: vec![out.as_mut_ptr() as usize],
        stages: vec![],
    }];
    // SAFETY: as above.
    let e = unsafe { execute_rank(&plan, 0, &bufs, &Failing) }.unwrap_err();
    assert!(e.to_string().contains("peer gone"));
    // A thread barrier whose peer never arrives times out.
    let b = ThreadBarrier::new(2, Duration::from_millis(50));
    let e = b.wait(0, 3).unwrap_err().to_string();
    assert!(e.contains("timed out") && e.contains("phase 3"), "{e}");
    // And stays failed for the late peer.
    assert!(b.wait(1, 3).is_err());
}

#[test]
fn run_threads_checks_inputs() {
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[5, 2], DType::BF16)], 2).unwrap();
    let plan = plan::all_gather(&layout, Topology::single_node(2)).unwrap();
    let e = run_threads(&plan, &[vec![vec![0u8; 12]], vec![vec![0u8; 11]]])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 1") && e.contains("'w'") && e.contains("11 bytes"),
        "{e}"
    );
    assert!(run_threads(&plan, &[vec![vec![0u8; 12]]]).is_err());
}
