//! A collective call as the FFI edge decoded it, independent of cxx and XLA types. Both the CPU
//! and the CUDA handlers build one of these, validate it against the group layout, and hand it to
//! their engine.
//!
//! FFI contract (what `tide_jax` passes, see docs/design.md "FFI contract"):
//! - all-gather: inputs are the N local shards `(shard_rows, *rest)`, outputs the N full parameters
//!   `(rows, *rest)` (same dtype as the shard; `()` for a 0-d parameter).
//! - reduce-scatter: inputs are the N full gradients `(rows, *rest)` (bf16, f16 or f32), outputs the
//!   N fp32 shards `(shard_rows, *rest)`.
//!
//! Bounds (any caller of `jax.ffi.ffi_call` can pass any attributes; none may abort, hang or
//! exhaust the process): `check_attributes` checks every attribute, with overflow-safe arithmetic,
//! before anything is allocated by its value, and `CallInfo::layout` checks the buffers and the
//! size of the plan they imply. The limits are the `MAX_*` constants below; a call past one fails
//! at once with an error naming the attribute (or buffer), its value and the limit. Messages stay
//! under `error::MAX_MESSAGE_BYTES`: lists and names in them are shortened.

use crate::error::{short_list, Result, TideError};
use crate::layout::{DType, GroupLayout, ParamSpec};
use crate::plan::Op;
use crate::topology::Topology;

/// Largest `world` (size of the sharded mesh axis) tide accepts. With `job` 0 the bound is tighter:
/// every rank is a device of this process, listed in `device_ordinals`.
pub const MAX_WORLD: usize = 1 << 16;
/// Most device entries (`device_ordinals`) of one call: the devices of a mesh in one process.
pub const MAX_DEVICES: usize = 1 << 16;
/// Most parameters (operands) of one call.
pub const MAX_PARAMS: usize = 1 << 16;
/// Most dims of one buffer.
pub const MAX_DIMS: usize = 64;
/// Largest buffer, in bytes (2^48: the virtual address space of x86-64 and aarch64).
pub const MAX_BUFFER_BYTES: usize = 1 << 48;
/// Largest plan, in steps (an upper bound computed before the plan is built): the CPU engine's plans
/// hold every rank's steps, about world^2 x parameters for the all-gather. Past it a call fails
/// asking to split its parameter group.
pub const MAX_PLAN_STEPS: usize = 1 << 24;
/// Characters of a parameter name kept for messages.
const MAX_NAME_CHARS: usize = 128;
/// Items of a list shown in a message.
const LIST_ITEMS: usize = 8;

/// The attributes of one call as the FFI edge received them, unchecked (docs/design.md "FFI
/// contract"): whatever a caller of `jax.ffi.ffi_call` passed.
#[derive(Debug, Clone, Copy)]
pub struct Attributes<'a> {
    pub site: i64,
    pub world: i64,
    pub nodes: i64,
    pub gpus_per_node: i64,
    /// XLA's device ordinal of the executing device (FFI context, not an attribute).
    pub device_ordinal: i64,
    pub device_ordinals: &'a [i64],
    pub device_ranks: &'a [i64],
    pub device_groups: &'a [i64],
    pub job: i64,
    /// Numbers of operands and results (bounded here, before the buffers are converted; how they
    /// relate is checked with the buffers).
    pub operands: usize,
    pub results: usize,
}

/// What `check_attributes` proved and derived: this device's place in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckedAttributes {
    pub world: usize,
    pub topology: Topology,
    pub rank: usize,
    pub group: usize,
    pub job: u64,
}

