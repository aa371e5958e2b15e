// CUDA launcher of tpamp::grad_stats_ and tpamp::grad_stats_out (math: csrc/kernels/grad_stats.h;
// CPU twin: csrc/cpu/grad_stats.cpp).
//
// One pass over a list of gradients that multiplies by an optional device scalar (the unscale),
// writes the result in place or to float32 outputs (the fp16/bf16 -> fp32 main-grad copy), and
// takes found_inf, sum of squares, max |g|, the zero count and per-tensor L2 norms of the values
// written. Two stages, so results do not depend on block scheduling: each block (one chunk)
// writes its partial results to its slot of a workspace; a finalize kernel reduces the slots in a
// fixed order (fp64), a second one the slots of each tensor for per-tensor norms.

#include "../host/validate.h"
#include "../kernels/grad_stats.h"
#include "../ops.h"
#include "multi_tensor_apply.cuh"

#include <ATen/ops/empty.h>

// Tuning knobs measured by the GPU check's variants (docs/benchmarks.md): the one-barrier tail
// and the vector loads in flight per thread.
#ifndef TPAMP_GS_FUSED_TAIL
#define TPAMP_GS_FUSED_TAIL 1
#endif
#ifndef TPAMP_GS_UNROLL
#define TPAMP_GS_UNROLL kUnroll
#endif

namespace tpamp {
namespace cuda {
namespace {

// Per-slot partials, carved from one byte workspace (fp64 fields first, for alignment).
struct Partials {
  double* sumsq;         // sum of squares; 0 for tensors outside the mask
  double* sumsq_all;     // sum of squares whatever the mask (per-tensor norms only, else null)
  float* amax;           // max |g| (nan if any); 0 outside the mask
  int32_t* zeros;        // zero elements; 0 outside the mask (or when not counted)
  int32_t* found;        // 1 if any element written is inf/nan; every tensor
  int32_t* slot_tensor;  // the slot's tensor index (per-tensor norms only, else null)
};

template <typename in_t, typename out_t>
struct GradStatsFunctor {
  const float* scale;  // null: no multiply
  Partials p;
  bool count_zeros;

