//! Every plan on the CPU engine against the naive reference: all-gather byte-exact, reduce-scatter
//! within fp32 rounding of an f64 sum, padding zero, bitwise identical across runs; plus
//! `Plan::validate` on built and broken plans.

use tide::engine::cpu::run_threads;
use tide::engine::reference;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Action, BufKind, Op, Phase, Plan, Region, RsOptions, Step};
use tide::Topology;

/// splitmix64: deterministic, no crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Finite values of `dtype` with varied magnitudes (about 2^-8 .. 2^8), as little-endian bytes.
    fn values(&mut self, dtype: DType, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * dtype.size_bytes());
        for _ in 0..n {
            let sign = self.below(2) as u32;
            match dtype {
                DType::F32 => {
                    let bits = (sign << 31)
                        | ((119 + self.below(16) as u32) << 23)
                        | (self.next() as u32 & 0x7f_ffff);
                    out.extend_from_slice(&bits.to_le_bytes());
                }
                DType::BF16 => {
                    let bits = (sign << 15)
                        | ((119 + self.below(16) as u32) << 7)
                        | (self.next() as u32 & 0x7f);
                    out.extend_from_slice(&(bits as u16).to_le_bytes());
                }
                DType::F16 => {
                    // Mostly normal, some subnormal values.
                    let exp = if self.below(8) == 0 {
                        0
                    } else {
                        7 + self.below(16) as u32
                    };
                    let bits = (sign << 15) | (exp << 10) | (self.next() as u32 & 0x3ff);
                    out.extend_from_slice(&(bits as u16).to_le_bytes());
                }
                _ => unreachable!(),
            }
        }
        out
    }
}

fn rs_group() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("w7x5", &[7, 5], DType::BF16),
        ParamSpec::new("scalar", &[], DType::F32),
        ParamSpec::new("b13", &[13], DType::F16),
        ParamSpec::new("t3x2x3", &[3, 2, 3], DType::F32),
        ParamSpec::new("w67x3", &[67, 3], DType::BF16),
        ParamSpec::new("one", &[1], DType::BF16),
        ParamSpec::new("h17x4", &[17, 4], DType::F16),
    ]
}

fn ag_group() -> Vec<ParamSpec> {
    let mut g = rs_group();
    g.extend([
        ParamSpec::new("u8_5x3", &[5, 3], DType::U8),
        ParamSpec::new("s64_9", &[9], DType::S64),
        ParamSpec::new("pred_11", &[11], DType::Pred),
        ParamSpec::new("f64_2x2", &[2, 2], DType::F64),
        ParamSpec::new("s16_65x1", &[65, 1], DType::S16),
    ]);
    g
}

fn check_all_gather(topology: Topology, seed: u64) {
    let world = topology.world();
    let layout = GroupLayout::new(&ag_group(), world).unwrap();
    let plan = plan::all_gather(&layout, topology).unwrap();
    plan.validate()
        .unwrap_or_else(|e| panic!("{topology}: {e}"));
    let mut rng = Rng(seed);
    // Padding rows get random bytes too: they must never reach the output.
    let inputs: Vec<Vec<Vec<u8>>> = (0..world)
        .map(|_| {
            layout
                .params
                .iter()
                .map(|p| rng.bytes(p.shard_bytes))
                .collect()
        })
        .collect();
    let want = reference::all_gather(&layout, &inputs);
    let got = run_threads(&plan, &inputs).unwrap();
    for (r, outs) in got.iter().enumerate() {
        for (i, out) in outs.iter().enumerate() {
            assert!(
                out == &want[i],
                "{topology}: rank {r}: {} differs",
                layout.params[i].describe()
            );
        }
    }
    let stats = plan.stats();
    // Every rank receives every other rank's valid rows, at least once, into its outputs.
    let others: usize = layout.params.iter().map(|p| p.full_bytes()).sum();
    for r in 0..world {
        let own: usize = layout
            .params
            .iter()
            .map(|p| p.valid_rows(r) * p.row_bytes())
            .sum();
        assert!(
            stats.recv_bytes_per_rank[r] >= others - own,
            "{topology}: rank {r} receives too little"
        );
    }
    assert_eq!(
        stats.stage_bytes_per_rank,
        (topology.nodes - 1) * layout.shard_bytes
    );
}