/// Checks the settings the call runs under (`config::check`) and every attribute, in milliseconds
/// whatever the values (O(devices log devices), nothing allocated by a value before it is bounded):
/// - at most `MAX_PARAMS` results (parameters) and twice that many operands;
/// - `job` >= 0; `world` in 1..=`MAX_WORLD`; `nodes` and `gpus_per_node` in 1..=world with
///   `nodes * gpus_per_node == world` (checked multiplication: no product wraps to the world);
/// - the device arrays have equal lengths in 1..=`MAX_DEVICES`; ordinals are distinct and include
///   the executing device; ranks lie in 0..world, groups in 0..entries (`job` 0) or
///   0..`MAX_DEVICES`, and no (group, rank) pair repeats (a duplicate rank is named as such);
/// - `job` 0 (every rank in this process): every group lists each rank 0..world exactly once, so
///   world * groups equals the number of entries and a missing rank is named at once instead of
///   after the timeout.
///
/// Errors name the call (op, site, device), the attribute and its (shortened) value.
pub fn check_attributes(op: Op, a: &Attributes) -> Result<CheckedAttributes> {
    crate::config::check()?;
    let what = format!(
        "{} site {} on device {}",
        op_name(op),
        a.site,
        a.device_ordinal
    );
    let bad = |m: String| TideError::InvalidArgument(format!("{what}: {m}"));
    let bad_topology = |m: String| TideError::InvalidTopology(format!("{what}: {m}"));

    // One result per parameter in every phase; a done also takes start's results as operands.
    if a.results > MAX_PARAMS || a.operands > 2 * MAX_PARAMS {
        return Err(bad(format!(
            "{} operands and {} results, more than tide's limit of {MAX_PARAMS} parameters per call \
             (call::MAX_PARAMS)",
            a.operands, a.results
        )));
    }
    let job = u64::try_from(a.job).map_err(|_| {
        bad(format!(
            "attribute 'job' is {}; it must be 0 (single process) or a positive multi-process job id",
            a.job
        ))
    })?;
    if a.world <= 0 {
        return Err(bad(format!(
            "attribute 'world' is {}; the sharded axis needs at least one device",
            a.world
        )));
    }
    let world = match usize::try_from(a.world) {
        Ok(w) if w <= MAX_WORLD => w,
        _ => {
            return Err(bad(format!(
                "attribute 'world' is {}, more than tide's limit of {MAX_WORLD} ranks (call::MAX_WORLD)",
                a.world
            )))
        }
    };
    let in_world = |v: i64| {
        usize::try_from(v)
            .ok()
            .filter(|&x| (1..=world).contains(&x))
    };
    let nodes = in_world(a.nodes).ok_or_else(|| {
        bad_topology(format!(
            "attribute 'nodes' is {}; it must be in 1..={world} (attribute 'world')",
            a.nodes
        ))
    })?;
    let gpus_per_node = in_world(a.gpus_per_node).ok_or_else(|| {
        bad_topology(format!(
            "attribute 'gpus_per_node' is {}; it must be in 1..={world} (attribute 'world')",
            a.gpus_per_node
        ))
    })?;
    if nodes.checked_mul(gpus_per_node) != Some(world) {
        return Err(bad_topology(format!(
            "attributes 'nodes' x 'gpus_per_node': {nodes}x{gpus_per_node} does not have the {world} \
             ranks of attribute 'world'"
        )));
    }
    let topology = Topology::new(nodes, gpus_per_node).map_err(|e| bad_topology(e.to_string()))?;

    let n = a.device_ordinals.len();
    if a.device_ranks.len() != n || a.device_groups.len() != n {
        return Err(bad(format!(
            "attributes 'device_ordinals', 'device_ranks', 'device_groups' must have equal lengths, \
             got {}, {}, {}",
            n,
            a.device_ranks.len(),
            a.device_groups.len()
        )));
    }
    if n == 0 || n > MAX_DEVICES {
        return Err(bad(format!(
            "attribute 'device_ordinals' has {n} entries; it lists the mesh's devices in this \
             process, 1..={MAX_DEVICES} (call::MAX_DEVICES)"
        )));
    }
    let device = a.device_ordinal;
    let at = a
        .device_ordinals
        .iter()
        .position(|&d| d == device)
        .ok_or_else(|| {
            bad(format!(
                "device ordinal {device} is not in attribute 'device_ordinals' {}: the call runs on a \
                 device outside the mesh it was traced for",
                short_list(a.device_ordinals, LIST_ITEMS)
            ))
        })?;
    let mut ordinals: Vec<(i64, usize)> = a.device_ordinals.iter().copied().zip(0..).collect();
    ordinals.sort_unstable();
    if let Some(w) = ordinals.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!(
            "device ordinal {} appears twice in attribute 'device_ordinals' (entries {} and {})",
            w[0].0, w[0].1, w[1].1
        )));
    }
    // With job 0 every group is complete here, so there are at most n / world groups.
    let groups_bound = if job == 0 { n } else { MAX_DEVICES };
    // (group, rank, entry) of every device, checked one by one, then for repeats.
    let mut places: Vec<(usize, usize, usize)> = Vec::with_capacity(n);
    for i in 0..n {
        let ordinal = a.device_ordinals[i];
        let rank = usize::try_from(a.device_ranks[i])
            .ok()
            .filter(|&r| r < world)
            .ok_or_else(|| {
                bad(format!(
                    "device {ordinal} (entry {i}) has rank {} in attribute 'device_ranks', outside \
                     world size {world}",
                    a.device_ranks[i]
                ))
            })?;
        let group = usize::try_from(a.device_groups[i])
            .ok()
            .filter(|&g| g < groups_bound)
            .ok_or_else(|| {
                bad(format!(
                    "device {ordinal} (entry {i}) has group {} in attribute 'device_groups'; groups \
                     number the positions on the other mesh axes, 0..{groups_bound}{}",
                    a.device_groups[i],
                    if job == 0 { " (the entries of this process)" } else { " (call::MAX_DEVICES)" }
                ))
            })?;
        places.push((group, rank, i));
    }
    places.sort_unstable();
    if let Some(w) = places
        .windows(2)
        .find(|w| (w[0].0, w[0].1) == (w[1].0, w[1].1))
    {
        return Err(bad(format!(
            "rank {} appears twice in group {} of attribute 'device_ranks' (devices {} and {}): \
             every rank of the axis is one device",
            w[0].1, w[0].0, a.device_ordinals[w[0].2], a.device_ordinals[w[1].2]
        )));
    }
    if job == 0 {
        // Sorted by (group, rank) without repeats: a complete group is exactly ranks 0..world.
        for chunk in places.chunk_by(|x, y| x.0 == y.0) {
            if let Some(missing) = (0..world).find(|&r| chunk.get(r).map(|p| p.1) != Some(r)) {
                return Err(bad(format!(
                    "group {} lacks rank {missing} (it lists {} of the {world} ranks of attribute \
                     'world' in 'device_ranks'); with attribute 'job' 0 every rank is a device of \
                     this process",
                    chunk[0].0,
                    chunk.len()
                )));
            }
        }
    }
    Ok(CheckedAttributes {
        world,
        topology,
        rank: places
            .iter()
            .find(|p| p.2 == at)
            .map(|p| p.1)
            .expect("every entry has a place"),
        group: usize::try_from(a.device_groups[at]).expect("checked above"),
        job,
    })
}

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
    /// The XLA device ordinal of each rank of this call's group (by rank) when every rank is in
    /// this process (`job` 0); empty otherwise. The rendezvous's deadlock check (`deadlock`) tells
    /// devices apart by them: each XLA device runs its programs one at a time. Shared, so a
    /// call's `deadlock::Place` takes it without a copy.
    pub rank_devices: std::sync::Arc<[i64]>,
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
    /// Set for a reduce-scatter *into* slices of larger buffers (`tide_reduce_scatter_into_*`):
    /// each result is a slice of `outputs[i]`, chosen on the device (`OutputAt`). None: the
    /// outputs are the results themselves.
    pub at: Option<OutputAt>,
    /// Set for the casting all-gather (`tide_all_gather_cast_*`, `crate::cast`): its fp32 operands
    /// and slice index; `inputs` are then bf16 views of this rank's own rows of `outputs` (start) or
    /// the start's results (done). None for every other call.
    pub cast: Option<CastFrom>,
    /// The caller waits on this call's done next (attribute `urgent`, scan_layers' last
    /// reduce-scatters): nothing runs beside it, so its reductions take the whole GPU
    /// (`config::for_call`). False for every call a step hides behind compute.
    pub urgent: bool,
}

