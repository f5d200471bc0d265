//! CUDA engine (in progress).
pub mod schedule;

use crate::call::CallInfo;
use crate::error::{Result, TideError};

pub fn execute(_call: &CallInfo) -> Result<()> {
    Err(TideError::Cuda { call: "tide cuda engine".into(), detail: "not built yet".into() })
}
