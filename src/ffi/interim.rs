//! TEMPORARY stand-in for the core work's plan builders and CPU engine (branch `core`), with the
//! same API (`plan::all_gather`, `plan::reduce_scatter`, `engine::cpu::StageBuffers`,
//! `engine::cpu::execute_rank`), so the FFI edge can be tested end to end before they land.
//! Single-phase direct plans and a plain interpreter; deleted once `core` is merged.

use crate::engine::{Barrier, RankBuffers};
use crate::error::{Result, TideError};
use crate::layout::{DType, GroupLayout};
use crate::plan::{Action, BufKind, Op, Operand, Phase, Plan, Region, RsOptions, Step};
use crate::topology::Topology;

fn region(rank: usize, kind: BufKind, index: usize, offset: usize) -> Region {
    Region { rank, kind, index, offset }
}

pub fn all_gather(layout: &GroupLayout, topology: Topology) -> Result<Plan> {
    let world = layout.world;
    let mut steps = Vec::new();
    for src in 0..world {
        for p in &layout.params {
            let (start, _) = p.owned_rows(src);
            let bytes = p.valid_rows(src) * p.row_bytes();
            if bytes == 0 {
                continue;
            }
            for dst in 0..world {
                steps.push(Step {
                    executor: src,
                    action: Action::Copy {
                        src: region(src, BufKind::Input, p.index, 0),
                        dst: region(dst, BufKind::Output, p.index, start * p.row_bytes()),
                        bytes,
                    },
                });
            }
        }
    }
    Ok(Plan {
        op: Op::AllGather,
        topology,
        layout: layout.clone(),
        phases: vec![Phase { name: "direct".into(), steps }],
        stage_slot_bytes: vec![],
    })
}

pub fn reduce_scatter(layout: &GroupLayout, topology: Topology, _opts: RsOptions) -> Result<Plan> {
    let world = layout.world;
    let mut steps = Vec::new();
    for dst in 0..world {
        for p in &layout.params {
            let (start, _) = p.owned_rows(dst);
            let valid = p.valid_rows(dst);
            let elems = valid * p.row_elems;
            if elems > 0 {
                let srcs = (0..world)
                    .map(|r| Operand { region: region(r, BufKind::Input, p.index, start * p.row_bytes()), dtype: p.dtype })
                    .collect();
                steps.push(Step { executor: dst, action: Action::Reduce { dst: region(dst, BufKind::Output, p.index, 0), srcs, elems } });
            }
            let pad = (p.shard_rows - valid) * p.row_elems * 4;
            if pad > 0 {
                steps.push(Step { executor: dst, action: Action::Zero { dst: region(dst, BufKind::Output, p.index, elems * 4), bytes: pad } });
            }
        }
    }
    Ok(Plan {
        op: Op::ReduceScatter,
        topology,
        layout: layout.clone(),
        phases: vec![Phase { name: "direct".into(), steps }],
        stage_slot_bytes: vec![],
    })
}

pub struct StageBuffers {
    slots: Vec<Vec<u64>>,
}

impl StageBuffers {
    pub fn new(plan: &Plan) -> StageBuffers {
        StageBuffers { slots: plan.stage_slot_bytes.iter().map(|&b| vec![0u64; b.div_ceil(8)]).collect() }
    }
    pub fn addrs(&self) -> Vec<usize> {
        self.slots.iter().map(|s| s.as_ptr() as usize).collect()
    }
}

fn addr(bufs: &[RankBuffers], r: &Region) -> usize {
    let b = &bufs[r.rank];
    let base = match r.kind {
        BufKind::Input => b.inputs[r.index],
        BufKind::Output => b.outputs[r.index],
        BufKind::Stage => b.stages[r.index],
    };
    base + r.offset
}

/// # Safety
/// Every address in `bufs` must be valid for the plan's regions.
pub unsafe fn execute_rank(plan: &Plan, rank: usize, bufs: &[RankBuffers], barrier: &dyn Barrier) -> Result<()> {
    for (k, phase) in plan.phases.iter().enumerate() {
        for step in phase.steps.iter().filter(|s| s.executor == rank) {
            match &step.action {
                Action::Copy { src, dst, bytes } => {
                    std::ptr::copy_nonoverlapping(addr(bufs, src) as *const u8, addr(bufs, dst) as *mut u8, *bytes)
                }
                Action::Zero { dst, bytes } => std::ptr::write_bytes(addr(bufs, dst) as *mut u8, 0, *bytes),
                Action::Reduce { dst, srcs, elems } => {
                    let out = addr(bufs, dst) as *mut f32;
                    for e in 0..*elems {
                        let mut acc = 0f32;
                        for (j, s) in srcs.iter().enumerate() {
                            let a = addr(bufs, &s.region);
                            let v = match s.dtype {
                                DType::F32 => *(a as *const f32).add(e),
                                DType::BF16 => f32::from_bits((*(a as *const u16).add(e) as u32) << 16),
                                other => {
                                    return Err(TideError::Internal(format!("interim engine: no {}", other.name())))
                                }
                            };
                            acc = if j == 0 { v } else { acc + v };
                        }
                        *out.add(e) = acc;
                    }
                }
            }
        }
        barrier.wait(rank, k)?;
    }
    Ok(())
}
