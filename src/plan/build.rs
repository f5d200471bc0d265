//! Plan builders: the all-gather and the reduce-scatter of a group over `nodes x gpus_per_node`.
//!
//! Every step is a *pull*: its destination is on its executor (copies land in the executor's own
//! memory, reductions write the executor's own fp32 buffers); Reduce sources are on the executor's
//! node (local memory, NVLink / NVSwitch); only Copy may cross nodes (the rail). `Plan::validate`
//! checks these rules.
//!
//! # All-gather
//! Single node ("direct"): one phase; rank r copies, for each parameter i and each source rank q
//! (ascending) with valid rows, q's `Input(i)` rows to `Output(i)` at `q * shard_rows * row_bytes`.
//!
//! Several nodes: paced recursive doubling over the rail (rank (n, j) talks only to ranks (m, j)),
//! Bruck-style so any node count works. Rank (n, j) keeps *relative* blocks: block t is the packed
//! shard of rank ((n + t) % N, j); block 0 is its own shard, read in place from its `Input(i)`s,
//! block t >= 1 lives in stage slot t - 1 (N - 1 slots of `layout.shard_bytes`, a packed shard each,
//! parameter i at its `prefix_offset`). In round k with `have = d` blocks, rank (n, j) pulls blocks
//! 0..c (c = min(d, N - d)) of rank ((n + d) % N, j) into its blocks d..d + c. One phase per round;
//! the copy-engine fan-out into `Output(i)` of the blocks a node holds runs one phase behind, in the
//! same phases (block 0 in phase 0), plus one final phase: rank (n, j) pulls, from its own and its
//! local peers' Inputs / stage slots, every source rank's valid rows to their final address.
//! With one node this is exactly the direct plan.
//!
//! # Reduce-scatter (two levels)
//! Executor (n, g) works in *rounds* r = 0..N. In round r it computes node n's fp32 partial for the
//! destination rank q = (m, l) with m = (n - r) mod N and l = (g - r) mod G (level 1: the G - 1 local
//! peers' slices of q's rows are staged by copy engine, chunk by chunk, through `stage_slots` bounded
//! slots used round-robin, then one Reduce per chunk sums them in local rank order 0..G-1, the
//! executor's own slice read in place from its Input). Round 0 is the node's own partial for the
//! executor itself (m = n, l = g) and is reduced straight into `Output(i)`; padding rows are zeroed.
//! For r >= 1 the partial goes into a packed fp32 partial buffer (parameter i at the prefix of the
//! fp32 shards) and crosses the rail g: rank (m, g) pulls it into its receive buffer (level 2),
//! and q sums it into its Output: `Output += recv` (reading (m, g)'s buffer over NVSwitch).
//!
//! Latin-square placement: the contributor at round r for destination local index l travels on,
//! and lands on, GPU g = (l + r) mod G of the destination node. For a fixed round, l -> g is a
//! permutation (every GPU computes, sends and receives exactly one partial per round, every rail
//! carries the same bytes); for a fixed destination, consecutive contributors land on different
//! GPUs (all G of them before any repeats), so the final sums of one node read from all its GPUs
//! at once. With N == G the (round x local index) table of GPUs is a Latin square.
//!
//! Pipelining and staging: round r's level 1 runs in phase r, its rail transfer in phase r + 1 and
//! its accumulation in phase r + 2, with two partial buffers and two receive buffers alternating by
//! round parity, so N + 2 phases in all. Staging per rank is the chunk slots plus 4 packed fp32
//! shards, independent of the node count at a fixed per-GPU output.
//!
//! Summation order, fixed: q's result is `((P_m + P_{m+1}) + ...) + P_{m+N-1}` (node indices mod
//! N), each node partial `P_n` summed over local ranks 0..G-1. Bitwise reproducible; with one node
//! this is the rank order 0..P-1 of the direct plan.
use super::{Action, BufKind, Op, Operand, Phase, Plan, Region, Step};
use crate::error::{Result, TideError};
use crate::layout::{DType, GroupLayout};
use crate::topology::Topology;

/// Options of the reduce-scatter plan: staging is `stage_slots * slot_bytes` per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RsOptions {
    pub stage_slots: usize,
    pub slot_bytes: usize,
}

