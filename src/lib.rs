//! tide: zero-copy FSDP collectives for JAX.
//!
//! Layers, innermost first (docs/design.md):
//! - `layout`, `topology`, `plan`, `cast`: the pure core. Shard arithmetic and collective plans as data; no
//!   CUDA, no XLA, no Python.
//! - `engine::cpu`: runs plans on host memory, ranks as threads; the test oracle and the JAX CPU backend.
//! - `cuda`: runs plans on GPUs with copy engines and short-lived reduction kernels.
//! - `ffi`: the thin XLA FFI edge (C++ in `cxxbridge/`, bridged with cxx).
//! - `info`: the build stamp and the runtime probe behind `tide_jax.info()`.

pub mod call;
pub mod cast;
pub mod config;
pub mod cuda;
pub mod deadlock;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod inflight;
pub mod info;
pub mod layout;
pub mod plan;
pub mod rendezvous;
pub mod topology;
pub mod transport;

pub use error::{Result, TideError};
pub use layout::{DType, GroupLayout, ParamLayout, ParamSpec};
pub use topology::Topology;
