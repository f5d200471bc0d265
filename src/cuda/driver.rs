//! The CUDA driver as tide uses it: cudarc's `driver::sys` (loaded lazily from libcuda.so.1), with
//! every call checked and turned into a `TideError::Cuda` that names the API call and what it acted
//! on (device, rank, parameter). cudarc panics when libcuda is absent or a symbol is missing, so
//! `init` checks for the library first and the engine's entry point also catches panics.
//! Nothing here runs at library load time.

use crate::error::{Result, TideError};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

pub use sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUresult, CUstream,
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
