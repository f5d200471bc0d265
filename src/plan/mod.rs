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

use crate::error::{Result, TideError};
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
    Copy {
        src: Region,
        dst: Region,
        bytes: usize,
    },
    /// A 2-D copy ([Note: strided parameters] in `layout.rs`): `blocks` pieces of `bytes` bytes,
    /// piece j from `src.offset + j * src_pitch` to `dst.offset + j * dst_pitch`. Every piece is
    /// exactly `Copy` of it; engines without 2-D copies run `Plan::flattened`. Never crosses nodes
    /// (the rail moves packed, contiguous buffers).
    CopyBlocks {
        src: Region,
        dst: Region,
        bytes: usize,
        blocks: usize,
        src_pitch: usize,
        dst_pitch: usize,
    },
    /// Write `bytes` zero bytes at dst (padding rows).
    Zero { dst: Region, bytes: usize },
    /// `dst[e] = (((f32(srcs[0][e]) + f32(srcs[1][e])) + ...)` for e in 0..elems, in fp32, in exactly
    /// the listed order (so results are bitwise reproducible). dst is fp32.
    Reduce {
        dst: Region,
        srcs: Vec<Operand>,
        elems: usize,
    },
}

impl Action {
    /// The byte ranges the action reads, one per contiguous piece: (where, bytes).
    pub fn reads(&self) -> Vec<(Region, usize)> {
        match self {
            Action::Copy { src, bytes, .. } => vec![(*src, *bytes)],
            Action::CopyBlocks { src, bytes, blocks, src_pitch, .. } => (0..*blocks)
                .map(|j| (Region { offset: src.offset + j * src_pitch, ..*src }, *bytes))
                .collect(),
            Action::Zero { .. } => vec![],
            Action::Reduce { srcs, elems, .. } => {
                srcs.iter().map(|o| (o.region, elems * o.dtype.size_bytes())).collect()
            }
        }
    }

    /// The byte ranges the action writes, one per contiguous piece: (where, bytes).
    pub fn writes(&self) -> Vec<(Region, usize)> {
        match self {
            Action::Copy { dst, bytes, .. } | Action::Zero { dst, bytes } => vec![(*dst, *bytes)],
            Action::CopyBlocks { dst, bytes, blocks, dst_pitch, .. } => (0..*blocks)
                .map(|j| (Region { offset: dst.offset + j * dst_pitch, ..*dst }, *bytes))
                .collect(),
            Action::Reduce { dst, elems, .. } => vec![(*dst, elems * 4)],
        }
    }
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

impl Plan {
    /// Bytes of `Input(index)` on every rank: the shard (all-gather) or the full gradient in its
    /// dtype (reduce-scatter).
    pub fn input_bytes(&self, index: usize) -> usize {
        let p = &self.layout.params[index];
        match self.op {
            Op::AllGather => p.shard_bytes,
            Op::ReduceScatter => p.full_bytes(),
        }
    }

    /// Bytes of `Output(index)` on every rank: the full parameter (all-gather) or the fp32 shard,
    /// padding rows included (reduce-scatter).
    pub fn output_bytes(&self, index: usize) -> usize {
        let p = &self.layout.params[index];
        match self.op {
            Op::AllGather => p.full_bytes(),
            Op::ReduceScatter => p.shard_elems() * 4,
        }
    }

    pub fn world(&self) -> usize {
        self.layout.world
    }

    /// Bytes of the buffer a region points into, or an error naming the region.
    pub fn buffer_bytes(&self, kind: BufKind, index: usize) -> Option<usize> {
        match kind {
            BufKind::Input if index < self.layout.len() => Some(self.input_bytes(index)),
            BufKind::Output if index < self.layout.len() => Some(self.output_bytes(index)),
            BufKind::Stage => self.stage_slot_bytes.get(index).copied(),
            _ => None,
        }
    }

