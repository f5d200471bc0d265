//! The CUDA driver as tide uses it, in cudarc's layering: `cudarc::driver::sys` (raw bindings,
//! loaded lazily from libcuda.so.1) below, this module (the `result` layer: one thin function per
//! driver call tide makes, each checked and turned into a `TideError::Cuda` that names the API call
//! and what it acted on: device, rank, parameter), and the owning types above it (`device`'s
//! `DeviceState`/`Slot`, `ipc`'s `Exporter`/`Importer`). No other module of the engine calls
//! `sys::cu*` itself.
//!
//! Conventions: `what` is a closure, so the hot path formats nothing unless a call failed. A
//! function taking raw handles or device addresses is `unsafe`: its `# Safety` section says what
//! the caller guarantees; the driver checks the rest. The context of the device must be current
//! (`CtxGuard`) for every call that creates, maps or enqueues.
//!
//! cudarc panics when libcuda is absent or a symbol is missing, so `init` checks for the library
//! first, `batch_copy_supported` and `batch_copy_3d_supported` look the optional symbols up, and the engine's entry points
//! also catch panics. Nothing here runs at library load time.

use crate::error::{Result, TideError};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

pub use sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUipcEventHandle, CUipcMemHandle,
    CUmemGenericAllocationHandle, CUmodule, CUresult, CUstream,
};

/// "CUDA_ERROR_INVALID_VALUE (invalid argument)" for a result code.
pub fn describe(r: CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: only called after the library was found (init); out-pointers are valid locals and the
    // driver returns static strings.
    unsafe {
        let n = if sys::cuGetErrorName(r, &mut name) == CUresult::CUDA_SUCCESS && !name.is_null() {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        };
        if sys::cuGetErrorString(r, &mut text) == CUresult::CUDA_SUCCESS && !text.is_null() {
            format!("{n} ({})", CStr::from_ptr(text).to_string_lossy())
        } else {
            n
        }
    }
}

/// Ok for CUDA_SUCCESS, else an error naming `call` and `what` (a closure, so the hot path formats
/// nothing unless something failed).
#[inline]
pub fn check(r: CUresult, call: &str, what: impl FnOnce() -> String) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(TideError::Cuda {
            call: call.to_string(),
            detail: format!("{} [{}]", describe(r), what()),
        })
    }
}

static INIT: OnceLock<std::result::Result<i32, String>> = OnceLock::new();

/// Finds libcuda and calls cuInit once per process; returns the driver's CUDA version (13000 = 13.0).
pub fn init() -> Result<i32> {
    let r = INIT.get_or_init(|| {
        // SAFETY: is_culib_present only tries to dlopen candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so.1) was not found: the CUDA engine needs an NVIDIA \
                        driver; on machines without GPUs use the CPU platform"
                .to_string());
        }
        // SAFETY: library present; cuInit(0) may be called any number of times.
        let r = unsafe { sys::cuInit(0) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuInit failed: {}", describe(r)));
        }
        let mut v = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::cuDriverGetVersion(&mut v) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuDriverGetVersion failed: {}", describe(r)));
        }
        Ok(v)
    });
    r.clone().map_err(|detail| TideError::Cuda {
        call: "CUDA driver initialization".into(),
        detail,
    })
}

/// Makes `ctx` current on this thread for the guard's lifetime and restores the previous context
/// (XLA's) on drop. Drop logs, never panics.
pub(crate) struct CtxGuard {
    prev: CUcontext,
    changed: bool,
}

impl CtxGuard {
    pub(crate) fn set(ctx: CUcontext, device: i64) -> Result<CtxGuard> {
        let mut prev: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(
            unsafe { sys::cuCtxGetCurrent(&mut prev) },
            "cuCtxGetCurrent",
            || format!("device {device}"),
        )?;
        if prev == ctx {
            return Ok(CtxGuard {
                prev,
                changed: false,
            });
        }
        // SAFETY: ctx is a retained primary context.
        check(
            unsafe { sys::cuCtxSetCurrent(ctx) },
            "cuCtxSetCurrent",
            || format!("device {device}"),
        )?;
        Ok(CtxGuard {
            prev,
            changed: true,
        })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: restoring the context that was current (possibly null = none).
            let r = unsafe { sys::cuCtxSetCurrent(self.prev) };
            if r != CUresult::CUDA_SUCCESS {
                log::warn!(
                    "tide: restoring the caller's CUDA context failed: {}",
                    describe(r)
                );
            }
        }
    }
}

// ----- devices and contexts -----

