//! Plan builders (stub; filled in by the core work).
use super::Plan;
use crate::error::{Result, TideError};
use crate::layout::GroupLayout;
use crate::topology::Topology;

/// Options of the reduce-scatter plan: staging is `stage_slots * slot_bytes` per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RsOptions {
    pub stage_slots: usize,
    pub slot_bytes: usize,
}

pub fn all_gather(_layout: &GroupLayout, _topology: Topology) -> Result<Plan> {
    Err(TideError::Internal("all_gather plan not implemented yet".into()))
}

pub fn reduce_scatter(_layout: &GroupLayout, _topology: Topology, _opts: RsOptions) -> Result<Plan> {
    Err(TideError::Internal("reduce_scatter plan not implemented yet".into()))
}
