// Multi-tensor apply: one kernel launch walks many tensors, one thread block per chunk.
//
// The layout follows NVIDIA apex (csrc/multi_tensor_apply.cuh): the host packs a table of tensor
// addresses into the kernel's parameters and each block finds its (tensor, chunk) from it, so a
// list of thousands of tensors costs a handful of launches and no host-to-device copy (and stays
// capturable in a CUDA graph). It differs from apex where apex is known to go wrong:
//
// * Empty tensors never enter a table, so they cannot leave a launch short of blocks or stall it.
// * Element counts and offsets are int64: a tensor may hold more than 2^31 elements.
// * The table stores each tensor's first block, not a per-block (tensor, chunk) pair: a launch is
//   limited by the number of tensors it holds (kMaxTensors), never by its number of blocks, and
//   a block finds its tensor by a binary search over at most kMaxTensors entries.
// * Each chunk has a global "slot" (its index among all chunks of the call, tensors in the
//   caller's order), so per-chunk partial results land in fixed places and a second kernel can
//   reduce them in a fixed order: reductions are deterministic, with no float atomics.
// * 16-byte vector loads/stores are used only when every pointer of a tensor is 16-byte aligned
//   (data_ptr includes the storage offset); other tensors take a scalar path.
//
// This is the CUDA launcher of "one math, two launchers" (csrc/README.md): the functors in
// csrc/cuda/*.cu call the math of csrc/kernels/*.h on float lanes; csrc/cpu/launcher.h is the CPU
// twin (same kChunkSize, same slot numbering).
//
// Header-only; each kernel file (one functor per .cu) includes it.

#pragma once

#include "../kernels/common.h"
#include "launch.cuh"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <array>
#include <climits>
#include <cstdint>
#include <vector>

namespace tpamp {

constexpr int kBlockSize = 512;        // threads per block; one block per chunk (kChunkSize)
constexpr int kUnroll = 4;             // vector loads in flight per thread
constexpr int kMaxKernelParamBytes = 4096;  // the portable kernel-parameter limit
static_assert(kChunkSize % (kBlockSize * 8) == 0, "a chunk must split evenly into 16-byte packs");

// How many tensors one launch's table holds: the table (37 bytes a tensor at depth 2) plus the
// functor must fit the 4 KB of kernel parameters.
template <int DEPTH>
struct MaxTensors;
template <>
struct MaxTensors<1> { static constexpr int value = 120; };
template <>
struct MaxTensors<2> { static constexpr int value = 90; };

// The tensors of one launch. DEPTH is the number of lists walked together (input, output).
template <int DEPTH>
struct TensorTable {
  static constexpr int kMax = MaxTensors<DEPTH>::value;
  void* addr[DEPTH][kMax];
  int64_t numel[kMax];
  int32_t first_block[kMax + 1];  // blocks of tensor i: [first_block[i], first_block[i + 1])
  int32_t slot[kMax];             // global slot of tensor i's first chunk
  int32_t index[kMax];            // position of tensor i in the caller's list
  uint8_t flags[kMax];            // kAligned | kMasked | kWrite
  int32_t count;
};
static_assert(sizeof(TensorTable<1>) <= 3584, "TensorTable<1> leaves too little room for the functor");
static_assert(sizeof(TensorTable<2>) <= 3584, "TensorTable<2> leaves too little room for the functor");

constexpr uint8_t kAligned = 1;  // every pointer of the tensor is 16-byte aligned
constexpr uint8_t kMasked = 2;   // caller-defined per-tensor flag (grad_stats: counts toward the norm)
constexpr uint8_t kWrite = 4;    // the functor stores its results for this tensor

// One tensor as the host hands it to multi_tensor_apply.
template <int DEPTH>
struct TensorEntry {
  std::array<void*, DEPTH> addr;
  int64_t numel;
  int32_t slot;
  int32_t index;
  uint8_t flags;
};

// What a block is given: its chunk of one tensor.
template <int DEPTH>
struct ChunkInfo {
  void* addr[DEPTH];  // tensor base pointers (untyped; the functor knows the dtypes)
  int64_t offset;     // first element of the chunk
  int n;              // elements in the chunk, 1 .. kChunkSize
  int32_t slot;       // global slot of this chunk
  int32_t index;      // position of the tensor in the caller's list
  bool aligned;
  bool masked;
  bool write;
};

inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int DEPTH, typename Functor>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_apply_kernel(const TensorTable<DEPTH> table, Functor functor) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  // The last tensor whose first block is <= b. first_block is strictly increasing (no empty
  // tensors), so this is the block's tensor.
  int lo = 0, hi = table.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table.first_block[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int t = lo;
  const int64_t chunk = static_cast<int64_t>(b - table.first_block[t]);
  ChunkInfo<DEPTH> c;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) c.addr[d] = table.addr[d][t];
  c.offset = chunk * kChunkSize;
  const int64_t left = table.numel[t] - c.offset;
  c.n = static_cast<int>(left < kChunkSize ? left : kChunkSize);
  c.slot = table.slot[t] + static_cast<int32_t>(chunk);
  c.index = table.index[t];
  c.aligned = (table.flags[t] & kAligned) != 0;
  c.masked = (table.flags[t] & kMasked) != 0;
  c.write = (table.flags[t] & kWrite) != 0;
  functor(c);
}