    /// Checks the plan's contract (see the module header and `plan::build`):
    /// - every region names an existing rank and buffer, and lies within the buffer;
    /// - no step writes an `Input`; every step's destination is on its executor (pull);
    /// - Reduce writes fp32 (an `Output` of a reduce-scatter or a stage slot) and reads from the
    ///   executor's node only; Copy and Zero may not write `Output` of an all-gather out of order;
    /// - in one phase no step reads or writes a region that another executor writes.
    pub fn validate(&self) -> Result<()> {
        use std::collections::HashMap;
        let world = self.layout.world;
        if self.topology.world() != world {
            return Err(TideError::InvalidTopology(format!(
                "plan topology {} has {} ranks but the layout has world size {world}",
                self.topology,
                self.topology.world()
            )));
        }
        let bad = |k: usize, s: &Step, why: String| -> TideError {
            TideError::Internal(format!(
                "invalid plan: phase {k} ('{}'), {}: {why}",
                self.phases[k].name,
                StepDisplay(s)
            ))
        };
        // (rank, kind, index) -> [(start, end, executor, is_write)]
        type Key = (usize, BufKind, usize);
        for (k, phase) in self.phases.iter().enumerate() {
            let mut touched: HashMap<Key, Vec<(usize, usize, usize, bool)>> = HashMap::new();
            for s in &phase.steps {
                if s.executor >= world {
                    return Err(bad(k, s, format!("executor outside world size {world}")));
                }
                let mut check = |r: &Region, bytes: usize, write: bool| -> Result<()> {
                    if r.rank >= world {
                        return Err(bad(
                            k,
                            s,
                            format!("region on rank {} outside world size {world}", r.rank),
                        ));
                    }
                    let size = self
                        .buffer_bytes(r.kind, r.index)
                        .ok_or_else(|| bad(k, s, format!("no buffer {:?}[{}]", r.kind, r.index)))?;
                    let end = r
                        .offset
                        .checked_add(bytes)
                        .ok_or_else(|| bad(k, s, "region overflows".into()))?;
                    if end > size {
                        return Err(bad(
                            k,
                            s,
                            format!(
                                "{} + {bytes} bytes ends past the buffer's {size} bytes",
                                RegionDisplay(r)
                            ),
                        ));
                    }
                    if write {
                        if r.kind == BufKind::Input {
                            return Err(bad(k, s, "writes an Input buffer".into()));
                        }
                        if r.rank != s.executor {
                            return Err(bad(
                                k,
                                s,
                                "writes another rank's memory (plans pull)".into(),
                            ));
                        }
                    }
                    if bytes > 0 {
                        touched
                            .entry((r.rank, r.kind, r.index))
                            .or_default()
                            .push((r.offset, end, s.executor, write));
                    }
                    Ok(())
                };
                match &s.action {
                    Action::Copy { src, dst, bytes } => {
                        check(src, *bytes, false)?;
                        check(dst, *bytes, true)?;
                    }
                    Action::CopyBlocks { src, dst, bytes, blocks, src_pitch, dst_pitch } => {
                        if *blocks == 0 || (*blocks > 1 && (*src_pitch < *bytes || *dst_pitch < *bytes)) {
                            return Err(bad(k, s, "2-D copy whose pieces overlap (pitch below the piece)".into()));
                        }
                        if self.topology.node_of(src.rank) != self.topology.node_of(s.executor) {
                            return Err(bad(k, s, "2-D copy from another node".into()));
                        }
                        for j in 0..*blocks {
                            let at = |r: &Region, pitch: usize| -> Result<Region> {
                                let off = j
                                    .checked_mul(pitch)
                                    .and_then(|o| o.checked_add(r.offset))
                                    .ok_or_else(|| bad(k, s, "region overflows".into()))?;
                                Ok(Region { offset: off, ..*r })
                            };
                            check(&at(src, *src_pitch)?, *bytes, false)?;
                            check(&at(dst, *dst_pitch)?, *bytes, true)?;
                        }
                    }
                    Action::Zero { dst, bytes } => check(dst, *bytes, true)?,
                    Action::Reduce { dst, srcs, elems } => {
                        if srcs.is_empty() {
                            return Err(bad(k, s, "Reduce without sources".into()));
                        }
                        if dst.kind == BufKind::Output && self.op != Op::ReduceScatter {
                            return Err(bad(
                                k,
                                s,
                                "Reduce into an all-gather Output (not fp32)".into(),
                            ));
                        }
                        let bytes = elems
                            .checked_mul(4)
                            .ok_or_else(|| bad(k, s, "size overflows".into()))?;
                        for o in srcs {
                            if !o.dtype.is_reducible() {
                                return Err(bad(
                                    k,
                                    s,
                                    format!("operand dtype {} is not reducible", o.dtype.name()),
                                ));
                            }
                            if self.topology.node_of(o.region.rank)
                                != self.topology.node_of(s.executor)
                            {
                                return Err(bad(k, s, "Reduce reads from another node".into()));
                            }
                            if o.region.kind != BufKind::Stage {
                                let want = if o.region.kind == BufKind::Output {
                                    DType::F32
                                } else {
                                    self.layout
                                        .params
                                        .get(o.region.index)
                                        .map(|p| p.dtype)
                                        .unwrap_or(o.dtype)
                                };
                                if o.dtype != want {
                                    return Err(bad(
                                        k,
                                        s,
                                        format!(
                                            "operand read as {} but the buffer holds {}",
                                            o.dtype.name(),
                                            want.name()
                                        ),
                                    ));
                                }
                            }
                            let ob = elems
                                .checked_mul(o.dtype.size_bytes())
                                .ok_or_else(|| bad(k, s, "size overflows".into()))?;
                            check(&o.region, ob, false)?;
                        }
                        check(dst, bytes, true)?;
                    }
                }
            }
            for ((rank, kind, index), mut list) in touched {
                list.sort_by_key(|t| t.0);
                // Sweep in start order; per executor, how far its reads and its writes seen so far reach.
                let mut active: Vec<(usize, usize, usize)> = Vec::new(); // (executor, read end, write end)
                for (start, end, exec, write) in list {
                    active.retain(|a| a.1.max(a.2) > start);
                    if let Some(a) = active
                        .iter()
                        .find(|a| a.0 != exec && (a.2 > start || (write && a.1 > start)))
                    {
                        let other_writes = a.2 > start;
                        return Err(TideError::Internal(format!(
                            "invalid plan: phase {k} ('{}'): rank {exec} {} {:?}[{index}] of rank {rank} at bytes [{start}, {end}) while rank {} {} it in the same phase",
                            phase.name,
                            if write { "writes" } else { "reads" },
                            kind,
                            a.0,
                            if other_writes { "writes" } else { "reads" },
                        )));
                    }
                    match active.iter_mut().find(|a| a.0 == exec) {
                        Some(a) if write => a.2 = a.2.max(end),
                        Some(a) => a.1 = a.1.max(end),
                        None if write => active.push((exec, 0, end)),
                        None => active.push((exec, end, 0)),
                    }
                }
            }
        }
        Ok(())
    }

