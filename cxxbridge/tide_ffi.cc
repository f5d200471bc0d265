// XLA FFI handlers of tide (docs/design.md "FFI contract"). Built against jaxlib 0.10.2's headers
// (XLA FFI API 0.3, see build.rs). Needs no CUDA headers: the stream is taken as `void*`.
//
// Binding (the attribute set must match what tide_jax passes exactly: XLA's decoder rejects both
// missing and extra attributes; it is bound once, as the struct `TideAttrs`):
//   RemainingArgs   operands (all-gather: N local shards; reduce-scatter: N full gradients;
//                   done: start's N results, then start's N operands again)
//   RemainingRets   N results (all-gather: full parameters; reduce-scatter: fp32 shards; done: the
//                   same buffers as its first N operands, aliased by tide_jax)
//   TideAttrs       site, world, nodes, gpus_per_node, device_ordinals, device_ranks,
//                   device_groups, names, job, urgent (docs/design.md "FFI contract")
//   DeviceOrdinal   context: the executing device (CPU: global device id; GPU: local hardware id)
//   RunId           context: XLA's run id, the same on every device of one launch
//   State<Instance> context: which instance of its call site this HLO instruction is (below)
//   PlatformStream  context, CUDA only: XLA's stream, as void*
//
// Instances (docs/design.md "Call sites and instances"): JAX reuses a traced function's body (a
// jitted helper called per layer, remat, ...), so one `site` attribute can sit on several HLO
// instructions that XLA runs in any order. XLA runs the instantiate stage once per instruction and
// process, in the compiled program's order; the handler numbers a site's instructions 0, 1, ...
// (per target), the same numbers in every process compiling the same program, and every call is
// keyed by (site, instance).
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
#include <memory>
#include <string>
#include <string_view>

#include "tide/src/ffi/mod.rs.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tide::ffi {

// The attributes of every tide target, decoded once as a struct.
struct TideAttrs {
  int64_t site;
  int64_t world;
  int64_t nodes;
  int64_t gpus_per_node;
  ::ffi::Span<const int64_t> device_ordinals;
  ::ffi::Span<const int64_t> device_ranks;
  ::ffi::Span<const int64_t> device_groups;
  std::string_view names;
  int64_t job;
  int64_t urgent;
};

