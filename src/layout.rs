//! Layout core: how a parameter group is sharded over `world` ranks, FSDP2's dim-0 rule, or along
//! any other dimension (`jax.lax.all_gather(..., axis=k, tiled=True)`).
//!
//! A parameter is sharded along its dim `axis` (0 unless `ParamSpec::along` says otherwise). Its
//! shape reads as `outer x rows x row_elems`: `outer` the product of the dims before `axis` (1 for
//! axis 0), `rows` dim `axis`, `row_elems` the product of the dims after it. With world size P,
//! `shard_rows = ceil(rows / P)`; rank r owns rows `[r * shard_rows, min((r + 1) * shard_rows,
//! rows))` of every one of the `outer` blocks, zero-padded to `shard_rows`; its shard is
//! `outer x shard_rows x row_elems`, contiguous. A 0-d parameter counts as one row of one element;
//! when rows < P some ranks hold only padding.
//!
//! [Note: strided parameters] With `outer > 1` a rank's rows are `outer` pieces of the full
//! parameter, `full_pitch()` bytes apart (`shard_pitch()` apart in the shard): plans move them as
//! one 2-D copy (`Action::CopyBlocks`), never through a transpose. Such a parameter must divide
//! evenly (`rows % world == 0`, as `jax.lax` requires): no padding rows inside the blocks, so a
//! rank's fp32 reduce-scatter result is contiguous. At world 1 a strided parameter is contiguous
//! (its one rank owns every row), so plans treat it as any other.
//!
//! Byte offsets: a rank's *packed shard* is the concatenation of its shards of every parameter in
//! group order; `prefix_offset` is where parameter i starts in it. The *unsharded group* is the
//! concatenation of the full parameters (rows x row_elems each), `unsharded_offset` likewise.
//! Pure arithmetic: no CUDA, no XLA, no Python.

use crate::error::{Result, TideError};
use crate::invalid;

/// Element types tide knows. The numeric codes are XLA FFI's `XLA_FFI_DataType` values, so the FFI
/// edge can pass them straight through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    Pred = 1,
    S8 = 2,
    S16 = 3,
    S32 = 4,
    S64 = 5,
    U8 = 6,
    U16 = 7,
    U32 = 8,
    U64 = 9,
    F16 = 10,
    F32 = 11,
    F64 = 12,
    BF16 = 16,
    C64 = 15,
    C128 = 18,
    F8E5M2 = 19,
    F8E4M3FN = 20,
    F8E4M3B11FNUZ = 23,
    F8E5M2FNUZ = 24,
    F8E4M3FNUZ = 25,
    F8E4M3 = 28,
    F8E3M4 = 29,
    F8E8M0FNU = 33,
}

/// Every `DType`: `from_xla` and `from_name` search it, so a new variant goes here too.
pub const ALL_DTYPES: [DType; 23] = [
    DType::Pred,
    DType::S8,
    DType::S16,
    DType::S32,
    DType::S64,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::C64,
    DType::C128,
    DType::F8E5M2,
    DType::F8E4M3FN,
    DType::F8E4M3B11FNUZ,
    DType::F8E5M2FNUZ,
    DType::F8E4M3FNUZ,
    DType::F8E4M3,
    DType::F8E3M4,
    DType::F8E8M0FNU,
];

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Pred | DType::S8 | DType::U8 => 1,
            DType::F8E5M2
            | DType::F8E4M3FN
            | DType::F8E4M3B11FNUZ
            | DType::F8E5M2FNUZ
            | DType::F8E4M3FNUZ
            | DType::F8E4M3
            | DType::F8E3M4
            | DType::F8E8M0FNU => 1,
            DType::S16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::S32 | DType::U32 | DType::F32 => 4,
            DType::S64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// From XLA FFI's data type code. Packed sub-byte types (S1/S2/S4, U1/U2/U4, F4E2M1FN) and the
    /// token are not element types tide can address by the byte: refused, naming the code.
    pub fn from_xla(code: i32) -> Result<DType> {
        match ALL_DTYPES.iter().find(|d| **d as i32 == code) {
            Some(&d) => Ok(d),
            None => match code {
                21 | 22 | 26 | 27 | 30 | 31 | 32 => invalid!(
                    "dtype code {code} (XLA_FFI_DataType) is a sub-byte type (int4, uint4, int2, uint2, \
                     int1, uint1 or float4_e2m1fn): tide moves whole bytes per element"
                ),
                other => invalid!("unknown dtype code {other} (XLA_FFI_DataType)"),
            },
        }
    }

    /// From the numpy / JAX name ("bfloat16", "float32", "float8_e4m3fn", ...).
    pub fn from_name(name: &str) -> Result<DType> {
        match ALL_DTYPES.iter().find(|d| d.name() == name) {
            Some(&d) => Ok(d),
            None => invalid!("unknown dtype {name:?}"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::Pred => "bool",
            DType::S8 => "int8",
            DType::S16 => "int16",
            DType::S32 => "int32",
            DType::S64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
            DType::F8E5M2 => "float8_e5m2",
            DType::F8E4M3FN => "float8_e4m3fn",
            DType::F8E4M3B11FNUZ => "float8_e4m3b11fnuz",
            DType::F8E5M2FNUZ => "float8_e5m2fnuz",
            DType::F8E4M3FNUZ => "float8_e4m3fnuz",
            DType::F8E4M3 => "float8_e4m3",
            DType::F8E3M4 => "float8_e3m4",
            DType::F8E8M0FNU => "float8_e8m0fnu",
        }
    }

    /// Can this dtype be an input of the reduce-scatter (summed in fp32)?
    pub fn is_reducible(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32)
    }
}

