//! Transports: how ranks that live in different processes reach each other's memory and meet at
//! barriers (docs/multiprocess.md). In one process, ranks are threads that meet in
//! `rendezvous::Session` and read XLA's buffers directly; across processes they need shared
//! memory and a control plane that survives (and reports) a dead peer.
//!
//! - `shm`: named POSIX shared-memory segments (the raw edge; `libc`).
//! - `group`: the control plane of one group of ranks on one host: join, barrier, failure
//!   propagation, dead-peer detection. Engine-independent: the CUDA path reuses it to exchange IPC
//!   handles and to order host-side steps.
//! - `cpu`: the CPU engine across processes (`run_cpu_multiprocess`): inputs and stage slots in
//!   shared memory among the ranks of a node, outputs in XLA's buffers.
//! - `rail`: copies between nodes over TCP for the CPU transport (no shared memory across hosts).

pub mod cpu;
pub mod group;
pub mod rail;
pub mod shm;

pub use cpu::{fail_cpu_multiprocess, run_cpu_multiprocess, run_cpu_multiprocess_with, ShmOptions};
pub use group::{ProcessGroup, Timing};
