//! XLA FFI edge, Rust half. The C++ handlers (`cxxbridge/tide_ffi.cc`) decode XLA's call frame into
//! an `FfiCall` and call one function per op and platform here; this module turns it into a
//! `call::CallInfo`, validates it, dispatches to an engine (CPU: `cpu`, CUDA: `crate::cuda`) and
//! returns an `FfiStatus` that the C++ turns into an XLA error (docs/design.md "FFI contract").
//!
//! Contract with the C++ side:
//! - Buffers are borrowed views owned by XLA, passed as addresses; nothing here frees them.
//! - Nothing unwinds across the bridge: every entry point runs under `catch_unwind`, and a panic
//!   becomes an internal error naming the call.
//! - Errors name the call (op, site), the device/rank and the parameter (see `call::CallInfo::layout`).
//!
//! The symbols jax registers (`tide_ffi_all_gather_cpu`, ...) are defined here and forward to the
//! C++ handlers: a Rust cdylib exports only Rust-defined symbols, so the C++ ones (`tide_cxx_*`)
//! stay internal to the library.

pub mod cpu;
pub mod worker;

use crate::call::{op_code, op_from_code, BufferView, CallInfo, Phase};
use crate::error::{Result, TideError};
use crate::layout::DType;
use crate::plan::Op;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

#[cxx::bridge(namespace = "tide::ffi")]
mod bridge {
    /// One XLA buffer: address, `XLA_FFI_DataType` code, dims.
    #[derive(Clone)]
    struct FfiBuffer {
        data: usize,
        dtype: i32,
        dims: Vec<i64>,
    }

    /// A decoded call frame. Attribute fields mirror docs/design.md "FFI contract".
    #[derive(Clone)]
    struct FfiCall {
        site: i64,
        world: i64,
        nodes: i64,
        gpus_per_node: i64,
        /// XLA's device ordinal of the executing device (FFI context `DeviceOrdinal`).
        device_ordinal: i64,
        device_ordinals: Vec<i64>,
        device_ranks: Vec<i64>,
        device_groups: Vec<i64>,
        /// Parameter names joined by '\n', as bytes (decoded lossily: only used in messages).
        names: Vec<u8>,
        inputs: Vec<FfiBuffer>,
        outputs: Vec<FfiBuffer>,
        /// XLA's stream (CUstream) on CUDA, 0 on CPU.
        stream: usize,
        /// XLA's RunId of this execution (FFI context `RunId`): the same on every device of one
        /// launch; keys the rendezvous (`rendezvous::run_seq`).
        run_id: i64,
        /// Multi-process job id (attribute `job`); 0: every rank of the call is in this process.
        job: i64,
        /// Attribute `urgent`: 1 when the caller waits on this call's done next (`CallInfo::urgent`).
        urgent: i64,
    }

    /// How a call ended; the C++ maps it onto `xla::ffi::ErrorCode`.
    #[derive(Debug)]
    #[repr(i32)]
    enum StatusCode {
        Ok = 0,
        InvalidArgument = 1,
        Internal = 2,
    }

    #[derive(Debug)]
    struct FfiStatus {
        code: StatusCode,
        message: String,
    }

    extern "Rust" {
        /// Instantiate stage: the instance number of a new HLO instruction of target (op, phase)
        /// with attribute `site` (docs/design.md "Call sites and instances").
        fn tide_instantiate(op: u8, phase: u8, site: i64) -> u64;
        /// Asynchronous CPU entry (every target): runs the call on a tide worker thread (or
        /// attaches it to its start, for done), then completes `promise` (an
        /// `xla::ffi::Promise*`) through `tide_complete_cpu`, exactly once.
        fn tide_call_cpu(op: u8, phase: u8, instance: u64, call: FfiCall, promise: usize);
        /// CUDA entry (every target): enqueues the call on the streams and returns.
        fn tide_call_cuda(op: u8, phase: u8, instance: u64, call: &FfiCall) -> FfiStatus;
    }