/// The number of CUDA devices visible to this process.
pub fn device_count() -> Result<i32> {
    let mut count = 0;
    // SAFETY: valid out-pointer; the driver is initialized by the caller (`init`).
    check(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount", String::new)?;
    Ok(count)
}

/// The device handle of `ordinal` (in range: the caller checked it against `device_count`).
pub fn device_get(ordinal: i32) -> Result<CUdevice> {
    let mut dev: CUdevice = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet", || {
        format!("ordinal {ordinal}")
    })?;
    Ok(dev)
}

/// The name of `dev` ("NVIDIA H200").
pub fn device_name(dev: CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: valid device handle; the driver writes at most `len` bytes, NUL-terminated.
    check(unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) }, "cuDeviceGetName", || {
        format!("device handle {dev}")
    })?;
    // SAFETY: NUL-terminated by the driver within the buffer (the last byte is never written past).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// Device attribute `attr` of `dev` (`name` and `ordinal` for errors).
pub fn device_attribute(dev: CUdevice, ordinal: i64, attr: sys::CUdevice_attribute, name: &str) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid device handle and out-pointer.
    check(unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) }, "cuDeviceGetAttribute", || {
        format!("device {ordinal}, {name}")
    })?;
    Ok(v)
}

/// Retains `dev`'s primary context (the one XLA uses). Never released: kept for the process.
pub fn primary_ctx_retain(dev: CUdevice, ordinal: i64) -> Result<CUcontext> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: valid device handle and out-pointer.
    check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain", || {
        format!("device {ordinal}")
    })?;
    Ok(ctx)
}

/// Whether `dev` can access `peer`'s memory.
pub fn can_access_peer(dev: CUdevice, peer: CUdevice, what: impl FnOnce() -> String) -> Result<bool> {
    let mut can = 0;
    // SAFETY: valid device handles and out-pointer.
    check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) }, "cuDeviceCanAccessPeer", what)?;
    Ok(can != 0)
}

/// Enables the current context to access `peer_ctx`'s memory; "already enabled" is success.
///
/// # Safety
/// `peer_ctx` is a retained context; the accessing device's context is current.
pub unsafe fn enable_peer_access(peer_ctx: CUcontext, what: impl FnOnce() -> String) -> Result<()> {
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) };
    if r == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check(r, "cuCtxEnablePeerAccess", what)
}

/// (free, total) bytes of the current context's device (`cuMemGetInfo`).
pub fn mem_get_info(what: impl FnOnce() -> String) -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; a context is current (else the driver returns an error).
    check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo", what)?;
    Ok((free, total))
}

// ----- streams and events -----

/// A new non-blocking stream (no implicit synchronization with the legacy stream).
pub fn stream_create(what: impl FnOnce() -> String) -> Result<CUstream> {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the device's context is current (callers hold a CtxGuard).
    check(
        unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
        "cuStreamCreate",
        what,
    )?;
    Ok(s)
}

/// A new non-blocking stream with the context's greatest priority (`cuCtxGetStreamPriorityRange`).
pub fn stream_create_high_priority(what: impl FnOnce() -> String) -> Result<CUstream> {
    let (mut least, mut greatest) = (0i32, 0i32);
    // SAFETY: valid out-pointers; the device's context is current (callers hold a CtxGuard).
    check(
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) },
        "cuCtxGetStreamPriorityRange",
        String::new,
    )?;
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: as `stream_create`.
    check(
        unsafe { sys::cuStreamCreateWithPriority(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32, greatest) },
        "cuStreamCreateWithPriority",
        what,
    )?;
    Ok(s)
}

/// A new event without timing (the only kind tide records; cheaper to record and wait on).
pub fn event_create(what: impl FnOnce() -> String) -> Result<CUevent> {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the device's context is current (callers hold a CtxGuard).
    check(
        unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
        "cuEventCreate",
        what,
    )?;
    Ok(e)
}

/// Records `event` on `stream`.
///
/// # Safety
/// Both handles are valid (created in this process, or opened from a peer) and not destroyed.
#[inline]
pub unsafe fn event_record(event: CUevent, stream: CUstream, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuEventRecord(event, stream) }, "cuEventRecord", what)
}

/// Makes `stream` wait on the most recent record of `event` (captured now: a later re-record is
/// never waited on).
///
/// # Safety
/// As `event_record`.
#[inline]
pub unsafe fn stream_wait_event(stream: CUstream, event: CUevent, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuStreamWaitEvent(stream, event, 0) }, "cuStreamWaitEvent", what)
}

