//! Parameters sharded along a dimension other than their first ([Note: strided parameters] in
//! `src/layout.rs`): every plan, on the CPU engine, against the naive reference (all-gather
//! byte-exact, reduce-scatter within fp32 rounding of an f64 sum and bitwise the same as the plan
//! flattened into 1-D copies), for 1, 2, 3, 8 and 64 ranks on one node and several, with staging
//! slots small enough to cut chunks inside a block; plus the layout's arithmetic and refusals.

use tide::engine::cpu::run_threads;
use tide::engine::reference;
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Action, RsOptions};
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
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Finite values of a reducible dtype (about 2^-8 .. 2^8), little-endian bytes.
    fn values(&mut self, dtype: DType, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * dtype.size_bytes());
        for _ in 0..n {
            let sign = (self.next() % 2) as u32;
            let exp = 119 + (self.next() % 16) as u32;
            match dtype {
                DType::F32 => out.extend_from_slice(
                    &((sign << 31) | (exp << 23) | (self.next() as u32 & 0x7f_ffff)).to_le_bytes(),
                ),
                DType::BF16 => out.extend_from_slice(
                    &(((sign << 15) | (exp << 7) | (self.next() as u32 & 0x7f)) as u16).to_le_bytes(),
                ),
                DType::F16 => {
                    let e = 7 + (self.next() % 16) as u32;
                    out.extend_from_slice(
                        &(((sign << 15) | (e << 10) | (self.next() as u32 & 0x3ff)) as u16).to_le_bytes(),
                    )
                }
                _ => unreachable!(),
            }
        }
        out
    }
}

/// A group mixing strided parameters (along dims 1 and 2, the last dim, rows of one element)
/// with dim-0 ones (uneven, padded), for `world` ranks.
fn rs_group(world: usize) -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("experts.w1", &[3, 2 * world, 5], DType::BF16).along(1),
        ParamSpec::new("w_cols", &[4, 3 * world], DType::F32).along(1),
        ParamSpec::new("w7x5", &[7, 5], DType::BF16),
        ParamSpec::new("experts.w2", &[2, 3, world], DType::F16).along(2),
        ParamSpec::new("lead1", &[1, world, 3], DType::F32).along(1),
        ParamSpec::new("wide", &[5, world, 33], DType::BF16).along(1),
    ]
}

fn ag_group(world: usize) -> Vec<ParamSpec> {
    let mut g = rs_group(world);
    g.extend([
        ParamSpec::new("u8_cols", &[5, 2 * world], DType::U8).along(1),
        ParamSpec::new("c128", &[2, world, 2], DType::C128).along(1),
        ParamSpec::new("s64_9", &[9], DType::S64),
    ]);
    g
}

fn topologies() -> Vec<Topology> {
    let mut t: Vec<Topology> = [1, 2, 3, 8, 64].iter().map(|&g| Topology::single_node(g)).collect();
    for (n, g) in [(2, 1), (3, 1), (2, 2), (2, 3), (3, 2)] {
        t.push(Topology { nodes: n, gpus_per_node: g });
    }
    t
}

#[test]
fn strided_all_gather_equals_reference() {
    for (k, topology) in topologies().into_iter().enumerate() {
        let world = topology.world();
        let layout = GroupLayout::new(&ag_group(world), world).unwrap();
        let plan = plan::all_gather(&layout, topology).unwrap();
        plan.validate().unwrap_or_else(|e| panic!("{topology}: {e}"));
        if world > 1 {
            let blocks = plan.phases.iter().flat_map(|p| &p.steps);
            assert!(
                blocks.clone().any(|s| matches!(s.action, Action::CopyBlocks { .. })),
                "{topology}: a strided gather lands its pieces with 2-D copies"
            );
        }
        let flat = plan.flattened();
        flat.validate().unwrap();
        assert!(flat.phases.iter().flat_map(|p| &p.steps).all(|s| !matches!(s.action, Action::CopyBlocks { .. })));
        let mut rng = Rng(17 + k as u64);
        let inputs: Vec<Vec<Vec<u8>>> = (0..world)
            .map(|_| layout.params.iter().map(|p| rng.bytes(p.shard_bytes)).collect())
            .collect();
        let want = reference::all_gather(&layout, &inputs);
        for (name, p) in [("plan", &plan), ("flattened", &flat)] {
            let got = run_threads(p, &inputs).unwrap();
            for (r, outs) in got.iter().enumerate() {
                for (i, out) in outs.iter().enumerate() {
                    assert!(out == &want[i], "{topology} {name}: rank {r}: {} differs", layout.params[i].describe());
                }
            }
        }
    }
}

