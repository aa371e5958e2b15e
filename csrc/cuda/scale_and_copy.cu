// CUDA launcher of tpamp::scale_ and tpamp::scale_and_copy (math: csrc/kernels/scale_and_copy.h;
// CPU twin: csrc/cpu/scale_and_copy.cpp).
//
// scale_: tensors[i] *= scale in place (the grad clip); a block whose scale is exactly 1 returns
// after reading it, so a clip that does not clip moves no gradient memory.
// scale_and_copy: dsts[i] = cast(srcs[i] * scale) (the fp32 main params -> fp16/bf16 model params
// copy when scale is absent), srcs and dsts disjoint.

#include "../host/validate.h"
#include "../kernels/scale_and_copy.h"
#include "../ops.h"
#include "multi_tensor_apply.cuh"

#include <type_traits>

namespace tpamp {
namespace cuda {
namespace {

template <typename src_t, typename dst_t>
struct ScaleCopyFunctor {
  const float* scale;  // null: plain cast-copy
  bool in_place;

  __device__ __forceinline__ void operator()(const ChunkInfo<2>& c) const {
    const bool mul = scale != nullptr;
    const float s = mul ? *scale : 1.0f;
    if (in_place && scale_is_identity(s)) return;  // no memory traffic
    const src_t* src = static_cast<const src_t*>(c.addr[0]) + c.offset;
    dst_t* dst = static_cast<dst_t*>(c.addr[1]) + c.offset;
    transform_chunk(src, dst, c.n, c.aligned, c.write, [&](src_t x) -> dst_t {
      if constexpr (std::is_same_v<src_t, dst_t>) {
        if (!mul) return x;  // a bit-exact copy (NaN payloads included)
      }
      float v = static_cast<float>(x);
      if (mul) v = scale_value(v, s);
      return static_cast<dst_t>(v);
    });
  }
};

void launch(at::TensorList srcs, at::TensorList dsts, const float* scale_ptr, bool in_place,
            const at::Device& device) {
  const int64_t n = static_cast<int64_t>(srcs.size());
  TORCH_CHECK(n <= INT32_MAX, "tpamp::scale_and_copy: too many tensors (", n, ")");
  c10::cuda::CUDAGuard guard(device);
  // One group per (src dtype, dst dtype); type index 0 float32, 1 float16, 2 bfloat16.
  auto type_index = [](at::ScalarType t) { return t == at::kFloat ? 0 : (t == at::kHalf ? 1 : 2); };
  std::vector<TensorEntry<2>> groups[3][3];
  for (int64_t i = 0; i < n; ++i) {
    void* src = srcs[i].data_ptr();
    void* dst = dsts[i].data_ptr();
    TensorEntry<2> e;
    e.addr = {src, dst};
    e.numel = srcs[i].numel();
    e.slot = 0;  // no per-chunk results
    e.index = static_cast<int32_t>(i);
    e.flags = static_cast<uint8_t>((is_aligned16(src) && is_aligned16(dst) ? kAligned : 0) | kWrite);
    groups[type_index(srcs[i].scalar_type())][type_index(dsts[i].scalar_type())].push_back(e);
  }
  const at::ScalarType types[3] = {at::kFloat, at::kHalf, at::kBFloat16};
  for (int a = 0; a < 3; ++a) {
    for (int b = 0; b < 3; ++b) {
      if (groups[a][b].empty()) continue;
      dispatch_float_type(types[a], "srcs", [&](auto src_tag) {
        using src_t = decltype(src_tag);
        dispatch_float_type(types[b], "dsts", [&](auto dst_tag) {
          using dst_t = decltype(dst_tag);
          multi_tensor_apply<2>(groups[a][b],
                                ScaleCopyFunctor<src_t, dst_t>{scale_ptr, in_place});
        });
      });
    }
  }
}

}  // namespace

void scale_(at::TensorList tensors, const at::Tensor& scale) {
  at::Device device(kLauncherDevice);
  validate_scale_and_copy("tpamp::scale_", tensors, tensors, true, scale, kLauncherDevice,
                          &device);
  if (tensors.empty()) return;
  launch(tensors, tensors, scale.data_ptr<float>(), true, device);
}

void scale_and_copy(at::TensorList srcs, at::TensorList dsts,
                    const std::optional<at::Tensor>& scale) {
  at::Device device(kLauncherDevice);
  const bool has_scale = validate_scale_and_copy("tpamp::scale_and_copy", srcs, dsts, false,
                                                 scale, kLauncherDevice, &device);
  if (srcs.empty()) return;
  launch(srcs, dsts, has_scale ? scale->data_ptr<float>() : nullptr, false, device);
}

}  // namespace cuda
}  // namespace tpamp