/// One parameter as the user sees it: full (unsharded) shape and dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// The dimension sharded over the ranks (0: FSDP2's rule). Must be a dimension of the shape
    /// (or 0 for a 0-d parameter).
    pub axis: usize,
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, shape: &[usize], dtype: DType) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
            axis: 0,
        }
    }

    /// The same parameter sharded along dimension `axis` ([Note: strided parameters]).
    pub fn along(mut self, axis: usize) -> ParamSpec {
        self.axis = axis;
        self
    }
}

/// One parameter's sharding over `world` ranks. All sizes in elements unless the name says bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    pub index: usize,
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// The sharded dimension (0 for a 0-d parameter).
    pub axis: usize,
    /// product of the dims before `axis` (1 for axis 0): the blocks a rank's rows come in.
    pub outer: usize,
    /// dim `axis` of the shape (1 for a 0-d parameter).
    pub rows: usize,
    /// product of the dims after `axis` (1 for 0-d and 1-d parameters).
    pub row_elems: usize,
    /// ceil(rows / world): rows of every rank's padded shard.
    pub shard_rows: usize,
    /// outer * shard_rows * row_elems * dtype size.
    pub shard_bytes: usize,
    /// byte offset of this parameter's shard in a rank's packed shard.
    pub prefix_offset: usize,
    /// byte offset of this parameter in the unsharded group.
    pub unsharded_offset: usize,
}

impl ParamLayout {
    pub fn row_bytes(&self) -> usize {
        self.row_elems * self.dtype.size_bytes()
    }
    pub fn full_bytes(&self) -> usize {
        self.outer * self.rows * self.row_bytes()
    }
    /// Bytes from one block of the full parameter to the next (`rows` rows).
    pub fn full_pitch(&self) -> usize {
        self.rows * self.row_bytes()
    }
    /// Bytes from one block of a shard to the next (`shard_rows` rows).
    pub fn shard_pitch(&self) -> usize {
        self.shard_rows * self.row_bytes()
    }
    /// Elements of a shard, padding included (`outer * shard_rows * row_elems`): the fp32
    /// reduce-scatter result.
    pub fn shard_elems(&self) -> usize {
        self.outer * self.shard_rows * self.row_elems
    }
    /// Real (non-padding) elements of `rank`'s shard, all blocks.
    pub fn valid_elems(&self, rank: usize) -> usize {
        self.outer * self.valid_rows(rank) * self.row_elems
    }
    /// The shape of every rank's shard: the shape with dim `axis` cut to `shard_rows` (`[1]` for
    /// a 0-d parameter).
    pub fn shard_shape(&self) -> Vec<usize> {
        let mut shape = self.shape.clone();
        match shape.get_mut(self.axis) {
            Some(d) => *d = self.shard_rows,
            None => shape = vec![self.shard_rows],
        }
        shape
    }
    /// Whether a rank's rows are several pieces of the full parameter ([Note: strided
    /// parameters]): `outer > 1` and more than one rank.
    pub fn is_strided(&self) -> bool {
        self.outer > 1 && self.shard_rows < self.rows
    }
    /// Rows `[start, end)` of the full parameter owned by `rank` (end may equal start: padding only).
    pub fn owned_rows(&self, rank: usize) -> (usize, usize) {
        let start = (rank * self.shard_rows).min(self.rows);
        let end = ((rank + 1) * self.shard_rows).min(self.rows);
        (start, end)
    }
    /// Number of real (non-padding) rows `rank` holds.
    pub fn valid_rows(&self, rank: usize) -> usize {
        let (s, e) = self.owned_rows(rank);
        e - s
    }
    /// "param 3 'layers.0.wq' (shape [7, 5], bfloat16)": how errors name a parameter (", along
    /// dim 1" when sharded along another dimension than 0).
    pub fn describe(&self) -> String {
        let along = if self.axis > 0 { format!(", along dim {}", self.axis) } else { String::new() };
        if self.name.is_empty() {
            format!(
                "param {} (shape {:?}, {}{along})",
                self.index,
                self.shape,
                self.dtype.name()
            )
        } else {
            format!(
                "param {} '{}' (shape {:?}, {}{along})",
                self.index,
                self.name,
                self.shape,
                self.dtype.name()
            )
        }
    }
}

