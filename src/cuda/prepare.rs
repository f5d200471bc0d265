//! What a CUDA call needs before its ranks meet, on both paths: XLA's stream checked (primary
//! context, no graph capture), the topology checked, the site's plan and this rank's schedule
//! (`Prepared`, cached per device in a `PlanCache`), the (address, bytes) lists it publishes, and
//! the NVLink multicast gate's answer. Nothing here enqueues work or allocates device memory.
//!
//! The cache's hot path (`PlanCache::get`) compares the call's buffers with the cached layout's
//! shapes without building a new layout: one lookup and a few comparisons per call.

use super::driver::{self, CUcontext, CUdevice, CUstream};
use super::multicast;
use super::schedule::{self, Schedule, SchedOptions};
use crate::call::CallInfo;
use crate::config::Config;
use crate::error::{Result, TideError};
use crate::layout::GroupLayout;
use crate::plan::{Op, Plan};
use crate::topology::Topology;
use std::collections::HashMap;
use std::sync::Arc;

/// A plan and this rank's schedule of it, for one call site (rebuilt if the call's shape changes).
pub struct Prepared {
    pub op: Op,
    pub rank: usize,
    pub topology: Topology,
    pub layout: GroupLayout,
    pub plan: Plan,
    pub schedule: Schedule,
    /// The settings the plan and schedule were built under (rebuilt when they change).
    pub settings: PlanSettings,
}

/// The configuration values a prepared plan and schedule depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSettings {
    pub stage_slots: usize,
    pub slot_bytes: usize,
    pub streams: usize,
    pub local_copy: crate::config::LocalCopy,
    /// Bytes of one reduction launch (`schedule::sum_pieces`): TIDE_RS_MAX_CTAS x TIDE_RS_CTA_BYTES.
    pub sum_piece_bytes: usize,
    /// 2-D copies scheduled as such (`Cmd::Copy2D`), not flattened into their blocks: TIDE_COPY2D
    /// other than 0, in-process (how they are issued, `copy2d`, does not change the schedule). The
    /// multi-process path keeps the 1-D copies (its peers' buffers are VMM
    /// mappings of other processes' memory: 2-D copies there are not yet measured, and they never
    /// cross nodes, so the rail is the same either way).
    pub copy2d: bool,
}

impl PlanSettings {
    pub fn of(call: &CallInfo, c: &Config) -> PlanSettings {
        let op = call.op;
        PlanSettings {
            copy2d: c.copy2d.keeps_2d() && call.job == 0,
            stage_slots: c.rs_stage_slots,
            slot_bytes: c.rs_slot_bytes,
            streams: match op {
                Op::AllGather => c.ag_streams,
                Op::ReduceScatter => c.rs_copy_streams,
            },
            local_copy: c.local_copy,
            sum_piece_bytes: (c.rs_max_ctas as usize).saturating_mul(c.rs_cta_bytes),
        }
    }
}

/// The prepared plans of one device, by (call site, op, rank): several ranks may share a device
/// (tests on one GPU).
#[derive(Default)]
pub struct PlanCache {
    entries: HashMap<(i64, Op, usize), Arc<Prepared>>,
}

impl PlanCache {
    /// The site's prepared plan for `call` (cached; rebuilt when the call's shapes, rank, topology
    /// or settings change). Call `check_call` first.
    pub fn get(&mut self, call: &CallInfo, cfg: &Config) -> Result<Arc<Prepared>> {
        // Hot path: the site's prepared plan, if the call's buffers still have its shapes (checked
        // against the cached layout without building a new one).
        let settings = PlanSettings::of(call, cfg);
        let cached = self
            .entries
            .get(&(call.site, call.op, call.rank))
            .filter(|p| {
                p.rank == call.rank
                    && p.topology == call.topology
                    && p.settings == settings
                    && same_shapes(&p.layout, call)
            })
            .cloned();
        if let Some(p) = cached {
            return Ok(p);
        }
        let p = Arc::new(build(call, cfg, settings)?);
        self.entries.insert((call.site, call.op, call.rank), p.clone());
        Ok(p)
    }

    /// A prepared plan of (site, op), any rank (tools: `examples/cuda_bench.rs`).
    pub fn find(&self, site: i64, op: Op) -> Option<&Arc<Prepared>> {
        self.entries
            .iter()
            .find(|(k, _)| k.0 == site && k.1 == op)
            .map(|(_, p)| p)
    }
}

fn build(call: &CallInfo, cfg: &Config, settings: PlanSettings) -> Result<Prepared> {
    let layout = call.layout()?;
    let plan = match call.op {
        Op::AllGather => crate::plan::all_gather(&layout, call.topology)?,
        Op::ReduceScatter => crate::plan::reduce_scatter(
            &layout,
            call.topology,
            crate::plan::RsOptions {
                stage_slots: cfg.rs_stage_slots,
                slot_bytes: cfg.rs_slot_bytes,
            },
        )?,
    };
    plan.validate()?;
    // 2-D copies go as cuMemcpy2DAsync (`Cmd::Copy2D`), or, under TIDE_COPY2D=0 and on the
    // multi-process path, as their blocks (`Plan::flattened`: one 1-D copy each, batched).
    let plan = if settings.copy2d { plan } else { plan.flattened() };
    let schedule = schedule::build(
        &plan,
        call.rank,
        &SchedOptions::new(settings.streams, settings.local_copy).with_sum_pieces(settings.sum_piece_bytes),
    )?;
    Ok(Prepared {
        op: call.op,
        rank: call.rank,
        topology: call.topology,
        layout,
        plan,
        schedule,
        settings,
    })
}