/// Whether everything enqueued on `stream` so far has completed (never blocks).
///
/// # Safety
/// `stream` is a valid stream of this process.
pub unsafe fn stream_idle(stream: CUstream, what: impl FnOnce() -> String) -> Result<bool> {
    match unsafe { sys::cuStreamQuery(stream) } {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => check(r, "cuStreamQuery", what).map(|()| false),
    }
}

/// Whether the work before `event`'s most recent record has completed (an event never recorded
/// has). Never blocks.
///
/// # Safety
/// `event` is a valid event of this process.
pub unsafe fn event_complete(event: CUevent, what: impl FnOnce() -> String) -> Result<bool> {
    match unsafe { sys::cuEventQuery(event) } {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => check(r, "cuEventQuery", what).map(|()| false),
    }
}

/// Destroys an event (pending work that records or waits on it is unaffected).
///
/// # Safety
/// `event` is a valid event of this process (created, or opened from a peer) that nothing uses
/// afterwards.
pub unsafe fn event_destroy(event: CUevent, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuEventDestroy_v2(event) }, "cuEventDestroy", what)
}

/// The context `stream` belongs to.
///
/// # Safety
/// `stream` is a valid stream (XLA's, valid for the call).
pub unsafe fn stream_context(stream: CUstream, what: impl FnOnce() -> String) -> Result<CUcontext> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    check(unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }, "cuStreamGetCtx", what)?;
    Ok(ctx)
}

/// Whether `stream` is being captured into a CUDA graph.
///
/// # Safety
/// As `stream_context`.
pub unsafe fn stream_capturing(stream: CUstream, what: impl FnOnce() -> String) -> Result<bool> {
    let mut cap = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    check(unsafe { sys::cuStreamIsCapturing(stream, &mut cap) }, "cuStreamIsCapturing", what)?;
    Ok(cap != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

// ----- copies, fills, launches -----

/// `bytes` from `src` to `dst` on `stream` (copy engines; unified addresses).
///
/// # Safety
/// Both ranges are valid device memory for `bytes` bytes (local, or peer memory with access
/// enabled or mapped) until the copy completes, ordered by the caller's stream rules.
#[inline]
pub unsafe fn memcpy_async(dst: u64, src: u64, bytes: usize, stream: CUstream, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) }, "cuMemcpyAsync", what)
}

/// A 2-D copy on `stream` (copy engines): `height` rows of `width` bytes, row j from `src + j *
/// src_pitch` to `dst + j * dst_pitch`. Both ends are unified addresses (CU_MEMORYTYPE_UNIFIED),
/// so either may be a peer's memory, as for `memcpy_async`. The driver refuses a pitch above the
/// device's CU_DEVICE_ATTRIBUTE_MAX_PITCH (`max_pitch`) or below `width`.
///
/// # Safety
/// Every row of both ends is valid device memory (local, or peer memory with access enabled or
/// mapped) until the copy completes, ordered by the caller's stream rules; no row of `dst`
/// overlaps a row of `src`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub unsafe fn memcpy_2d_async(
    dst: u64,
    dst_pitch: usize,
    src: u64,
    src_pitch: usize,
    width: usize,
    height: usize,
    stream: CUstream,
    what: impl FnOnce() -> String,
) -> Result<()> {
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    // SAFETY: the descriptor is a valid local (the driver reads it during the call); ranges per
    // the caller.
    check(unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) }, "cuMemcpy2DAsync", what)
}

/// The largest pitch `memcpy_2d_async` may be given on device `ordinal`
/// (CU_DEVICE_ATTRIBUTE_MAX_PITCH; 2^31 - 1 on current GPUs).
pub fn max_pitch(ordinal: i64) -> Result<usize> {
    let dev = device_get(ordinal as i32)?;
    let v = device_attribute(dev, ordinal, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH, "max pitch")?;
    Ok(v.max(0) as usize)
}

/// Sets `bytes` at `dst` to zero on `stream`.
///
/// # Safety
/// `dst` is valid device memory for `bytes` bytes until the fill completes.
#[inline]
pub unsafe fn memset_zero_async(dst: u64, bytes: usize, stream: CUstream, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMemsetD8Async(dst, 0, bytes, stream) }, "cuMemsetD8Async", what)
}

/// One copy of a batch: destination, source, bytes, and the devices holding either end (location
/// hints; ignored for non-managed memory, but they must name devices of this process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchCopy {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
    pub dst_dev: i64,
    pub src_dev: i64,
}

