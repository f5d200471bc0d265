//! The casting all-gather's rounding on the GPU (`crate::cast` has the contract): before the
//! collective's start, one `tide_cast_at_f32_bf16` launch per parameter on XLA's stream rounds this
//! rank's real rows of slice `index` of the fp32 operand straight into their place in the bf16
//! result (`CallInfo::inputs`, the views `cast::views` made). XLA's stream, not tide's: the rows
//! must be written before the call's `ready` (rule A1 records it after everything XLA enqueued
//! first, so peers read them only then), and the launch takes the place of XLA's own convert, which
//! would run there too. A full grid (it runs between XLA's kernels, not beside them). The index is
//! read by the kernel on the device: the host never waits.

use super::device;
use super::driver::{self, CUstream};
use super::kernels;
use crate::call::CallInfo;
use crate::error::{Result, TideError};

/// CTAs of one rounding launch at most (grid-stride beyond): a few waves of an H200's 132 SMs.
const MAX_CTAS: u32 = 1024;

/// Enqueues the rounding of a casting all-gather's start on XLA's stream; nothing for other calls.
pub(crate) fn launch(call: &CallInfo) -> Result<()> {
    let Some(cast) = &call.cast else {
        return Ok(());
    };
    let what = || format!("tide all_gather_cast_start site {} rank {} device {}", call.site, call.rank, call.device_ordinal);
    if call.stream == 0 {
        return Err(TideError::InvalidArgument(format!("{}: XLA passed no CUDA stream", what())));
    }
    let layout = call.layout()?;
    if cast.srcs.len() != layout.len() {
        return Err(TideError::Internal(format!("{}: {} fp32 operands for {} parameters", what(), cast.srcs.len(), layout.len())));
    }
    let dev = device::get(call.device_ordinal)?;
    let mut st = dev
        .lock()
        .map_err(|_| TideError::Internal(format!("{}: device state poisoned", what())))?;
    let _ctx = driver::CtxGuard::set(st.ctx, call.device_ordinal)?;
    let f = st.ensure_module()?.cast_at;
    let stream = call.stream as CUstream;
    for ((p, src), view) in layout.params.iter().zip(&cast.srcs).zip(&call.inputs) {
        let n = crate::cast::own_rows(p, call.rank).1 as u64;
        if n == 0 {
            continue;
        }
        let stride = crate::cast::slice_stride(p) as u64;
        let (mut d, mut s, mut count, mut at) = (view.ptr as u64, src.ptr as u64, cast.count as u64, cast.index_ptr as u64);
        let (mut nn, mut st_b) = (n, stride);
        let mut vectorized = i32::from(s.is_multiple_of(16) && stride.is_multiple_of(16) && d.is_multiple_of(8));
        let units = if vectorized != 0 { n.div_ceil(4) } else { n };
        let grid = kernels::grid(units, MAX_CTAS);
        let mut params: [*mut std::ffi::c_void; 7] = [
            &mut d as *mut u64 as *mut _,
            &mut s as *mut u64 as *mut _,
            &mut nn as *mut u64 as *mut _,
            &mut at as *mut u64 as *mut _,
            &mut count as *mut u64 as *mut _,
            &mut st_b as *mut u64 as *mut _,
            &mut vectorized as *mut i32 as *mut _,
        ];
        // SAFETY: params match tide_cast_at_f32_bf16(unsigned short*, const float*, unsigned long
        // long, const int*, unsigned long long, unsigned long long, int) and live across the call;
        // the view holds n bf16 elements of XLA's result, the operand `count` slices of `stride`
        // bytes (cast::views checked both against the layout); the kernel clamps the index.
        unsafe {
            driver::launch_kernel(f, grid, kernels::threads(), stream, &mut params, "cuLaunchKernel(tide_cast_at_f32_bf16)", || {
                format!("{}: {}, {n} elements, grid {grid}", what(), p.describe())
            })?;
        }
    }
    Ok(())
}