/// A parameter group sharded over `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLayout {
    pub world: usize,
    pub params: Vec<ParamLayout>,
    /// Bytes of one rank's packed shard (sum of shard_bytes).
    pub shard_bytes: usize,
    /// Bytes of the unsharded group (sum of full_bytes).
    pub unsharded_bytes: usize,
}

fn checked_mul(a: usize, b: usize, what: &dyn Fn() -> String) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| TideError::InvalidArgument(format!("{}: size overflows", what())))
}

impl GroupLayout {
    pub fn new(params: &[ParamSpec], world: usize) -> Result<GroupLayout> {
        if world == 0 {
            return invalid!("world size must be at least 1, got 0");
        }
        if params.is_empty() {
            return invalid!("empty parameter group: nothing to shard");
        }
        let mut out = Vec::with_capacity(params.len());
        let mut prefix = 0usize;
        let mut unsharded = 0usize;
        for (index, p) in params.iter().enumerate() {
            let what = || {
                format!(
                    "param {index} '{}' (shape {:?}, {})",
                    p.name,
                    p.shape,
                    p.dtype.name()
                )
            };
            if let Some(d) = p.shape.iter().position(|&d| d == 0) {
                return invalid!(
                    "{}: dim {d} is zero; zero-size parameters cannot be sharded",
                    what()
                );
            }
            if p.axis > 0 && p.axis >= p.shape.len() {
                return invalid!(
                    "{}: cannot shard along dim {} of a {}-d parameter",
                    what(),
                    p.axis,
                    p.shape.len()
                );
            }
            let rows = p.shape.get(p.axis).copied().unwrap_or(1);
            let mut outer = 1usize;
            for &d in p.shape.iter().take(p.axis) {
                outer = checked_mul(outer, d, &what)?;
            }
            let mut row_elems = 1usize;
            for &d in p.shape.iter().skip(p.axis + 1) {
                row_elems = checked_mul(row_elems, d, &what)?;
            }
            let shard_rows = rows.div_ceil(world);
            if outer > 1 && world > 1 && rows % world != 0 {
                return invalid!(
                    "{}: dim {} (size {rows}) is not divisible by the {world} ranks; a parameter \
                     sharded along a dimension other than its first must divide evenly",
                    what(),
                    p.axis
                );
            }
            let row_bytes = checked_mul(row_elems, p.dtype.size_bytes(), &what)?;
            let block_bytes = checked_mul(shard_rows, row_bytes, &what)?;
            let shard_bytes = checked_mul(outer, block_bytes, &what)?;
            let full_bytes = checked_mul(checked_mul(rows, row_bytes, &what)?, outer, &what)?;
            // The padded global buffer (world * shard_rows rows) must be addressable too.
            checked_mul(shard_bytes, world, &what)?;
            out.push(ParamLayout {
                index,
                name: p.name.clone(),
                shape: p.shape.clone(),
                dtype: p.dtype,
                axis: p.axis,
                outer,
                rows,
                row_elems,
                shard_rows,
                shard_bytes,
                prefix_offset: prefix,
                unsharded_offset: unsharded,
            });
            prefix = prefix.checked_add(shard_bytes).ok_or_else(|| {
                TideError::InvalidArgument(format!("{}: group size overflows", what()))
            })?;
            unsharded = unsharded.checked_add(full_bytes).ok_or_else(|| {
                TideError::InvalidArgument(format!("{}: group size overflows", what()))
            })?;
        }
        Ok(GroupLayout {
            world,
            params: out,
            shard_bytes: prefix,
            unsharded_bytes: unsharded,
        })
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }
}