fn check_reduce_scatter(topology: Topology, opts: RsOptions, seed: u64) {
    let world = topology.world();
    let layout = GroupLayout::new(&rs_group(), world).unwrap();
    let plan = plan::reduce_scatter(&layout, topology, opts).unwrap();
    plan.validate()
        .unwrap_or_else(|e| panic!("{topology} {opts:?}: {e}"));
    let mut rng = Rng(seed);
    let inputs: Vec<Vec<Vec<u8>>> = (0..world)
        .map(|_| {
            layout
                .params
                .iter()
                .map(|p| rng.values(p.dtype, p.rows * p.row_elems))
                .collect()
        })
        .collect();
    let want = reference::reduce_scatter(&layout, &inputs).unwrap();
    let got = run_threads(&plan, &inputs).unwrap();
    let again = run_threads(&plan, &inputs).unwrap();
    assert!(got == again, "{topology} {opts:?}: two runs differ bitwise");
    let eps = f32::EPSILON as f64; // 2^-23
    for (r, outs) in got.iter().enumerate() {
        for (i, out) in outs.iter().enumerate() {
            let p = &layout.params[i];
            assert_eq!(out.len(), p.shard_rows * p.row_elems * 4);
            let valid = p.valid_rows(r) * p.row_elems;
            for e in 0..p.shard_rows * p.row_elems {
                let v = f32::from_le_bytes(out[4 * e..4 * e + 4].try_into().unwrap());
                if e >= valid {
                    assert_eq!(
                        v.to_bits(),
                        0,
                        "{topology}: rank {r} {} padding elem {e} = {v}",
                        p.describe()
                    );
                    continue;
                }
                let (s, a) = (want[r][i].sum[e], want[r][i].abs_sum[e]);
                let bound = world as f64 * eps * a;
                assert!(
                    (v as f64 - s).abs() <= bound,
                    "{topology} {opts:?}: rank {r} {} elem {e}: got {v}, want {s} (bound {bound})",
                    p.describe()
                );
            }
        }
    }
    let stats = plan.stats();
    if topology.gpus_per_node > 1 {
        // Chunk slots never exceed the requested staging.
        let chunk: usize = plan
            .stage_slot_bytes
            .iter()
            .take(plan.stage_slot_bytes.len() - if topology.nodes > 1 { 4 } else { 0 })
            .sum();
        assert!(
            chunk <= opts.stage_slots * opts.slot_bytes,
            "{topology}: chunk staging {chunk}"
        );
    } else if topology.nodes == 1 {
        assert_eq!(stats.stage_bytes_per_rank, 0);
    }
    let out_elems: usize = layout.params.iter().map(|p| p.rows * p.row_elems).sum();
    assert!(stats.reduce_elems >= out_elems);
}

fn rs_opts(gpus: usize) -> Vec<RsOptions> {
    let peers = gpus.saturating_sub(1).max(1);
    vec![
        RsOptions {
            stage_slots: 2,
            slot_bytes: peers * 12,
        },
        RsOptions {
            stage_slots: 3,
            slot_bytes: peers * 100,
        },
        RsOptions {
            stage_slots: 2,
            slot_bytes: 1 << 20,
        },
    ]
}

#[test]
fn single_node_all_gather() {
    for world in [1, 2, 3, 5, 8] {
        check_all_gather(Topology::single_node(world), 11 + world as u64);
    }
}

#[test]
fn single_node_reduce_scatter() {
    for world in [1, 2, 3, 5, 8] {
        for (k, opts) in rs_opts(world).into_iter().enumerate() {
            check_reduce_scatter(
                Topology::single_node(world),
                opts,
                100 * world as u64 + k as u64,
            );
        }
    }
}

#[test]
fn direct_all_gather_shape() {
    // The direct plan: one phase, for each param and source rank in order, one copy at its final address.
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[7, 3], DType::BF16)], 3).unwrap();
    let plan = plan::all_gather(&layout, Topology::single_node(3)).unwrap();
    assert_eq!(plan.phases.len(), 1);
    assert!(plan.stage_slot_bytes.is_empty());
    let mine: Vec<&Step> = plan.phases[0]
        .steps
        .iter()
        .filter(|s| s.executor == 1)
        .collect();
    let want_rows = [3usize, 3, 1];
    assert_eq!(mine.len(), 3);
    for (q, s) in mine.iter().enumerate() {
        assert_eq!(
            s.action,
            Action::Copy {
                src: Region {
                    rank: q,
                    kind: BufKind::Input,
                    index: 0,
                    offset: 0
                },
                dst: Region {
                    rank: 1,
                    kind: BufKind::Output,
                    index: 0,
                    offset: q * 3 * 6
                },
                bytes: want_rows[q] * 6,
            }
        );
    }
}

