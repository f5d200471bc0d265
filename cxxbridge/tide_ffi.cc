// XLA FFI handlers of tide (docs/design.md "FFI contract"). Built against jaxlib 0.10.2's headers
// (XLA FFI API 0.3, see build.rs). Needs no CUDA headers: the stream is taken as `void*`.
//
// Binding, in order (the attribute set must match what tide_jax passes exactly: XLA's decoder
// rejects both missing and extra attributes):
//   RemainingArgs   N operands (all-gather: local shards; reduce-scatter: full gradients)
//   RemainingRets   N results (all-gather: full parameters; reduce-scatter: fp32 shards)
//   site            int64 scalar: id of the call site, the same on every rank
//   world           int64 scalar: size of the sharded mesh axis
//   nodes           int64 scalar: topology
//   gpus_per_node   int64 scalar: topology, nodes * gpus_per_node == world
//   device_ordinals int64 array: XLA device ordinal of every device of the mesh
//   device_ranks    int64 array: its rank along the axis
//   device_groups   int64 array: its group over the other mesh axes
//   names           string: parameter names joined by '\n' (for error messages)
//   job             int64 scalar: multi-process job id, 0 when every rank is in this process
//                   (docs/multiprocess.md)
//   DeviceOrdinal   context: the executing device (CPU: global device id; GPU: local hardware id)
//   PlatformStream  context, CUDA only: XLA's stream, as void*
//
// Buffers are borrowed views owned by XLA; only their addresses, dtypes and dims cross to Rust.
// No handler claims command-buffer compatibility: execution talks to the host (rendezvous).
//
// The CPU handlers are asynchronous: they decode the frame, hand it to Rust with a heap-allocated
// `Promise`, and return its `Future` at once; Rust runs the call on a tide worker thread and
// completes the promise through `tide_complete_cpu` (docs/design.md "CPU handlers are
// asynchronous": blocking XLA:CPU's pool threads in rendezvous can starve it). Buffers stay valid
// until the future completes: XLA keeps them for the thunk until then.