    /// The same plan with every `CopyBlocks` as the `Copy` steps of its pieces, in order (one
    /// `Copy` where the pieces are adjacent on both sides): what an engine without 2-D copies
    /// executes. Bitwise the same results; a plan without 2-D copies comes back unchanged.
    pub fn flattened(&self) -> Plan {
        let mut plan = self.clone();
        for phase in &mut plan.phases {
            if !phase.steps.iter().any(|s| matches!(s.action, Action::CopyBlocks { .. })) {
                continue;
            }
            let mut steps = Vec::with_capacity(phase.steps.len());
            for s in phase.steps.drain(..) {
                match s.action {
                    Action::CopyBlocks { src, dst, bytes, blocks, src_pitch, dst_pitch } => {
                        if src_pitch == bytes && dst_pitch == bytes {
                            steps.push(Step {
                                executor: s.executor,
                                action: Action::Copy { src, dst, bytes: bytes * blocks },
                            });
                            continue;
                        }
                        for j in 0..blocks {
                            steps.push(Step {
                                executor: s.executor,
                                action: Action::Copy {
                                    src: Region { offset: src.offset + j * src_pitch, ..src },
                                    dst: Region { offset: dst.offset + j * dst_pitch, ..dst },
                                    bytes,
                                },
                            });
                        }
                    }
                    action => steps.push(Step { executor: s.executor, action }),
                }
            }
            phase.steps = steps;
        }
        plan
    }

