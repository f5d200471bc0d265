//! A collective call as the FFI edge decoded it, independent of cxx and XLA types. Both the CPU
//! and the CUDA handlers build one of these, validate it against the group layout, and hand it to
//! their engine.
//!
//! FFI contract (what `tide_jax` passes, see docs/design.md "FFI contract"):
//! - all-gather: inputs are the N local shards `(shard_rows, *rest)`, outputs the N full parameters
//!   `(rows, *rest)` (same dtype as the shard; `()` for a 0-d parameter).
//! - reduce-scatter: inputs are the N full gradients `(rows, *rest)` (bf16, f16 or f32), outputs the
//!   N fp32 shards `(shard_rows, *rest)`.

use crate::error::Result;
use crate::layout::{DType, GroupLayout, ParamSpec};
use crate::plan::Op;
use crate::topology::Topology;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferView {
    pub ptr: usize,
    pub dtype: DType,
    pub dims: Vec<usize>,
}

#[derive(Debug, Clone)]
pub struct CallInfo {
    pub op: Op,
    /// Unique id of the call site (one `ffi_call` in the traced program), the same on every rank.
    pub site: i64,
    /// XLA's RunId of this launch (the same on every device of one execution); 0 where unknown.
    /// Rendezvous keys use it so one rank's failure cannot leave later runs out of step.
    pub run_id: i64,
    /// Multi-process job id agreed through jax.distributed's key-value store; 0 when every rank of
    /// the mesh lives in this process (docs/multiprocess.md).
    pub job: u64,
    /// XLA's device ordinal of the executing device.
    pub device_ordinal: i64,
    /// This device's rank along the sharded mesh axis, and which group (the other mesh axes) it is in.
    pub rank: usize,
    pub group: usize,
    pub world: usize,
    pub topology: Topology,
    /// Parameter names (pytree paths) for error messages; may be empty strings.
    pub names: Vec<String>,
    pub inputs: Vec<BufferView>,
    pub outputs: Vec<BufferView>,
    /// XLA's stream (CUstream) on CUDA, 0 on CPU.
    pub stream: usize,
}

impl CallInfo {
    /// Builds the group layout this call implies and checks every buffer against it. Errors name
    /// the parameter (index, name, shape), the rank and the call.
    pub fn layout(&self) -> Result<GroupLayout> {
        build_layout(self)
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "tide all_gather",
        Op::ReduceScatter => "tide reduce_scatter",
    }
}

fn build_layout(call: &CallInfo) -> Result<GroupLayout> {
    use crate::invalid;
    let what = op_name(call.op);
    let n = call.inputs.len();
    if n == 0 {
        return invalid!(
            "{what} on rank {}: empty parameter group (no operands)",
            call.rank
        );
    }
    if call.outputs.len() != n {
        return invalid!(
            "{what} on rank {}: {} operands but {} results; one result per parameter",
            call.rank,
            n,
            call.outputs.len()
        );
    }
    if call.world == 0 || call.rank >= call.world {
        return invalid!(
            "{what}: rank {} is outside world size {}",
            call.rank,
            call.world
        );
    }
    let name = |i: usize| call.names.get(i).cloned().unwrap_or_default();
    // The full shape is the all-gather's output and the reduce-scatter's input.
    let (full, shard) = match call.op {
        Op::AllGather => (&call.outputs, &call.inputs),
        Op::ReduceScatter => (&call.inputs, &call.outputs),
    };
    let specs: Vec<ParamSpec> = (0..n)
        .map(|i| ParamSpec::new(name(i), &full[i].dims, full[i].dtype))
        .collect();
    let layout = GroupLayout::new(&specs, call.world).map_err(|e| {
        crate::error::TideError::InvalidArgument(format!("{what} on rank {}: {e}", call.rank))
    })?;
    for (i, p) in layout.params.iter().enumerate() {
        let mut want = vec![p.shard_rows];
        want.extend(p.shape.iter().skip(1));
        let got = &shard[i];
        let role = match call.op {
            Op::AllGather => "operand (local shard)",
            Op::ReduceScatter => "result (fp32 shard)",
        };
        if got.dims != want {
            return invalid!(
                "{what} on rank {}: {}: {role} has shape {:?}, the layout over {} ranks wants {:?}",
                call.rank,
                p.describe(),
                got.dims,
                call.world,
                want
            );
        }
        match call.op {
            Op::AllGather => {
                if got.dtype != p.dtype {
                    return invalid!(
                        "{what} on rank {}: {}: shard dtype {} differs from the result dtype {}",
                        call.rank,
                        p.describe(),
                        got.dtype.name(),
                        p.dtype.name()
                    );
                }
            }
            Op::ReduceScatter => {
                if !p.dtype.is_reducible() {
                    return Err(crate::error::TideError::UnsupportedDtype {
                        dtype: format!(
                            "{} ({} on rank {})",
                            p.dtype.name(),
                            p.describe(),
                            call.rank
                        ),
                        op: "reduce_scatter (bfloat16, float16 or float32 gradients)",
                    });
                }
                if got.dtype != DType::F32 {
                    return invalid!(
                        "{what} on rank {}: {}: result dtype is {}, tide reduces into float32",
                        call.rank,
                        p.describe(),
                        got.dtype.name()
                    );
                }
            }
        }
    }
    Ok(layout)
}
