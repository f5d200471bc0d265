//! CUDA engine: runs plans on the GPUs of this process with copy engines and short-lived fp32
//! reduction kernels. One process drives all local GPUs; XLA runs each device's program on its own
//! host thread and the FFI edge calls `execute_phase` there with the neutral call description
//! (`crate::call::CallInfo`: its stream `call.stream`, device ordinal, job) and its `call::Phase`.
//! This file holds the contracts (the rules below, cited from the code); the code lives in the
//! modules, each owning one thing, and a call goes down through them (docs/design.md, "The CUDA
//! engine"):
//!
//! | layer | module | owns |
//! | --- | --- | --- |
//! | the call | `start_done` | the funnel of every call: sync / start / done, the in-flight records (A1, A4) |
//! | the paths | `inprocess`, `multiproc` (+ `mailbox`, `rail`) | how ranks meet: a `rendezvous::Session` in-process; shared-memory mailboxes, IPC and the NCCL rail across processes |
//! | emulation | `emulate` | one rank of a world-P call alone on its GPU, peers as local buffers (benchmarks, tests) |
//! | the meeting | `meeting` | the `Meeting` seam, what ranks publish (`RankInfo`), the end of a call, the panic guard |
//! | preparing | `prepare` | XLA's stream checked, the plan and schedule (cached), the published lists, the multicast gate |
//! | issuing | `issue` | the one phase loop and end of call over a `Meeting` (rules 3-5, A2-A3), each command, batching |
//! | device resources | `device` | contexts, streams, events, staging, in-flight slots (`SlotLease`), kernels loaded |
//! | pure parts | `schedule`, `kernels`, `fuse`, `copy2d` | steps -> streams/events (with the protocol model), launch shapes, batching rules, how 2-D copies go to the driver (TIDE_COPY2D) |
//! | drivers | `driver`, `nvrtc`, `nccl`, `ipc`, `multicast` | checked calls of the CUDA driver (the only `sys::cu*` calls), NVRTC, NCCL, the IPC/VMM export and import, the gated multicast |
//!
//! # One driver
//! Every call, in-process or multi-process, synchronous or split, enters at `execute_phase`
//! (`start_done`: start/done, per-call in-flight slots: rules A1-A4 below) and is issued by one
//! phase loop and end of call, `issue::run_phases` (rules 3-5 / A2-A3) under `meeting::end_call`
//! (unwind guard, failure published to the peers, leave), over a `meeting::Meeting` built after
//! the exchange: `meeting::InProcess` (`rendezvous::Session`) or `multiproc::mailbox::Mailbox`
//! (`transport::ProcessGroup`, mailboxes, `signal`s, and the NCCL rail as hooks at phase
//! start, per cross-node copy, at phase and `done` records). What the two paths hand `run_phases`
//! differs only as data (`issue::Issue`): MAIN and its side streams, local, phase and `done` events
//! (the slot's in-process; the device's, with XLA's stream or a slot's tide stream as MAIN,
//! multi-process), whether small work is fused (TIDE_FUSE_BYTES: in-process only) and the
//! multicast grant (in-process only). TIDE_COPY_BATCH applies to both.
//!
//! # Start/done: the in-process driver (`start_done`, `inprocess`; rules A1-A4, modelled and each
//! shown necessary in `schedule`'s tests `start_done_*`)
//! Every in-process call, synchronous or split, runs on an *in-flight slot* of its device and op
//! (`device::Slot`): tide's own stream T (the schedule's MAIN: reductions with at most
//! TIDE_RS_MAX_CTAS CTAs, zeroing, SM copies, joins), side copy streams, its own events (`entry`,
//! `ready`, `done`, `released`, phase and local events) and, for the reduce-scatter, its own stage
//! slots. A slot belongs to one call from its start until its done (`device::SlotLease`), so two
//! calls in flight never share events or staging. At most TIDE_MAX_IN_FLIGHT (default 4) calls per
//! op and device: a start beyond that fails with an error naming the setting (it cannot wait: the
//! done that would free a slot runs later on the same thread). Memory per device: the all-gather
//! none beyond XLA's buffers; the reduce-scatter TIDE_MAX_IN_FLIGHT x TIDE_RS_STAGE_SLOTS x
//! TIDE_RS_SLOT_BYTES (default at most 4 x 3 x 16 MiB = 192 MiB; a slot's staging is allocated when
//! the slot is first used, so a program with at most 2 reduce-scatters in flight uses 96 MiB), kept.
//! - A1 (start): XLA's stream X records `entry`; T waits on it and records `ready`. So `ready`
//!   follows everything XLA enqueued before the start (the inputs' producers, the last readers of
//!   the output buffers) and everything the slot's previous call enqueued on T, even a call whose
//!   done never ran. X is not made to wait.
//! - A2: rendezvous publishing buffers and T's events; the schedule is issued with MAIN = T: every
//!   stream waits on the `ready` of each rank whose buffers it touches before its first command
//!   (side streams on their own rank's too). The schedule's previous-done wait is skipped: A1
//!   implies it. Phases as in rule 4 below, on T.
//! - A3: T (which joined the side streams) records `done`; exit barrier; T waits on every peer's
//!   `done` (they finished reading this rank's inputs) and records `released`; then every rank
//!   `leave`s the session, which returns only once all ranks did: no event of the call is recorded
//!   again (by a later call on its slot) before every wait on it has been issued.
//! - A4 (done, later on X): X waits on `released`, then the slot is freed. Done finds its start
//!   through `crate::inflight` by the buffer addresses and fails, naming the site, if they differ
//!   (never stale data). Done's operands are start's results (aliased) and start's operands again,
//!   so XLA keeps both alive until then.
//!
//! Synchronous targets are A1-A4 back to back. Edge cases: done without start fails (no record);
//! two starts of one site in flight are two records (distinct result buffers), each with its own
//! slot; a start without done keeps its slot until the next start writing the same result buffer
//! replaces its record (the dropped call still runs to completion on T; XLA's stream never waits
//! for it, so a program must not reuse its buffers before then: tide_jax always pairs them); a
//! start that fails leaves no record and makes X wait on whatever it enqueued.
//!
//! # Buffer ownership and stream rules (the multi-process path, `multiproc`)
//! Buffers: `Input(i)` / `Output(i)` of every rank are XLA's, borrowed for one call; stage slots and
//! side streams are tide's, one set per device, reused by every call. Per rank and call:
//! 1. XLA's stream (MAIN) first waits on this rank's `done` event of its previous call, then records
//!    this rank's `ready` event: everything XLA enqueued before the call (writes of the inputs, last
//!    uses of the output buffers) and all of this rank's previous tide work precede `ready`.
//! 2. The rank joins the rendezvous `(site, group, seq)` publishing its buffer addresses and sizes,
//!    its stage slots and its `ready`, `done` and phase event handles (events are created once per
//!    device with CU_EVENT_DISABLE_TIMING and reused). A rank that failed before this point joins
//!    anyway with its error, so its peers fail at once rather than at the timeout.
//! 3. Each stream, before its first command in phase 0, waits on the `ready` event of every rank
//!    whose buffers it touches (side streams: their own rank's too, which follows the rank's
//!    previous `done` by rule 1; a side stream touching only peers would wait on `done` itself).
//!    So no peer buffer is read before its producer wrote it, and no output is written while XLA
//!    might still use it. Copies go on side streams (copy engines: one cuMemcpyBatchAsync per run of
//!    a stream's copies, in pieces, on unified addresses with peer access enabled), balanced by
//!    bytes; Reduce (the `rs_sum_*` kernels, at most TIDE_RS_MAX_CTAS CTAs per launch, one launch
//!    per sum piece: docs/design.md "Stealing nothing from compute"), Zero (cuMemsetD8Async) and SM
//!    local copies go on MAIN. Inside the rank,
//!    steps that touch overlapping bytes (one writing) are ordered by local events: a copy into a
//!    stage slot waits for the last Reduce that read the slot, a Reduce for the copies into its slots
//!    (once per copy stream, on the latest of them there: `schedule` module header).
//! 4. Between phases: MAIN joins the side streams, records the phase event, host barrier, then each
//!    stream waits on every rank's phase event before its first command of the next phase.
//! 5. End: MAIN waits on every side stream used (so XLA's later work sees the outputs), records
//!    `done` (all of this rank's reads of peer memory are before it), then the exit barrier, then
//!    MAIN waits on every peer's `done`: peers read my inputs, and XLA must not reuse them before.
//!
//! No host synchronization with the device anywhere: only event records and stream waits.
//!
//! Why reusing events across calls is race-free: cuStreamWaitEvent captures the event's most recent
//! record at the time of the call (a wait on a later re-record is never implied). Every wait on a
//! peer's `ready`/phase event is issued after the rendezvous/barrier that follows its record, and
//! before the waiter reaches the exit barrier, which the owner must pass before it can record the
//! event again in its next call. Every wait on a peer's `done` is issued after the exit barrier
//! (so after the record) and before the waiter returns, hence before it joins the next call's
//! rendezvous, which the owner must pass before recording `done` again. Local events are recorded
//! and waited on by the one host thread that owns the device, in order, within one call.
//! Stage slots and side streams are reused safely because of the wait on the previous `done`.
//!
//! Memory (device, per GPU, allocated once and kept): the all-gather needs none beyond XLA's
//! buffers (every piece lands at its final address; the cast, if any, is XLA's, on the local shard).
//! The reduce-scatter stages peers' slices in `TIDE_RS_STAGE_SLOTS x TIDE_RS_SLOT_BYTES` bytes
//! (default 3 x 16 MiB = 48 MiB), independent of the group size and of the number of GPUs; chunks of
//! at most `slot_bytes / (P - 1)` per peer cycle through the slots. Plus events and streams.
//!
//! Concurrency: the in-process driver holds a device's state lock only while it takes a slot,
//! prepares the plan and the slot's resources and records rule A1's events; the rendezvous and the
//! issuing run on copies of the slot's handles without it, so several ranks may share one device
//! (tests on one GPU). The multi-process path holds it for its whole call. XLA issues a device's
//! calls from that device's thread one at a time; if two tide calls of one device were ever issued
//! concurrently in different orders on two devices, they would fail with a rendezvous timeout, not
//! hang. On errors the rank calls `Session::fail` so peers fail fast; work already enqueued is
//! still ordered before XLA's later work (A3's error path, `released`).
//!
//! Multi-process jobs (`call.job != 0`) prepare and exchange in `multiproc` (a shared-memory
//! mailbox, peers mapped by VMM/IPC, the rail over NCCL: docs/multiprocess.md) and are issued by
//! `issue::run_phases`; their start runs the call with a slot's tide stream as MAIN but the
//! device's side streams, events and staging (`multiproc::start`: rules 1-5, calls serialized by
//! the previous `done`), because their staging and events are exported to other processes once per
//! device and rank, not per slot. In one process,
//! multi-node (hierarchical) plans are refused with a clear error; CUDA graph capture
//! of the call is refused (the handler must not be declared command-buffer compatible).

pub mod device;
mod cast;
pub mod copy2d;
pub mod driver;
pub mod emulate;
pub mod fuse;
mod inprocess;
pub mod ipc;
mod issue;
pub mod kernels;
pub mod meeting;
pub mod multicast;
pub mod multiproc;
pub mod nccl;
pub mod nvrtc;
pub mod prepare;
pub mod schedule;
pub mod signal;
mod start_done;

pub use meeting::RankInfo;
pub use emulate::{execute_emulated, EmulatedPeer};
pub use start_done::{execute, execute_phase};