/// The copies as one `cuMemcpyBatchAsync` on `stream` (source order: the stream's; each copy its
/// own attributes). Only where `batch_copy_supported`.
///
/// # Safety
/// As `memcpy_async`, for every copy.
pub unsafe fn memcpy_batch_async(copies: &[BatchCopy], stream: CUstream, what: impl FnOnce() -> String) -> Result<()> {
    let loc = |dev: i64| sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev as i32,
    };
    let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.dst).collect();
    let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.src).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.bytes).collect();
    let mut attrs: Vec<sys::CUmemcpyAttributes> = copies
        .iter()
        .map(|c| sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: loc(c.src_dev),
            dstLocHint: loc(c.dst_dev),
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        })
        .collect();
    let mut idxs: Vec<usize> = (0..copies.len()).collect();
    // SAFETY: five arrays of `copies.len()` entries, alive across the call; ranges per the caller.
    check(
        unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                attrs.as_mut_ptr(),
                idxs.as_mut_ptr(),
                copies.len(),
                stream,
            )
        },
        "cuMemcpyBatchAsync",
        what,
    )
}

/// One 2-D copy as `memcpy_2d_async` and `memcpy_3d_batch_async` take it: `rows` rows of `width`
/// bytes, row j from `src + j * src_pitch` to `dst + j * dst_pitch` (unified addresses), and the
/// devices holding either end (location hints, as `BatchCopy`'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StridedCopy {
    pub dst: u64,
    pub dst_pitch: usize,
    pub src: u64,
    pub src_pitch: usize,
    pub width: usize,
    pub rows: usize,
    pub dst_dev: i64,
    pub src_dev: i64,
}

/// The cuMemcpy3DBatchAsync descriptor of one 2-D copy: both operands pointers
/// (CU_MEMCPY_OPERAND_TYPE_POINTER) whose `rowLength` is the pitch and `layerHeight` the row count
/// (in elements, which are bytes for pointer-to-pointer copies), extent `width x rows x 1`, the
/// source read in stream order, and the copy preferring to overlap with compute (as `BatchCopy`).
/// Pure (builds the struct, calls nothing).
pub fn batch_op_2d(c: &StridedCopy) -> sys::CUDA_MEMCPY3D_BATCH_OP {
    let operand = |ptr: u64, pitch: usize, dev: i64| sys::CUmemcpy3DOperand {
        type_: sys::CUmemcpy3DOperandType::CU_MEMCPY_OPERAND_TYPE_POINTER,
        op: sys::CUmemcpy3DOperand_st__bindgen_ty_1 {
            ptr: sys::CUmemcpy3DOperand_st__bindgen_ty_1__bindgen_ty_1 {
                ptr,
                rowLength: pitch,
                layerHeight: c.rows,
                locHint: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: dev as i32,
                },
            },
        },
    };
    // One row: the pitch is never stepped over, but it may not be below the width.
    let (sp, dp) = if c.rows <= 1 { (c.width, c.width) } else { (c.src_pitch, c.dst_pitch) };
    sys::CUDA_MEMCPY3D_BATCH_OP {
        src: operand(c.src, sp, c.src_dev),
        dst: operand(c.dst, dp, c.dst_dev),
        extent: sys::CUextent3D { width: c.width, height: c.rows, depth: 1 },
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
    }
}

/// The 2-D copies as one `cuMemcpy3DBatchAsync_v2` on `stream` (`batch_op_2d` each; the batch in
/// stream order, its copies in any order among themselves). Only where
/// `batch_copy_3d_supported`; no copy may be empty (the driver refuses a zero extent).
///
/// # Safety
/// As `memcpy_2d_async`, for every copy; no copy of the batch writes bytes another reads or writes.
pub unsafe fn memcpy_3d_batch_async(copies: &[StridedCopy], stream: CUstream, what: impl FnOnce() -> String) -> Result<()> {
    let mut ops: Vec<sys::CUDA_MEMCPY3D_BATCH_OP> = copies.iter().map(batch_op_2d).collect();
    // SAFETY: `ops` holds `copies.len()` descriptors, alive across the call (the driver reads them
    // during it); flags must be 0; ranges per the caller.
    check(
        unsafe { sys::cuMemcpy3DBatchAsync_v2(ops.len(), ops.as_mut_ptr(), 0, stream) },
        "cuMemcpy3DBatchAsync",
        || format!("{} 2-D copies: {}", copies.len(), what()),
    )
}

/// Whether the driver exports cuMemcpy3DBatchAsync_v2 (CUDA 12.8+ drivers): where it does not,
/// TIDE_COPY2D=batch / batch-bands fall back (`cuda::issue`, logged once) instead of failing
/// (cudarc's lazy loader would panic on the call).
pub fn batch_copy_3d_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        init().is_ok()
            // SAFETY: only looks the symbol up; the library is the one the engine already loaded.
            && std::panic::catch_unwind(|| unsafe {
                sys::culib()
                    .get::<unsafe extern "C" fn()>(b"cuMemcpy3DBatchAsync_v2\0")
                    .is_ok()
            })
            .unwrap_or(false)
    })
}

