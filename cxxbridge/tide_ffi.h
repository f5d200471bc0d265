// tide's XLA FFI handlers: the C++ half of the FFI edge (the Rust half is src/ffi/mod.rs).
//
// The handlers decode XLA's call frame (variadic buffers, attributes, device ordinal, stream) into
// the cxx shared struct `tide::ffi::FfiCall` and hand it to Rust, which validates and executes the
// call. Rust's status comes back as an `xla::ffi::Error`. The symbols exported from the cdylib
// (`tide_ffi_all_gather_cpu`, ...) are Rust functions forwarding to the `tide_cxx_*` handlers below;
// a Rust cdylib exports only Rust-defined symbols.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* tide_cxx_all_gather_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* tide_cxx_reduce_scatter_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* tide_cxx_all_gather_cuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* tide_cxx_reduce_scatter_cuda(XLA_FFI_CallFrame* call_frame);
}
