//! Fuzz test of the FFI edge's decode/validate path (`tide::ffi::run_cpu`, what the CPU handlers
//! run), issue #8 part 2: any attribute set a caller of `jax.ffi.ffi_call` can build ends, quickly,
//! either in a clear error (bounded message naming the attribute or buffer) or in a correct result.
//!
//! Cases: the adversarial sets of the issue (world 2^32, world 10^6, a wrapping nodes x
//! gpus_per_node, duplicate ranks, ...) and more limits; then thousands of random cases, each a
//! valid call (world 1..=4, 1 or 2 groups, 1..=3 parameters of random shapes and dtypes) that is run
//! on every rank (threads) and checked against a reference, or the same with 1..=3 random
//! mutations, run on the one device it names.
//!
//! Memory safety of the harness: a buffer has a real allocation of exactly the bytes its dims and
//! dtype claim (at most 1 MiB), or address 0; so a call the library accepts can only touch memory
//! it owns, and a call with a null buffer must be refused.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use tide::config;
use tide::ffi::{run_cpu, FfiBuffer, FfiCall, FfiStatus, StatusCode};
use tide::plan::Op;

const F32: i32 = 11;
const F16: i32 = 10;
const BF16: i32 = 16;
const S32: i32 = 4;
const U8: i32 = 6;

/// The longest a refused call may take (the checks are O(devices log devices): the random cases
/// take microseconds, the largest adversarial ones (65536 device entries) a few milliseconds).
/// Unoptimized builds (`cargo test`) are about 10x slower.
const FAIL_FAST: Duration = Duration::from_millis(if cfg!(debug_assertions) { 250 } else { 50 });
/// The rendezvous timeout of this test: a call whose attributes are valid but whose peers never
/// come (a mutation the library cannot tell from a valid call) fails after it.
const TIMEOUT_S: f64 = 0.05;

/// xorshift64*: tiny, deterministic, good enough to pick cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + self.below((hi - lo + 1) as u64) as i64
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
    fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            xs.swap(i, j);
        }
    }
}

fn use_test_timeout() {
    let mut c = config::Config::defaults();
    c.timeout_s = TIMEOUT_S;
    config::set_override(Some(c));
}

/// A buffer as the harness passes it: dtype code and dims (anything), and its storage.
#[derive(Clone, Debug)]
struct Buf {
    dtype: i32,
    dims: Vec<i64>,
}

fn elem_size(code: i32) -> Option<usize> {
    match code {
        1 | 2 | 6 => Some(1),
        3 | 7 | 10 | 16 => Some(2),
        4 | 8 | 11 => Some(4),
        5 | 9 | 12 => Some(8),
        _ => None,
    }
}

/// Bytes the buffer claims, if the harness can (and may) allocate them: at most 1 MiB.
fn claimed_bytes(b: &Buf) -> Option<usize> {
    let mut n = elem_size(b.dtype)?;
    for &d in &b.dims {
        n = n.checked_mul(usize::try_from(d).ok()?)?;
    }
    (n <= 1 << 20).then_some(n)
}

/// One attribute set, its buffers' descriptions, and which device runs it.
#[derive(Clone, Debug)]
struct Case {
    op: Op,
    site: i64,
    world: i64,
    nodes: i64,
    gpus_per_node: i64,
    device_ordinal: i64,
    device_ordinals: Vec<i64>,
    device_ranks: Vec<i64>,
    device_groups: Vec<i64>,
    names: Vec<u8>,
    inputs: Vec<Buf>,
    outputs: Vec<Buf>,
    job: i64,
}

/// Storage of one call's buffers: 8-byte aligned, exactly the claimed bytes (0 when unallocated).
struct Storage {
    inputs: Vec<Vec<u64>>,
    outputs: Vec<Vec<u64>>,
}

fn alloc(b: &Buf) -> (Vec<u64>, usize) {
    match claimed_bytes(b) {
        Some(bytes) if bytes > 0 => {
            let v = vec![0u64; bytes.div_ceil(8)];
            let p = v.as_ptr() as usize;
            (v, p)
        }
        _ => (Vec::new(), 0),
    }
}