    /// What the plan moves and sums, from its steps.
    pub fn stats(&self) -> PlanStats {
        let world = self.layout.world;
        let mut st = PlanStats {
            recv_bytes_per_rank: vec![0; world],
            cross_node_recv_bytes_per_rank: vec![0; world],
            stage_bytes_per_rank: self.stage_slot_bytes.iter().sum(),
            ..PlanStats::default()
        };
        for phase in &self.phases {
            for s in &phase.steps {
                st.steps += 1;
                match &s.action {
                    Action::Copy { src, dst, bytes } => {
                        if src.rank == dst.rank {
                            st.local_copy_bytes += bytes;
                        } else {
                            st.recv_bytes_per_rank[dst.rank] += bytes;
                            if self.topology.node_of(src.rank) != self.topology.node_of(dst.rank) {
                                st.cross_node_recv_bytes_per_rank[dst.rank] += bytes;
                            }
                        }
                    }
                    Action::CopyBlocks { src, dst, bytes, blocks, .. } => {
                        let total = bytes * blocks;
                        if src.rank == dst.rank {
                            st.local_copy_bytes += total;
                        } else {
                            st.recv_bytes_per_rank[dst.rank] += total;
                        }
                    }
                    Action::Zero { .. } => {}
                    Action::Reduce { elems, .. } => st.reduce_elems += elems,
                }
            }
        }
        st
    }
}

struct RegionDisplay<'a>(&'a Region);

impl fmt::Display for RegionDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.0;
        let kind = match r.kind {
            BufKind::Input => "in",
            BufKind::Output => "out",
            BufKind::Stage => "stage",
        };
        write!(f, "r{}.{kind}[{}]+{}", r.rank, r.index, r.offset)
    }
}

struct StepDisplay<'a>(&'a Step);

impl fmt::Display for StepDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        match &s.action {
            Action::Copy { src, dst, bytes } => {
                write!(
                    f,
                    "rank {}: copy {} -> {} ({bytes} B)",
                    s.executor,
                    RegionDisplay(src),
                    RegionDisplay(dst)
                )
            }
            Action::CopyBlocks { src, dst, bytes, blocks, src_pitch, dst_pitch } => write!(
                f,
                "rank {}: copy {blocks} x {bytes} B {} (pitch {src_pitch}) -> {} (pitch {dst_pitch})",
                s.executor,
                RegionDisplay(src),
                RegionDisplay(dst)
            ),
            Action::Zero { dst, bytes } => write!(
                f,
                "rank {}: zero {} ({bytes} B)",
                s.executor,
                RegionDisplay(dst)
            ),
            Action::Reduce { dst, srcs, elems } => {
                write!(f, "rank {}: reduce {} = ", s.executor, RegionDisplay(dst))?;
                for (k, o) in srcs.iter().enumerate() {
                    if k > 0 {
                        write!(f, " + ")?;
                    }
                    write!(f, "{}:{}", RegionDisplay(&o.region), o.dtype.name())?;
                }
                write!(f, " ({elems} elems, {} B out)", elems * 4)
            }
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        StepDisplay(self).fmt(f)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            Op::AllGather => "all-gather",
            Op::ReduceScatter => "reduce-scatter",
        };
        let st = self.stats();
        writeln!(
            f,
            "{op} plan over {} ({} params, {} phases, {} steps, stage {} B/rank in {} slots)",
            self.topology,
            self.layout.len(),
            self.phases.len(),
            st.steps,
            st.stage_bytes_per_rank,
            self.stage_slot_bytes.len()
        )?;
        for (k, phase) in self.phases.iter().enumerate() {
            writeln!(f, "phase {k} '{}':", phase.name)?;
            for s in &phase.steps {
                writeln!(f, "  phase {k} {s}")?;
            }
        }
        Ok(())
    }
}