impl Default for RsOptions {
    fn default() -> RsOptions {
        RsOptions {
            stage_slots: 2,
            slot_bytes: 32 << 20,
        }
    }
}

impl RsOptions {
    /// From the process configuration (TIDE_RS_STAGE_SLOTS, TIDE_RS_SLOT_BYTES).
    pub fn from_config() -> RsOptions {
        let c = crate::config::current();
        RsOptions {
            stage_slots: c.rs_stage_slots,
            slot_bytes: c.rs_slot_bytes,
        }
    }
}

fn check_topology(layout: &GroupLayout, topology: Topology, what: &str) -> Result<()> {
    if topology.nodes == 0 || topology.gpus_per_node == 0 {
        return Err(TideError::InvalidTopology(format!(
            "{what}: topology {topology} has no ranks"
        )));
    }
    topology.check_world(layout.world).map_err(|e| match e {
        TideError::InvalidTopology(m) => TideError::InvalidTopology(format!("{what}: {m}")),
        other => other,
    })
}

fn region(rank: usize, kind: BufKind, index: usize, offset: usize) -> Region {
    Region {
        rank,
        kind,
        index,
        offset,
    }
}

fn copy(executor: usize, src: Region, dst: Region, bytes: usize) -> Step {
    Step {
        executor,
        action: Action::Copy { src, dst, bytes },
    }
}

/// `blocks` pieces of `bytes` at the given pitches: one `Copy` where they are adjacent on both
/// sides (or there is one), else a 2-D `CopyBlocks`.
fn copy_blocks(
    executor: usize,
    src: Region,
    dst: Region,
    bytes: usize,
    blocks: usize,
    src_pitch: usize,
    dst_pitch: usize,
) -> Step {
    if blocks == 1 || (src_pitch == bytes && dst_pitch == bytes) {
        return copy(executor, src, dst, bytes * blocks);
    }
    Step {
        executor,
        action: Action::CopyBlocks { src, dst, bytes, blocks, src_pitch, dst_pitch },
    }
}

/// Copies one rank's shard rows of `p` (at `at`: its Input, or its copy in a packed stage block)
/// to their final place in `Output(p)` of `exec`: one piece per block of the parameter
/// ([Note: strided parameters] in `layout.rs`).
fn land(exec: usize, at: Region, p: &crate::layout::ParamLayout, q: usize) -> Option<Step> {
    let bytes = p.valid_rows(q) * p.row_bytes();
    if bytes == 0 {
        return None;
    }
    let dst = region(exec, BufKind::Output, p.index, q * p.shard_rows * p.row_bytes());
    Some(copy_blocks(exec, at, dst, bytes, p.outer, p.shard_pitch(), p.full_pitch()))
}