impl Case {
    /// The case for a failure message, lists shortened.
    fn summary(&self) -> String {
        fn short<T: std::fmt::Debug>(xs: &[T]) -> String {
            if xs.len() <= 8 {
                format!("{xs:?}")
            } else {
                format!("{:?}... ({} in all)", &xs[..8], xs.len())
            }
        }
        format!(
            "{:?} site {} world {} topology {}x{} job {} on device {}: ordinals {} ranks {} groups {} \
             inputs {} outputs {}",
            self.op,
            self.site,
            self.world,
            self.nodes,
            self.gpus_per_node,
            self.job,
            self.device_ordinal,
            short(&self.device_ordinals),
            short(&self.device_ranks),
            short(&self.device_groups),
            short(&self.inputs),
            short(&self.outputs)
        )
    }

    /// The FfiCall on `device`, with fresh storage (inputs filled by `fill`).
    fn ffi(&self, device: i64, fill: &dyn Fn(usize, &mut [u8])) -> (FfiCall, Storage) {
        let mut st = Storage {
            inputs: Vec::new(),
            outputs: Vec::new(),
        };
        let mut ins = Vec::new();
        for (i, b) in self.inputs.iter().enumerate() {
            let (mut v, p) = alloc(b);
            if p != 0 {
                let bytes = claimed_bytes(b).unwrap();
                fill(i, &mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes]);
            }
            ins.push(FfiBuffer {
                data: if v.is_empty() { 0 } else { v.as_ptr() as usize },
                dtype: b.dtype,
                dims: b.dims.clone(),
            });
            st.inputs.push(v);
        }
        let mut outs = Vec::new();
        for b in &self.outputs {
            let (mut v, _) = alloc(b);
            // Poison: a result the library should have written but did not shows as nan / 0xff.
            v.iter_mut().for_each(|w| *w = u64::MAX);
            outs.push(FfiBuffer {
                data: if v.is_empty() { 0 } else { v.as_ptr() as usize },
                dtype: b.dtype,
                dims: b.dims.clone(),
            });
            st.outputs.push(v);
        }
        let call = FfiCall {
            site: self.site,
            world: self.world,
            nodes: self.nodes,
            gpus_per_node: self.gpus_per_node,
            device_ordinal: device,
            device_ordinals: self.device_ordinals.clone(),
            device_ranks: self.device_ranks.clone(),
            device_groups: self.device_groups.clone(),
            names: self.names.clone(),
            inputs: ins,
            outputs: outs,
            stream: 0,
            run_id: 0,
            job: self.job,
            urgent: 0,
        };
        (call, st)
    }
}

/// A valid call: world 1..=4 (a random factorization into nodes x gpus_per_node), 1 or 2 groups,
/// devices with shuffled distinct ordinals, 1..=3 parameters of 0..=3 dims.
fn valid_case(rng: &mut Rng, site: i64) -> Case {
    let op = if rng.below(2) == 0 {
        Op::AllGather
    } else {
        Op::ReduceScatter
    };
    let world = rng.range(1, 4);
    let divisors: Vec<i64> = (1..=world).filter(|d| world % d == 0).collect();
    let nodes = rng.pick(&divisors);
    let groups = rng.range(1, 2);
    let mut places: Vec<(i64, i64)> = (0..groups)
        .flat_map(|g| (0..world).map(move |r| (g, r)))
        .collect();
    rng.shuffle(&mut places);
    let base = rng.range(-3, 100);
    let mut ordinals: Vec<i64> = (0..places.len() as i64).map(|i| base + 3 * i).collect();
    rng.shuffle(&mut ordinals);
    let params = rng.range(1, 3) as usize;
    let (mut inputs, mut outputs, mut names) = (Vec::new(), Vec::new(), Vec::new());
    for p in 0..params {
        let dtype = match op {
            Op::ReduceScatter => rng.pick(&[F32, BF16, F16]),
            Op::AllGather => rng.pick(&[F32, BF16, F16, S32, U8]),
        };
        let ndim = rng.range(0, 3) as usize;
        let full: Vec<i64> = (0..ndim).map(|_| rng.range(1, 9)).collect();
        let rows = full.first().copied().unwrap_or(1);
        let mut shard = full.clone();
        if shard.is_empty() {
            shard.push(1);
        }
        shard[0] = (rows + world - 1) / world;
        let (full_buf, shard_buf) = (
            Buf {
                dtype,
                dims: full.clone(),
            },
            Buf {
                dtype: if op == Op::ReduceScatter { F32 } else { dtype },
                dims: shard,
            },
        );
        match op {
            Op::AllGather => {
                inputs.push(shard_buf);
                outputs.push(full_buf);
            }
            Op::ReduceScatter => {
                inputs.push(full_buf);
                outputs.push(shard_buf);
            }
        }
        names.push(format!("layers.{p}.w"));
    }
    let device_ordinal = rng.pick(&ordinals);
    Case {
        op,
        site,
        world,
        nodes,
        gpus_per_node: world / nodes,
        device_ordinal,
        device_ordinals: ordinals,
        device_ranks: places.iter().map(|p| p.1).collect(),
        device_groups: places.iter().map(|p| p.0).collect(),
        names: names.join("\n").into_bytes(),
        inputs,
        outputs,
        job: 0,
    }
}