#include "tide/cxxbridge/tide_ffi.h"

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "tide/src/ffi/mod.rs.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tide::ffi {
namespace {

enum class Op { kAllGather, kReduceScatter };
enum class Platform { kCpu, kCuda };

const char* OpName(Op op) {
  return op == Op::kAllGather ? "tide all_gather" : "tide reduce_scatter";
}

rust::Vec<int64_t> ToVec(::ffi::Span<const int64_t> span) {
  rust::Vec<int64_t> out;
  out.reserve(span.size());
  for (int64_t v : span) out.push_back(v);
  return out;
}

FfiBuffer ToBuffer(const ::ffi::AnyBuffer& buf) {
  FfiBuffer out;
  out.data = reinterpret_cast<size_t>(buf.untyped_data());
  out.dtype = static_cast<int32_t>(buf.element_type());
  auto dims = buf.dimensions();
  out.dims.reserve(dims.size());
  for (int64_t d : dims) out.dims.push_back(d);
  return out;
}

// Fills `call` from the frame; an error for a non-buffer operand or result. May throw (allocation).
::ffi::Error Decode(Op op, ::ffi::RemainingArgs args, ::ffi::RemainingRets rets, int64_t site,
                    int64_t world, int64_t nodes, int64_t gpus_per_node,
                    ::ffi::Span<const int64_t> device_ordinals,
                    ::ffi::Span<const int64_t> device_ranks,
                    ::ffi::Span<const int64_t> device_groups, std::string_view names, int64_t job,
                    int32_t device_ordinal, ::ffi::RunId run_id, void* stream, FfiCall& call) {
    std::string where = std::string(OpName(op)) + " site " + std::to_string(site) +
                        " on device " + std::to_string(device_ordinal);
    call.site = site;
    call.world = world;
    call.nodes = nodes;
    call.gpus_per_node = gpus_per_node;
    call.device_ordinal = device_ordinal;
    call.device_ordinals = ToVec(device_ordinals);
    call.device_ranks = ToVec(device_ranks);
    call.device_groups = ToVec(device_groups);
    call.names.reserve(names.size());
    for (char c : names) call.names.push_back(static_cast<uint8_t>(c));
    call.stream = reinterpret_cast<size_t>(stream);
    call.run_id = run_id.run_id;
    call.job = job;

    call.inputs.reserve(args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      auto buf = args.get<::ffi::AnyBuffer>(i);
      if (!buf.has_value()) {
        return ::ffi::Error::InvalidArgument(where + ": operand " + std::to_string(i) +
                                             " is not a buffer: " + buf.error().message());
      }
      call.inputs.push_back(ToBuffer(*buf));
    }
    call.outputs.reserve(rets.size());
    for (size_t i = 0; i < rets.size(); ++i) {
      auto buf = rets.get<::ffi::AnyBuffer>(i);
      if (!buf.has_value()) {
        return ::ffi::Error::InvalidArgument(where + ": result " + std::to_string(i) +
                                             " is not a buffer: " + buf.error().message());
      }
      call.outputs.push_back(ToBuffer(**buf));
    }
    return ::ffi::Error::Success();
}

::ffi::Error ToError(const FfiStatus& status) {
    switch (status.code) {
      case StatusCode::Ok:
        return ::ffi::Error::Success();
      case StatusCode::InvalidArgument:
        return ::ffi::Error::InvalidArgument(std::string(status.message));
      default:
        return ::ffi::Error::Internal(std::string(status.message));
    }
}

::ffi::Error Run(Op op, Platform platform, ::ffi::RemainingArgs args, ::ffi::RemainingRets rets,
                 int64_t site, int64_t world, int64_t nodes, int64_t gpus_per_node,
                 ::ffi::Span<const int64_t> device_ordinals, ::ffi::Span<const int64_t> device_ranks,
                 ::ffi::Span<const int64_t> device_groups, std::string_view names, int64_t job,
                 int32_t device_ordinal, ::ffi::RunId run_id, void* stream) {
  // Nothing may escape a handler: a C++ exception (allocation failure, a cxx conversion) becomes
  // an internal error; Rust catches its own panics (src/ffi/mod.rs).
  try {
    FfiCall call;
    ::ffi::Error decoded = Decode(op, args, rets, site, world, nodes, gpus_per_node,
                                  device_ordinals, device_ranks, device_groups, names, job,
                                  device_ordinal, run_id, stream, call);
    if (!decoded.success()) return decoded;
    FfiStatus status;
    switch (platform) {
      case Platform::kCpu:
        status = op == Op::kAllGather ? tide_all_gather_cpu(call) : tide_reduce_scatter_cpu(call);
        break;
      case Platform::kCuda:
        status = op == Op::kAllGather ? tide_all_gather_cuda(call) : tide_reduce_scatter_cuda(call);
        break;
    }
    return ToError(status);
  } catch (const std::exception& e) {
    return ::ffi::Error::Internal(std::string(OpName(op)) + " site " + std::to_string(site) +
                                  ": C++ exception in the FFI handler: " + e.what());
  } catch (...) {
    return ::ffi::Error::Internal(std::string(OpName(op)) + " site " + std::to_string(site) +
                                  ": unknown C++ exception in the FFI handler");
  }
}

template <Op op>
::ffi::Future RunCpu(::ffi::RemainingArgs args, ::ffi::RemainingRets rets, int64_t site,
                     int64_t world, int64_t nodes, int64_t gpus_per_node,
                     ::ffi::Span<const int64_t> device_ordinals,
                     ::ffi::Span<const int64_t> device_ranks,
                     ::ffi::Span<const int64_t> device_groups, std::string_view names,
                     int64_t job, int32_t device_ordinal, ::ffi::RunId run_id) {
  ::ffi::Promise promise;
  ::ffi::Future future(promise);
  // Owned by Rust from the start call on; completed and deleted by tide_complete_cpu.
  auto* box = new ::ffi::Promise(std::move(promise));
  try {
    FfiCall call;
    ::ffi::Error decoded = Decode(op, args, rets, site, world, nodes, gpus_per_node,
                                  device_ordinals, device_ranks, device_groups, names, job,
                                  device_ordinal, run_id, nullptr, call);
    if (!decoded.success()) {
      box->SetError(decoded);
      delete box;
      return future;
    }
    size_t handle = reinterpret_cast<size_t>(box);
    box = nullptr;  // Rust completes it, exactly once, on every path (src/ffi/mod.rs)
    if (op == Op::kAllGather) {
      tide_all_gather_cpu_start(std::move(call), handle);
    } else {
      tide_reduce_scatter_cpu_start(std::move(call), handle);
    }
  } catch (const std::exception& e) {
    if (box != nullptr) {
      box->SetError(::ffi::Error::Internal(std::string(OpName(op)) + " site " +
                                           std::to_string(site) +
                                           ": C++ exception in the FFI handler: " + e.what()));
      delete box;
    }
  } catch (...) {
    if (box != nullptr) {
      box->SetError(::ffi::Error::Internal(std::string(OpName(op)) + " site " +
                                           std::to_string(site) +
                                           ": unknown C++ exception in the FFI handler"));
      delete box;
    }
  }
  return future;
}

template <Op op>
::ffi::Error RunCuda(::ffi::RemainingArgs args, ::ffi::RemainingRets rets, int64_t site,
                     int64_t world, int64_t nodes, int64_t gpus_per_node,
                     ::ffi::Span<const int64_t> device_ordinals,
                     ::ffi::Span<const int64_t> device_ranks,
                     ::ffi::Span<const int64_t> device_groups, std::string_view names,
                     int64_t job, int32_t device_ordinal, ::ffi::RunId run_id, void* stream) {
  return Run(op, Platform::kCuda, args, rets, site, world, nodes, gpus_per_node, device_ordinals,
             device_ranks, device_groups, names, job, device_ordinal, run_id, stream);
}

// The binding shared by every handler, up to the platform-specific context.
auto Bind() {
  return ::ffi::Ffi::Bind()
      .RemainingArgs()
      .RemainingRets()
      .Attr<int64_t>("site")
      .Attr<int64_t>("world")
      .Attr<int64_t>("nodes")
      .Attr<int64_t>("gpus_per_node")
      .Attr<::ffi::Span<const int64_t>>("device_ordinals")
      .Attr<::ffi::Span<const int64_t>>("device_ranks")
      .Attr<::ffi::Span<const int64_t>>("device_groups")
      .Attr<std::string_view>("names")
      .Attr<int64_t>("job")
      .Ctx<::ffi::DeviceOrdinal>()
      .Ctx<::ffi::RunId>();
}

}  // namespace

void tide_complete_cpu(size_t promise, int32_t code, rust::Str message) {
  auto* box = reinterpret_cast<::ffi::Promise*>(promise);
  if (code == 0) {
    box->SetAvailable();
  } else {
    std::string msg(message.data(), message.size());
    box->SetError(code == 1 ? ::ffi::Error::InvalidArgument(msg) : ::ffi::Error::Internal(msg));
  }
  delete box;
}

}  // namespace tide::ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(tide_cxx_all_gather_cpu,
                              tide::ffi::RunCpu<tide::ffi::Op::kAllGather>,
                              tide::ffi::Bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(tide_cxx_reduce_scatter_cpu,
                              tide::ffi::RunCpu<tide::ffi::Op::kReduceScatter>,
                              tide::ffi::Bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(tide_cxx_all_gather_cuda,
                              tide::ffi::RunCuda<tide::ffi::Op::kAllGather>,
                              tide::ffi::Bind().Ctx<::ffi::PlatformStream<void*>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(tide_cxx_reduce_scatter_cuda,
                              tide::ffi::RunCuda<tide::ffi::Op::kReduceScatter>,
                              tide::ffi::Bind().Ctx<::ffi::PlatformStream<void*>>());
