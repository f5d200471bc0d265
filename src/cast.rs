//! The casting all-gather: fp32 shards in, bf16 parameters out, the cast folded into the gather
//! (`tide_all_gather_cast_start` / `_done`, docs/design.md "FFI contract" and "The casting
//! all-gather"). Pure: the rounding, where each rank's rows land, and the checks; the engines do the
//! moving (`ffi::cpu` on the host, `cuda::cast` on XLA's stream).
//!
//! Contract: operands N fp32 buffers `(L, *shard_i)` (a layer loop's stacked shards) and an int32
//! slice index; results N bf16 full parameters. Result i is what
//! `all_gather(operand_i[slice(index)].astype(bfloat16))` gives, `slice` as
//! `call::OutputAt::slice` (a negative index counts from the end, then clamped to [0, L - 1]).
//!
//! Data path (CUDA): each rank rounds its own real rows of slice `index` straight into their final
//! place in its result (`own_rows`), on XLA's stream, before the collective's start; the collective
//! then runs the plain all-gather plan with those rows as its operand (`views`: bf16 views of the
//! results), so peers read a rank's rows where they landed and the own shard is never copied (a copy
//! whose source is its destination does nothing: the engines skip it). Between start and done
//! nothing is held but the results: no bf16 shard buffer, no fp32 operand. On the host (CPU engine)
//! the rows are rounded into a temporary bf16 shard that stands as the operand (no aliasing there).
//!
//! Rounding: round to nearest, ties to even, as XLA's convert (`cvt.rn.bf16.f32` on the GPU);
//! infinities stay infinite, a NaN stays a NaN (its payload is not kept).

use crate::call::{BufferView, CallInfo, CastFrom};
use crate::error::{Result, TideError};
use crate::layout::{DType, GroupLayout, ParamLayout, ParamSpec};

/// fp32 -> bf16, round to nearest even (`bits` is the fp32 bit pattern). NaN -> a quiet NaN of the
/// same sign.
pub fn f32_to_bf16(bits: u32) -> u16 {
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) as u16 & 0x8000) | 0x7fc0;
    }
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// Rounds `src` into `dst` element by element (`f32_to_bf16`).
pub fn round_into(dst: &mut [u16], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16(s.to_bits());
    }
}

/// Where `rank`'s real rows of parameter `p` land in its result: (byte offset, elements). Zero
/// elements when the rank holds only padding.
pub fn own_rows(p: &ParamLayout, rank: usize) -> (usize, usize) {
    let (start, end) = p.owned_rows(rank);
    (start * p.row_bytes(), (end - start) * p.row_elems)
}

/// Bytes between two slices of a stacked fp32 operand of `p`: one fp32 shard, padding rows included.
pub fn slice_stride(p: &ParamLayout) -> usize {
    p.shard_rows * p.row_elems * 4
}