/// Adversarial values of one 64-bit attribute.
const HUGE: [i64; 10] = [
    0,
    -1,
    i64::MIN,
    i64::MAX,
    1 << 32,
    1_000_000,
    1 << 16,
    (1 << 16) + 1,
    768_614_336_404_564_651,
    -768_614_336_404_564_651,
];

/// Applies one random mutation; returns the words the error must contain (any of them).
fn mutate(rng: &mut Rng, c: &mut Case) -> &'static [&'static str] {
    let n = c.device_ordinals.len();
    let at = rng.below(n as u64) as usize;
    match rng.below(22) {
        0 => {
            c.world = rng.pick(&HUGE);
            &["'world'", "'nodes'", "'gpus_per_node'", "'device_ranks'"]
        }
        1 => {
            c.nodes = rng.pick(&HUGE);
            &["'nodes'"]
        }
        2 => {
            c.gpus_per_node = rng.pick(&HUGE);
            &["'gpus_per_node'"]
        }
        3 => {
            // A product that wraps to the world: 768614336404564651 * 24 = 8 mod 2^64.
            c.world = 8;
            c.nodes = 768_614_336_404_564_651;
            c.gpus_per_node = 24;
            &["'nodes'"]
        }
        4 => {
            // Two devices with one rank in one group (rank r given to a second device).
            let other = (at + 1) % n;
            if n < 2 {
                c.device_ranks[at] = c.world;
                return &["'device_ranks'"];
            }
            c.device_ranks[other] = c.device_ranks[at];
            c.device_groups[other] = c.device_groups[at];
            &["appears twice in group", "'device_ranks'"]
        }
        5 => {
            c.device_ranks[at] = rng.pick(&HUGE).wrapping_add(c.world);
            &["'device_ranks'"]
        }
        6 => {
            c.device_groups[at] = rng.pick(&[-1, i64::MIN, i64::MAX, 1 << 40]);
            &["'device_groups'"]
        }
        7 => {
            // A device dropped: its rank is missing from its group.
            c.device_ordinals.remove(at);
            c.device_ranks.remove(at);
            c.device_groups.remove(at);
            &[
                "lacks rank",
                "'device_ordinals'",
                "'device_ranks'",
                "'device_groups'",
            ]
        }
        8 => {
            match rng.below(3) {
                0 => c.device_ordinals.push(1000),
                1 => {
                    c.device_ranks.pop();
                }
                _ => c.device_groups.extend([0, 0]),
            }
            &["equal lengths"]
        }
        9 => {
            c.device_ordinal = rng.pick(&[i64::MIN, -7, 1 << 40]);
            &["'device_ordinals'"]
        }
        10 => {
            let other = (at + 1) % n;
            if other == at {
                c.device_ordinals[at] = c.device_ordinal + 1;
                return &["'device_ordinals'"];
            }
            c.device_ordinals[other] = c.device_ordinals[at];
            &["'device_ordinals'"]
        }
        11 => {
            c.job = rng.pick(&[-1, i64::MIN]);
            &["'job'"]
        }
        12 => {
            let b = pick_buf(rng, c);
            let k = rng.below(b.dims.len().max(1) as u64) as usize;
            if b.dims.is_empty() {
                b.dims.push(-1);
            } else {
                b.dims[k] = rng.pick(&[-1, i64::MIN, i64::MAX, 1 << 40, 0]);
            }
            &["operand", "result", "dim", "shape"]
        }
        13 => {
            let b = pick_buf(rng, c);
            b.dims = vec![1 << 30; rng.range(2, 4) as usize];
            &["operand", "result", "2^48"]
        }
        14 => {
            let b = pick_buf(rng, c);
            b.dims = vec![1; rng.range(65, 300) as usize];
            &["operand", "result", "dims"]
        }
        15 => {
            let b = pick_buf(rng, c);
            b.dtype = rng.pick(&[0, 13, 14, 17, 21, 32, 99, -1, i32::MAX]); // unknown, token, sub-byte
            &["dtype"]
        }
        16 => {
            // A dtype tide knows but the op cannot take there.
            let rs = c.op == Op::ReduceScatter;
            let b = pick_buf(rng, c);
            b.dtype = if rs { S32 } else { 12 }; // int32 gradient / fp32 shard; f64 vs the other
            &["dtype", "float32", "reduce_scatter", "differs"]
        }
        17 => {
            if rng.below(2) == 0 {
                c.outputs.pop();
            } else {
                c.inputs.push(c.inputs[0].clone());
            }
            &["operands but"]
        }
        18 => {
            c.inputs.clear();
            c.outputs.clear();
            &["empty parameter group"]
        }
        19 => {
            // A shard of the wrong number of rows.
            let ag = c.op == Op::AllGather;
            let b = if ag {
                &mut c.inputs[0]
            } else {
                &mut c.outputs[0]
            };
            if b.dims.is_empty() {
                b.dims.push(2);
            } else {
                b.dims[0] = b.dims[0].wrapping_add(1);
            }
            &["wants", "shape"]
        }
        20 => {
            // The world of another mesh, with a matching topology.
            c.world = rng.pick(&[c.world + 1, 1 << 16, 1 << 32, 1_000_000]);
            c.nodes = 1;
            c.gpus_per_node = c.world;
            &["'world'", "lacks rank", "wants"]
        }
        _ => {
            // Names past any bound, with a shape error that must quote one of them.
            c.names = vec![b'x'; 1 << 20];
            let ag = c.op == Op::AllGather;
            let b = if ag {
                &mut c.inputs[0]
            } else {
                &mut c.outputs[0]
            };
            if b.dims.is_empty() {
                b.dims.push(2);
            } else {
                b.dims[0] = b.dims[0].wrapping_add(1);
            }
            &["wants", "shape"]
        }
    }
}

