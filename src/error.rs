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

/// Longest error message tide hands to XLA, in bytes: attributes and names come from callers, and a
/// message listing them must not grow with them.
pub const MAX_MESSAGE_BYTES: usize = 2048;

/// `message` cut to at most `MAX_MESSAGE_BYTES` (on a character boundary), saying how long it was.
pub fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let note = format!(" ... ({} bytes, cut)", message.len());
    let mut end = MAX_MESSAGE_BYTES - note.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{note}", &message[..end])
}

/// `[a, b, c]`, or the first `max` items and the count: lists in messages stay short.
pub fn short_list<T: fmt::Display>(items: &[T], max: usize) -> String {
    let shown: Vec<String> = items.iter().take(max).map(|x| x.to_string()).collect();
    if items.len() <= max {
        format!("[{}]", shown.join(", "))
    } else {
        format!("[{}, ... ({} in all)]", shown.join(", "), items.len())
    }
}