/// Turns a decoded casting all-gather start (`inputs`: the N fp32 operands; `outputs`: the N bf16
/// results) into the call the engines run: `cast` holds the operands and the index, `inputs` become
/// bf16 views of this rank's own rows of the results (shape of a shard; at a rank holding only
/// padding, the result's first byte: never read). Errors name the call, the rank and the parameter.
pub fn views(mut info: CallInfo, index_ptr: usize) -> Result<CallInfo> {
    let what = format!("tide all_gather_cast site {}", info.site);
    let who = format!("rank {} (device {})", info.rank, info.device_ordinal);
    let n = info.outputs.len();
    if n == 0 || info.inputs.len() != n {
        return crate::invalid!(
            "{what} on {who}: takes N fp32 operands and an index and returns N results; got {} \
             operands for {n} results",
            info.inputs.len()
        );
    }
    if index_ptr == 0 {
        return crate::invalid!("{what} on {who}: no index buffer");
    }
    if info.world == 0 || info.rank >= info.world {
        return crate::invalid!("{what} on {who}: rank {} is outside world size {}", info.rank, info.world);
    }
    let name = |i: usize| crate::call::short_name(info.names.get(i).map(String::as_str).unwrap_or(""));
    let specs: Vec<ParamSpec> = info
        .outputs
        .iter()
        .enumerate()
        .map(|(i, b)| ParamSpec::new(name(i), &b.dims, b.dtype))
        .collect();
    let layout = GroupLayout::new(&specs, info.world)
        .map_err(|e| TideError::InvalidArgument(format!("{what} on {who}: {e}")))?;
    let count = info.inputs[0].dims.first().copied().unwrap_or(0);
    for (p, src) in layout.params.iter().zip(&info.inputs) {
        if p.dtype != DType::BF16 {
            return crate::invalid!(
                "{what} on {who}: {}: result dtype {} is not supported; the casting all-gather \
                 lands bfloat16 (gather other dtypes with tide_all_gather)",
                p.describe(),
                p.dtype.name()
            );
        }
        let mut want = vec![count, p.shard_rows];
        want.extend(p.shape.iter().skip(1));
        if src.dtype != DType::F32 || src.dims != want || count == 0 {
            return crate::invalid!(
                "{what} on {who}: {}: operand is {}{:?}; the layout over {} ranks wants float32{:?} \
                 (L >= 1 stacked fp32 shards, the same L for every parameter)",
                p.describe(),
                src.dtype.name(),
                src.dims,
                info.world,
                want
            );
        }
    }
    let srcs = std::mem::take(&mut info.inputs);
    info.inputs = layout
        .params
        .iter()
        .zip(&info.outputs)
        .map(|(p, out)| {
            let (offset, elems) = own_rows(p, info.rank);
            let mut dims = vec![p.shard_rows];
            dims.extend(p.shape.iter().skip(1));
            BufferView {
                ptr: if elems > 0 { out.ptr + offset } else { out.ptr },
                dtype: DType::BF16,
                dims,
            }
        })
        .collect();
    info.cast = Some(CastFrom { srcs, index_ptr, count });
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: the exact value of x rounded to the nearest bf16, ties to even, by comparing
    /// distances in f64 (no bit tricks).
    fn nearest(x: f32) -> u16 {
        if x.is_nan() {
            return if x.is_sign_negative() { 0xffc0 } else { 0x7fc0 };
        }
        let lo = (x.to_bits() >> 16) as u16; // truncation: toward zero
        if x.is_infinite() {
            return lo;
        }
        let hi = lo + 1; // the next bf16 away from zero (past the largest finite: infinity)
        // the value a bf16 pattern stands for, infinity as 2^128 (the rounding boundary)
        let val = |b: u16| {
            let v = f32::from_bits((b as u32) << 16) as f64;
            if v.is_infinite() { 2f64.powi(128).copysign(v) } else { v }
        };
        let (dl, dh) = ((x as f64 - val(lo)).abs(), (val(hi) - x as f64).abs());
        if dl < dh || (dl == dh && lo & 1 == 0) {
            lo
        } else {
            hi
        }
    }

    #[test]
    fn rounding_is_nearest_even() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u32
        };
        let mut cases: Vec<u32> = (0..200_000).map(|_| next()).collect();
        // ties, both parities; around 1; subnormals; the overflow boundary; infinities; NaNs
        for hi in [0x3f80u32, 0x3f81, 0x0001, 0x0000, 0x7f7f, 0x7f7e, 0xff7f, 0x8001] {
            for lo in [0x0000u32, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff] {
                cases.push(hi << 16 | lo);
            }
        }
        cases.extend([0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0xffc0_0001, 0x7f80_0001, 0x0000_0000, 0x8000_0000]);
        for bits in cases {
            let x = f32::from_bits(bits);
            let got = f32_to_bf16(bits);
            if x.is_nan() {
                assert!(f32::from_bits((got as u32) << 16).is_nan(), "{bits:#x} -> {got:#x}");
                assert_eq!(got >> 15, (bits >> 31) as u16, "sign of NaN {bits:#x}");
            } else {
                assert_eq!(got, nearest(x), "{bits:#010x} ({x:e})");
            }
        }
        // spot values
        assert_eq!(f32_to_bf16(1.0f32.to_bits()), 0x3f80);
        assert_eq!(f32_to_bf16(0x3f80_8000), 0x3f80); // tie, even stays
        assert_eq!(f32_to_bf16(0x3f81_8000), 0x3f82); // tie, odd rounds up
        assert_eq!(f32_to_bf16(0x7f7f_ffff), 0x7f80); // rounds to infinity
        assert_eq!(f32_to_bf16(0xff80_0000), 0xff80);
    }

    fn call(world: usize, rank: usize, shapes: &[Vec<usize>], count: usize) -> CallInfo {
        let layout = GroupLayout::new(
            &shapes.iter().map(|s| ParamSpec::new("", s, DType::BF16)).collect::<Vec<_>>(),
            world,
        )
        .unwrap();
        CallInfo {
            op: crate::plan::Op::AllGather,
            site: 7,
            run_id: 0,
            rank_devices: Vec::new().into(),
            job: 0,
            device_ordinal: rank as i64,
            rank,
            group: 0,
            world,
            topology: crate::topology::Topology::single_node(world),
            names: vec!["w".into(), "b".into(), "s".into()],
            inputs: layout
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let mut dims = vec![count, p.shard_rows];
                    dims.extend(p.shape.iter().skip(1));
                    BufferView { ptr: 0x10_0000 * (i + 1), dtype: DType::F32, dims }
                })
                .collect(),
            outputs: shapes
                .iter()
                .enumerate()
                .map(|(i, s)| BufferView { ptr: 0x100_0000 * (i + 1), dtype: DType::BF16, dims: s.clone() })
                .collect(),
            stream: 0,
            at: None,
            cast: None,
            urgent: false,
        }
    }

    #[test]
    fn views_are_each_ranks_own_rows() {
        let shapes = vec![vec![10, 3], vec![5], vec![]];
        for world in [1usize, 2, 3, 8] {
            for rank in 0..world {
                let c = call(world, rank, &shapes, 4);
                let srcs = c.inputs.clone();
                let v = views(c, 0xabc).unwrap();
                let layout = v.layout().expect("views pass the layout's checks");
                let cast = v.cast.as_ref().unwrap();
                assert_eq!((cast.index_ptr, cast.count), (0xabc, 4));
                assert_eq!(cast.srcs, srcs);
                for (i, p) in layout.params.iter().enumerate() {
                    let (start, end) = p.owned_rows(rank);
                    let want = if end > start { v.outputs[i].ptr + start * p.row_elems * 2 } else { v.outputs[i].ptr };
                    assert_eq!(v.inputs[i].ptr, want, "world {world} rank {rank} param {i}");
                    assert_eq!(v.inputs[i].dtype, DType::BF16);
                    assert_eq!(own_rows(p, rank).1, (end - start) * p.row_elems);
                    // never past the result's end
                    assert!(v.inputs[i].ptr + own_rows(p, rank).1 * 2 <= v.outputs[i].ptr + p.full_bytes());
                    assert_eq!(slice_stride(p), p.shard_rows * p.row_elems * 4);
                }
            }
        }
    }

    #[test]
    fn views_refuse_what_they_cannot_cast() {
        let shapes = vec![vec![10, 3], vec![5]];
        let err = |c: CallInfo| views(c, 0xabc).unwrap_err().to_string();
        let mut c = call(3, 1, &shapes, 2);
        c.outputs[1].dtype = DType::F16;
        assert!(err(c).contains("param 1 'b'"), "names the parameter");
        let mut c = call(3, 1, &shapes, 2);
        c.inputs[0].dtype = DType::BF16;
        let e = err(c);
        assert!(e.contains("param 0 'w'") && e.contains("float32[2, 4, 3]") && e.contains("rank 1"), "{e}");
        let mut c = call(3, 1, &shapes, 2);
        c.inputs[1].dims[0] = 3; // L differs between parameters
        assert!(err(c).contains("param 1 'b'"));
        let mut c = call(3, 1, &shapes, 2);
        c.inputs.pop();
        assert!(err(c).contains("1 operands for 2 results"));
        assert!(views(call(3, 1, &shapes, 2), 0).is_err(), "no index");
        let mut c = call(3, 1, &shapes, 0);
        c.inputs[0].dims[0] = 0;
        assert!(views(c, 0xabc).is_err(), "L = 0");
    }
}
