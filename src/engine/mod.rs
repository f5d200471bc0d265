//! Engines execute plans. Every engine runs the same `plan::Plan`; the CPU engine (`cpu`) is the
//! oracle in tests and the backend of JAX's CPU platform, the CUDA engine lives in `crate::cuda`.

pub mod cpu;
pub mod reference;

use crate::error::Result;

/// Raw addresses of one rank's buffers, as the plan names them (`BufKind::Input(i)` is `inputs[i]`,
/// and so on). Addresses are host pointers on CPU, device pointers (unified addressing) on CUDA.
/// The engine borrows them: XLA owns inputs and outputs, the engine's caller owns stages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankBuffers {
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
    pub stages: Vec<usize>,
}

/// A barrier over all ranks of a plan, entered between phases. It fails (never hangs forever)
/// when a peer does not arrive in time or reported an error.
pub trait Barrier: Sync {
    fn wait(&self, rank: usize, phase: usize) -> Result<()>;
}

/// The link between nodes of a multi-process run (`transport::rail`): copies whose source rank is
/// on another node arrive through it. Phase k's sends start at `begin_phase(k)` (their sources are
/// final by then: written in earlier phases, not touched in phase k, which the transport checks)
/// and are complete at `end_phase(k)`; `recv` blocks until the copy's bytes are in place.
pub trait Rail {
    /// Whether copies from `rank` arrive through the rail.
    fn is_remote(&self, rank: usize) -> bool;
    fn begin_phase(&mut self, phase: usize) -> Result<()>;
    /// Receives step `step` (its index in phase `phase`) into `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `bytes` bytes, and not accessed by anything else until
    /// this returns.
    unsafe fn recv(&mut self, phase: usize, step: usize, dst: *mut u8, bytes: usize) -> Result<()>;
    fn end_phase(&mut self, phase: usize) -> Result<()>;
}