fn pick_buf<'a>(rng: &mut Rng, c: &'a mut Case) -> &'a mut Buf {
    let outs = rng.below(2) == 0;
    let list = if outs { &mut c.outputs } else { &mut c.inputs };
    let i = rng.below(list.len() as u64) as usize;
    &mut list[i]
}

/// How a case ended.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Succeeded alone (a complete single-rank world); its data was checked.
    Ok,
    /// Refused with a clear error.
    Refused,
    /// Valid attributes and buffers, peers absent: failed after the rendezvous timeout.
    TimedOut,
}

/// Runs `c` on its one device and checks the verdict; returns it and the time taken.
fn run_one(c: &Case, must_contain: &[&str]) -> (Verdict, Duration) {
    let (call, storage) = c.ffi(c.device_ordinal, &|_, bytes| bytes.fill(0x3c));
    let t0 = Instant::now();
    let status = run_cpu(c.op, &call);
    let mut took = t0.elapsed();
    // A refusal is deterministic and has no effects: on a loaded machine (CI runs tests in
    // parallel on 2 cores) one attempt can be descheduled past FAIL_FAST, so a slow refusal is
    // timed again and the fastest of 3 counts.
    let refused = status.code != StatusCode::Ok && !status.message.contains("did not arrive");
    for _ in 0..2 {
        if !refused || took < FAIL_FAST {
            break;
        }
        let t0 = Instant::now();
        let again = run_cpu(c.op, &call);
        took = took.min(t0.elapsed());
        assert_ne!(again.code, StatusCode::Ok, "a refused call succeeded when repeated");
    }
    drop(call);
    check_status(c, &status, must_contain, took);
    if status.code == StatusCode::Ok {
        // Only a complete single-rank world can succeed alone: the result is the input.
        assert_eq!(
            c.world,
            1,
            "a call succeeded without its peers: {}",
            c.summary()
        );
        check_single_rank(c, &storage);
        return (Verdict::Ok, took);
    }
    if status.message.contains("did not arrive") {
        return (Verdict::TimedOut, took);
    }
    (Verdict::Refused, took)
}