#[test]
fn direct_reduce_scatter_p1_has_no_stage() {
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[4, 2], DType::BF16)], 1).unwrap();
    let plan = plan::reduce_scatter(
        &layout,
        Topology::single_node(1),
        RsOptions {
            stage_slots: 2,
            slot_bytes: 64,
        },
    )
    .unwrap();
    assert!(plan.stage_slot_bytes.is_empty());
    assert_eq!(plan.phases.len(), 1);
    match &plan.phases[0].steps[..] {
        [Step {
            action: Action::Reduce { srcs, elems: 8, .. },
            ..
        }] => assert_eq!(srcs.len(), 1),
        other => panic!("unexpected steps {other:?}"),
    }
}

#[test]
fn hierarchical_all_gather() {
    for (n, g) in [(2, 1), (2, 4), (4, 2), (3, 5), (5, 1), (8, 8)] {
        check_all_gather(Topology::new(n, g).unwrap(), 1000 + (n * 10 + g) as u64);
    }
}

#[test]
fn hierarchical_reduce_scatter() {
    for (n, g) in [(2, 1), (2, 4), (4, 2), (3, 5), (5, 1)] {
        for (k, opts) in rs_opts(g).into_iter().enumerate() {
            check_reduce_scatter(
                Topology::new(n, g).unwrap(),
                opts,
                2000 + (n * 10 + g) as u64 + k as u64,
            );
        }
    }
}

#[test]
fn sixty_four_ranks() {
    let t = Topology::new(8, 8).unwrap();
    check_reduce_scatter(
        t,
        RsOptions {
            stage_slots: 2,
            slot_bytes: 7 * 12,
        },
        64,
    );
    check_reduce_scatter(
        t,
        RsOptions {
            stage_slots: 2,
            slot_bytes: 1 << 20,
        },
        65,
    );
    check_all_gather(Topology::single_node(64), 66);
    check_reduce_scatter(
        Topology::single_node(64),
        RsOptions {
            stage_slots: 2,
            slot_bytes: 63 * 8,
        },
        67,
    );
}

#[test]
fn rs_staging_is_flat_in_nodes() {
    // Fixed per-GPU output: rows grow with the world size.
    let mut stage = Vec::new();
    for nodes in [2, 4, 8] {
        let world = nodes * 8;
        let layout = GroupLayout::new(
            &[ParamSpec::new("w", &[world * 64, 256], DType::BF16)],
            world,
        )
        .unwrap();
        let plan = plan::reduce_scatter(
            &layout,
            Topology::new(nodes, 8).unwrap(),
            RsOptions {
                stage_slots: 2,
                slot_bytes: 7 << 10,
            },
        )
        .unwrap();
        stage.push(plan.stats().stage_bytes_per_rank);
    }
    assert!(
        stage.iter().all(|&s| s == stage[0]),
        "staging per rank grows with nodes: {stage:?}"
    );
}

#[test]
fn plan_errors() {
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[4], DType::BF16)], 4).unwrap();
    let e = plan::all_gather(&layout, Topology::new(3, 1).unwrap()).unwrap_err();
    assert!(e.to_string().contains("world size 4"), "{e}");
    let e = plan::reduce_scatter(&layout, Topology::new(2, 3).unwrap(), RsOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("6 ranks"), "{e}");
    let e = plan::reduce_scatter(
        &layout,
        Topology::single_node(4),
        RsOptions {
            stage_slots: 2,
            slot_bytes: 4,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("slot_bytes"), "{e}");
    let ints = GroupLayout::new(&[ParamSpec::new("i", &[4], DType::S32)], 2).unwrap();
    let e =
        plan::reduce_scatter(&ints, Topology::single_node(2), RsOptions::default()).unwrap_err();
    assert!(e.to_string().contains("int32"), "{e}");
}

