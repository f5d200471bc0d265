// tide's XLA FFI handlers: the C++ half of the FFI edge (the Rust half is src/ffi/mod.rs).
//
// The handlers decode XLA's call frame (variadic buffers, attributes, device ordinal, stream) into
// the cxx shared struct `tide::ffi::FfiCall` and hand it to Rust, which validates and executes the
// call. Rust's status comes back as an `xla::ffi::Error`. The symbols exported from the cdylib
// (`tide_ffi_all_gather_cpu`, ...) are Rust functions forwarding to the `tide_cxx_*` handlers below;
// a Rust cdylib exports only Rust-defined symbols.
#pragma once

#include <cstddef>
#include <cstdint>

#include "rust/cxx.h"
#include "xla/ffi/api/c_api.h"

namespace tide::ffi {
// Completes the asynchronous CPU call whose `xla::ffi::Promise*` is `promise` (code 0: ok,
// 1: invalid argument, else internal, with `message`) and deletes the promise. Called by Rust,
// exactly once per started call, from any thread.
void tide_complete_cpu(std::size_t promise, std::int32_t code, rust::Str message);
}  // namespace tide::ffi

extern "C" {
XLA_FFI_Error* tide_cxx_all_gather_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* tide_cxx_reduce_scatter_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* tide_cxx_all_gather_cuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* tide_cxx_reduce_scatter_cuda(XLA_FFI_CallFrame* call_frame);
}