pub fn all_gather(layout: &GroupLayout, topology: Topology) -> Result<Plan> {
    check_topology(layout, topology, "all_gather plan")?;
    let nodes = topology.nodes;
    let gpus = topology.gpus_per_node;
    let packed = layout.shard_bytes;

    // Bruck rounds: (d, c) = (blocks held before the round, blocks pulled in it).
    let mut rounds = Vec::new();
    let mut have = 1usize;
    while have < nodes {
        let c = have.min(nodes - have);
        rounds.push((have, c));
        have += c;
    }
    // Blocks (relative indices) a node can fan out in phase k: block 0 in phase 0, the blocks of
    // round k - 1 in phase k.
    let fan_blocks = |k: usize| -> std::ops::Range<usize> {
        if k == 0 {
            0..1
        } else {
            let (d, c) = rounds[k - 1];
            d..d + c
        }
    };

    let mut phases = Vec::with_capacity(rounds.len() + 1);
    for k in 0..=rounds.len() {
        let mut steps = Vec::new();
        for exec in 0..layout.world {
            let n = topology.node_of(exec);
            let j = topology.local_of(exec);
            if let Some(&(d, c)) = rounds.get(k) {
                let src_node = (n + d) % nodes;
                let src_rank = topology.rank(src_node, j);
                for t in 0..c {
                    let dst_slot = d + t - 1;
                    if t == 0 {
                        for p in &layout.params {
                            let bytes = p.valid_elems(src_rank) * p.dtype.size_bytes();
                            if bytes > 0 {
                                steps.push(copy(
                                    exec,
                                    region(src_rank, BufKind::Input, p.index, 0),
                                    region(exec, BufKind::Stage, dst_slot, p.prefix_offset),
                                    bytes,
                                ));
                            }
                        }
                    } else {
                        steps.push(copy(
                            exec,
                            region(src_rank, BufKind::Stage, t - 1, 0),
                            region(exec, BufKind::Stage, dst_slot, 0),
                            packed,
                        ));
                    }
                }
            }
            // Fan-out: every (source rank q, holder on this node) pair available in this phase.
            let blocks = fan_blocks(k);
            for p in &layout.params {
                let mut sources: Vec<(usize, Region)> = Vec::new();
                for t in blocks.clone() {
                    let src_node = (n + t) % nodes;
                    for l in 0..gpus {
                        let q = topology.rank(src_node, l);
                        let holder = topology.rank(n, l);
                        let at = if t == 0 {
                            region(holder, BufKind::Input, p.index, 0)
                        } else {
                            region(holder, BufKind::Stage, t - 1, p.prefix_offset)
                        };
                        sources.push((q, at));
                    }
                }
                sources.sort_by_key(|&(q, _)| q);
                for (q, at) in sources {
                    steps.extend(land(exec, at, p, q));
                }
            }
        }
        let name = if nodes == 1 {
            "all-gather direct".to_string()
        } else if k < rounds.len() {
            format!("rail round {k} + fan-out")
        } else {
            "fan-out".to_string()
        };
        phases.push(Phase { name, steps });
    }
    let stage_slot_bytes = vec![packed; nodes - 1];
    Ok(Plan {
        op: Op::AllGather,
        topology,
        layout: layout.clone(),
        phases,
        stage_slot_bytes,
    })
}

/// Byte offset of parameter i's fp32 shard in a packed fp32 shard (the partial / receive buffers).
pub fn fp32_prefix(layout: &GroupLayout, index: usize) -> usize {
    layout.params[..index]
        .iter()
        .map(|p| p.shard_elems() * 4)
        .sum()
}

/// Bytes of a packed fp32 shard: one rank's reduce-scatter output, all parameters.
pub fn fp32_shard_bytes(layout: &GroupLayout) -> usize {
    fp32_prefix(layout, layout.params.len())
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Chunking of level 1: how many elements of one dtype a chunk holds and the byte stride of the
/// pieces in a slot (64-byte aligned when the slot allows it).
struct Chunking {
    peers: usize,
    per_piece: usize,
}

impl Chunking {
    fn cap_elems(&self, elem: usize) -> usize {
        if self.per_piece >= 64 {
            (self.per_piece / 64 * 64) / elem
        } else {
            self.per_piece / elem
        }
    }
    fn stride(&self, elems: usize, elem: usize) -> usize {
        if self.per_piece >= 64 {
            round_up(elems * elem, 64)
        } else {
            elems * elem
        }
    }
}

/// Emits level 1 for `exec` computing its node's partial of destination rank `q`: staged copies
/// and Reduces into `dst_of(param index, element offset)`.
struct Level1<'a> {
    layout: &'a GroupLayout,
    topology: Topology,
    chunking: Option<Chunking>,
    slots: usize,
    /// Round-robin slot counter per executor.
    next_slot: Vec<usize>,
    /// Largest slot content used, and chunks per executor (to size the stage).
    max_slot_used: usize,
    chunks_per_exec: Vec<usize>,
}

