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

use crate::call::{BufferView, CallInfo};
use crate::error::{Result, TideError};
use crate::layout::DType;
use crate::plan::Op;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

#[cxx::bridge(namespace = "tide::ffi")]
mod bridge {
    /// One XLA buffer: address, `XLA_FFI_DataType` code, dims.
    struct FfiBuffer {
        data: usize,
        dtype: i32,
        dims: Vec<i64>,
    }

    /// A decoded call frame. Attribute fields mirror docs/design.md "FFI contract".
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
        fn tide_all_gather_cpu(call: &FfiCall) -> FfiStatus;
        fn tide_reduce_scatter_cpu(call: &FfiCall) -> FfiStatus;
        /// Asynchronous CPU entry: runs the call on a tide worker thread, then completes
        /// `promise` (an `xla::ffi::Promise*`) through `tide_complete_cpu`, exactly once.
        fn tide_all_gather_cpu_start(call: FfiCall, promise: usize);
        fn tide_reduce_scatter_cpu_start(call: FfiCall, promise: usize);
        fn tide_all_gather_cuda(call: &FfiCall) -> FfiStatus;
        fn tide_reduce_scatter_cuda(call: &FfiCall) -> FfiStatus;
    }

    unsafe extern "C++" {
        include!("tide/cxxbridge/tide_ffi.h");
        fn tide_complete_cpu(promise: usize, code: i32, message: &str);
    }
}

pub use bridge::{FfiBuffer, FfiCall, FfiStatus, StatusCode};

extern "C" {
    fn tide_cxx_all_gather_cpu(call_frame: *mut c_void) -> *mut c_void;
    fn tide_cxx_reduce_scatter_cpu(call_frame: *mut c_void) -> *mut c_void;
    fn tide_cxx_all_gather_cuda(call_frame: *mut c_void) -> *mut c_void;
    fn tide_cxx_reduce_scatter_cuda(call_frame: *mut c_void) -> *mut c_void;
}

/// XLA FFI handler (`XLA_FFI_Error* (XLA_FFI_CallFrame*)`): target `tide_all_gather`, platform cpu.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn tide_ffi_all_gather_cpu(call_frame: *mut c_void) -> *mut c_void {
    // SAFETY: forwarded unchanged to the C++ handler, which catches every C++ exception.
    unsafe { tide_cxx_all_gather_cpu(call_frame) }
}

/// XLA FFI handler: target `tide_reduce_scatter`, platform cpu.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn tide_ffi_reduce_scatter_cpu(call_frame: *mut c_void) -> *mut c_void {
    // SAFETY: as above.
    unsafe { tide_cxx_reduce_scatter_cpu(call_frame) }
}

/// XLA FFI handler: target `tide_all_gather`, platform CUDA.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn tide_ffi_all_gather_cuda(call_frame: *mut c_void) -> *mut c_void {
    // SAFETY: as above.
    unsafe { tide_cxx_all_gather_cuda(call_frame) }
}

/// XLA FFI handler: target `tide_reduce_scatter`, platform CUDA.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn tide_ffi_reduce_scatter_cuda(call_frame: *mut c_void) -> *mut c_void {
    // SAFETY: as above.
    unsafe { tide_cxx_reduce_scatter_cuda(call_frame) }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Platform {
    Cpu,
    Cuda,
}

fn tide_all_gather_cpu(call: &FfiCall) -> FfiStatus {
    entry(Op::AllGather, Platform::Cpu, call)
}
fn tide_reduce_scatter_cpu(call: &FfiCall) -> FfiStatus {
    entry(Op::ReduceScatter, Platform::Cpu, call)
}
fn tide_all_gather_cuda(call: &FfiCall) -> FfiStatus {
    entry(Op::AllGather, Platform::Cuda, call)
}
fn tide_reduce_scatter_cuda(call: &FfiCall) -> FfiStatus {
    entry(Op::ReduceScatter, Platform::Cuda, call)
}