fn check_status(c: &Case, s: &FfiStatus, must_contain: &[&str], took: Duration) {
    if s.code == StatusCode::Ok {
        return;
    }
    let m = &s.message;
    assert!(
        m.len() <= 2048,
        "message of {} bytes: {}...",
        m.len(),
        &m[..200]
    );
    assert!(
        m.contains("tide all_gather") || m.contains("tide reduce_scatter"),
        "the message names the call: {m}"
    );
    let timed_out = m.contains("did not arrive");
    if timed_out {
        // Valid attributes whose peers never come: the one failure that waits (the timeout).
        assert!(
            took < Duration::from_secs_f64(TIMEOUT_S) * 40,
            "{took:?}: {m}"
        );
        return;
    }
    assert!(
        took < FAIL_FAST,
        "refused in {took:?}, not at once: {m}\n{}",
        c.summary()
    );
    assert!(
        must_contain.is_empty() || must_contain.iter().any(|w| m.contains(w)),
        "expected one of {must_contain:?} in: {m}\ncase: {}",
        c.summary()
    );
}

fn bytes_of(v: &[u64], n: usize) -> &[u8] {
    &bytemuck::cast_slice::<u64, u8>(v)[..n]
}

fn to_f32(dtype: i32, b: &[u8]) -> Vec<f32> {
    match dtype {
        F32 => b
            .chunks(4)
            .map(|x| f32::from_le_bytes(x.try_into().unwrap()))
            .collect(),
        BF16 => b
            .chunks(2)
            .map(|x| tide::engine::cpu::bf16_to_f32(u16::from_le_bytes([x[0], x[1]])))
            .collect(),
        F16 => b
            .chunks(2)
            .map(|x| tide::engine::cpu::f16_to_f32(u16::from_le_bytes([x[0], x[1]])))
            .collect(),
        other => panic!("not a float dtype {other}"),
    }
}

/// World 1: the all-gather copies the shard, the reduce-scatter widens the gradient to fp32.
fn check_single_rank(c: &Case, st: &Storage) {
    for (i, (inp, out)) in c.inputs.iter().zip(&c.outputs).enumerate() {
        let (ib, ob) = (claimed_bytes(inp).unwrap(), claimed_bytes(out).unwrap());
        match c.op {
            Op::AllGather => assert_eq!(
                bytes_of(&st.inputs[i], ib),
                bytes_of(&st.outputs[i], ob),
                "param {i}"
            ),
            Op::ReduceScatter => assert_eq!(
                to_f32(inp.dtype, bytes_of(&st.inputs[i], ib)),
                to_f32(F32, bytes_of(&st.outputs[i], ob)),
                "param {i}"
            ),
        }
    }
}

/// Small integers, exact in every dtype and in any order of fp32 sums.
fn value(group: i64, rank: i64, param: usize, e: usize) -> f32 {
    ((group * 5 + rank * 3 + param as i64 * 7 + e as i64) % 13 - 6) as f32
}