/// What a casting all-gather reads (`crate::cast`): per parameter an fp32 buffer `(count, *shard)`,
/// and the int32 index of the slice to gather (`OutputAt::slice`'s rule; device memory on CUDA,
/// host memory on CPU). A done carries `srcs` empty (it only pairs with its start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CastFrom {
    pub srcs: Vec<BufferView>,
    pub index_ptr: usize,
    pub count: usize,
}

/// Where a reduce-scatter into larger buffers writes (docs/design.md "FFI contract",
/// `tide_reduce_scatter_into_start`): `outputs[i]` has shape `(count, *shard_i)` and the call's
/// result i is `outputs[i][slice(index)]`, where `index` is the int32 scalar at `index_ptr` (device
/// memory on CUDA, read by the kernels when they run; host memory on CPU) and `slice` is
/// `jax.lax.dynamic_update_slice`'s rule: a negative index counts from the end, then it is clamped
/// to [0, count - 1], so an index past either end writes the nearest slice and never outside the
/// buffer. Every other slice is left as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputAt {
    /// Address of the int32 slice index.
    pub index_ptr: usize,
    /// Slices in each output buffer (its leading dim), >= 1.
    pub count: usize,
}

impl OutputAt {
    /// The slice an index value selects: `index` (plus `count` if negative) clamped to [0, count - 1].
    pub fn slice(&self, index: i32) -> usize {
        let count = self.count as i64;
        let i = if index < 0 { index as i64 + count } else { index as i64 };
        i.clamp(0, (count - 1).max(0)) as usize
    }
}

