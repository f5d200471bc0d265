//! Helpers shared by the GPU test binaries (`cuda_engine`, `cuda_mp`, `cuda_async`, `cuda_failure`): each test
//! file includes this module with `mod common;`, so not every binary uses every item. `gpu`: GPU 0,
//! buffers, calls and what a process holds.
#![allow(dead_code)]

pub mod gpu;

use std::io::Write;
use tide::layout::{DType, ParamSpec};

/// The odd-shaped parameter group the GPU tests run: rows that do not divide over 2 or 3 ranks, a
/// 0-d and a 1-d parameter, three dtypes, one parameter above the small-work batching threshold.
pub fn odd_group() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("attn.wq", &[37, 24], DType::BF16),
        ParamSpec::new("scalar", &[], DType::F32),
        ParamSpec::new("mlp.w_up", &[301, 3], DType::F16),
        ParamSpec::new("mlp.big", &[1024, 96], DType::BF16),
        ParamSpec::new("norm", &[5], DType::BF16),
        ParamSpec::new("f32.mat", &[33, 40], DType::F32),
    ]
}

/// One line to stderr (shown without `--nocapture` when a test fails).
pub fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// Finite values of the dtype (no inf/NaN), deterministic per (seed, rank, param).
pub fn fill(bytes: &mut [u8], dtype: DType, mut x: u64) {
    x |= 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match dtype {
        DType::F32 => {
            for c in bytes.chunks_mut(4) {
                let v = ((next() % 2_000_001) as f32 - 1_000_000.0) * 1e-3;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::BF16 | DType::F16 => {
            for c in bytes.chunks_mut(2) {
                let mut h = (next() >> 17) as u16;
                let exp_mask = if dtype == DType::BF16 { 0x7f80 } else { 0x7c00 };
                if h & exp_mask == exp_mask {
                    h &= !(exp_mask & (exp_mask >> 1));
                }
                c.copy_from_slice(&h.to_le_bytes());
            }
        }
        _ => bytes.iter_mut().for_each(|b| *b = next() as u8),
    }
}