fn encode(dtype: i32, x: f32, out: &mut [u8]) {
    match dtype {
        F32 => out.copy_from_slice(&x.to_le_bytes()),
        BF16 => out.copy_from_slice(&tide::engine::cpu::f32_to_bf16(x).to_le_bytes()),
        F16 => {
            // Small integers: exact as f16 (sign, exponent 15 + e, mantissa).
            let bits: u16 = if x == 0.0 {
                0
            } else {
                let a = x.abs() as u32;
                let e = 31 - a.leading_zeros();
                let mant = ((a << (10 - e)) & 0x3ff) as u16;
                (if x < 0.0 { 0x8000 } else { 0 }) | (((e + 15) as u16) << 10) | mant
            };
            out.copy_from_slice(&bits.to_le_bytes());
        }
        S32 => out.copy_from_slice(&(x as i32).to_le_bytes()),
        U8 => out[0] = x as i8 as u8,
        other => panic!("dtype {other}"),
    }
}

/// Runs a valid case on every device (threads) and checks every result against the reference.
fn run_all_ranks(c: &Case) {
    let c = Arc::new(c.clone());
    let handles: Vec<_> = (0..c.device_ordinals.len())
        .map(|entry| {
            let c = c.clone();
            thread::spawn(move || {
                let (group, rank) = (c.device_groups[entry], c.device_ranks[entry]);
                let fill = |param: usize, bytes: &mut [u8]| {
                    let dtype = c.inputs[param].dtype;
                    let size = elem_size(dtype).unwrap();
                    for (e, chunk) in bytes.chunks_mut(size).enumerate() {
                        encode(dtype, value(group, rank, param, e), chunk);
                    }
                };
                let (call, st) = c.ffi(c.device_ordinals[entry], &fill);
                let s = run_cpu(c.op, &call);
                (entry, s, st)
            })
        })
        .collect();
    for h in handles {
        let (entry, s, st) = h.join().unwrap();
        assert_eq!(s.code, StatusCode::Ok, "{}\n{}", s.message, c.summary());
        check_all_ranks(&c, entry, &st);
    }
}

fn check_all_ranks(c: &Case, entry: usize, st: &Storage) {
    let (group, rank) = (c.device_groups[entry], c.device_ranks[entry]);
    for i in 0..c.inputs.len() {
        let (full, shard) = match c.op {
            Op::AllGather => (&c.outputs[i], &c.inputs[i]),
            Op::ReduceScatter => (&c.inputs[i], &c.outputs[i]),
        };
        let row_elems: usize = full.dims.iter().skip(1).product::<i64>() as usize;
        let rows = full.dims.first().copied().unwrap_or(1) as usize;
        let shard_rows = shard.dims[0] as usize;
        let out = &c.outputs[i];
        let got_bytes = bytes_of(&st.outputs[i], claimed_bytes(out).unwrap());
        match c.op {
            Op::AllGather => {
                let size = elem_size(out.dtype).unwrap();
                let mut want = vec![0u8; got_bytes.len()];
                for row in 0..rows {
                    let (src, local) = ((row / shard_rows) as i64, row % shard_rows);
                    for k in 0..row_elems {
                        let e = row * row_elems + k;
                        let x = value(group, src, i, local * row_elems + k);
                        encode(out.dtype, x, &mut want[e * size..(e + 1) * size]);
                    }
                }
                assert_eq!(got_bytes, &want[..], "all-gather param {i} on rank {rank}");
            }
            Op::ReduceScatter => {
                let got = to_f32(F32, got_bytes);
                for (e, g) in got.iter().enumerate() {
                    let row = rank as usize * shard_rows + e / row_elems;
                    let want: f32 = if row < rows {
                        let at = row * row_elems + e % row_elems;
                        (0..c.world).map(|r| value(group, r, i, at)).sum()
                    } else {
                        0.0 // padding rows
                    };
                    assert_eq!(*g, want, "reduce-scatter param {i} rank {rank} element {e}");
                }
            }
        }
    }
}