impl CallInfo {
    /// What the rendezvous's deadlock check knows of this call on `engine`'s devices (a cycle
    /// through it broken after `confirm_after`); None when it cannot be checked (no run id, or
    /// ranks in other processes).
    pub fn place(
        &self,
        engine: &'static str,
        confirm_after: std::time::Duration,
    ) -> Option<crate::deadlock::Place> {
        (self.run_id != 0 && self.rank_devices.len() == self.world).then(|| crate::deadlock::Place {
            engine,
            run: self.run_id,
            devices: self.rank_devices.clone(),
            confirm_after,
            stall_after: None,
        })
    }

    /// Builds the group layout this call implies and checks every buffer against it. Errors name
    /// the parameter (index, name, shape), the rank and the call.
    pub fn layout(&self) -> Result<GroupLayout> {
        build_layout(self)
    }

    /// The operands a start's in-flight record holds (`crate::inflight`; done passes them again, so
    /// XLA keeps them alive until then): all of them, except for the casting all-gather, which
    /// reads its operands before the start returns and holds none.
    pub fn held_operands(&self) -> Vec<usize> {
        if self.cast.is_some() {
            Vec::new()
        } else {
            self.inputs.iter().map(|b| b.ptr).collect()
        }
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "tide all_gather",
        Op::ReduceScatter => "tide reduce_scatter",
    }
}

/// Which half of a collective a call is (docs/design.md "Start/done"). The FFI edge decodes it
/// from the target; the engines take it with the `CallInfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The whole collective in one call (start and done back to back).
    Sync,
    /// Launch the collective and return; its results are valid only after the matching done.
    Start,
    /// Wait for the call its start launched (found by the buffers, `crate::inflight`).
    Done,
}

impl Phase {
    /// The phase of the FFI bridge's code (0 sync, 1 start, 2 done).
    pub fn from_code(code: u8) -> Result<Phase> {
        match code {
            0 => Ok(Phase::Sync),
            1 => Ok(Phase::Start),
            2 => Ok(Phase::Done),
            _ => Err(TideError::Internal(format!("unknown phase code {code}"))),
        }
    }
}

/// The op code of the FFI bridge, `crate::inflight` and the multi-process announcements
/// (0 all-gather, 1 reduce-scatter).
pub fn op_code(op: Op) -> u8 {
    match op {
        Op::AllGather => 0,
        Op::ReduceScatter => 1,
    }
}

/// The op of an op code (`op_code`'s inverse).
pub fn op_from_code(code: u8) -> Result<Op> {
    match code {
        0 => Ok(Op::AllGather),
        1 => Ok(Op::ReduceScatter),
        _ => Err(TideError::Internal(format!("unknown op code {code}"))),
    }
}

