//! Property tests of the FSDP2 dim-0 shard arithmetic over awkward shapes, with a hand-rolled RNG.

use tide::layout::{DType, GroupLayout, ParamSpec, ALL_DTYPES};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const DTYPES: [DType; 23] = ALL_DTYPES;

/// Shapes that stress the rule: 0-d, 1-D, rows < P, rows == P, rows % P != 0, 3-D.
fn awkward_shape(rng: &mut Rng, world: usize) -> Vec<usize> {
    let rest = |rng: &mut Rng, k: usize| (0..k).map(|_| 1 + rng.below(5)).collect::<Vec<_>>();
    let rows = match rng.below(6) {
        0 => return vec![],
        1 => 1 + rng.below(world.max(2) - 1), // rows < P (or 1)
        2 => world,
        3 => world * (1 + rng.below(4)) + 1 + rng.below(world.max(2) - 1),
        4 => 1 + rng.below(3 * world + 7),
        _ => 1,
    };
    let mut shape = vec![rows];
    let k = rng.below(3);
    shape.extend(rest(rng, k));
    shape
}

fn check_layout(layout: &GroupLayout, specs: &[ParamSpec]) {
    let world = layout.world;
    let mut prefix = 0;
    let mut unsharded = 0;
    for (i, (p, s)) in layout.params.iter().zip(specs).enumerate() {
        assert_eq!(p.index, i);
        assert_eq!(p.shape, s.shape);
        let rows = s.shape.first().copied().unwrap_or(1);
        let row_elems: usize = s.shape.iter().skip(1).product();
        assert_eq!((p.rows, p.row_elems), (rows, row_elems), "{}", p.describe());
        assert_eq!(p.shard_rows, rows.div_ceil(world));
        assert_eq!(
            p.shard_bytes,
            p.shard_rows * row_elems * s.dtype.size_bytes()
        );
        assert_eq!(p.full_bytes(), rows * row_elems * s.dtype.size_bytes());
        assert_eq!(p.prefix_offset, prefix);
        assert_eq!(p.unsharded_offset, unsharded);
        prefix += p.shard_bytes;
        unsharded += p.full_bytes();
        // Owned ranges: in rank order, disjoint, contiguous, covering [0, rows).
        let mut next = 0;
        let mut total = 0;
        for r in 0..world {
            let (a, b) = p.owned_rows(r);
            assert!(a <= b && b <= rows);
            assert_eq!(b - a, p.valid_rows(r));
            assert!(p.valid_rows(r) <= p.shard_rows);
            if b > a {
                assert_eq!(a, next, "{}: rank {r} range not contiguous", p.describe());
                assert_eq!(a, r * p.shard_rows);
                next = b;
            }
            // Only a trailing run of ranks can be short, and only the first short one is partial.
            if r > 0 && p.valid_rows(r) > 0 {
                assert_eq!(p.valid_rows(r - 1), p.shard_rows);
            }
            total += b - a;
        }
        assert_eq!(
            total,
            rows,
            "{}: valid rows do not sum to rows",
            p.describe()
        );
        assert_eq!(next, rows);
        // The padded global buffer holds every row.
        assert!(world * p.shard_rows >= rows && world * p.shard_rows < rows + world);
    }
    assert_eq!(layout.shard_bytes, prefix);
    assert_eq!(layout.unsharded_bytes, unsharded);
}

#[test]
fn random_groups_over_many_world_sizes() {
    let mut rng = Rng(7);
    for world in [1, 2, 3, 4, 5, 7, 8, 13, 16, 64, 128] {
        for _ in 0..60 {
            let n = 1 + rng.below(6);
            let specs: Vec<ParamSpec> = (0..n)
                .map(|k| {
                    ParamSpec::new(
                        format!("p{k}"),
                        &awkward_shape(&mut rng, world),
                        DTYPES[rng.below(DTYPES.len())],
                    )
                })
                .collect();
            let layout = GroupLayout::new(&specs, world).unwrap();
            assert_eq!(layout.world, world);
            assert_eq!(layout.len(), n);
            check_layout(&layout, &specs);
        }
    }
}