#[test]
fn random_and_mutated_attribute_sets() {
    use_test_timeout();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let t0 = Instant::now();
    let (mut valid_runs, mut refused, mut ok_alone, mut timed_out) = (0, 0, 0, 0);
    let mut slowest = Duration::ZERO;
    for k in 0..4000i64 {
        let mut c = valid_case(&mut rng, 100_000 + k);
        if rng.below(8) == 0 {
            run_all_ranks(&c);
            valid_runs += 1;
            continue;
        }
        let mutations = rng.range(1, 3);
        let mut words: Vec<&str> = Vec::new();
        for _ in 0..mutations {
            let n = c.device_ordinals.len();
            if n == 0 || c.device_ranks.len() != n || c.device_groups.len() != n {
                break; // later mutations index these
            }
            if c.inputs.is_empty() || c.outputs.is_empty() {
                break;
            }
            words.extend(mutate(&mut rng, &mut c));
        }
        match run_one(&c, &words) {
            (Verdict::Ok, _) => ok_alone += 1,
            (Verdict::TimedOut, _) => timed_out += 1,
            (Verdict::Refused, took) => {
                refused += 1;
                slowest = slowest.max(took);
            }
        }
    }
    println!(
        "fuzz: {valid_runs} valid calls run on every rank and checked, {refused} refused (slowest \
         {slowest:?}), {ok_alone} single-rank calls still valid after mutation (checked), \
         {timed_out} valid attribute sets waiting for absent peers; {:?} in all",
        t0.elapsed()
    );
    assert!(
        valid_runs > 300 && refused > 2500,
        "the mix covers both outcomes"
    );
}

/// The cases, and every limit at and past its bound.
#[test]
fn adversarial_attribute_sets() {
    use_test_timeout();
    let base = || {
        let mut c = valid_case(&mut Rng(3), 0);
        c.op = Op::AllGather;
        c
    };
    let mut cases: Vec<(Case, &[&str])> = Vec::new();
    let single = |world: i64, nodes: i64, gpus: i64, entries: i64| {
        // One parameter of `world` rows; `entries` devices listed, ranks 0..entries, group 0.
        let mut c = base();
        c.world = world;
        c.nodes = nodes;
        c.gpus_per_node = gpus;
        c.device_ordinals = (0..entries).collect();
        c.device_ranks = (0..entries).collect();
        c.device_groups = vec![0; entries as usize];
        c.device_ordinal = 0;
        c.inputs = vec![Buf {
            dtype: F32,
            dims: vec![1, 4],
        }];
        c.outputs = vec![Buf {
            dtype: F32,
            dims: vec![world.clamp(1, 1 << 20), 4],
        }];
        c
    };
    cases.push((single(1 << 32, 1, 1 << 32, 1), &["'world' is 4294967296"]));
    cases.push((single(1_000_000, 1, 1_000_000, 1), &["'world' is 1000000"]));
    cases.push((single(10_000, 1, 10_000, 1), &["group 0 lacks rank 1"]));
    cases.push((
        single(8, 768_614_336_404_564_651, 24, 8),
        &["'nodes' is 768614336404564651"],
    ));
    let mut dup = single(8, 1, 8, 8);
    dup.device_ranks[5] = 2;
    cases.push((dup, &["rank 2 appears twice in group 0", "devices 2 and 5"]));
    // Valid attributes at the world bound (every rank listed), but a plan past MAX_PLAN_STEPS.
    let mut big = single(1 << 16, 1 << 8, 1 << 8, 1 << 16);
    big.device_ordinal = 12345;
    cases.push((
        big.clone(),
        &["MAX_PLAN_STEPS", "split the parameter group"],
    ));
    big.op = Op::ReduceScatter;
    big.inputs = vec![Buf {
        dtype: BF16,
        dims: vec![1 << 16, 4],
    }];
    big.outputs = vec![Buf {
        dtype: F32,
        dims: vec![1, 4],
    }];
    cases.push((big, &["MAX_PLAN_STEPS"]));
    cases.push((
        single(8, 2, 4, 1 << 17),
        &["'device_ordinals' has 131072 entries"],
    ));
    let mut many = single(1, 1, 1, 1);
    many.inputs = vec![
        Buf {
            dtype: F32,
            dims: vec![1],
        };
        (1 << 16) + 1
    ];
    many.outputs = many.inputs.clone();
    cases.push((
        many,
        &["65537 operands and 65537 results, more than", "MAX_PARAMS"],
    ));
    let mut far = single(2, 1, 2, 2);
    far.device_ordinals = vec![i64::MIN, i64::MAX];
    far.device_ordinal = 77;
    cases.push((
        far,
        &["device ordinal 77 is not in attribute 'device_ordinals'"],
    ));
    let mut long_list = single(4, 1, 4, 4);
    long_list.device_ordinals = (0..50_000).collect();
    long_list.device_ranks = vec![0; 50_000];
    long_list.device_groups = (0..50_000).collect();
    long_list.device_ordinal = -1;
    cases.push((long_list, &["(50000 in all)"]));
    let mut wrap = single(4, 2, 2, 4);
    wrap.outputs[0].dims = vec![i64::MAX / 2, 3];
    cases.push((wrap, &["result 0", "2^48"]));

    let (count, mut slowest) = (cases.len(), Duration::ZERO);
    for (i, (mut c, words)) in cases.into_iter().enumerate() {
        c.site = 200_000 + i as i64;
        let (verdict, took) = run_one(&c, words);
        assert_eq!(verdict, Verdict::Refused, "case {i}");
        assert!(took < FAIL_FAST, "case {i}: {took:?}");
        slowest = slowest.max(took);
    }
    println!("adversarial: {count} cases refused, slowest {slowest:?}");
}