fn two_rank_plan() -> Plan {
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[4, 2], DType::F32)], 2).unwrap();
    plan::all_gather(&layout, Topology::single_node(2)).unwrap()
}

#[test]
fn validate_rejects_broken_plans() {
    let out = |rank, offset| Region {
        rank,
        kind: BufKind::Output,
        index: 0,
        offset,
    };
    let inp = |rank| Region {
        rank,
        kind: BufKind::Input,
        index: 0,
        offset: 0,
    };
    // Rank 1 reads rank 0's output while rank 0 writes it in the same phase.
    let mut plan = two_rank_plan();
    plan.phases[0].steps.push(Step {
        executor: 1,
        action: Action::Copy {
            src: out(0, 0),
            dst: out(1, 0),
            bytes: 8,
        },
    });
    let e = plan.validate().unwrap_err().to_string();
    assert!(e.contains("same phase"), "{e}");
    // The same read one phase later is fine.
    let mut plan = two_rank_plan();
    plan.phases.push(Phase {
        name: "later".into(),
        steps: vec![Step {
            executor: 1,
            action: Action::Copy {
                src: out(0, 0),
                dst: out(1, 0),
                bytes: 8,
            },
        }],
    });
    plan.validate().unwrap();
    // Out of bounds.
    let mut plan = two_rank_plan();
    plan.phases[0].steps.push(Step {
        executor: 0,
        action: Action::Copy {
            src: inp(1),
            dst: out(0, 28),
            bytes: 8,
        },
    });
    assert!(plan
        .validate()
        .unwrap_err()
        .to_string()
        .contains("past the buffer"));
    // Writing another rank's memory, or an input.
    let mut plan = two_rank_plan();
    plan.phases[0].steps[0].executor = 1;
    assert!(plan.validate().is_err());
    let mut plan = two_rank_plan();
    plan.phases[0].steps.push(Step {
        executor: 0,
        action: Action::Zero {
            dst: inp(0),
            bytes: 4,
        },
    });
    assert!(plan.validate().unwrap_err().to_string().contains("Input"));
    // Reduce into an all-gather output (not fp32).
    let mut plan = two_rank_plan();
    plan.phases.push(Phase {
        name: "bad".into(),
        steps: vec![Step {
            executor: 0,
            action: Action::Reduce {
                dst: out(0, 0),
                srcs: vec![plan::Operand {
                    region: inp(0),
                    dtype: DType::F32,
                }],
                elems: 1,
            },
        }],
    });
    assert!(plan.validate().unwrap_err().to_string().contains("fp32"));
    // A missing stage slot.
    let mut plan = two_rank_plan();
    plan.phases[0].steps[0].action = Action::Zero {
        dst: Region {
            rank: 0,
            kind: BufKind::Stage,
            index: 0,
            offset: 0,
        },
        bytes: 1,
    };
    assert!(plan.validate().is_err());
    assert_eq!(plan.op, Op::AllGather);
}

#[test]
fn plans_print() {
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[5, 2], DType::BF16)], 4).unwrap();
    let plan = plan::reduce_scatter(
        &layout,
        Topology::new(2, 2).unwrap(),
        RsOptions {
            stage_slots: 2,
            slot_bytes: 8,
        },
    )
    .unwrap();
    let text = plan.to_string();
    assert!(text.starts_with("reduce-scatter plan over 2x2"), "{text}");
    assert_eq!(
        text.lines()
            .filter(|l| l.trim_start().starts_with("phase ") && l.contains("rank "))
            .count(),
        plan.stats().steps
    );
    assert!(text.contains("reduce r0.out[0]+0"), "{text}");
}