pub(crate) fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "all_gather",
        Op::ReduceScatter => "reduce_scatter",
    }
}

/// Checks XLA's stream (given, in the device's primary context `ctx`, not being captured) and the
/// call's topology. `multi_node`: hierarchical plans allowed (the cross-process path runs their
/// rail over NCCL).
pub(crate) fn check_call(call: &CallInfo, ctx: CUcontext, multi_node: bool) -> Result<()> {
    let ord = call.device_ordinal;
    if call.stream == 0 {
        return Err(TideError::InvalidArgument(format!(
            "tide {} on device {ord}: XLA passed no CUDA stream",
            op_name(call.op)
        )));
    }
    let stream = call.stream as CUstream;
    // SAFETY: XLA's stream handle, valid for the call.
    let sctx = unsafe { driver::stream_context(stream, || format!("XLA's stream on device {ord}"))? };
    if sctx != ctx {
        return Err(TideError::Cuda {
            call: "cuStreamGetCtx".into(),
            detail: format!("XLA's stream on device {ord} is not in the device's primary context"),
        });
    }
    // SAFETY: as above.
    if unsafe { driver::stream_capturing(stream, || format!("device {ord}"))? } {
        return Err(TideError::InvalidArgument(format!(
            "tide {} on device {ord}: called during CUDA graph capture; tide's collectives rendezvous on the host \
             and cannot be captured (do not mark the handler command-buffer compatible)",
            op_name(call.op)
        )));
    }
    if call.topology.nodes > 1 && !multi_node {
        return Err(TideError::InvalidTopology(format!(
            "tide {} on device {ord}: topology {} has several nodes; the CUDA engine runs single-node plans only \
             (multi-node is not supported on the CUDA engine yet)",
            op_name(call.op),
            call.topology
        )));
    }
    call.topology.check_world(call.world)
}

/// Whether `call`'s buffers have exactly the shapes and dtypes of `layout` (what `call.layout()`
/// would rebuild and validate): the full parameter on one side, the dim-0 shard on the other.
fn same_shapes(layout: &GroupLayout, call: &CallInfo) -> bool {
    let n = layout.params.len();
    if layout.world != call.world || call.inputs.len() != n || call.outputs.len() != n {
        return false;
    }
    layout.params.iter().enumerate().all(|(i, p)| {
        let (full, shard, shard_dtype) = match call.op {
            Op::AllGather => (&call.outputs[i], &call.inputs[i], p.dtype),
            Op::ReduceScatter => (&call.inputs[i], &call.outputs[i], crate::layout::DType::F32),
        };
        // A reduce-scatter into slices: every result buffer has `at.count` slices in front.
        let shard_dims = match (call.op, call.at) {
            (Op::ReduceScatter, Some(at)) if shard.dims.first() == Some(&at.count) => &shard.dims[1..],
            (Op::ReduceScatter, Some(_)) => return false,
            _ => &shard.dims[..],
        };
        full.dims == p.shape
            && full.dtype == p.dtype
            && shard.dtype == shard_dtype
            && shard_dims == p.shard_shape().as_slice()
    })
}

/// NVLink multicast: off unless asked for; then the whole gate (multicast module header), the
/// device attribute query last. No multicast call is made here.
pub(crate) fn multicast_grant(call: &CallInfo, dev: CUdevice, plan: &Plan, cfg: &Config) -> Option<multicast::Granted> {
    if call.op != Op::AllGather || !cfg.multicast {
        return None;
    }
    if plan.layout.params.iter().any(|p| p.is_strided()) {
        log::info!(
            "tide: multicast declined for all_gather site {}: a parameter is gathered along a dimension \
             other than its first (2-D copies; the multicast fan-out lands contiguous shards)",
            call.site
        );
        return None;
    }
    let shard_bytes: Vec<usize> = plan.layout.params.iter().map(|p| p.shard_bytes).collect();
    let ord = call.device_ordinal;
    let d = multicast::decide(
        &multicast::GateInputs {
            requested: cfg.multicast,
            env_denial: multicast::env_denial(&|k| std::env::var(k).ok()),
            nodes: call.topology.nodes,
            world: call.world,
            shard_bytes: &shard_bytes,
        },
        &mut || multicast::device_supports(dev, ord),
    );
    multicast::log_once(ord, call.site, &d);
    d.granted()
}

/// (address, bytes) of each operand and result, null buffers refused. For a reduce-scatter into
/// slices (`CallInfo::at`) a result is its buffer's slice 0: the kernels that write it add the
/// slice the index selects on the device (`issue`).
#[allow(clippy::type_complexity)]
pub(crate) fn buffer_lists(call: &CallInfo, plan: &Plan) -> Result<(Vec<(u64, usize)>, Vec<(u64, usize)>)> {
    let n = plan.layout.len();
    let mut inputs = Vec::with_capacity(n);
    let mut outputs = Vec::with_capacity(n);
    for i in 0..n {
        for (list, view, bytes, role) in [
            (&mut inputs, &call.inputs[i], plan.input_bytes(i), "operand"),
            (&mut outputs, &call.outputs[i], plan.output_bytes(i), "result"),
        ] {
            if view.ptr == 0 && bytes > 0 {
                return Err(TideError::InvalidArgument(format!(
                    "tide {} on rank {}: {}: {role} buffer is null",
                    op_name(call.op),
                    call.rank,
                    plan.layout.params[i].describe()
                )));
            }
            list.push((view.ptr as u64, bytes));
        }
    }
    Ok((inputs, outputs))
}