    unsafe extern "C++" {
        include!("tide/cxxbridge/tide_ffi.h");
        fn tide_complete_cpu(promise: usize, code: i32, message: &str);
    }
}

pub use bridge::{FfiBuffer, FfiCall, FfiStatus, StatusCode};

/// Exports `tide_ffi_<target>_{instantiate,cpu,cuda}`, forwarding to the C++ handlers
/// `tide_cxx_<target>_*` (cxxbridge/tide_ffi.cc `TIDE_TARGET`): one line per target.
macro_rules! forward_target {
    ($($name:ident),* $(,)?) => {
        $(
            #[allow(non_snake_case)]
            pub mod $name {
                use std::ffi::c_void;
                extern "C" {
                    #[link_name = concat!("tide_cxx_", stringify!($name), "_instantiate")]
                    fn cxx_instantiate(call_frame: *mut c_void) -> *mut c_void;
                    #[link_name = concat!("tide_cxx_", stringify!($name), "_cpu")]
                    fn cxx_cpu(call_frame: *mut c_void) -> *mut c_void;
                    #[link_name = concat!("tide_cxx_", stringify!($name), "_cuda")]
                    fn cxx_cuda(call_frame: *mut c_void) -> *mut c_void;
                }
                /// XLA FFI handler, instantiate stage.
                ///
                /// # Safety
                /// Called by XLA with a valid call frame.
                #[export_name = concat!("tide_ffi_", stringify!($name), "_instantiate")]
                pub unsafe extern "C" fn instantiate(call_frame: *mut c_void) -> *mut c_void {
                    // SAFETY: forwarded unchanged to the C++ handler, which catches every C++ exception.
                    unsafe { cxx_instantiate(call_frame) }
                }
                /// XLA FFI handler, platform cpu.
                ///
                /// # Safety
                /// Called by XLA with a valid call frame.
                #[export_name = concat!("tide_ffi_", stringify!($name), "_cpu")]
                pub unsafe extern "C" fn cpu(call_frame: *mut c_void) -> *mut c_void {
                    // SAFETY: as above.
                    unsafe { cxx_cpu(call_frame) }
                }
                /// XLA FFI handler, platform CUDA.
                ///
                /// # Safety
                /// Called by XLA with a valid call frame.
                #[export_name = concat!("tide_ffi_", stringify!($name), "_cuda")]
                pub unsafe extern "C" fn cuda(call_frame: *mut c_void) -> *mut c_void {
                    // SAFETY: as above.
                    unsafe { cxx_cuda(call_frame) }
                }
            }
        )*
    };
}

/// The targets (python/tide_jax/_lib.py `TARGETS` registers the same list).
pub mod targets {
    forward_target!(
        all_gather,
        reduce_scatter,
        all_gather_start,
        all_gather_done,
        reduce_scatter_start,
        reduce_scatter_done,
        reduce_scatter_into_start,
        reduce_scatter_into_done,
        all_gather_cast_start,
        all_gather_cast_done,
    );
}

/// The bridge's op code: 0 all-gather, 1 reduce-scatter, 2 reduce-scatter into slices of larger
/// buffers (`tide_reduce_scatter_into_*`: a reduce-scatter whose `CallInfo` carries `at`), 3 the
/// casting all-gather (`tide_all_gather_cast_*`: fp32 in, bf16 out; `CallInfo::cast`, `crate::cast`).
/// Must match `Op` in cxxbridge/tide_ffi.cc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Plain,
    Into,
    Cast,
}

fn bridge_op(code: u8) -> Result<(Op, Variant)> {
    match code {
        2 => Ok((Op::ReduceScatter, Variant::Into)),
        3 => Ok((Op::AllGather, Variant::Cast)),
        c => Ok((op_from_code(c)?, Variant::Plain)),
    }
}

extern "C" {
    fn tide_cxx_instance_type_id() -> *mut c_void;
    fn tide_cxx_instance_type_info() -> *mut c_void;
}

