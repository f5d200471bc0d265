//! The one error type of tide. Every message names the thing that failed: the parameter (index and
//! name when known), its shape and dtype, the rank, and the call or API that failed. Errors cross the
//! FFI edge as XLA errors (see `ffi`), never as panics or aborts.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TideError {
    /// A layout or call argument is invalid (empty group, zero-size dim, overflow, mismatched shard...).
    InvalidArgument(String),
    /// A dtype tide does not handle for this operation.
    UnsupportedDtype { dtype: String, op: &'static str },
    /// A plan or topology that cannot be built (e.g. world size does not match nodes x gpus).
    InvalidTopology(String),
    /// Peers did not arrive at a rendezvous in time, or one of them failed.
    Rendezvous(String),
    /// A CUDA driver / NVRTC / NCCL call failed: `call` is the API name, `detail` the library's message.
    Cuda { call: String, detail: String },
    /// Anything else that should not happen; a bug in tide.
    Internal(String),
}

pub type Result<T, E = TideError> = std::result::Result<T, E>;

impl fmt::Display for TideError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TideError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            TideError::UnsupportedDtype { dtype, op } => {
                write!(f, "unsupported dtype {dtype} for {op}")
            }
            TideError::InvalidTopology(m) => write!(f, "invalid topology: {m}"),
            TideError::Rendezvous(m) => write!(f, "rendezvous failed: {m}"),
            TideError::Cuda { call, detail } => write!(f, "{call} failed: {detail}"),
            TideError::Internal(m) => write!(f, "internal error (a tide bug): {m}"),
        }
    }
}

impl std::error::Error for TideError {}

/// Shorthand for `Err(TideError::InvalidArgument(format!(...)))`.
#[macro_export]
macro_rules! invalid {
    ($($arg:tt)*) => { Err($crate::error::TideError::InvalidArgument(format!($($arg)*))) };
}