  __device__ __forceinline__ void operator()(const ChunkInfo<2>& c) const {
    const in_t* in = static_cast<const in_t*>(c.addr[0]) + c.offset;
    out_t* out = static_cast<out_t*>(c.addr[1]) + c.offset;
    const bool mul = scale != nullptr;
    const float s = mul ? *scale : 1.0f;
    const bool zeros = count_zeros;
    // Per thread: the math of kernels/grad_stats.h on float lanes, over the values as stored.
    StatsLanes<float> acc = stats_init<float>();
    transform_chunk<TPAMP_GS_UNROLL>(in, out, c.n, c.aligned, c.write, [&](in_t x) -> out_t {
      float v = static_cast<float>(x);
      if (mul) v = scale_value(v, s);
      const out_t w = static_cast<out_t>(v);
      const float r = static_cast<float>(w);
      if (zeros) {
        stats_add<true>(acc, r);
      } else {
        stats_add<false>(acc, r);
      }
      return w;
    });
    ChunkStats cs = chunk_stats_init();
    const bool ok = fold_block(cs, acc.sq, acc.amax, acc.zeros);
    // A thread's fp32 sum of squares overflowed with every value finite: the block sums the
    // chunk again in fp64 from the values as stored (the barrier makes the writes visible).
    if (__syncthreads_or(ok ? 0 : 1)) {
      cs.sumsq = 0.0;
      for (int i = threadIdx.x; i < c.n; i += kBlockSize) {
        add_sq_fp64(cs.sumsq, c.write ? static_cast<float>(out[i]) : static_cast<float>(in[i]));
      }
    }

#if TPAMP_GS_FUSED_TAIL
    // The four results in one reduction: each warp reduces with block_reduce's shuffle tree, the
    // warp totals meet in shared memory after one barrier, and warp 0 reduces them in warp order.
    // The same tree as four block_reduce calls (the same bits) with one barrier instead of eight:
    // a chunk is only 16 vector steps a thread, so its tail is a large share of its time.
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    double sq = warp_reduce(cs.sumsq, SumOp{});
    float mx = warp_reduce(cs.amax, MaxNanOp{});
    int nz = warp_reduce(static_cast<int>(cs.zeros), SumOp{});
    const bool warp_bad = __any_sync(0xffffffffu, cs.found != 0);
    __shared__ double shared_d[32];
    __shared__ float shared_f[32];
    __shared__ int shared_i[32];
    __shared__ int shared_b[32];
    if (lane == 0) {
      shared_d[warp] = sq;
      shared_f[warp] = mx;
      shared_i[warp] = nz;
      shared_b[warp] = warp_bad ? 1 : 0;
    }
    __syncthreads();
    if (warp != 0) return;
    constexpr int kWarps = kBlockSize / 32;
    sq = warp_reduce(lane < kWarps ? shared_d[lane] : 0.0, SumOp{});
    mx = warp_reduce(lane < kWarps ? shared_f[lane] : 0.0f, MaxNanOp{});
    nz = warp_reduce(lane < kWarps ? shared_i[lane] : 0, SumOp{});
    const bool any_bad = __any_sync(0xffffffffu, lane < kWarps && shared_b[lane] != 0);
#else
    __shared__ double shared_d[32];
    __shared__ float shared_f[32];
    __shared__ int shared_i[32];
    const int any_bad = __syncthreads_or(cs.found);
    const double sq = block_reduce(cs.sumsq, SumOp{}, 0.0, shared_d);
    const float mx = block_reduce(cs.amax, MaxNanOp{}, 0.0f, shared_f);
    const int nz = block_reduce(static_cast<int>(cs.zeros), SumOp{}, 0, shared_i);
#endif
    if (threadIdx.x == 0) {
      p.sumsq[c.slot] = c.masked ? sq : 0.0;
      p.amax[c.slot] = c.masked ? mx : 0.0f;
      p.zeros[c.slot] = c.masked ? nz : 0;
      p.found[c.slot] = any_bad ? 1 : 0;
      if (p.sumsq_all != nullptr) {
        p.sumsq_all[c.slot] = sq;
        p.slot_tensor[c.slot] = c.index;
      }
    }
  }
};

// One block reduces all slots in a fixed order and writes the four totals.
__global__ void __launch_bounds__(kBlockSize)
    grad_stats_finalize_kernel(Partials p, int64_t num_slots, float* found_inf, double* sumsq,
                               float* amax, int64_t* zeros) {
  double sq = 0.0;
  float mx = 0.0f;
  long long nz = 0;
  int bad = 0;
  for (int64_t s = threadIdx.x; s < num_slots; s += kBlockSize) {
    sq += p.sumsq[s];
    mx = max_propagate_nan(mx, p.amax[s]);
    nz += p.zeros[s];
    bad |= p.found[s];
  }
  __shared__ double shared_d[32];
  __shared__ float shared_f[32];
  __shared__ long long shared_l[32];
  bad = __syncthreads_or(bad);
  sq = block_reduce(sq, SumOp{}, 0.0, shared_d);
  mx = block_reduce(mx, MaxNanOp{}, 0.0f, shared_f);
  nz = block_reduce(nz, SumOp{}, 0LL, shared_l);
  if (threadIdx.x == 0) {
    found_inf[0] = bad ? 1.0f : 0.0f;
    sumsq[0] = sq;  // fp64: no rounding through fp32 before the caller's root
    amax[0] = mx;
    zeros[0] = static_cast<int64_t>(nz);
  }
}

// First slot whose tensor index is >= t; slot_tensor is non-decreasing because slots are
// numbered in the caller's tensor order.
__device__ __forceinline__ int32_t lower_bound_slot(const int32_t* slot_tensor, int32_t num_slots,
                                                    int32_t t) {
  int32_t lo = 0, hi = num_slots;
  while (lo < hi) {
    const int32_t mid = lo + ((hi - lo) >> 1);
    if (slot_tensor[mid] < t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One warp per tensor: L2 norm from the tensor's slots (none for an empty tensor: 0).
__global__ void __launch_bounds__(kBlockSize)
    per_tensor_norm_kernel(Partials p, int32_t num_slots, int32_t num_tensors, float* norms) {
  constexpr int kWarps = kBlockSize / 32;
  const int32_t t = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (t >= num_tensors) return;  // whole warps leave; no block barrier follows
  const int32_t begin = lower_bound_slot(p.slot_tensor, num_slots, t);
  const int32_t end = lower_bound_slot(p.slot_tensor, num_slots, t + 1);
  double sq = 0.0;
  for (int32_t s = begin + lane; s < end; s += 32) sq += p.sumsq_all[s];
  sq = warp_reduce(sq, SumOp{});
  if (lane == 0) norms[t] = static_cast<float>(sqrt(sq));
}

GradStatsResult grad_stats_impl(const char* op, at::TensorList grads, at::TensorList out,
                                bool in_place, const std::optional<at::Tensor>& scale,
                                const c10::List<bool>& mask, bool count_zeros, bool per_tensor) {
  const GradStatsArgs args =
      validate_grad_stats(op, grads, out, in_place, scale, mask, kLauncherDevice);
  const int64_t n = static_cast<int64_t>(grads.size());
  TORCH_CHECK(n <= INT32_MAX, op, ": too many tensors (", n, ")");
  const at::Device device = args.device;
  const bool has_scale = args.has_scale;

  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Slots in the caller's order; entries grouped by grad dtype since each launch is compiled for
  // one (in, out) pair. Type index: 0 float32, 1 float16, 2 bfloat16.
  auto type_index = [](at::ScalarType t) { return t == at::kFloat ? 0 : (t == at::kHalf ? 1 : 2); };
  std::vector<TensorEntry<2>> groups[3];
  int64_t num_slots = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    const int64_t numel = g.numel();
    if (numel == 0) continue;
    void* src = g.data_ptr();
    void* dst = in_place ? src : out[i].data_ptr();
    TensorEntry<2> e;
    e.addr = {src, dst};
    e.numel = numel;
    e.slot = static_cast<int32_t>(num_slots);
    e.index = static_cast<int32_t>(i);
    // Nothing to store when the pass reads and writes the same memory without a multiply.
    e.flags = static_cast<uint8_t>((is_aligned16(src) && is_aligned16(dst) ? kAligned : 0) |
                                   (mask.get(i) ? kMasked : 0) |
                                   (has_scale || !in_place ? kWrite : 0));
    groups[type_index(g.scalar_type())].push_back(e);
    num_slots += num_chunks(numel);
    TORCH_CHECK(num_slots <= INT32_MAX, op, ": ", num_slots, " chunks exceed the int32 slot index");
  }

  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor found_inf = at::empty({1}, f32);
  at::Tensor sumsq = at::empty({}, f32.dtype(at::kDouble));
  at::Tensor amax = at::empty({}, f32);
  at::Tensor zeros = at::empty({}, f32.dtype(at::kLong));
  at::Tensor norms = at::empty({per_tensor ? n : 0}, f32);

  at::Tensor workspace;
  Partials p{};
  if (num_slots > 0) {
    // 2 fp64 + 4 32-bit fields per slot.
    workspace = at::empty({num_slots * (2 * 8 + 4 * 4)}, f32.dtype(at::kByte));
    char* w = static_cast<char*>(workspace.data_ptr());
    p.sumsq = reinterpret_cast<double*>(w);
    p.amax = reinterpret_cast<float*>(w + 16 * num_slots);
    p.zeros = reinterpret_cast<int32_t*>(w + 20 * num_slots);
    p.found = reinterpret_cast<int32_t*>(w + 24 * num_slots);
    if (per_tensor) {
      p.sumsq_all = reinterpret_cast<double*>(w + 8 * num_slots);
      p.slot_tensor = reinterpret_cast<int32_t*>(w + 28 * num_slots);
    }
  }

  const float* scale_ptr = has_scale ? scale->data_ptr<float>() : nullptr;
  for (int k = 0; k < 3; ++k) {
    if (groups[k].empty()) continue;
    const at::ScalarType in_type = k == 0 ? at::kFloat : (k == 1 ? at::kHalf : at::kBFloat16);
    dispatch_float_type(in_type, "grads", [&](auto in_tag) {
      using in_t = decltype(in_tag);
      if (in_place) {
        multi_tensor_apply<2>(groups[k], GradStatsFunctor<in_t, in_t>{scale_ptr, p, count_zeros});
      } else {
        multi_tensor_apply<2>(groups[k], GradStatsFunctor<in_t, float>{scale_ptr, p, count_zeros});
      }
    });
  }

  TPAMP_LAUNCH(grad_stats_finalize_kernel, 1, kBlockSize, 0, stream, p, num_slots,
               found_inf.data_ptr<float>(), sumsq.data_ptr<double>(), amax.data_ptr<float>(),
               zeros.data_ptr<int64_t>());
  if (per_tensor && n > 0) {
    constexpr int kWarps = kBlockSize / 32;
    const unsigned int blocks = static_cast<unsigned int>((n + kWarps - 1) / kWarps);
    TPAMP_LAUNCH(per_tensor_norm_kernel, blocks, kBlockSize, 0, stream, p,
                 static_cast<int32_t>(num_slots), static_cast<int32_t>(n),
                 norms.data_ptr<float>());
  }
  return {found_inf, sumsq, amax, zeros, norms};
}

}  // namespace

GradStatsResult grad_stats_(at::TensorList grads, const std::optional<at::Tensor>& scale,
                            const c10::List<bool>& mask, bool count_zeros, bool per_tensor) {
  return grad_stats_impl("tpamp::grad_stats_", grads, {}, true, scale, mask, count_zeros,
                         per_tensor);
}

GradStatsResult grad_stats_out(at::TensorList grads, const std::optional<at::Tensor>& scale,
                               const c10::List<bool>& mask, bool count_zeros, bool per_tensor,
                               at::TensorList out) {
  return grad_stats_impl("tpamp::grad_stats_out", grads, out, false, scale, mask, count_zeros,
                         per_tensor);
}

}  // namespace cuda
}  // namespace tpamp