/// Address of the instance state's `XLA_FFI_TypeId` (registered by tide_jax before the targets).
#[no_mangle]
pub extern "C" fn tide_ffi_instance_type_id() -> *mut c_void {
    // SAFETY: returns the address of a static; no arguments.
    unsafe { tide_cxx_instance_type_id() }
}

/// Address of the instance state's `XLA_FFI_TypeInfo` (its deleter).
#[no_mangle]
pub extern "C" fn tide_ffi_instance_type_info() -> *mut c_void {
    // SAFETY: as above.
    unsafe { tide_cxx_instance_type_info() }
}

/// Instance counters by (op, phase, site): the instantiate stage numbers each HLO instruction of a
/// site (docs/design.md "Call sites and instances").
type InstanceKey = (u8, u8, i64);
static INSTANCES: Lazy<Mutex<HashMap<InstanceKey, u64>>> = Lazy::new(|| Mutex::new(HashMap::new()));

fn tide_instantiate(op: u8, phase: u8, site: i64) -> u64 {
    let mut map = INSTANCES.lock().unwrap_or_else(|p| p.into_inner());
    let n = map.entry((op, phase, site)).or_insert(0);
    let instance = *n;
    *n += 1;
    instance
}

/// Bits of the site key that hold the instance: a site may have up to 2^16 instructions.
pub const INSTANCE_BITS: u32 = 16;

/// The key of one instruction of a call site: what the rendezvous, plan caches and lanes are keyed
/// by. `site` (the attribute tide_jax assigns per traced call) must be in [0, 2^47).
pub fn site_key(op: Op, site: i64, instance: u64) -> Result<i64> {
    if !(0..(1i64 << (63 - INSTANCE_BITS))).contains(&site) {
        return crate::invalid!(
            "{} site {site}: attribute 'site' must be in [0, 2^{})",
            op_name(op),
            63 - INSTANCE_BITS
        );
    }
    if instance >= 1 << INSTANCE_BITS {
        return crate::invalid!(
            "{} site {site}: more than 2^{INSTANCE_BITS} instructions carry this site in the \
             compiled programs of this process",
            op_name(op)
        );
    }
    Ok((site << INSTANCE_BITS) | instance as i64)
}

fn internal_panic(what: impl std::fmt::Display, payload: &(dyn std::any::Any + Send)) -> TideError {
    TideError::Internal(format!("{what}: panic: {}", panic_message(payload)))
}

fn with_site_key(op: Op, instance: u64, mut call: FfiCall) -> Result<FfiCall> {
    call.site = site_key(op, call.site, instance)?;
    Ok(call)
}