/// World 1 calls with random valid shapes always succeed with the right data (the "correct
/// result" half of the contract, on the single-rank path the issue's cases reach).
#[test]
fn single_rank_calls_are_correct() {
    use_test_timeout();
    let mut rng = Rng(11);
    let mut checked = 0;
    while checked < 300 {
        let c = valid_case(&mut rng, 300_000 + checked);
        if c.world != 1 {
            continue;
        }
        let (call, st) = c.ffi(c.device_ordinal, &|i, bytes| {
            for (e, b) in bytes.iter_mut().enumerate() {
                *b = (e * 7 + i) as u8 & 0x3f; // finite in every float dtype
            }
        });
        let s = run_cpu(c.op, &call);
        assert_eq!(s.code, StatusCode::Ok, "{}", s.message);
        check_single_rank(&c, &st);
        checked += 1;
    }
}

/// The done target's decoding (`decode_done`: start's N results, aliased, then start's N
/// operands) on the same random and mutated attribute sets: a `CallInfo` or a bounded error naming
/// the call, at once. (Decoding only: a done's execution needs its start.)
#[test]
fn done_decoding_of_mutated_sets() {
    use_test_timeout();
    let mut rng = Rng(0x5eed);
    let (mut decoded, mut refused) = (0, 0);
    for k in 0..2000i64 {
        let mut c = valid_case(&mut rng, 400_000 + k);
        let mutations = rng.range(0, 2);
        for _ in 0..mutations {
            let n = c.device_ordinals.len();
            if n == 0 || c.device_ranks.len() != n || c.device_groups.len() != n {
                break;
            }
            if c.inputs.is_empty() || c.outputs.is_empty() {
                break;
            }
            mutate(&mut rng, &mut c);
        }
        let (mut call, _storage) = c.ffi(c.device_ordinal, &|_, _| {});
        // Done's operands: start's results (the very buffers of done's results), then start's operands.
        let mut operands = call
            .outputs
            .iter()
            .map(|b| FfiBuffer {
                data: b.data,
                dtype: b.dtype,
                dims: b.dims.clone(),
            })
            .collect::<Vec<_>>();
        operands.append(&mut call.inputs);
        if rng.below(10) == 0 && !operands.is_empty() {
            operands[0].data ^= 8; // not aliased
        }
        call.inputs = operands;
        let t0 = Instant::now();
        let r = tide::ffi::decode_done(c.op, &call);
        let mut took = t0.elapsed();
        for _ in 0..2 {
            if took < FAIL_FAST {
                break;
            }
            let t0 = Instant::now();
            let _ = tide::ffi::decode_done(c.op, &call); // as in run_one: fastest of 3 on a loaded machine
            took = took.min(t0.elapsed());
        }
        assert!(took < FAIL_FAST, "{took:?}");
        match r {
            Ok(_) => decoded += 1,
            Err(e) => {
                let m = tide::ffi::status(Err(e)).message;
                assert!(m.len() <= 2048 && m.contains("site"), "{m}");
                refused += 1;
            }
        }
    }
    println!("done decoding: {decoded} decoded, {refused} refused");
    assert!(decoded > 100 && refused > 500);
}
