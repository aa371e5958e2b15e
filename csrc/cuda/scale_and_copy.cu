// tpamp::scale_and_copy: dsts[i] = cast(srcs[i] * scale) in one pass over a list of tensors.
// Used for the grad clip (in place: srcs is dsts, scale = clip coefficient) and for copying the
// fp32 main params into the fp16/bf16 model params (scale absent). The product is taken in
// float32 with the exact float32 scale, then rounded once to the destination type.

#include "multi_tensor_apply.cuh"
#include "ops.h"

#include <ATen/MemoryOverlap.h>

#include <type_traits>

namespace tpamp {
namespace {

template <typename src_t, typename dst_t>
struct ScaleCopyFunctor {
  const float* scale;  // null: plain cast-copy

  __device__ __forceinline__ void operator()(const ChunkInfo<2>& c) const {
    const src_t* src = static_cast<const src_t*>(c.addr[0]) + c.offset;
    dst_t* dst = static_cast<dst_t*>(c.addr[1]) + c.offset;
    const bool mul = scale != nullptr;
    const float s = mul ? *scale : 1.0f;
    transform_chunk(src, dst, c.n, c.aligned, c.write, [&](src_t x) -> dst_t {
      if constexpr (std::is_same_v<src_t, dst_t>) {
        if (!mul) return x;  // a bit-exact copy (NaN payloads included)
      }
      float v = static_cast<float>(x);
      if (mul) v *= s;
      return static_cast<dst_t>(v);
    });
  }
};

}  // namespace

void scale_and_copy_cuda(at::TensorList srcs, at::TensorList dsts,
                         const std::optional<at::Tensor>& scale) {
  const int64_t n = static_cast<int64_t>(srcs.size());
  TORCH_CHECK(static_cast<int64_t>(dsts.size()) == n, "tpamp::scale_and_copy: srcs has ", n,
              " tensors, dsts has ", dsts.size());
  if (n == 0) return;
  TORCH_CHECK(n <= INT32_MAX, "tpamp::scale_and_copy: too many tensors (", n, ")");
  const at::Device device = srcs[0].device();
  TORCH_CHECK(device.is_cuda(), "tpamp::scale_and_copy: tensors must be on a CUDA device, got ",
              device);
  const bool has_scale = scale.has_value() && scale->defined();
  if (has_scale) {
    TORCH_CHECK(scale->device() == device, "tpamp::scale_and_copy: scale is on ",
                scale->device(), ", expected ", device);
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1,
                "tpamp::scale_and_copy: scale must be a 1-element float32 tensor, got ",
                scale->scalar_type(), " of shape ", scale->sizes());
  }
  for (int64_t i = 0; i < n; ++i) {
    for (const auto* which : {"srcs", "dsts"}) {
      const at::Tensor& t = which[0] == 's' ? srcs[i] : dsts[i];
      TORCH_CHECK(t.defined(), "tpamp::scale_and_copy: ", which, "[", i, "] is undefined");
      TORCH_CHECK(t.device() == device, "tpamp::scale_and_copy: ", which, "[", i, "] is on ",
                  t.device(), ", expected ", device, " (all tensors on one CUDA device)");
      TORCH_CHECK(is_float_type(t.scalar_type()), "tpamp::scale_and_copy: ", which, "[", i,
                  "] has dtype ", t.scalar_type(), "; expected float32, float16 or bfloat16");
      TORCH_CHECK(t.is_contiguous(), "tpamp::scale_and_copy: ", which, "[", i,
                  "] must be contiguous, got sizes ", t.sizes(), " and strides ", t.strides());
    }
    TORCH_CHECK(srcs[i].sizes() == dsts[i].sizes(), "tpamp::scale_and_copy: dsts[", i,
                "] has shape ", dsts[i].sizes(), ", srcs[", i, "] has shape ", srcs[i].sizes());
    const auto overlap = at::get_overlap_status(srcs[i], dsts[i]);
    TORCH_CHECK(overlap != at::MemOverlapStatus::Partial &&
                    overlap != at::MemOverlapStatus::TooHard,
                "tpamp::scale_and_copy: dsts[", i, "] partly overlaps srcs[", i,
                "]; pass the same tensor (in place) or disjoint memory");
  }

  c10::cuda::CUDAGuard guard(device);

  // One group per (src dtype, dst dtype); type index 0 float32, 1 float16, 2 bfloat16.
  auto type_index = [](at::ScalarType t) { return t == at::kFloat ? 0 : (t == at::kHalf ? 1 : 2); };
  std::vector<TensorEntry<2>> groups[3][3];
  for (int64_t i = 0; i < n; ++i) {
    void* src = srcs[i].data_ptr();
    void* dst = dsts[i].data_ptr();
    // In place without a scale leaves the values as they are.
    if (!has_scale && src == dst && srcs[i].scalar_type() == dsts[i].scalar_type()) continue;
    TensorEntry<2> e;
    e.addr = {src, dst};
    e.numel = srcs[i].numel();
    e.slot = 0;  // no per-chunk results
    e.index = static_cast<int32_t>(i);
    e.flags = static_cast<uint8_t>((is_aligned16(src) && is_aligned16(dst) ? kAligned : 0) | kWrite);
    groups[type_index(srcs[i].scalar_type())][type_index(dsts[i].scalar_type())].push_back(e);
  }

  const float* scale_ptr = has_scale ? scale->data_ptr<float>() : nullptr;
  const at::ScalarType types[3] = {at::kFloat, at::kHalf, at::kBFloat16};
  for (int a = 0; a < 3; ++a) {
    for (int b = 0; b < 3; ++b) {
      if (groups[a][b].empty()) continue;
      dispatch_float_type(types[a], "srcs", [&](auto src_tag) {
        using src_t = decltype(src_tag);
        dispatch_float_type(types[b], "dsts", [&](auto dst_tag) {
          using dst_t = decltype(dst_tag);
          multi_tensor_apply<2>(groups[a][b], ScaleCopyFunctor<src_t, dst_t>{scale_ptr});
        });
      });
    }
  }
}

}  // namespace tpamp