// Instantiate-stage state of one HLO instruction: its instance number within its site.
struct Instance {
  static ::ffi::TypeId id;
  uint64_t instance;
};
::ffi::TypeId Instance::id = {};
XLA_FFI_TypeInfo instance_type_info = ::ffi::MakeTypeInfo<Instance>();

}  // namespace tide::ffi

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    tide::ffi::TideAttrs, ::xla::ffi::StructMember<int64_t>("site"),
    ::xla::ffi::StructMember<int64_t>("world"), ::xla::ffi::StructMember<int64_t>("nodes"),
    ::xla::ffi::StructMember<int64_t>("gpus_per_node"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("device_ordinals"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("device_ranks"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("device_groups"),
    ::xla::ffi::StructMember<std::string_view>("names"),
    ::xla::ffi::StructMember<int64_t>("job"), ::xla::ffi::StructMember<int64_t>("urgent"));

namespace tide::ffi {
namespace {

// Must match `Op` and `Phase` codes in src/ffi/mod.rs.
// kReduceScatterInto: the reduce-scatter into slices of larger buffers; kAllGatherCast: the
// casting all-gather, fp32 in, bf16 out (`bridge_op` in Rust).
enum class Op : uint8_t { kAllGather = 0, kReduceScatter = 1, kReduceScatterInto = 2, kAllGatherCast = 3 };
enum class Phase : uint8_t { kSync = 0, kStart = 1, kDone = 2 };

std::string Where(Op op, Phase phase, int64_t site) {
  std::string name = op == Op::kAllGather         ? "tide all_gather"
                     : op == Op::kReduceScatter   ? "tide reduce_scatter"
                     : op == Op::kAllGatherCast   ? "tide all_gather_cast"
                                                  : "tide reduce_scatter_into";
  if (phase == Phase::kStart) name += "_start";
  if (phase == Phase::kDone) name += "_done";
  return name + " site " + std::to_string(site);
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
::ffi::Error Decode(Op op, Phase phase, ::ffi::RemainingArgs args, ::ffi::RemainingRets rets,
                    const TideAttrs& a, int32_t device_ordinal, ::ffi::RunId run_id, void* stream,
                    FfiCall& call) {
  std::string where = Where(op, phase, a.site) + " on device " + std::to_string(device_ordinal);
  call.site = a.site;
  call.world = a.world;
  call.nodes = a.nodes;
  call.gpus_per_node = a.gpus_per_node;
  call.device_ordinal = device_ordinal;
  call.device_ordinals = ToVec(a.device_ordinals);
  call.device_ranks = ToVec(a.device_ranks);
  call.device_groups = ToVec(a.device_groups);
  call.names.reserve(a.names.size());
  for (char c : a.names) call.names.push_back(static_cast<uint8_t>(c));
  call.stream = reinterpret_cast<size_t>(stream);
  call.run_id = run_id.run_id;
  call.job = a.job;
  call.urgent = a.urgent;

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

::ffi::Error FromException(Op op, Phase phase, int64_t site, const char* what) {
  return ::ffi::Error::Internal(Where(op, phase, site) + ": C++ exception in the FFI handler: " +
                                what);
}

template <Op op, Phase phase>
::ffi::ErrorOr<std::unique_ptr<Instance>> Instantiate(TideAttrs a) {
  try {
    auto state = std::make_unique<Instance>();
    state->instance = tide_instantiate(static_cast<uint8_t>(op), static_cast<uint8_t>(phase), a.site);
    return state;
  } catch (const std::exception& e) {
    return ::ffi::Unexpected(FromException(op, phase, a.site, e.what()));
  } catch (...) {
    return ::ffi::Unexpected(FromException(op, phase, a.site, "unknown"));
  }
}

// CUDA: synchronous from XLA's point of view (tide's work is enqueued on streams).
template <Op op, Phase phase>
::ffi::Error RunCuda(::ffi::RemainingArgs args, ::ffi::RemainingRets rets, TideAttrs a,
                     int32_t device_ordinal, ::ffi::RunId run_id, Instance* instance,
                     void* stream) {
  // Nothing may escape a handler: a C++ exception (allocation failure, a cxx conversion) becomes
  // an internal error; Rust catches its own panics (src/ffi/mod.rs).
  try {
    FfiCall call;
    ::ffi::Error decoded = Decode(op, phase, args, rets, a, device_ordinal, run_id, stream, call);
    if (!decoded.success()) return decoded;
    return ToError(tide_call_cuda(static_cast<uint8_t>(op), static_cast<uint8_t>(phase),
                                  instance->instance, call));
  } catch (const std::exception& e) {
    return FromException(op, phase, a.site, e.what());
  } catch (...) {
    return FromException(op, phase, a.site, "unknown");
  }
}

// CPU: asynchronous (docs/design.md "CPU handlers are asynchronous"): decode, hand the call and a
// heap-allocated Promise to Rust, return its Future at once.
template <Op op, Phase phase>
::ffi::Future RunCpu(::ffi::RemainingArgs args, ::ffi::RemainingRets rets, TideAttrs a,
                     int32_t device_ordinal, ::ffi::RunId run_id, Instance* instance) {
  ::ffi::Promise promise;
  ::ffi::Future future(promise);
  // Owned by Rust from the call on; completed and deleted by tide_complete_cpu.
  auto* box = new ::ffi::Promise(std::move(promise));
  try {
    FfiCall call;
    ::ffi::Error decoded = Decode(op, phase, args, rets, a, device_ordinal, run_id, nullptr, call);
    if (!decoded.success()) {
      box->SetError(decoded);
      delete box;
      return future;
    }
    size_t handle = reinterpret_cast<size_t>(box);
    box = nullptr;  // Rust completes it, exactly once, on every path (src/ffi/mod.rs)
    tide_call_cpu(static_cast<uint8_t>(op), static_cast<uint8_t>(phase), instance->instance,
                  std::move(call), handle);
  } catch (const std::exception& e) {
    if (box != nullptr) {
      box->SetError(FromException(op, phase, a.site, e.what()));
      delete box;
    }
  } catch (...) {
    if (box != nullptr) {
      box->SetError(FromException(op, phase, a.site, "unknown"));
      delete box;
    }
  }
  return future;
}

auto BindExecute() {
  return ::ffi::Ffi::Bind()
      .RemainingArgs()
      .RemainingRets()
      .Attrs<TideAttrs>()
      .Ctx<::ffi::DeviceOrdinal>()
      .Ctx<::ffi::RunId>()
      .Ctx<::ffi::State<Instance>>();
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

extern "C" void* tide_cxx_instance_type_id() { return &tide::ffi::Instance::id; }
extern "C" void* tide_cxx_instance_type_info() { return &tide::ffi::instance_type_info; }

// The targets: one line each. Every target has an instantiate handler (numbering its
// instructions) and an execute handler per platform.
#define TIDE_TARGET(name, op, phase)                                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(tide_cxx_##name##_instantiate,                                  \
                                (tide::ffi::Instantiate<op, phase>),                            \
                                ::xla::ffi::Ffi::BindInstantiate()                              \
                                    .Attrs<tide::ffi::TideAttrs>());                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(tide_cxx_##name##_cpu, (tide::ffi::RunCpu<op, phase>),          \
                                tide::ffi::BindExecute());                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(tide_cxx_##name##_cuda, (tide::ffi::RunCuda<op, phase>),        \
                                tide::ffi::BindExecute().Ctx<::xla::ffi::PlatformStream<void*>>());

using tide::ffi::Op;
using tide::ffi::Phase;
TIDE_TARGET(all_gather, Op::kAllGather, Phase::kSync)
TIDE_TARGET(reduce_scatter, Op::kReduceScatter, Phase::kSync)
TIDE_TARGET(all_gather_start, Op::kAllGather, Phase::kStart)
TIDE_TARGET(all_gather_done, Op::kAllGather, Phase::kDone)
TIDE_TARGET(reduce_scatter_start, Op::kReduceScatter, Phase::kStart)
TIDE_TARGET(reduce_scatter_done, Op::kReduceScatter, Phase::kDone)
TIDE_TARGET(reduce_scatter_into_start, Op::kReduceScatterInto, Phase::kStart)
TIDE_TARGET(reduce_scatter_into_done, Op::kReduceScatterInto, Phase::kDone)
TIDE_TARGET(all_gather_cast_start, Op::kAllGatherCast, Phase::kStart)
TIDE_TARGET(all_gather_cast_done, Op::kAllGatherCast, Phase::kDone)
