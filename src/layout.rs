//! Layout core: how a parameter group is sharded over `world` ranks, FSDP2's dim-0 rule.
//!
//! With world size P, `shard_rows = ceil(rows / P)`; rank r owns rows
//! `[r * shard_rows, min((r + 1) * shard_rows, rows))`, zero-padded to `shard_rows`. A 0-d parameter
//! counts as one row of one element; when rows < P some ranks hold only padding.
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
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Pred | DType::S8 | DType::U8 => 1,
            DType::S16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::S32 | DType::U32 | DType::F32 => 4,
            DType::S64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// From XLA FFI's data type code.
    pub fn from_xla(code: i32) -> Result<DType> {
        Ok(match code {
            1 => DType::Pred,
            2 => DType::S8,
            3 => DType::S16,
            4 => DType::S32,
            5 => DType::S64,
            6 => DType::U8,
            7 => DType::U16,
            8 => DType::U32,
            9 => DType::U64,
            10 => DType::F16,
            11 => DType::F32,
            12 => DType::F64,
            16 => DType::BF16,
            other => return invalid!("unknown dtype code {other} (XLA_FFI_DataType)"),
        })
    }

    /// From the numpy / JAX name ("bfloat16", "float32", ...).
    pub fn from_name(name: &str) -> Result<DType> {
        Ok(match name {
            "bool" => DType::Pred,
            "int8" => DType::S8,
            "int16" => DType::S16,
            "int32" => DType::S32,
            "int64" => DType::S64,
            "uint8" => DType::U8,
            "uint16" => DType::U16,
            "uint32" => DType::U32,
            "uint64" => DType::U64,
            "float16" => DType::F16,
            "float32" => DType::F32,
            "float64" => DType::F64,
            "bfloat16" => DType::BF16,
            other => return invalid!("unknown dtype {other:?}"),
        })
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
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, shape: &[usize], dtype: DType) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
        }
    }
}

/// One parameter's sharding over `world` ranks. All sizes in elements unless the name says bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    pub index: usize,
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// dim 0 of the shape (1 for a 0-d parameter).
    pub rows: usize,
    /// product of the other dims (1 for 0-d and 1-d parameters).
    pub row_elems: usize,
    /// ceil(rows / world): rows of every rank's padded shard.
    pub shard_rows: usize,
    /// shard_rows * row_elems * dtype size.
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
        self.rows * self.row_bytes()
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
    /// "param 3 'layers.0.wq' (shape [7, 5], bfloat16)": how errors name a parameter.
    pub fn describe(&self) -> String {
        if self.name.is_empty() {
            format!(
                "param {} (shape {:?}, {})",
                self.index,
                self.shape,
                self.dtype.name()
            )
        } else {
            format!(
                "param {} '{}' (shape {:?}, {})",
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
            let rows = p.shape.first().copied().unwrap_or(1);
            let mut row_elems = 1usize;
            for &d in p.shape.iter().skip(1) {
                row_elems = checked_mul(row_elems, d, &what)?;
            }
            let shard_rows = rows.div_ceil(world);
            let row_bytes = checked_mul(row_elems, p.dtype.size_bytes(), &what)?;
            let shard_bytes = checked_mul(shard_rows, row_bytes, &what)?;
            let full_bytes = checked_mul(rows, row_bytes, &what)?;
            // The padded global buffer (world * shard_rows rows) must be addressable too.
            checked_mul(shard_bytes, world, &what)?;
            out.push(ParamLayout {
                index,
                name: p.name.clone(),
                shape: p.shape.clone(),
                dtype: p.dtype,
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