fn build_layout(call: &CallInfo) -> Result<GroupLayout> {
    use crate::invalid;
    let what = format!("{} site {}", op_name(call.op), call.site);
    let who = format!("rank {} (device {})", call.rank, call.device_ordinal);
    let n = call.inputs.len();
    if n == 0 {
        return invalid!("{what} on {who}: empty parameter group (no operands)",);
    }
    if call.outputs.len() != n {
        return invalid!(
            "{what} on {who}: {} operands but {} results; one result per parameter",
            n,
            call.outputs.len()
        );
    }
    if let Some(at) = call.at {
        if call.op != Op::ReduceScatter || at.count == 0 || at.index_ptr == 0 {
            return invalid!(
                "{what} on {who}: writing into slices needs a reduce-scatter, buffers with at least \
                 one slice and an index buffer (got {:?}, {} slices, index at {:#x})",
                call.op,
                at.count,
                at.index_ptr
            );
        }
    }
    if call.world == 0 || call.rank >= call.world {
        return invalid!(
            "{what} on {who}: rank {} is outside world size {}",
            call.rank,
            call.world
        );
    }
    if n > MAX_PARAMS {
        return invalid!(
            "{what} on {who}: {n} operands, more than tide's limit of {MAX_PARAMS} parameters per \
             call (call::MAX_PARAMS)",
        );
    }
    for (role, list) in [("operand", &call.inputs), ("result", &call.outputs)] {
        for (i, b) in list.iter().enumerate() {
            check_buffer(b).map_err(|m| {
                TideError::InvalidArgument(format!("{what} on {who}: {role} {i}: {m}"))
            })?;
        }
    }
    let name = |i: usize| short_name(call.names.get(i).map(String::as_str).unwrap_or(""));
    // The full shape is the all-gather's output and the reduce-scatter's input.
    let (full, shard) = match call.op {
        Op::AllGather => (&call.outputs, &call.inputs),
        Op::ReduceScatter => (&call.inputs, &call.outputs),
    };
    let lead = usize::from(call.at.is_some()); // the slices' dim before a slice's own
    let specs: Vec<ParamSpec> = (0..n)
        .map(|i| {
            let axis = sharded_axis(&full[i].dims, shard[i].dims.get(lead..).unwrap_or(&[]));
            ParamSpec::new(name(i), &full[i].dims, full[i].dtype).along(axis)
        })
        .collect();
    let layout = GroupLayout::new(&specs, call.world)
        .map_err(|e| crate::error::TideError::InvalidArgument(format!("{what} on {who}: {e}")))?;
    check_plan_size(&what, &who, call, &layout)?;
    for (i, p) in layout.params.iter().enumerate() {
        if p.axis > 0 && (call.at.is_some() || call.cast.is_some()) {
            return invalid!(
                "{what} on {who}: {}: slices of stacked buffers and the casting all-gather shard \
                 dim 0 only",
                p.describe()
            );
        }
        let mut want = p.shard_shape();
        if let (Op::ReduceScatter, Some(at)) = (call.op, call.at) {
            want.insert(0, at.count);
        }
        let got = &shard[i];
        let role = match call.op {
            Op::AllGather => "operand (local shard)",
            Op::ReduceScatter => "result (fp32 shard)",
        };
        if got.dims != want {
            return invalid!(
                "{what} on {who}: {}: {role} has shape {:?}, the layout over {} ranks wants {:?}",
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
                        "{what} on {who}: {}: shard dtype {} differs from the result dtype {}",
                        p.describe(),
                        got.dtype.name(),
                        p.dtype.name()
                    );
                }
            }
            Op::ReduceScatter => {
                if !p.dtype.is_reducible() {
                    return Err(crate::error::TideError::UnsupportedDtype {
                        dtype: format!("{} ({} in {what} on {who})", p.dtype.name(), p.describe()),
                        op: "reduce_scatter (bfloat16, float16 or float32 gradients)",
                    });
                }
                if got.dtype != DType::F32 {
                    return invalid!(
                        "{what} on {who}: {}: result dtype is {}, tide reduces into float32",
                        p.describe(),
                        got.dtype.name()
                    );
                }
            }
        }
    }
    Ok(layout)
}

/// The sharded dimension of a parameter whose full shape is `full` and whose shard is `shard`:
/// the one dimension whose size differs (docs/design.md "FFI contract"), 0 when none does (world
/// 1, or rows that fit one rank) or when the shapes differ in some other way (then the shape
/// check that follows names the mismatch against the dim-0 layout).
pub(crate) fn sharded_axis(full: &[usize], shard: &[usize]) -> usize {
    if full.len() != shard.len() {
        return 0;
    }
    let mut differ = full.iter().zip(shard).enumerate().filter(|(_, (a, b))| a != b).map(|(d, _)| d);
    match (differ.next(), differ.next()) {
        (Some(d), None) => d,
        _ => 0,
    }
}

/// At most `MAX_NAME_CHARS` characters of a parameter name, for messages.
pub(crate) fn short_name(name: &str) -> String {
    match name.char_indices().nth(MAX_NAME_CHARS) {
        Some((at, _)) => format!("{}...", &name[..at]),
        None => name.to_string(),
    }
}

