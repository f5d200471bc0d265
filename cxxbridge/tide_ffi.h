// tide's XLA FFI handlers: the C++ half of the FFI edge (the Rust half is src/ffi/mod.rs).
//
// The handlers decode XLA's call frame (variadic buffers, the attribute struct `TideAttrs`, device
// ordinal, run id, stream, and the call site's instantiate-stage state) into the cxx shared struct
// `tide::ffi::FfiCall` and hand it to Rust, which validates and executes the call. Rust's status
// comes back as an `xla::ffi::Error`. The symbols exported from the cdylib (`tide_ffi_*`) are Rust
// functions forwarding to the `tide_cxx_*` handlers; a Rust cdylib exports only Rust-defined
// symbols. The list of targets is `TIDE_TARGETS` in tide_ffi.cc (one line per target).
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
// The instance state's XLA_FFI_TypeId and XLA_FFI_TypeInfo, registered by tide_jax
// (jax.ffi.register_ffi_type) before the targets.
void* tide_cxx_instance_type_id();
void* tide_cxx_instance_type_info();

#define TIDE_DECLARE_TARGET(name)                                     \
  XLA_FFI_Error* tide_cxx_##name##_instantiate(XLA_FFI_CallFrame* f); \
  XLA_FFI_Error* tide_cxx_##name##_cpu(XLA_FFI_CallFrame* f);         \
  XLA_FFI_Error* tide_cxx_##name##_cuda(XLA_FFI_CallFrame* f);
TIDE_DECLARE_TARGET(all_gather)
TIDE_DECLARE_TARGET(reduce_scatter)
TIDE_DECLARE_TARGET(all_gather_start)
TIDE_DECLARE_TARGET(all_gather_done)
TIDE_DECLARE_TARGET(reduce_scatter_start)
TIDE_DECLARE_TARGET(reduce_scatter_done)
#undef TIDE_DECLARE_TARGET
}