impl Level1<'_> {
    fn emit(
        &mut self,
        exec: usize,
        q: usize,
        dst_of: &dyn Fn(usize, usize) -> Region,
        steps: &mut Vec<Step>,
    ) {
        let node = self.topology.node_of(exec);
        let gpus = self.topology.gpus_per_node;
        let layout = self.layout;
        for p in &layout.params {
            if p.is_strided() {
                self.emit_strided(exec, q, p, dst_of, steps);
                continue;
            }
            let elem = p.dtype.size_bytes();
            let (row_start, _) = p.owned_rows(q);
            let total = p.valid_elems(q); // outer > 1 only at world 1: the whole gradient
            let base = row_start * p.row_elems;
            let cap = match &self.chunking {
                Some(c) => c.cap_elems(elem),
                None => total.max(1),
            };
            let mut off = 0;
            while off < total {
                let elems = cap.min(total - off);
                let in_off = (base + off) * elem;
                let mut srcs = Vec::with_capacity(gpus);
                if let Some(c) = &self.chunking {
                    let slot = self.next_slot[exec] % self.slots;
                    self.next_slot[exec] += 1;
                    self.chunks_per_exec[exec] += 1;
                    let stride = c.stride(elems, elem);
                    self.max_slot_used = self.max_slot_used.max(stride * c.peers);
                    let mut piece = 0;
                    for l in 0..gpus {
                        let peer = self.topology.rank(node, l);
                        if peer == exec {
                            srcs.push(Operand {
                                region: region(exec, BufKind::Input, p.index, in_off),
                                dtype: p.dtype,
                            });
                        } else {
                            let at = region(exec, BufKind::Stage, slot, piece * stride);
                            steps.push(copy(
                                exec,
                                region(peer, BufKind::Input, p.index, in_off),
                                at,
                                elems * elem,
                            ));
                            srcs.push(Operand {
                                region: at,
                                dtype: p.dtype,
                            });
                            piece += 1;
                        }
                    }
                } else {
                    srcs.push(Operand {
                        region: region(exec, BufKind::Input, p.index, in_off),
                        dtype: p.dtype,
                    });
                }
                steps.push(Step {
                    executor: exec,
                    action: Action::Reduce {
                        dst: dst_of(p.index, off),
                        srcs,
                        elems,
                    },
                });
                off += elems;
            }
        }
    }
}

impl Level1<'_> {
    /// Level 1 of a strided parameter ([Note: strided parameters] in `layout.rs`): q's slice is
    /// `outer` blocks of `shard_rows` rows, `full_pitch` apart in every rank's gradient. With local
    /// peers, every local rank's slice, the executor's own included, is staged chunk by chunk by
    /// (2-D) copies into one contiguous piece of the slot each, then summed in local rank order
    /// as a contiguous Reduce; alone on its node, the executor widens its own slice block by block.
    fn emit_strided(
        &mut self,
        exec: usize,
        q: usize,
        p: &crate::layout::ParamLayout,
        dst_of: &dyn Fn(usize, usize) -> Region,
        steps: &mut Vec<Step>,
    ) {
        let elem = p.dtype.size_bytes();
        let block = p.shard_rows * p.row_elems; // elements of one block of q's slice
        let pitch = p.rows * p.row_elems; // elements from one block of the gradient to the next
        let base = p.owned_rows(q).0 * p.row_elems;
        let total = p.outer * block;
        let Some(c) = &self.chunking else {
            for o in 0..p.outer {
                steps.push(Step {
                    executor: exec,
                    action: Action::Reduce {
                        dst: dst_of(p.index, o * block),
                        srcs: vec![Operand {
                            region: region(exec, BufKind::Input, p.index, (o * pitch + base) * elem),
                            dtype: p.dtype,
                        }],
                        elems: block,
                    },
                });
            }
            return;
        };
        let cap = c.cap_elems(elem);
        let node = self.topology.node_of(exec);
        let mut off = 0;
        while off < total {
            let elems = cap.min(total - off);
            let slot = self.next_slot[exec] % self.slots;
            self.next_slot[exec] += 1;
            self.chunks_per_exec[exec] += 1;
            let stride = c.stride(elems, elem);
            self.max_slot_used = self.max_slot_used.max(stride * c.peers);
            // The chunk's runs in the gradient: (element offset, elements per block, blocks).
            let mut runs = Vec::new();
            let (mut pos, end) = (off, off + elems);
            while pos < end {
                let (b, within) = (pos / block, pos % block);
                if within == 0 && end - pos >= block {
                    let nb = (end - pos) / block;
                    runs.push((b * pitch + base, block, nb));
                    pos += nb * block;
                } else {
                    let len = (block - within).min(end - pos);
                    runs.push((b * pitch + base + within, len, 1));
                    pos += len;
                }
            }
            let mut srcs = Vec::with_capacity(self.topology.gpus_per_node);
            for l in 0..self.topology.gpus_per_node {
                let peer = self.topology.rank(node, l);
                let at = region(exec, BufKind::Stage, slot, l * stride);
                let mut into = 0;
                for &(in_off, len, nb) in &runs {
                    steps.push(copy_blocks(
                        exec,
                        region(peer, BufKind::Input, p.index, in_off * elem),
                        region(exec, BufKind::Stage, slot, l * stride + into * elem),
                        len * elem,
                        nb,
                        pitch * elem,
                        len * elem,
                    ));
                    into += len * nb;
                }
                srcs.push(Operand { region: at, dtype: p.dtype });
            }
            steps.push(Step {
                executor: exec,
                action: Action::Reduce { dst: dst_of(p.index, off), srcs, elems },
            });
            off += elems;
        }
    }
}