/// Whether the driver exports cuMemcpyBatchAsync_v2 (CUDA 12.8+ drivers); older drivers get one
/// cuMemcpyAsync per copy instead of failing (cudarc's lazy loader would panic on the call).
pub fn batch_copy_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        // SAFETY: only looks the symbol up; the library is the one the engine already loaded.
        std::panic::catch_unwind(|| unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2\0")
                .is_ok()
        })
        .unwrap_or(false)
    })
}

/// Launches `f` on `stream` with `grid` CTAs of `threads` threads (1-D, no shared memory).
/// `kernel` names it in errors ("cuLaunchKernel(tide_copy)").
///
/// # Safety
/// `params` points to one pointer per kernel parameter, each to a value of the parameter's type,
/// alive across the call (the driver copies them at launch); every address they carry is valid
/// for what the kernel does with it until it completes.
#[inline]
pub unsafe fn launch_kernel(
    f: CUfunction,
    grid: u32,
    threads: u32,
    stream: CUstream,
    params: &mut [*mut std::ffi::c_void],
    kernel: &str,
    what: impl FnOnce() -> String,
) -> Result<()> {
    check(
        unsafe { sys::cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, 0, stream, params.as_mut_ptr(), std::ptr::null_mut()) },
        kernel,
        what,
    )
}

// ----- modules -----

/// Loads a cubin image into the current context.
pub fn module_load_data(image: &[u8], what: impl FnOnce() -> String) -> Result<CUmodule> {
    let mut module: CUmodule = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the image outlives the call (the driver copies it); the device's
    // context is current.
    check(
        unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const _) },
        "cuModuleLoadData",
        what,
    )?;
    Ok(module)
}

/// Kernel `name` of a loaded module.
///
/// # Safety
/// `module` is a loaded module of this process (never unloaded).
pub unsafe fn module_get_function(module: CUmodule, name: &str, what: impl FnOnce() -> String) -> Result<CUfunction> {
    let c = std::ffi::CString::new(name).map_err(|_| TideError::Internal(format!("kernel name {name:?} has a NUL")))?;
    let mut f: CUfunction = std::ptr::null_mut();
    check(unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) }, "cuModuleGetFunction", what)?;
    Ok(f)
}

/// Sets `f`'s preferred shared-memory carveout (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`,
/// percent of the SM's unified L1/shared memory, 0..=100): a hint the driver follows when it places
/// the kernel's CTAs (TIDE_SM_CARVEOUT).
///
/// # Safety
/// `f` is a function of a loaded module of this process (never unloaded).
pub unsafe fn func_set_carveout(f: CUfunction, percent: i32, what: impl FnOnce() -> String) -> Result<()> {
    check(
        unsafe {
            sys::cuFuncSetAttribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                percent,
            )
        },
        "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)",
        what,
    )
}

// ----- memory: allocations -----

/// `bytes` of device memory (`cuMemAlloc`) in the current context.
pub fn mem_alloc(bytes: usize, what: impl FnOnce() -> String) -> Result<CUdeviceptr> {
    let mut ptr: CUdeviceptr = 0;
    // SAFETY: valid out-pointer; the device's context is current.
    check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc", what)?;
    Ok(ptr)
}

/// Frees a `mem_alloc` allocation.
///
/// # Safety
/// `ptr` came from `mem_alloc` and no work that uses it is pending.
pub unsafe fn mem_free(ptr: CUdeviceptr, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree", what)
}

/// (base, size) of the allocation holding device address `ptr`.
///
/// # Safety
/// `ptr` is a device address of this process (the driver fails on others).
pub unsafe fn mem_address_range(ptr: u64, what: impl FnOnce() -> String) -> Result<(CUdeviceptr, usize)> {
    let mut base: CUdeviceptr = 0;
    let mut size: usize = 0;
    check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }, "cuMemGetAddressRange", what)?;
    Ok((base, size))
}

/// The VMM allocation handle of the mapping at `base`, retained (release with `mem_release`);
/// `None` when the memory is not VMM (`cuMemAlloc`'d).
///
/// # Safety
/// `base` is a mapped device address of this process.
pub unsafe fn mem_retain_allocation_handle(base: CUdeviceptr) -> Option<CUmemGenericAllocationHandle> {
    let mut h: CUmemGenericAllocationHandle = 0;
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, base as *mut std::ffi::c_void) };
    (r == CUresult::CUDA_SUCCESS).then_some(h)
}

