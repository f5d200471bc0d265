//! Naive reference collectives, written straight from the layout rule with no plan: the oracle the
//! plans and engines are tested against.
//! - all-gather: each rank's output is the concatenation of every rank's valid rows (block by block
//!   for a parameter sharded along a later dimension);
//! - reduce-scatter: an f64 sum over ranks per element (bf16/f16/f32 inputs), padding rows 0.

use super::cpu::{bf16_to_f32, f16_to_f32};
use crate::error::{Result, TideError};
use crate::layout::{DType, GroupLayout};

/// `inputs[rank][param]` are the padded shards; returns the full parameter bytes, per param (the
/// same on every rank).
pub fn all_gather(layout: &GroupLayout, inputs: &[Vec<Vec<u8>>]) -> Vec<Vec<u8>> {
    layout
        .params
        .iter()
        .map(|p| {
            // Block by block (`outer` of them: the dims before the sharded one), every rank's
            // valid rows of that block in rank order.
            let mut full = Vec::with_capacity(p.full_bytes());
            for o in 0..p.outer {
                for (q, ins) in inputs.iter().enumerate() {
                    let at = o * p.shard_rows * p.row_bytes();
                    full.extend_from_slice(&ins[p.index][at..at + p.valid_rows(q) * p.row_bytes()]);
                }
            }
            full
        })
        .collect()
}

/// Element `e` of a buffer of `dtype`, widened to f64.
pub fn element_f64(bytes: &[u8], dtype: DType, e: usize) -> Result<f64> {
    Ok(match dtype {
        DType::BF16 => bf16_to_f32(u16::from_le_bytes([bytes[2 * e], bytes[2 * e + 1]])) as f64,
        DType::F16 => f16_to_f32(u16::from_le_bytes([bytes[2 * e], bytes[2 * e + 1]])) as f64,
        DType::F32 => f32::from_le_bytes(bytes[4 * e..4 * e + 4].try_into().unwrap()) as f64,
        other => {
            return Err(TideError::UnsupportedDtype {
                dtype: other.name().to_string(),
                op: "reference reduce_scatter (bfloat16, float16 or float32)",
            })
        }
    })
}

/// One rank's reduce-scatter result for one parameter: `sum[e]` over ranks and `abs_sum[e]` (for
/// error bounds), `shard_rows * row_elems` elements, padding rows 0.
#[derive(Debug, Clone, PartialEq)]
pub struct RsShard {
    pub sum: Vec<f64>,
    pub abs_sum: Vec<f64>,
}

/// `inputs[rank][param]` are the full gradients; returns `[rank][param]`.
pub fn reduce_scatter(layout: &GroupLayout, inputs: &[Vec<Vec<u8>>]) -> Result<Vec<Vec<RsShard>>> {
    let world = layout.world;
    let mut out = Vec::with_capacity(world);
    for r in 0..world {
        let mut per_param = Vec::with_capacity(layout.len());
        for p in &layout.params {
            let n = p.shard_elems();
            let block = p.shard_rows * p.row_elems;
            let mut sum = vec![0.0f64; n];
            let mut abs_sum = vec![0.0f64; n];
            let (start, _) = p.owned_rows(r);
            let valid = p.valid_rows(r) * p.row_elems;
            for ins in inputs {
                for o in 0..p.outer {
                    for e in 0..valid {
                        let at = (o * p.rows + start) * p.row_elems + e;
                        let x = element_f64(&ins[p.index], p.dtype, at)?;
                        sum[o * block + e] += x;
                        abs_sum[o * block + e] += x.abs();
                    }
                }
            }
            per_param.push(RsShard { sum, abs_sum });
        }
        out.push(per_param);
    }
    Ok(out)
}