/// The documented summation order, in fp32: for destination rank q = (m, l), node partials in node
/// order m, m+1, ... (mod N), each summed over local ranks 0..G-1. One node: rank order.
fn expected_rs_fp32(
    layout: &GroupLayout,
    topology: Topology,
    inputs: &[Vec<Vec<u8>>],
) -> Vec<Vec<Vec<u32>>> {
    let (nodes, gpus) = (topology.nodes, topology.gpus_per_node);
    let mut out = Vec::new();
    for q in 0..layout.world {
        let m = topology.node_of(q);
        let mut per_param = Vec::new();
        for p in &layout.params {
            let (start, _) = p.owned_rows(q);
            let mut bits = vec![0u32; p.shard_rows * p.row_elems];
            for (e, b) in bits
                .iter_mut()
                .enumerate()
                .take(p.valid_rows(q) * p.row_elems)
            {
                let idx = start * p.row_elems + e;
                let node_sum = |n: usize| {
                    let mut acc = 0f32;
                    for l in 0..gpus {
                        let x = reference::element_f64(
                            &inputs[topology.rank(n, l)][p.index],
                            p.dtype,
                            idx,
                        )
                        .unwrap() as f32;
                        acc = if l == 0 { x } else { acc + x };
                    }
                    acc
                };
                let mut acc = node_sum(m);
                for r in 1..nodes {
                    acc += node_sum((m + r) % nodes);
                }
                *b = acc.to_bits();
            }
            per_param.push(bits);
        }
        out.push(per_param);
    }
    out
}

#[test]
fn reduce_scatter_sums_in_the_documented_order() {
    for (n, g) in [(1, 1), (1, 5), (1, 8), (2, 1), (2, 4), (3, 5), (4, 4)] {
        let topology = Topology::new(n, g).unwrap();
        let layout = GroupLayout::new(&rs_group(), topology.world()).unwrap();
        let mut rng = Rng(77 + n as u64 * 10 + g as u64);
        let inputs: Vec<Vec<Vec<u8>>> = (0..topology.world())
            .map(|_| {
                layout
                    .params
                    .iter()
                    .map(|p| rng.values(p.dtype, p.rows * p.row_elems))
                    .collect()
            })
            .collect();
        let want = expected_rs_fp32(&layout, topology, &inputs);
        // Chunking never changes the per-element order, so every option gives the same bits.
        for opts in rs_opts(g) {
            let plan = plan::reduce_scatter(&layout, topology, opts).unwrap();
            let got = run_threads(&plan, &inputs).unwrap();
            for (q, outs) in got.iter().enumerate() {
                for (i, out) in outs.iter().enumerate() {
                    let bits: Vec<u32> = out
                        .chunks(4)
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    assert!(
                        bits == want[q][i],
                        "{topology} {opts:?}: rank {q} {}",
                        layout.params[i].describe()
                    );
                }
            }
        }
    }
}

#[test]
fn latin_square_placement() {
    // 4x4: over the rounds, each destination's remote contributors land on distinct GPUs of its node,
    // and in every round each GPU receives exactly one partial over its own rail.
    let topology = Topology::new(4, 4).unwrap();
    let layout = GroupLayout::new(&[ParamSpec::new("w", &[64, 3], DType::BF16)], 16).unwrap();
    let plan = plan::reduce_scatter(
        &layout,
        topology,
        RsOptions {
            stage_slots: 2,
            slot_bytes: 1 << 12,
        },
    )
    .unwrap();
    let mut holders: Vec<Vec<usize>> = vec![Vec::new(); 16];
    for phase in &plan.phases {
        let mut rail_receivers = Vec::new();
        for s in &phase.steps {
            match &s.action {
                Action::Copy { src, dst, .. }
                    if topology.node_of(src.rank) != topology.node_of(dst.rank) =>
                {
                    assert_eq!(
                        topology.local_of(src.rank),
                        topology.local_of(dst.rank),
                        "rail copy off its rail"
                    );
                    rail_receivers.push(dst.rank);
                }
                Action::Reduce { dst, srcs, .. }
                    if dst.kind == BufKind::Output && srcs.len() == 2 && srcs[0].region == *dst =>
                {
                    holders[dst.rank].push(srcs[1].region.rank);
                }
                _ => {}
            }
        }
        if !rail_receivers.is_empty() {
            rail_receivers.sort();
            assert_eq!(rail_receivers, (0..16).collect::<Vec<_>>());
        }
    }
    for (q, h) in holders.iter().enumerate() {
        let mut gpus: Vec<usize> = h.iter().map(|&r| topology.local_of(r)).collect();
        assert!(h
            .iter()
            .all(|&r| topology.node_of(r) == topology.node_of(q)));
        gpus.sort();
        gpus.dedup();
        assert_eq!(gpus.len(), 3, "rank {q}: contributors on GPUs {h:?}");
    }
}