/// Drops one reference to a VMM allocation handle.
///
/// # Safety
/// `h` holds a reference this caller owns (retained, imported or created).
pub unsafe fn mem_release(h: CUmemGenericAllocationHandle, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMemRelease(h) }, "cuMemRelease", what)
}

/// A new physical allocation of `size` bytes on device `ordinal` (pinned device memory).
pub fn mem_create(size: usize, ordinal: i64, what: impl FnOnce() -> String) -> Result<CUmemGenericAllocationHandle> {
    let prop = device_allocation_prop(ordinal);
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: valid pointers; size is a multiple of the allocation granularity (the caller's).
    check(unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) }, "cuMemCreate", what)?;
    Ok(h)
}

/// Pinned device memory on device `ordinal`, as VMM allocations describe it.
fn device_allocation_prop(ordinal: i64) -> sys::CUmemAllocationProp {
    // SAFETY: plain C struct; all-zero is a valid starting value.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    };
    p
}

/// The recommended granularity of VMM allocations on device `ordinal`.
pub fn mem_allocation_granularity(ordinal: i64) -> Result<usize> {
    let prop = device_allocation_prop(ordinal);
    let mut g = 0usize;
    // SAFETY: valid pointers.
    check(
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        "cuMemGetAllocationGranularity",
        || format!("device {ordinal}"),
    )?;
    Ok(g)
}

// ----- memory: virtual address ranges and mappings -----

/// A fresh virtual address range of `size` bytes.
pub fn mem_address_reserve(size: usize, what: impl FnOnce() -> String) -> Result<CUdeviceptr> {
    let mut p: CUdeviceptr = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { sys::cuMemAddressReserve(&mut p, size, 0, 0, 0) }, "cuMemAddressReserve", what)?;
    Ok(p)
}

/// Frees a reserved range.
///
/// # Safety
/// `va..va+size` was reserved by `mem_address_reserve` and nothing is mapped in it.
pub unsafe fn mem_address_free(va: CUdeviceptr, size: usize, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMemAddressFree(va, size) }, "cuMemAddressFree", what)
}

/// Maps allocation `h` (`size` bytes) at `va`.
///
/// # Safety
/// `va..va+size` is reserved and unmapped; `h` is a live allocation handle of at least `size` bytes.
pub unsafe fn mem_map(va: CUdeviceptr, size: usize, h: CUmemGenericAllocationHandle, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMemMap(va, size, 0, h, 0) }, "cuMemMap", what)
}

/// Unmaps `va..va+size`.
///
/// # Safety
/// The range is mapped and no pending work uses it.
pub unsafe fn mem_unmap(va: CUdeviceptr, size: usize, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMemUnmap(va, size) }, "cuMemUnmap", what)
}

/// Grants device `ordinal` read/write access to the mapped range `va..va+size`.
///
/// # Safety
/// The range is mapped in this process.
pub unsafe fn mem_set_access(va: CUdeviceptr, size: usize, ordinal: i64, what: impl FnOnce() -> String) -> Result<()> {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as i32,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    check(unsafe { sys::cuMemSetAccess(va, size, &desc, 1) }, "cuMemSetAccess", what)
}

// ----- memory and events across processes -----

/// Exports allocation `h` as a POSIX file descriptor (a new fd the caller owns). The error says
/// how the allocation must have been created.
///
/// # Safety
/// `h` is a live (retained) VMM allocation handle.
pub unsafe fn mem_export_fd(h: CUmemGenericAllocationHandle, what: impl FnOnce() -> String) -> Result<i32> {
    let mut fd: i32 = -1;
    // Out-pointer to an int, as the POSIX fd handle type wants.
    check(
        unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut std::ffi::c_void,
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        },
        "cuMemExportToShareableHandle(POSIX fd)",
        what,
    )?;
    Ok(fd)
}

/// Imports an allocation exported as POSIX fd `fd` (the fd stays the caller's).
pub fn mem_import_fd(fd: i32, what: impl FnOnce() -> String) -> Result<CUmemGenericAllocationHandle> {
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out-pointer; for POSIX fds the "os handle" is the fd value itself.
    check(
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        },
        "cuMemImportFromShareableHandle",
        what,
    )?;
    Ok(h)
}