/// Every CPU call (docs/design.md "CPU handlers are asynchronous", "Start/done"). On XLA's
/// thread: decode, and for in-process calls take the rendezvous sequence number (so it follows
/// the order XLA invoked the handler). Sync and start: the call runs on a tide worker thread, which
/// completes the promise (start also sets its `inflight::Record`). Done: finds its start's record
/// by the buffers and completes the promise with its result. Never unwinds; completes the promise exactly once on every path.
fn tide_call_cpu(op: u8, phase: u8, instance: u64, call: FfiCall, promise: usize) {
    let complete = move |st: FfiStatus| {
        bridge::tide_complete_cpu(promise, st.code.repr, &st.message);
    };
    let (site, device) = (call.site, call.device_ordinal);
    let prepared = catch_unwind(AssertUnwindSafe(|| -> Result<_> {
        let ((op, variant), phase) = (bridge_op(op)?, Phase::from_code(phase)?);
        let call = with_site_key(op, instance, call)?;
        if phase == Phase::Done {
            let info = match variant {
                // SAFETY: a CPU call's index operand is host memory XLA keeps alive for the call.
                Variant::Into => unsafe { cpu::resolve_at(decode_done_into(&call, call.site)?)? },
                Variant::Cast => decode_done_cast(&call, call.site)?,
                Variant::Plain => decode_done(op, &call)?,
            };
            let record = crate::inflight::take(
                &phase_name(op, phase, site),
                op_code(op),
                info.device_ordinal,
                &info.outputs.iter().map(|b| b.ptr).collect::<Vec<_>>(),
                &info.inputs[info.outputs.len()..]
                    .iter()
                    .map(|b| b.ptr)
                    .collect::<Vec<_>>(),
            )?;
            return Ok((info, 0, Some(record), phase, Vec::new()));
        }
        if variant != Variant::Plain && phase != Phase::Start {
            return Err(TideError::Internal(format!("{variant:?} target in phase {phase:?}")));
        }
        // The casting all-gather's bf16 shards, rounded here on XLA's thread (the operand is read
        // now, as on the GPU); they stand as the operands and live until the worker is done.
        let mut shards = Vec::new();
        let info = match (variant, phase) {
            // SAFETY: as above.
            (Variant::Into, _) => unsafe { cpu::resolve_at(decode_start_into(&call, call.site)?)? },
            (Variant::Cast, _) => {
                let info = decode_start_cast(&call, call.site)?;
                // SAFETY: the operands and the index are host memory XLA keeps alive for the call.
                let (info, s) = unsafe { cpu::cast_shards(info)? };
                shards = s;
                info
            }
            (Variant::Plain, Phase::Start) => decode_start(op, &call)?,
            (Variant::Plain, _) => decode(op, &call)?,
        };
        // Registered before the sequence number is taken: nothing after that may fail.
        let record = if phase == Phase::Start {
            let what = format!(
                "{} on device {}",
                phase_name(op, phase, site),
                info.device_ordinal
            );
            let record = crate::inflight::Record::new(
                what,
                info.device_ordinal,
                info.outputs.iter().map(|b| b.ptr).collect(),
                info.held_operands(),
            );
            crate::inflight::register(op_code(op), record.clone())?;
            Some(record)
        } else {
            None
        };
        let seq = if info.job == 0 {
            crate::rendezvous::run_seq(info.site, info.group, info.rank, info.run_id)
        } else {
            cpu::lane_ticket(&info)
        };
        Ok((info, seq, record, phase, shards))
    }))
    .unwrap_or_else(|payload| {
        Err(internal_panic(
            format_args!("tide call site {site} on device {device}"),
            &*payload,
        ))
    });
    let (info, seq, record, phase, shards) = match prepared {
        Ok(p) => p,
        Err(e) => return complete(status(Err(e))),
    };
    if phase == Phase::Done {
        let record = record.expect("done has a record");
        return record.on_finish(move |r| complete(status(r)));
    }
    // A CPU start completes its future only when its collective is finished, like the synchronous
    // call: XLA:CPU may copy or free a start's results as soon as the start completes (a copy at
    // a loop boundary), and a worker still writing them would corrupt memory. The future still
    // frees XLA's thread at once, so independent work overlaps; done then checks the pairing.
    let record_for_job = record.clone();
    worker::submit(move || {
        let _shards = shards; // the casting all-gather's operands, alive until the call is done
        let result = catch_unwind(AssertUnwindSafe(|| {
            if info.job != 0 {
                cpu::execute_multiprocess_ticket(&info, info.job, seq)
            } else {
                cpu::execute_seq(&info, seq)
            }
        }))
        .unwrap_or_else(|payload| {
            Err(internal_panic(
                format_args!(
                    "{} site {} on device {}",
                    op_name(info.op),
                    info.site,
                    info.device_ordinal
                ),
                &*payload,
            ))
        });
        if let Some(record) = record_for_job {
            record.finish(result.clone());
        }
        complete(status(result));
    });
}