/// The reference's all-gather read the other way round: element (o, q * shard_rows + j, e) of the
/// full parameter is element (o, j, e) of rank q's shard, written out from the shape alone.
#[test]
fn reference_gathers_along_the_axis() {
    let world = 3;
    let spec = ParamSpec::new("x", &[2, 6, 2], DType::U8).along(1);
    let layout = GroupLayout::new(&[spec], world).unwrap();
    let inputs: Vec<Vec<Vec<u8>>> = (0..world)
        .map(|q| vec![(0..8).map(|e| (q * 100 + e) as u8).collect()])
        .collect();
    let full = &reference::all_gather(&layout, &inputs)[0];
    for o in 0..2 {
        for row in 0..6 {
            for e in 0..2 {
                let (q, j) = (row / 2, row % 2);
                assert_eq!(full[(o * 6 + row) * 2 + e], (q * 100 + (o * 2 + j) * 2 + e) as u8);
            }
        }
    }
}

#[test]
fn strided_reduce_scatter_equals_reference() {
    for (k, topology) in topologies().into_iter().enumerate() {
        let world = topology.world();
        let gpus = topology.gpus_per_node;
        let layout = GroupLayout::new(&rs_group(world), world).unwrap();
        // Slots of a few elements per piece cut chunks inside blocks and across them.
        for opts in [
            RsOptions { stage_slots: 2, slot_bytes: gpus * 12 },
            RsOptions { stage_slots: 3, slot_bytes: gpus * 100 },
            RsOptions { stage_slots: 2, slot_bytes: 1 << 20 },
        ] {
            let plan = plan::reduce_scatter(&layout, topology, opts).unwrap();
            plan.validate().unwrap_or_else(|e| panic!("{topology} {opts:?}: {e}"));
            let steps: usize = plan.phases.iter().map(|p| p.steps.len()).sum();
            let bound = tide::call::plan_steps_bound(plan::Op::ReduceScatter, &layout, topology, opts.slot_bytes).unwrap();
            assert!(steps <= bound, "{topology} {opts:?}: {steps} steps, bound {bound}");
            let mut rng = Rng(99 + k as u64);
            let inputs: Vec<Vec<Vec<u8>>> = (0..world)
                .map(|_| layout.params.iter().map(|p| rng.values(p.dtype, p.full_bytes() / p.dtype.size_bytes())).collect())
                .collect();
            let want = reference::reduce_scatter(&layout, &inputs).unwrap();
            let got = run_threads(&plan, &inputs).unwrap();
            let flat = run_threads(&plan.flattened(), &inputs).unwrap();
            assert!(got == flat, "{topology} {opts:?}: the flattened plan differs bitwise");
            let eps = f32::EPSILON as f64;
            for (r, outs) in got.iter().enumerate() {
                for (i, out) in outs.iter().enumerate() {
                    let p = &layout.params[i];
                    assert_eq!(out.len(), p.shard_elems() * 4);
                    for e in 0..p.shard_elems() {
                        let v = f32::from_le_bytes(out[4 * e..4 * e + 4].try_into().unwrap()) as f64;
                        let (s, a) = (want[r][i].sum[e], want[r][i].abs_sum[e]);
                        assert!(
                            (v - s).abs() <= world as f64 * eps * a,
                            "{topology} {opts:?}: rank {r} {} elem {e}: got {v}, want {s}",
                            p.describe()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn strided_layout_arithmetic_and_refusals() {
    let l = GroupLayout::new(&[ParamSpec::new("w", &[4, 6, 5], DType::BF16).along(1)], 3).unwrap();
    let p = &l.params[0];
    assert_eq!((p.outer, p.rows, p.row_elems, p.shard_rows), (4, 6, 5, 2));
    assert_eq!(p.shard_shape(), vec![4, 2, 5]);
    assert_eq!((p.shard_bytes, p.full_bytes()), (4 * 2 * 5 * 2, 4 * 6 * 5 * 2));
    assert_eq!((p.shard_pitch(), p.full_pitch()), (2 * 5 * 2, 6 * 5 * 2));
    assert!(p.is_strided());
    assert!(p.describe().contains("along dim 1"), "{}", p.describe());
    // World 1: the one rank owns every row, contiguous.
    let one = GroupLayout::new(&[ParamSpec::new("w", &[4, 6, 5], DType::BF16).along(1)], 1).unwrap();
    assert!(!one.params[0].is_strided());
    // A strided dimension the ranks do not divide: refused, naming the parameter and the dim.
    let e = GroupLayout::new(&[ParamSpec::new("experts.w", &[4, 7], DType::F32).along(1)], 2).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("experts.w") && m.contains("dim 1") && m.contains("not divisible"), "{m}");
    // An axis past the last dim.
    let m = GroupLayout::new(&[ParamSpec::new("b", &[4], DType::F32).along(1)], 2).unwrap_err().to_string();
    assert!(m.contains("'b'") && m.contains("dim 1"), "{m}");
    // Axis 0 with a leading dim: no outer blocks, padding allowed (FSDP2's rule, unchanged).
    let d0 = GroupLayout::new(&[ParamSpec::new("w", &[7, 5], DType::BF16)], 2).unwrap();
    assert_eq!((d0.params[0].outer, d0.params[0].shard_rows), (1, 4));
}
