//! Plans: a collective over a parameter group, built as data.
//!
//! A plan is a list of *phases*. Phases are separated by a barrier over all ranks: nothing of phase
//! k+1 starts on any rank before every step of phase k finished on every rank. Inside a phase each
//! step has an *executor* rank (the rank whose engine issues it, e.g. whose stream a copy goes on);
//! one executor's steps run in the listed order (an engine may overlap them only where the regions
//! they touch do not overlap), different executors run concurrently. A step never reads a region
//! that another executor writes in the same phase (`Plan::validate` checks this).
//!
//! Buffers per rank: `Input(i)` and `Output(i)` are parameter i's operand and result (owned by XLA;
//! all-gather: shard in, full parameter out; reduce-scatter: full gradient in, fp32 shard out).
//! `Stage(s)` are tide's own scratch slots of `Plan::stage_slot_bytes[s]` bytes on every rank.
//!
//! Engines (`engine::cpu`, `cuda`) execute the same plans; the CPU engine is the oracle.

pub mod build;

use crate::layout::{DType, GroupLayout};
use crate::topology::Topology;
use std::fmt;

pub use build::{all_gather, reduce_scatter, RsOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    AllGather,
    ReduceScatter,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufKind {
    Input,
    Output,
    Stage,
}

/// A byte position in one rank's buffer. `index` is the parameter index for Input/Output and the
/// slot index for Stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    pub rank: usize,
    pub kind: BufKind,
    pub index: usize,
    pub offset: usize,
}

/// A source of a reduction: where, and as what element type it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    pub region: Region,
    pub dtype: DType,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Move `bytes` bytes from src to dst unchanged.
    Copy { src: Region, dst: Region, bytes: usize },
    /// Write `bytes` zero bytes at dst (padding rows).
    Zero { dst: Region, bytes: usize },
    /// `dst[e] = (((f32(srcs[0][e]) + f32(srcs[1][e])) + ...)` for e in 0..elems, in fp32, in exactly
    /// the listed order (so results are bitwise reproducible). dst is fp32.
    Reduce { dst: Region, srcs: Vec<Operand>, elems: usize },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub executor: usize,
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phase {
    pub name: String,
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub op: Op,
    pub topology: Topology,
    pub layout: GroupLayout,
    pub phases: Vec<Phase>,
    /// Bytes of each stage slot; every rank has the same slots.
    pub stage_slot_bytes: Vec<usize>,
}

/// What a plan costs, computed from its steps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Bytes written into each rank by copies whose source is on another rank.
    pub recv_bytes_per_rank: Vec<usize>,
    /// Of those, bytes whose source is on another node (over the rail).
    pub cross_node_recv_bytes_per_rank: Vec<usize>,
    /// Bytes copied where source and destination are on the same rank.
    pub local_copy_bytes: usize,
    /// Elements summed (output elements of Reduce steps) over all ranks.
    pub reduce_elems: usize,
    /// tide scratch per rank (sum of stage slots).
    pub stage_bytes_per_rank: usize,
    pub steps: usize,
}