/// Every CUDA call: decode, then the CUDA engine enqueues it on the streams (start and done
/// split it: `crate::cuda::execute_phase`).
fn tide_call_cuda(op: u8, phase: u8, instance: u64, call: &FfiCall) -> FfiStatus {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let ((op, variant), phase) = (bridge_op(op)?, Phase::from_code(phase)?);
        let site = site_key(op, call.site, instance)?;
        let info = match (phase, variant) {
            (Phase::Done, Variant::Plain) => decode_done_as(op, call, site)?,
            (Phase::Start, Variant::Plain) => decode_start_as(op, call, site)?,
            (Phase::Sync, Variant::Plain) => decode_as(op, call, site, &call.outputs)?,
            (Phase::Start, Variant::Into) => decode_start_into(call, site)?,
            (Phase::Done, Variant::Into) => decode_done_into(call, site)?,
            (Phase::Start, Variant::Cast) => decode_start_cast(call, site)?,
            (Phase::Done, Variant::Cast) => decode_done_cast(call, site)?,
            (Phase::Sync, v) => return Err(TideError::Internal(format!("{v:?} target has no synchronous form"))),
        };
        // The CUDA engine validates the layout itself, after taking its rendezvous sequence
        // number, so a rank that fails validation still tells its peers.
        crate::cuda::execute_phase(&info, phase)
    }))
    .unwrap_or_else(|payload| {
        Err(internal_panic(
            format_args!(
                "tide call site {} on device {}",
                call.site, call.device_ordinal
            ),
            &*payload,
        ))
    });
    status(result)
}

/// What the CPU handlers run for a synchronous call, callable without XLA (tests): `decode`,
/// `cpu::execute`, `status`.
pub fn run_cpu(op: Op, call: &FfiCall) -> FfiStatus {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let info = decode(op, call)?;
        if info.job != 0 {
            cpu::execute_multiprocess(&info, info.job)
        } else {
            cpu::execute(&info, info.run_id)
        }
    }))
    .unwrap_or_else(|payload| {
        Err(internal_panic(
            format_args!(
                "{} site {} on device {}",
                op_name(op),
                call.site,
                call.device_ordinal
            ),
            &*payload,
        ))
    });
    status(result)
}

pub(crate) fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "tide all_gather",
        Op::ReduceScatter => "tide reduce_scatter",
    }
}

fn phase_name(op: Op, phase: Phase, site: i64) -> String {
    let suffix = match phase {
        Phase::Sync => "",
        Phase::Start => "_start",
        Phase::Done => "_done",
    };
    format!("{}{suffix} site {site}", op_name(op))
}

/// Decodes a start call: N operands; 2N results, the N results proper, then the N operands passed
/// through (result N+i aliased to operand i). Passing them through makes them start's outputs,
/// which done takes: XLA can then neither free them nor hand done a recomputed copy while tide
/// still reads them. The `CallInfo` has the N results proper.
pub fn decode_start(op: Op, call: &FfiCall) -> Result<CallInfo> {
    decode_start_as(op, call, call.site)
}

fn decode_start_as(op: Op, call: &FfiCall, site: i64) -> Result<CallInfo> {
    let n = call.inputs.len();
    if n == 0 || call.outputs.len() != 2 * n {
        return crate::invalid!(
            "{} on device {}: takes N operands and returns 2N results (the N results, then the N \
             operands aliased); got {} operands and {} results",
            phase_name(op, Phase::Start, call.site),
            call.device_ordinal,
            n,
            call.outputs.len()
        );
    }
    for i in 0..n {
        if call.outputs[n + i].data != call.inputs[i].data {
            return crate::invalid!(
                "{} on device {}: result {} is not aliased to operand {i} (input_output_aliases must \
                 map operand i to result N+i)",
                phase_name(op, Phase::Start, call.site),
                call.device_ordinal,
                n + i
            );
        }
    }
    decode_as(op, call, site, &call.outputs[..n])
}

/// Decodes a done call: operands are start's N results then start's N operands (as start passed
/// them through), results the N buffers aliased to the first N operands.
pub fn decode_done(op: Op, call: &FfiCall) -> Result<CallInfo> {
    decode_done_as(op, call, call.site)
}