// Launches Functor over every chunk of every non-empty entry, on the current stream of the
// current device (the caller holds a device guard). Entries go in the order given; a launch
// takes up to kMaxTensors of them.
template <int DEPTH, typename Functor>
void multi_tensor_apply(const std::vector<TensorEntry<DEPTH>>& entries, const Functor& functor) {
  static_assert(sizeof(TensorTable<DEPTH>) + sizeof(Functor) <= kMaxKernelParamBytes,
                "kernel parameters exceed 4 KB: lower MaxTensors or slim the functor");
  using Table = TensorTable<DEPTH>;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Table table;
  table.count = 0;
  int64_t blocks = 0;

  auto launch = [&]() {
    if (table.count == 0) return;
    table.first_block[table.count] = static_cast<int32_t>(blocks);
    auto* apply_kernel = &multi_tensor_apply_kernel<DEPTH, Functor>;
    TPAMP_LAUNCH(apply_kernel, static_cast<unsigned int>(blocks), kBlockSize, 0, stream, table,
                 functor);
    table.count = 0;
    blocks = 0;
  };

  for (const auto& e : entries) {
    if (e.numel == 0) continue;  // nothing to do, and no block may wait on it
    const int64_t chunks = num_chunks(e.numel);
    TORCH_CHECK(chunks <= INT32_MAX, "tpamp multi_tensor_apply: a tensor of ", e.numel,
                " elements needs ", chunks, " chunks, more than one launch can hold");
    if (table.count == Table::kMax || blocks + chunks > INT32_MAX) launch();
    const int i = table.count++;
    for (int d = 0; d < DEPTH; ++d) table.addr[d][i] = e.addr[d];
    table.numel[i] = e.numel;
    table.first_block[i] = static_cast<int32_t>(blocks);
    table.slot[i] = e.slot;
    table.index[i] = e.index;
    table.flags[i] = e.flags;
    blocks += chunks;
  }
  launch();
}

// ---------------------------------------------------------------------------------------------
// Device helpers shared by the functors.

// N elements of T moved as whole 16-byte words (N * sizeof(T) is a multiple of 16), so a pack
// needs only 16-byte alignment: 8 fp16 = one 16-byte load, 8 fp32 = two.
template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

// Elements per vector step: one 16-byte word of the narrower of the two types.
template <typename in_t, typename out_t>
struct VecWidth {
  static constexpr int value = 16 / (sizeof(in_t) < sizeof(out_t) ? sizeof(in_t) : sizeof(out_t));
};

// Applies f (in_t -> out_t) to every element of one chunk, in[i] -> out[i], and stores the
// results when `store` is true. f may accumulate statistics in the caller's registers. `in` and
// `out` may be the same memory (in place): each element is read and written by one thread, and
// all reads of a step precede its writes.
// U: vector loads in flight per thread (kUnroll unless a functor measured better).
template <int U = kUnroll, typename in_t, typename out_t, typename F>
__device__ __forceinline__ void transform_chunk(const in_t* in, out_t* out, int n, bool aligned,
                                                bool store, F&& f) {
  constexpr int V = VecWidth<in_t, out_t>::value;
  int scalar_start = 0;
  if (aligned) {
    const int nvec = n / V;
    for (int base = threadIdx.x; base < nvec; base += kBlockSize * U) {
      Pack<in_t, V> buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = base + u * kBlockSize;
        if (p < nvec) buf[u] = reinterpret_cast<const Pack<in_t, V>*>(in)[p];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = base + u * kBlockSize;
        if (p < nvec) {
          Pack<out_t, V> o;
#pragma unroll
          for (int j = 0; j < V; ++j) o.v[j] = f(buf[u].v[j]);
          if (store) reinterpret_cast<Pack<out_t, V>*>(out)[p] = o;
        }
      }
    }
    scalar_start = nvec * V;
  }
  for (int i = scalar_start + threadIdx.x; i < n; i += kBlockSize) {
    const out_t o = f(in[i]);
    if (store) out[i] = o;
  }
}

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxNanOp {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return max_propagate_nan(a, b);
  }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Deterministic block reduction over kBlockSize threads (fixed shuffle tree, then the warp
// totals in warp order). The result is valid in thread 0. `shared` holds 32 T; the call ends with a barrier so it can be
// reused at once.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* shared) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_reduce(v, op);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    constexpr int nwarps = kBlockSize / 32;
    v = lane < nwarps ? shared[lane] : identity;
    v = warp_reduce(v, op);
  }
  __syncthreads();
  return v;
}

// Runs f.template operator()<T>() with T the C++ type of a float32/float16/bfloat16 dtype.
template <typename F>
void dispatch_float_type(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, what, " has dtype ", t, "; expected float32, float16 or bfloat16");
  }
}

}  // namespace tpamp