fn tide_all_gather_cpu_start(call: FfiCall, promise: usize) {
    start_cpu(Op::AllGather, call, promise)
}
fn tide_reduce_scatter_cpu_start(call: FfiCall, promise: usize) {
    start_cpu(Op::ReduceScatter, call, promise)
}

/// The asynchronous CPU handlers' entry (docs/design.md "CPU handlers are asynchronous"). On
/// XLA's thread: decode, and for in-process calls take the rendezvous sequence number (so it
/// follows the order XLA invoked the handler). Then the call runs on a tide worker thread, which
/// completes the promise. Never unwinds; completes the promise exactly once on every path.
fn start_cpu(op: Op, call: FfiCall, promise: usize) {
    let complete = move |st: FfiStatus| {
        bridge::tide_complete_cpu(promise, st.code.repr, &st.message);
    };
    let prepared = catch_unwind(AssertUnwindSafe(|| -> Result<(CallInfo, u64)> {
        let info = decode(op, &call)?;
        let seq = if info.job == 0 {
            crate::rendezvous::run_seq(info.site, info.group, info.rank, info.run_id)
        } else {
            0
        };
        Ok((info, seq))
    }))
    .unwrap_or_else(|payload| {
        Err(TideError::Internal(format!(
            "{} site {} on device {}: panic: {}",
            op_name(op),
            call.site,
            call.device_ordinal,
            panic_message(&*payload)
        )))
    });
    let (info, seq) = match prepared {
        Ok(p) => p,
        Err(e) => return complete(status(Err(e))),
    };
    worker::submit(move || {
        let result = catch_unwind(AssertUnwindSafe(|| {
            if info.job != 0 {
                cpu::execute_multiprocess(&info, info.job)
            } else {
                cpu::execute_seq(&info, seq)
            }
        }))
        .unwrap_or_else(|payload| {
            Err(TideError::Internal(format!(
                "{} site {} on device {}: panic: {}",
                op_name(info.op),
                info.site,
                info.device_ordinal,
                panic_message(&*payload)
            )))
        });
        complete(status(result));
    });
}

/// What the CPU handlers run, callable without XLA (tests): `decode`, `cpu::execute`, `status`.
pub fn run_cpu(op: Op, call: &FfiCall) -> FfiStatus {
    entry(op, Platform::Cpu, call)
}

pub(crate) fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "tide all_gather",
        Op::ReduceScatter => "tide reduce_scatter",
    }
}

/// Every call from C++ lands here: decode, validate, execute; never unwinds.
fn entry(op: Op, platform: Platform, call: &FfiCall) -> FfiStatus {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let info = decode(op, call)?;
        match platform {
            Platform::Cpu if info.job != 0 => cpu::execute_multiprocess(&info, info.job),
            Platform::Cpu => cpu::execute(&info, info.run_id),
            // The CUDA engine validates the layout itself, after taking its rendezvous sequence
            // number, so a rank that fails validation still tells its peers.
            Platform::Cuda => crate::cuda::execute_job(&info, info.job),
        }
    }))
    .unwrap_or_else(|payload| {
        Err(TideError::Internal(format!(
            "{} site {} on device {}: panic: {}",
            op_name(op),
            call.site,
            call.device_ordinal,
            panic_message(&*payload)
        )))
    });
    status(result)
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
    let attrs = crate::call::check_attributes(
        op,
        &crate::call::Attributes {
            site: call.site,
            world: call.world,
            nodes: call.nodes,
            gpus_per_node: call.gpus_per_node,
            device_ordinal: call.device_ordinal,
            device_ordinals: &call.device_ordinals,
            device_ranks: &call.device_ranks,
            device_groups: &call.device_groups,
            job: call.job,
            operands: call.inputs.len(),
            results: call.outputs.len(),
        },
    )?;
    let name = format!("{} site {}", op_name(op), call.site);
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
    Ok(CallInfo {
        op,
        site: call.site,
        run_id: call.run_id,
        job: attrs.job,
        device_ordinal: device,
        rank,
        group,
        world,
        topology,
        names,
        inputs: buffers(&call.inputs, "operand", &name)?,
        outputs: buffers(&call.outputs, "result", &name)?,
        stream: call.stream,
    })
}