fn decode_done_as(op: Op, call: &FfiCall, site: i64) -> Result<CallInfo> {
    let n = call.outputs.len();
    if n == 0 || call.inputs.len() != 2 * n {
        return crate::invalid!(
            "{} on device {}: takes start's N results and start's N operands ({} operands) and \
             returns N results; got {} operands and {} results",
            phase_name(op, Phase::Done, call.site),
            call.device_ordinal,
            2 * n,
            call.inputs.len(),
            n
        );
    }
    done_aliased(call, &phase_name(op, Phase::Done, call.site))?;
    decode_as(op, call, site, &call.outputs)
}

/// A done's contract: its N results are its first N operands (result i aliased to operand i), the
/// buffers its start returned; an error naming the call otherwise.
fn done_aliased(call: &FfiCall, what: &str) -> Result<()> {
    match (0..call.outputs.len()).find(|&i| call.inputs[i].data != call.outputs[i].data) {
        None => Ok(()),
        Some(i) => crate::invalid!(
            "{what} on device {}: result {i} is not aliased to operand {i} (input_output_aliases \
             must map operand i to result i for the first N operands)",
            call.device_ordinal
        ),
    }
}

const INTO_START: &str = "tide reduce_scatter_into_start";
const INTO_DONE: &str = "tide reduce_scatter_into_done";

/// Checks the index operand of a reduce-scatter into slices: an int32 scalar.
fn index_operand(b: &FfiBuffer, what: &str, device: i64, position: usize) -> Result<usize> {
    if b.dtype != 4 || !b.dims.is_empty() || b.data == 0 {
        return crate::invalid!(
            "{what} on device {device}: operand {position} (the slice index) must be an int32 scalar; got \
             dtype code {} with dims {:?}",
            b.dtype,
            b.dims
        );
    }
    Ok(b.data)
}

/// The slices of the N buffers of a reduce-scatter into slices: every buffer's leading dim, equal.
fn slice_count(bufs: &[FfiBuffer], what: &str, device: i64) -> Result<usize> {
    let first = bufs[0].dims.first().copied().unwrap_or(0);
    for (i, b) in bufs.iter().enumerate() {
        let lead = b.dims.first().copied().unwrap_or(0);
        if b.dims.is_empty() || lead < 1 || lead != first {
            return crate::invalid!(
                "{what} on device {device}: buffer {i} has shape {:?}; every buffer needs the same \
                 leading slice dim >= 1 (the first has {first})",
                b.dims
            );
        }
    }
    Ok(first as usize)
}

/// Decodes `tide_reduce_scatter_into_start` (docs/design.md "FFI contract"): operands the N
/// gradients, the N fp32 buffers `(L, *shard)` and the int32 slice index; results the N buffers
/// (result i aliased to operand N + i), then the N gradients (N + i aliased to i) and the index
/// (2N aliased to 2N), passed through so XLA keeps what tide reads alive until done. The
/// `CallInfo` has the gradients as inputs, the whole buffers as outputs and `at` set.
pub fn decode_start_into(call: &FfiCall, site: i64) -> Result<CallInfo> {
    let (ops, res) = (call.inputs.len(), call.outputs.len());
    let device = call.device_ordinal;
    if ops < 3 || ops % 2 == 0 || res != ops {
        return crate::invalid!(
            "{INTO_START} site {} on device {device}: takes N gradients, N buffers and an index \
             (2N + 1 operands) and returns 2N + 1 results; got {ops} operands and {res} results",
            call.site
        );
    }
    let n = (ops - 1) / 2;
    let aliased = (0..n).all(|i| call.outputs[i].data == call.inputs[n + i].data && call.outputs[n + i].data == call.inputs[i].data)
        && call.outputs[2 * n].data == call.inputs[2 * n].data;
    if !aliased {
        return crate::invalid!(
            "{INTO_START} site {} on device {device}: input_output_aliases must map operand N + i to \
             result i, operand i to result N + i and operand 2N to result 2N",
            call.site
        );
    }
    let index_ptr = index_operand(&call.inputs[2 * n], INTO_START, device, 2 * n)?;
    let count = slice_count(&call.outputs[..n], INTO_START, device)?;
    let mut info = decode_io(Op::ReduceScatter, call, site, &call.inputs[..n], &call.outputs[..n])?;
    info.at = Some(crate::call::OutputAt { index_ptr, count });
    Ok(info)
}