/// A buffer's own bounds: at most `MAX_DIMS` dims, at most `MAX_BUFFER_BYTES` bytes (checked
/// multiplication), and an address unless it is empty.
fn check_buffer(b: &BufferView) -> std::result::Result<(), String> {
    if b.dims.len() > MAX_DIMS {
        return Err(format!(
            "{} dims, more than tide's limit of {MAX_DIMS} (call::MAX_DIMS)",
            b.dims.len()
        ));
    }
    let bytes = b
        .dims
        .iter()
        .try_fold(b.dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
        .filter(|&bytes| bytes <= MAX_BUFFER_BYTES);
    match bytes {
        None => Err(format!(
            "shape {:?} of {} is more than tide's limit of 2^48 bytes per buffer \
             (call::MAX_BUFFER_BYTES)",
            b.dims,
            b.dtype.name()
        )),
        Some(bytes) if bytes > 0 && b.ptr == 0 => Err(format!(
            "shape {:?} of {} at address 0 (a null buffer)",
            b.dims,
            b.dtype.name()
        )),
        Some(_) => Ok(()),
    }
}

/// An upper bound on the steps of the plan for `layout` over `topology` (`crate::plan::build`;
/// every rank's steps are in one plan), `None` if it overflows. All-gather: every executor pulls
/// each source rank's rows of each parameter once (at most min(world, rows) sources hold rows),
/// plus per rail round one block per parameter and node. Reduce-scatter: per round, every
/// destination's rows of each parameter in chunks of a staging slot, each chunk one copy per local
/// peer and one reduce, plus a few level-2 steps and three step lists per phase and executor.
pub fn plan_steps_bound(
    op: Op,
    layout: &GroupLayout,
    topology: Topology,
    slot_bytes: usize,
) -> Option<usize> {
    let world = layout.world;
    let params = layout.params.len();
    let sources = layout
        .params
        .iter()
        .try_fold(0usize, |acc, p| acc.checked_add(p.rows.min(world)))?;
    let nodes = topology.nodes;
    match op {
        Op::AllGather => {
            let rounds = (usize::BITS - nodes.leading_zeros()) as usize; // >= ceil(log2(nodes))
            let rail = rounds.checked_mul(params.checked_add(nodes)?)?;
            world.checked_mul(sources.checked_add(rail)?)
        }
        Op::ReduceScatter => {
            let gpus = topology.gpus_per_node;
            let per_piece = (slot_bytes / gpus.saturating_sub(1).max(1)).max(1);
            let chunks = layout.params.iter().try_fold(0usize, |acc, p| {
                let bytes = p.rows.checked_mul(p.row_bytes())?;
                acc.checked_add(bytes / per_piece + 1)
            })?;
            let level1 = nodes
                .checked_mul(gpus)?
                .checked_mul(chunks.checked_add(sources)?)?;
            let level2 = world
                .checked_mul(nodes.checked_add(2)?)?
                .checked_mul(params.checked_add(3)?.checked_mul(3)?)?;
            // A strided parameter's chunk is up to three copies per local rank, and alone on its
            // node an executor widens it block by block (`plan::build`, Level1::emit_strided).
            let strided = layout.params.iter().filter(|p| p.is_strided()).try_fold(0usize, |acc, p| {
                acc.checked_add(p.outer.checked_add(3)?.checked_mul(gpus.checked_add(1)?)?)
            })?;
            let strided = world.checked_mul(nodes)?.checked_mul(strided)?;
            level1.checked_add(level2)?.checked_add(strided)
        }
    }
}

fn check_plan_size(what: &str, who: &str, call: &CallInfo, layout: &GroupLayout) -> Result<()> {
    let slot_bytes = crate::config::current().rs_slot_bytes;
    match plan_steps_bound(call.op, layout, call.topology, slot_bytes) {
        Some(steps) if steps <= MAX_PLAN_STEPS => Ok(()),
        steps => crate::invalid!(
            "{what} on {who}: the plan for {} parameters over world {} (topology {}) would have {} \
             steps, more than tide's limit of {MAX_PLAN_STEPS} (call::MAX_PLAN_STEPS); split the \
             parameter group into several calls",
            layout.params.len(),
            layout.world,
            call.topology,
            steps.map_or("more than 2^64".to_string(), |s| format!("up to {s}"))
        ),
    }
}