/// The legacy IPC handle bytes of the `cuMemAlloc` allocation starting at `base`.
///
/// # Safety
/// `base` is the start of a `cuMemAlloc` allocation of this process.
pub unsafe fn ipc_mem_handle(base: CUdeviceptr, what: impl FnOnce() -> String) -> Result<[u8; 64]> {
    let mut mh: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    check(unsafe { sys::cuIpcGetMemHandle(&mut mh, base) }, "cuIpcGetMemHandle", what)?;
    let mut bytes = [0u8; 64];
    for (d, s) in bytes.iter_mut().zip(mh.reserved.iter()) {
        *d = *s as u8;
    }
    Ok(bytes)
}

/// Opens a peer's legacy IPC allocation (lazy peer access); close with `ipc_close_mem_handle`.
pub fn ipc_open_mem_handle(handle: &[u8; 64], what: impl FnOnce() -> String) -> Result<CUdeviceptr> {
    // SAFETY: all-zero is a valid handle value to fill in.
    let mut mh: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    for (d, s) in mh.reserved.iter_mut().zip(handle.iter()) {
        *d = *s as std::ffi::c_char;
    }
    let mut p: CUdeviceptr = 0;
    // SAFETY: valid out-pointer; handle bytes from the peer's cuIpcGetMemHandle.
    check(
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, mh, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32) },
        "cuIpcOpenMemHandle",
        what,
    )?;
    Ok(p)
}

/// Closes an `ipc_open_mem_handle` mapping.
///
/// # Safety
/// `p` came from `ipc_open_mem_handle` and no pending work uses it.
pub unsafe fn ipc_close_mem_handle(p: CUdeviceptr, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuIpcCloseMemHandle(p) }, "cuIpcCloseMemHandle", what)
}

/// Registers `bytes` of host memory at `p` (page-aligned) for every context
/// (`CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP`) and returns its device address, for stream memory
/// operations on it (`stream_write_value32`, `stream_wait_value32`).
///
/// # Safety
/// `p` is mapped for `bytes` and stays mapped (and registered) for the life of the process.
pub unsafe fn host_register(p: *mut u8, bytes: usize, what: impl Fn() -> String) -> Result<CUdeviceptr> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    check(unsafe { sys::cuMemHostRegister_v2(p.cast(), bytes, flags) }, "cuMemHostRegister", &what)?;
    let mut d: CUdeviceptr = 0;
    check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p.cast(), 0) }, "cuMemHostGetDevicePointer", &what)?;
    Ok(d)
}

/// Enqueues on `stream` a write of `value` to the 32-bit word at `addr`, after everything before
/// it on the stream, with a system-wide memory fence before the write (`CU_STREAM_WRITE_VALUE_DEFAULT`):
/// whoever sees the value sees the stream's earlier writes.
///
/// # Safety
/// `addr` is a device address of registered host memory (`host_register`) or device memory, valid
/// until the write ran.
pub unsafe fn stream_write_value32(stream: CUstream, addr: CUdeviceptr, value: u32, what: impl FnOnce() -> String) -> Result<()> {
    let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    check(unsafe { sys::cuStreamWriteValue32_v2(stream, addr, value, flags) }, "cuStreamWriteValue32", what)
}

/// Makes `stream` wait until the 32-bit word at `addr` is `value` or later (`CU_STREAM_WAIT_VALUE_GEQ`:
/// `(int32)(*addr - value) >= 0`, so counters may wrap).
///
/// # Safety
/// As `stream_write_value32`.
pub unsafe fn stream_wait_value32(stream: CUstream, addr: CUdeviceptr, value: u32, what: impl FnOnce() -> String) -> Result<()> {
    let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    check(unsafe { sys::cuStreamWaitValue32_v2(stream, addr, value, flags) }, "cuStreamWaitValue32", what)
}

// ----- multicast (the opt-in NVLink multicast all-gather; `multicast` gates every call) -----

/// The recommended granularity of a multicast object for `world` devices and `size` bytes.
pub fn multicast_granularity(world: usize, size: usize, what: impl FnOnce() -> String) -> Result<usize> {
    let prop = multicast_prop(world, size);
    let mut g = 0usize;
    // SAFETY: valid pointers.
    check(
        unsafe {
            sys::cuMulticastGetGranularity(&mut g, &prop, sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_RECOMMENDED)
        },
        "cuMulticastGetGranularity",
        what,
    )?;
    Ok(g)
}

fn multicast_prop(world: usize, size: usize) -> sys::CUmulticastObjectProp {
    sys::CUmulticastObjectProp {
        numDevices: world as u32,
        size,
        handleTypes: 0,
        flags: 0,
    }
}