/// Decodes `tide_reduce_scatter_into_done`: operands start's 2N + 1 results (the N buffers, the N
/// gradients, the index), results the N buffers (result i aliased to operand i). The `CallInfo`
/// has the shape of a plain done (inputs: the N buffers then the N gradients) with `at` set.
pub fn decode_done_into(call: &FfiCall, site: i64) -> Result<CallInfo> {
    let n = call.outputs.len();
    let device = call.device_ordinal;
    if n == 0 || call.inputs.len() != 2 * n + 1 {
        return crate::invalid!(
            "{INTO_DONE} site {} on device {device}: takes start's 2N + 1 results and returns the N \
             buffers; got {} operands and {n} results",
            call.site,
            call.inputs.len()
        );
    }
    done_aliased(call, &format!("{INTO_DONE} site {}", call.site))?;
    let index_ptr = index_operand(&call.inputs[2 * n], INTO_DONE, device, 2 * n)?;
    let count = slice_count(&call.outputs, INTO_DONE, device)?;
    let mut info = decode_io(Op::ReduceScatter, call, site, &call.inputs[..2 * n], &call.outputs)?;
    info.at = Some(crate::call::OutputAt { index_ptr, count });
    Ok(info)
}

const CAST_START: &str = "tide all_gather_cast_start";
const CAST_DONE: &str = "tide all_gather_cast_done";

/// Decodes `tide_all_gather_cast_start` (docs/design.md "FFI contract", `crate::cast`): operands
/// the N fp32 stacked shards `(L, *shard_i)` and the int32 slice index; results the N bf16 full
/// parameters, aliased to nothing (start reads the operands before it returns, in stream order: it
/// holds none of them). The `CallInfo` has `cast` set and bf16 views of this rank's rows of the
/// results as inputs (`cast::views`).
pub fn decode_start_cast(call: &FfiCall, site: i64) -> Result<CallInfo> {
    let (ops, res) = (call.inputs.len(), call.outputs.len());
    let device = call.device_ordinal;
    if res == 0 || ops != res + 1 {
        return crate::invalid!(
            "{CAST_START} site {} on device {device}: takes N fp32 shards and an index (N + 1 \
             operands) and returns N results; got {ops} operands and {res} results",
            call.site
        );
    }
    let n = res;
    let index_ptr = index_operand(&call.inputs[n], CAST_START, device, n)?;
    let info = decode_io(Op::AllGather, call, site, &call.inputs[..n], &call.outputs)?;
    crate::cast::views(info, index_ptr)
}

