// CPU launcher of tpamp::scale_ and tpamp::scale_and_copy (math: csrc/kernels/scale_and_copy.h;
// CUDA twin: csrc/cuda/scale_and_copy.cu).

#include "../host/validate.h"
#include "../kernels/scale_and_copy.h"
#include "../ops.h"
#include "launcher.h"
#include "vec_lanes.h"

#include <cstring>
#include <type_traits>

namespace tpamp {
namespace cpu {
namespace {

// dst[0 .. n) = cast<dst_t>(src * s) (kMul) or cast<dst_t>(src).
template <typename src_t, typename dst_t, bool kMul>
void scale_copy_chunk(const src_t* src, dst_t* dst, int64_t n, float s) {
  if constexpr (std::is_same_v<src_t, dst_t> && !kMul) {
    std::memmove(dst, src, static_cast<size_t>(n) * sizeof(src_t));  // bit-exact
  } else {
    const FVec sv(s);
    int64_t i = 0;
    for (; kUseVec && i + kVecStep <= n; i += kVecStep) {
      FVec a, b;
      VecIO<src_t>::load(src + i, a, b);
      if (kMul) {
        a = scale_value(a, sv);
        b = scale_value(b, sv);
      }
      VecIO<dst_t>::template store<true, false>(dst + i, a, b);
    }
    for (; i < n; ++i) {
      float v = static_cast<float>(src[i]);
      if (kMul) v = scale_value(v, s);
      dst[i] = static_cast<dst_t>(v);
    }
  }
}

template <typename F>
void dispatch_float(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "tpamp: unexpected dtype ", t);  // validated before
  }
}

void run(at::TensorList srcs, at::TensorList dsts, bool has_scale, float s) {
  std::vector<int64_t> numels;
  numels.reserve(srcs.size());
  for (const auto& t : srcs) numels.push_back(t.numel());
  const ChunkPlan plan = plan_chunks(numels);
  for_each_chunk(plan, [&](int64_t, const Chunk& c) {
    const at::Tensor& src = srcs[c.entry];
    const at::Tensor& dst = dsts[c.entry];
    dispatch_float(src.scalar_type(), [&](auto src_tag) {
      using src_t = decltype(src_tag);
      dispatch_float(dst.scalar_type(), [&](auto dst_tag) {
        using dst_t = decltype(dst_tag);
        const src_t* in = static_cast<const src_t*>(src.const_data_ptr()) + c.offset;
        dst_t* out = static_cast<dst_t*>(dst.data_ptr()) + c.offset;
        if (has_scale) {
          scale_copy_chunk<src_t, dst_t, true>(in, out, c.n, s);
        } else {
          scale_copy_chunk<src_t, dst_t, false>(in, out, c.n, s);
        }
      });
    });
  });
}

}  // namespace

void scale_(at::TensorList tensors, const at::Tensor& scale) {
  at::Device device(at::kCPU);
  validate_scale_and_copy("tpamp::scale_", tensors, tensors, true, scale, at::kCPU, &device);
  const float s = scale.item<float>();  // host memory: no sync
  if (scale_is_identity(s)) return;     // no memory traffic
  run(tensors, tensors, true, s);
}

void scale_and_copy(at::TensorList srcs, at::TensorList dsts,
                    const std::optional<at::Tensor>& scale) {
  at::Device device(at::kCPU);
  const bool has_scale =
      validate_scale_and_copy("tpamp::scale_and_copy", srcs, dsts, false, scale, at::kCPU, &device);
  run(srcs, dsts, has_scale, has_scale ? scale->item<float>() : 1.0f);
}

}  // namespace cpu
}  // namespace tpamp