#[test]
fn specific_shapes() {
    let specs = [
        ParamSpec::new("scalar", &[], DType::F32),
        ParamSpec::new("seven", &[7], DType::BF16),
        ParamSpec::new("eight", &[8, 3], DType::F16),
        ParamSpec::new("cube", &[9, 2, 5], DType::S64),
    ];
    let l = GroupLayout::new(&specs, 8).unwrap();
    check_layout(&l, &specs);
    let scalar = &l.params[0];
    assert_eq!(
        (scalar.rows, scalar.row_elems, scalar.shard_rows),
        (1, 1, 1)
    );
    assert_eq!(
        (0..8).map(|r| scalar.valid_rows(r)).collect::<Vec<_>>(),
        [1, 0, 0, 0, 0, 0, 0, 0]
    );
    let seven = &l.params[1];
    assert_eq!(seven.shard_rows, 1);
    assert_eq!(seven.valid_rows(7), 0);
    assert_eq!(seven.owned_rows(7), (7, 7));
    let eight = &l.params[2];
    assert!((0..8).all(|r| eight.valid_rows(r) == 1));
    let cube = &l.params[3];
    assert_eq!(
        (cube.shard_rows, cube.row_elems, cube.shard_bytes),
        (2, 10, 160)
    );
    assert_eq!(
        (0..8).map(|r| cube.valid_rows(r)).collect::<Vec<_>>(),
        [2, 2, 2, 2, 1, 0, 0, 0]
    );
    assert_eq!(l.shard_bytes, 4 + 2 + 6 + 160);
    assert_eq!(l.unsharded_bytes, 4 + 14 + 48 + 720);
    assert_eq!(cube.prefix_offset, 12);
    assert_eq!(cube.unsharded_offset, 66);
}

#[test]
fn errors_name_the_problem() {
    let e = GroupLayout::new(&[], 4).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    let e = GroupLayout::new(&[ParamSpec::new("w", &[3], DType::F32)], 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("world size"), "{e}");
    let e = GroupLayout::new(
        &[
            ParamSpec::new("ok", &[3], DType::F32),
            ParamSpec::new("zero", &[4, 0, 2], DType::BF16),
        ],
        2,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("param 1 'zero'") && e.contains("dim 1 is zero"),
        "{e}"
    );
    for shape in [
        vec![usize::MAX / 2, 3],
        vec![4, usize::MAX / 4, 8],
        vec![usize::MAX, 1],
    ] {
        let e = GroupLayout::new(&[ParamSpec::new("huge", &shape, DType::F32)], 3)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("overflow") && e.contains("huge"),
            "{shape:?}: {e}"
        );
    }
    // Each fits, the group does not.
    let big = usize::MAX / 2 + 1;
    let e = GroupLayout::new(
        &[
            ParamSpec::new("a", &[big], DType::U8),
            ParamSpec::new("b", &[big], DType::U8),
        ],
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("overflow"), "{e}");
}

#[test]
fn dtype_codes_round_trip() {
    for d in DTYPES {
        assert_eq!(DType::from_xla(d as i32).unwrap(), d);
        assert_eq!(DType::from_name(d.name()).unwrap(), d);
    }
    // XLA_FFI_DataType's codes and byte sizes (xla/ffi/api/c_api.h of jaxlib 0.10.2).
    for (code, name, bytes) in [
        (1, "bool", 1),
        (2, "int8", 1),
        (5, "int64", 8),
        (9, "uint64", 8),
        (10, "float16", 2),
        (12, "float64", 8),
        (15, "complex64", 8),
        (16, "bfloat16", 2),
        (18, "complex128", 16),
        (19, "float8_e5m2", 1),
        (20, "float8_e4m3fn", 1),
        (23, "float8_e4m3b11fnuz", 1),
        (24, "float8_e5m2fnuz", 1),
        (25, "float8_e4m3fnuz", 1),
        (28, "float8_e4m3", 1),
        (29, "float8_e3m4", 1),
        (33, "float8_e8m0fnu", 1),
    ] {
        let d = DType::from_xla(code).unwrap();
        assert_eq!((d.name(), d.size_bytes()), (name, bytes), "code {code}");
    }
    // Sub-byte types and the token are refused, saying why.
    for code in [21, 22, 26, 27, 30, 31, 32] {
        let e = DType::from_xla(code).unwrap_err().to_string();
        assert!(e.contains("sub-byte"), "{e}");
    }
    assert!(DType::from_xla(17).unwrap_err().to_string().contains("unknown dtype code 17"));
    assert!(DType::from_xla(99).is_err());
    assert!(DType::from_name("int4").is_err());
    let reducible: Vec<DType> = DTYPES
        .iter()
        .copied()
        .filter(|d| d.is_reducible())
        .collect();
    assert_eq!(reducible, [DType::F16, DType::F32, DType::BF16]);
}