/// Decodes `tide_all_gather_cast_done`: operands start's N results, results the same N buffers
/// (result i aliased to operand i). The `CallInfo` has the N results as inputs and outputs and
/// `cast` set with no sources: done only finds its start (which held no operands).
pub fn decode_done_cast(call: &FfiCall, site: i64) -> Result<CallInfo> {
    let n = call.outputs.len();
    let device = call.device_ordinal;
    if n == 0 || call.inputs.len() != n {
        return crate::invalid!(
            "{CAST_DONE} site {} on device {device}: takes start's N results and returns them; got \
             {} operands and {n} results",
            call.site,
            call.inputs.len()
        );
    }
    done_aliased(call, &format!("{CAST_DONE} site {}", call.site))?;
    let mut info = decode_io(Op::AllGather, call, site, &call.inputs, &call.outputs)?;
    info.cast = Some(crate::call::CastFrom { srcs: Vec::new(), index_ptr: 0, count: 0 });
    Ok(info)
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// The status the C++ turns into an XLA error: bad input is `kInvalidArgument`, the rest `kInternal`.
pub fn status(result: Result<()>) -> FfiStatus {
    match result {
        Ok(()) => FfiStatus {
            code: StatusCode::Ok,
            message: String::new(),
        },
        Err(e) => {
            let code = match e {
                TideError::InvalidArgument(_)
                | TideError::UnsupportedDtype { .. }
                | TideError::InvalidTopology(_) => StatusCode::InvalidArgument,
                _ => StatusCode::Internal,
            };
            FfiStatus {
                code,
                message: crate::error::bounded(e.to_string()),
            }
        }
    }
}

fn nonneg(value: i64, what: impl Fn() -> String) -> Result<usize> {
    usize::try_from(value).map_err(|_| {
        TideError::InvalidArgument(format!("{}: must be non-negative, got {value}", what()))
    })
}

fn buffers(list: &[FfiBuffer], role: &str, call_name: &str) -> Result<Vec<BufferView>> {
    list.iter()
        .enumerate()
        .map(|(i, b)| {
            let dtype = DType::from_xla(b.dtype)
                .map_err(|e| TideError::InvalidArgument(format!("{call_name}: {role} {i}: {e}")))?;
            let dims = b
                .dims
                .iter()
                .map(|&d| nonneg(d, || format!("{call_name}: {role} {i} dims {:?}", b.dims)))
                .collect::<Result<Vec<_>>>()?;
            Ok(BufferView {
                ptr: b.data,
                dtype,
                dims,
            })
        })
        .collect()
}

/// Builds the `CallInfo` of a decoded frame: checks the attributes (`call::check_attributes`) and
/// maps the device ordinal to this device's rank and group. Buffer shapes are checked later, by
/// `CallInfo::layout`.
pub fn decode(op: Op, call: &FfiCall) -> Result<CallInfo> {
    decode_as(op, call, call.site, &call.outputs)
}

/// `decode` with the site key and the results to use (a start's first N), without copying the call.
fn decode_as(op: Op, call: &FfiCall, site: i64, outputs: &[FfiBuffer]) -> Result<CallInfo> {
    decode_io(op, call, site, &call.inputs, outputs)
}

/// `decode_as` with the operands to use too.
fn decode_io(op: Op, call: &FfiCall, site: i64, inputs: &[FfiBuffer], outputs: &[FfiBuffer]) -> Result<CallInfo> {
    let attrs = crate::call::check_attributes(
        op,
        &crate::call::Attributes {
            site,
            world: call.world,
            nodes: call.nodes,
            gpus_per_node: call.gpus_per_node,
            device_ordinal: call.device_ordinal,
            device_ordinals: &call.device_ordinals,
            device_ranks: &call.device_ranks,
            device_groups: &call.device_groups,
            job: call.job,
            operands: inputs.len(),
            results: outputs.len(),
        },
    )?;
    let name = format!("{} site {}", op_name(op), site);
    let device = call.device_ordinal;
    let (world, topology, rank, group) = (attrs.world, attrs.topology, attrs.rank, attrs.group);
    let names = if call.names.is_empty() {
        Vec::new()
    } else {
        String::from_utf8_lossy(&call.names)
            .split('\n')
            .map(str::to_string)
            .collect()
    };
    let mut rank_devices = Vec::new();
    if attrs.job == 0 {
        // Checked by check_attributes: every rank of every group appears once.
        rank_devices = vec![0; world];
        for ((&ordinal, &r), &g) in call.device_ordinals.iter().zip(&call.device_ranks).zip(&call.device_groups) {
            if g as usize == group {
                rank_devices[r as usize] = ordinal;
            }
        }
    }
    let rank_devices = rank_devices.into();
    Ok(CallInfo {
        op,
        site,
        run_id: call.run_id,
        rank_devices,
        job: attrs.job,
        device_ordinal: device,
        rank,
        group,
        world,
        topology,
        names,
        inputs: buffers(inputs, "operand", &name)?,
        outputs: buffers(outputs, "result", &name)?,
        stream: call.stream,
        at: None,
        cast: None,
        urgent: call.urgent != 0,
    })
}