// Ranks are indices into several per-rank tables at once; index loops read clearest here.
#[allow(clippy::needless_range_loop)]
pub fn reduce_scatter(layout: &GroupLayout, topology: Topology, opts: RsOptions) -> Result<Plan> {
    check_topology(layout, topology, "reduce_scatter plan")?;
    for p in &layout.params {
        if !p.dtype.is_reducible() {
            return Err(TideError::UnsupportedDtype {
                dtype: format!("{} ({})", p.dtype.name(), p.describe()),
                op: "reduce_scatter (bfloat16, float16 or float32 gradients)",
            });
        }
    }
    let nodes = topology.nodes;
    let gpus = topology.gpus_per_node;
    let world = layout.world;
    let chunking = if gpus > 1 {
        if opts.stage_slots == 0 {
            return crate::invalid!("reduce_scatter plan: stage_slots must be at least 1");
        }
        // A strided parameter stages every local rank's slice, its own too ([Note: strided
        // parameters] in `layout.rs`): one more piece per chunk.
        let pieces = if layout.params.iter().any(|p| p.is_strided()) { gpus } else { gpus - 1 };
        let c = Chunking {
            peers: pieces,
            per_piece: opts.slot_bytes / pieces,
        };
        let widest = layout
            .params
            .iter()
            .map(|p| p.dtype.size_bytes())
            .max()
            .unwrap_or(4);
        if c.cap_elems(widest) == 0 {
            return crate::invalid!(
                "reduce_scatter plan: slot_bytes {} cannot hold one element from each of {} local peers ({} bytes each)",
                opts.slot_bytes,
                pieces,
                widest
            );
        }
        Some(c)
    } else {
        None
    };
    let mut level1 = Level1 {
        layout,
        topology,
        chunking,
        slots: opts.stage_slots.max(1),
        next_slot: vec![0; world],
        max_slot_used: 0,
        chunks_per_exec: vec![0; world],
    };
    let fp32_bytes = fp32_shard_bytes(layout);
    let prefixes: Vec<usize> = (0..layout.len()).map(|i| fp32_prefix(layout, i)).collect();
    // Slot indices of the level-2 buffers, after the chunk slots (fixed up once the count is known).
    const PARTIAL: usize = 0;
    const RECV: usize = 2;

    // Steps per (phase, executor), built round by round, then laid out executor-major per phase.
    let phase_count = if nodes == 1 { 1 } else { nodes + 2 };
    // Each entry: (phase, executor, steps in the order: transfer, level 1, accumulate).
    let mut xfer: Vec<Vec<Vec<Step>>> = vec![vec![Vec::new(); world]; phase_count];
    let mut l1: Vec<Vec<Vec<Step>>> = vec![vec![Vec::new(); world]; phase_count];
    let mut acc: Vec<Vec<Vec<Step>>> = vec![vec![Vec::new(); world]; phase_count];
    // Level-2 buffer slots are marked with an offset of usize::MAX / 2 + k and fixed up below.
    let big = |k: usize| usize::MAX / 2 + k;

    for r in 0..nodes {
        for exec in 0..world {
            let n = topology.node_of(exec);
            let g = topology.local_of(exec);
            let m = (n + nodes - r) % nodes;
            let l = (g + gpus - r % gpus) % gpus;
            let q = topology.rank(m, l);
            let mut steps = Vec::new();
            if r == 0 {
                level1.emit(
                    exec,
                    q,
                    &|i, off| region(exec, BufKind::Output, i, off * 4),
                    &mut steps,
                );
                for p in &layout.params {
                    let valid = p.valid_elems(q) * 4;
                    let padded = p.shard_elems() * 4;
                    if padded > valid {
                        steps.push(Step {
                            executor: exec,
                            action: Action::Zero {
                                dst: region(exec, BufKind::Output, p.index, valid),
                                bytes: padded - valid,
                            },
                        });
                    }
                }
            } else {
                let slot = big(PARTIAL + r % 2);
                level1.emit(
                    exec,
                    q,
                    &|i, off| region(exec, BufKind::Stage, slot, prefixes[i] + off * 4),
                    &mut steps,
                );
            }
            l1[r][exec] = steps;
        }
        if r == 0 {
            continue;
        }
        // Level 2: (m, g) pulls the partial of q = (m, l) from (n, g), n = (m + r) % N, over rail g;
        // then q accumulates it from (m, g)'s receive buffer.
        for recv in 0..world {
            let m = topology.node_of(recv);
            let g = topology.local_of(recv);
            let n = (m + r) % nodes;
            let l = (g + gpus - r % gpus) % gpus;
            let q = topology.rank(m, l);
            let sender = topology.rank(n, g);
            // Merge contiguous valid ranges of the packed partial into one rail copy each.
            let mut ranges: Vec<(usize, usize)> = Vec::new();
            for p in &layout.params {
                let bytes = p.valid_elems(q) * 4;
                if bytes == 0 {
                    continue;
                }
                let start = prefixes[p.index];
                match ranges.last_mut() {
                    Some(last) if last.1 == start => last.1 = start + bytes,
                    _ => ranges.push((start, start + bytes)),
                }
            }
            for (a, b) in ranges {
                xfer[r + 1][recv].push(copy(
                    recv,
                    region(sender, BufKind::Stage, big(PARTIAL + r % 2), a),
                    region(recv, BufKind::Stage, big(RECV + r % 2), a),
                    b - a,
                ));
            }
            for p in &layout.params {
                let elems = p.valid_elems(q);
                if elems == 0 {
                    continue;
                }
                let out = region(q, BufKind::Output, p.index, 0);
                acc[r + 2][q].push(Step {
                    executor: q,
                    action: Action::Reduce {
                        dst: out,
                        srcs: vec![
                            Operand {
                                region: out,
                                dtype: DType::F32,
                            },
                            Operand {
                                region: region(
                                    recv,
                                    BufKind::Stage,
                                    big(RECV + r % 2),
                                    prefixes[p.index],
                                ),
                                dtype: DType::F32,
                            },
                        ],
                        elems,
                    },
                });
            }
        }
    }

    let chunk_slots = if level1.chunking.is_some() {
        level1
            .chunks_per_exec
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .min(level1.slots)
    } else {
        0
    };
    let fix = |reg: &mut Region| {
        if reg.kind == BufKind::Stage && reg.index >= usize::MAX / 2 {
            reg.index = chunk_slots + (reg.index - usize::MAX / 2);
        }
    };
    let mut phases = Vec::with_capacity(phase_count);
    for k in 0..phase_count {
        let mut steps = Vec::new();
        for exec in 0..world {
            for s in xfer[k][exec]
                .drain(..)
                .chain(l1[k][exec].drain(..))
                .chain(acc[k][exec].drain(..))
            {
                let mut s = s;
                match &mut s.action {
                    Action::Copy { src, dst, .. } | Action::CopyBlocks { src, dst, .. } => {
                        fix(src);
                        fix(dst);
                    }
                    Action::Zero { dst, .. } => fix(dst),
                    Action::Reduce { dst, srcs, .. } => {
                        fix(dst);
                        for o in srcs.iter_mut() {
                            fix(&mut o.region);
                        }
                    }
                }
                steps.push(s);
            }
        }
        let name = if nodes == 1 {
            "reduce-scatter direct".to_string()
        } else {
            let mut parts = Vec::new();
            if k < nodes {
                parts.push(format!("level-1 round {k}"));
            }
            if k >= 2 && k - 1 < nodes {
                parts.push(format!("rail round {}", k - 1));
            }
            if k >= 3 {
                parts.push(format!("accumulate round {}", k - 2));
            }
            parts.join(" + ")
        };
        phases.push(Phase { name, steps });
    }
    let mut stage_slot_bytes = vec![level1.max_slot_used; chunk_slots];
    if nodes > 1 {
        stage_slot_bytes.extend([fp32_bytes; 4]);
    }
    Ok(Plan {
        op: Op::ReduceScatter,
        topology,
        layout: layout.clone(),
        phases,
        stage_slot_bytes,
    })
}
