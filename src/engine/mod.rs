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