/// A multicast object for `world` devices of `size` bytes (a multiple of the granularities).
pub fn multicast_create(world: usize, size: usize, what: impl FnOnce() -> String) -> Result<CUmemGenericAllocationHandle> {
    let prop = multicast_prop(world, size);
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: valid pointers.
    check(unsafe { sys::cuMulticastCreate(&mut h, &prop) }, "cuMulticastCreate", what)?;
    Ok(h)
}

/// Adds `dev` to multicast object `handle`.
///
/// # Safety
/// `handle` came from `multicast_create`.
pub unsafe fn multicast_add_device(handle: CUmemGenericAllocationHandle, dev: CUdevice, what: impl FnOnce() -> String) -> Result<()> {
    check(unsafe { sys::cuMulticastAddDevice(handle, dev) }, "cuMulticastAddDevice", what)
}

/// Backs `size` bytes of multicast object `handle` with allocation `mem`.
///
/// # Safety
/// Both handles are live; every device was added before.
pub unsafe fn multicast_bind_mem(
    handle: CUmemGenericAllocationHandle,
    mem: CUmemGenericAllocationHandle,
    size: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    check(unsafe { sys::cuMulticastBindMem(handle, 0, mem, 0, size, 0) }, "cuMulticastBindMem", what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_2d_batch_op_matches_cuda_h() {
        // CUDA 12.8+ cuda.h: CUmemcpy3DOperand { type (4, padded to 8); union { ptr { CUdeviceptr
        // ptr; size_t rowLength; size_t layerHeight; CUmemLocation locHint (8) } (32); array } }
        // = 40 bytes; CUDA_MEMCPY3D_BATCH_OP { src; dst; CUextent3D extent (24);
        // CUmemcpySrcAccessOrder srcAccessOrder (4); unsigned int flags } = 112 bytes.
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<sys::CUmemcpy3DOperand>(), 40);
        assert_eq!(offset_of!(sys::CUmemcpy3DOperand, op), 8);
        assert_eq!(size_of::<sys::CUDA_MEMCPY3D_BATCH_OP>(), 112);
        assert_eq!(offset_of!(sys::CUDA_MEMCPY3D_BATCH_OP, dst), 40);
        assert_eq!(offset_of!(sys::CUDA_MEMCPY3D_BATCH_OP, extent), 80);
        assert_eq!(offset_of!(sys::CUDA_MEMCPY3D_BATCH_OP, srcAccessOrder), 104);
        assert_eq!(offset_of!(sys::CUDA_MEMCPY3D_BATCH_OP, flags), 108);
        type Ptr = sys::CUmemcpy3DOperand_st__bindgen_ty_1__bindgen_ty_1;
        assert_eq!((offset_of!(Ptr, rowLength), offset_of!(Ptr, layerHeight), offset_of!(Ptr, locHint)), (8, 16, 24));

        // A peer's 4096 rows of 3584 bytes (a [4096, 14336] bf16 weight along dim 1 at world 8)
        // landing 28672 bytes apart.
        let c = StridedCopy { dst: 0x7000_0000, dst_pitch: 28672, src: 0x9000_0000, src_pitch: 3584, width: 3584, rows: 4096, dst_dev: 0, src_dev: 3 };
        let op = batch_op_2d(&c);
        let (src, dst) = (op.src, op.dst);
        assert_eq!(src.type_, sys::CUmemcpy3DOperandType::CU_MEMCPY_OPERAND_TYPE_POINTER);
        assert_eq!(dst.type_, sys::CUmemcpy3DOperandType::CU_MEMCPY_OPERAND_TYPE_POINTER);
        // SAFETY: the pointer member is the one written.
        let (sp, dp) = unsafe { (src.op.ptr, dst.op.ptr) };
        assert_eq!((sp.ptr, sp.rowLength, sp.layerHeight, sp.locHint.id), (0x9000_0000, 3584, 4096, 3));
        assert_eq!((dp.ptr, dp.rowLength, dp.layerHeight, dp.locHint.id), (0x7000_0000, 28672, 4096, 0));
        assert_eq!(sp.locHint.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        let e = op.extent;
        assert_eq!((e.width, e.height, e.depth), (3584, 4096, 1));
        assert_eq!(op.srcAccessOrder, sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM);
        assert_eq!(op.flags, 1);
        // One row: pitches of the width (never stepped over; the driver wants them >= the width).
        let one = batch_op_2d(&StridedCopy { rows: 1, src_pitch: 0, dst_pitch: 0, ..c });
        // SAFETY: as above.
        let (sp, dp) = unsafe { (one.src.op.ptr, one.dst.op.ptr) };
        assert_eq!((sp.rowLength, dp.rowLength, sp.layerHeight, one.extent.height), (3584, 3584, 1, 1));
    }
}
