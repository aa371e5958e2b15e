// SIMT emulation of the CUDA built-ins the launchers in csrc/cuda/ use, so g++ compiles those
// .cu files unchanged against CPU torch and their kernels run on CPU tensors (test
// infrastructure: the module tpamp._C_simt, csrc/README.md "Testing the CUDA launchers without a
// GPU").
//
// Model: one fiber per CUDA thread, on the thread that launches; the blocks of a launch run one
// after another; in a block the fibers run in a schedule order chosen at run time
// (TPAMP_SIMT_ORDER=forward|reverse|random, TPAMP_SIMT_SEED for random), each until it reaches a
// barrier or a warp operation or exits. A barrier (__syncthreads*) completes when every thread of
// the block waits at it; a warp operation (__shfl*_sync, __ballot_sync, __syncwarp, ...) when every
// lane its mask names has reached it. Misuse is an error (c10::Error, naming file:line, kernel,
// block and thread), never a hang or a silent result:
//   * a thread exits, or waits at another barrier, while others wait at a barrier;
//   * a warp operation whose mask names exited (or non-existent) lanes, lanes at another warp
//     operation or a different mask, or a shuffle reading a lane outside the mask;
//   * deadlock: no thread can run;
//   * a launch over the hardware limits: 1024 threads a block (x, y <= 1024, z <= 64), grid
//     y, z <= 65535, 48 KiB of dynamic shared memory, 4 KiB of kernel parameters, an empty grid.
// Fibers carry ThreadSanitizer / AddressSanitizer annotations (TPAMP_SIMT_SANITIZE builds).
//
// Not emulated (see csrc/README.md): streams, asynchrony, graphs, device memory, ordering between
// blocks (they run in sequence), device math rounding (nvcc contracts a * b + c into fma), the
// 48 KiB limit of static __shared__ memory (ptxas enforces it in the nvcc build), performance.
//
// Generic: a new kernel in csrc/cuda/ needs nothing here unless it uses a built-in not listed.

#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------------------------
// CUDA's vector types and qualifiers.

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Static storage: one copy per kernel, shared by the fibers of a block (blocks run in sequence).
#define __shared__ static
#define __constant__ static

namespace tpamp {
namespace simt {

// Where a built-in was called or a kernel launched.
struct Site {
  const char* file;
  int line;
};

constexpr int kWarpSize = 32;
constexpr unsigned int kMaxThreadsPerBlock = 1024;
constexpr size_t kMaxDynamicSharedBytes = 48 * 1024;
constexpr size_t kMaxParamBytes = 4096;

// The calling fiber's built-in variables.
uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();

enum BarrierKind : int { kBarSync = 0, kBarOr = 1, kBarAnd = 2, kBarCount = 3 };
int syncthreads(Site site, int kind, int predicate);

enum WarpKind : int {
  kShflIdx = 0,
  kShflUp = 1,
  kShflDown = 2,
  kShflXor = 3,
  kBallot = 4,
  kSyncWarp = 5,
};
// One warp operation of the calling lane: value bits in, the result bits out.
uint64_t warp_op(Site site, int kind, const char* name, unsigned int mask, uint64_t value,
                 int arg, int width);
unsigned int active_mask();

template <typename T>
inline T shfl(Site site, int kind, const char* name, unsigned int mask, T var, int arg,
              int width = kWarpSize) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= sizeof(uint64_t),
                "a shuffled value is at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = warp_op(site, kind, name, mask, bits, arg, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline unsigned int ballot(Site site, const char* name, unsigned int mask, int predicate) {
  return static_cast<unsigned int>(warp_op(site, kBallot, name, mask, predicate ? 1 : 0, 0, kWarpSize));
}

// ---------------------------------------------------------------------------------------------
// Launch.

using Body = void (*)(void* ctx);
void run_launch(Site site, const char* kernel_name, dim3 grid, dim3 block, size_t shared_bytes,
                size_t param_bytes, Body body, void* ctx);

// Kernel-parameter bytes as CUDA lays them out (each at its alignment).
template <typename... P>
constexpr size_t param_bytes() {
  size_t off = 0;
  ((off = (off + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
  return off;
}

template <typename... P, typename... A>
void launch(Site site, const char* kernel_name, void (*kernel)(P...), dim3 grid, dim3 block,
            size_t shared_bytes, const void* /*stream*/, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "a kernel launch passes one value per parameter");
  using Params = std::tuple<std::decay_t<P>...>;
  struct Ctx {
    void (*kernel)(P...);
    Params params;
  };
  // The parameters are converted and copied once, as a launch does; each thread gets its copy.
  Ctx ctx{kernel, Params(std::forward<A>(args)...)};
  run_launch(site, kernel_name, grid, block, shared_bytes, param_bytes<std::decay_t<P>...>(),
             [](void* c) {
               Ctx* x = static_cast<Ctx*>(c);
               std::apply(x->kernel, x->params);
             },
             &ctx);
}

}  // namespace simt
}  // namespace tpamp

// ---------------------------------------------------------------------------------------------
// The built-ins, as the kernels spell them.

#define TPAMP_SIMT_SITE (::tpamp::simt::Site{__FILE__, __LINE__})

#define threadIdx (::tpamp::simt::thread_idx())
#define blockIdx (::tpamp::simt::block_idx())
#define blockDim (::tpamp::simt::block_dim())
#define gridDim (::tpamp::simt::grid_dim())
#define warpSize 32

#define __syncthreads() ::tpamp::simt::syncthreads(TPAMP_SIMT_SITE, ::tpamp::simt::kBarSync, 0)
#define __syncthreads_or(p) \
  ::tpamp::simt::syncthreads(TPAMP_SIMT_SITE, ::tpamp::simt::kBarOr, (p) ? 1 : 0)
#define __syncthreads_and(p) \
  ::tpamp::simt::syncthreads(TPAMP_SIMT_SITE, ::tpamp::simt::kBarAnd, (p) ? 1 : 0)
#define __syncthreads_count(p) \
  ::tpamp::simt::syncthreads(TPAMP_SIMT_SITE, ::tpamp::simt::kBarCount, (p) ? 1 : 0)

#define __shfl_sync(...) \
  ::tpamp::simt::shfl(TPAMP_SIMT_SITE, ::tpamp::simt::kShflIdx, "__shfl_sync", __VA_ARGS__)
#define __shfl_up_sync(...) \
  ::tpamp::simt::shfl(TPAMP_SIMT_SITE, ::tpamp::simt::kShflUp, "__shfl_up_sync", __VA_ARGS__)
#define __shfl_down_sync(...) \
  ::tpamp::simt::shfl(TPAMP_SIMT_SITE, ::tpamp::simt::kShflDown, "__shfl_down_sync", __VA_ARGS__)
#define __shfl_xor_sync(...) \
  ::tpamp::simt::shfl(TPAMP_SIMT_SITE, ::tpamp::simt::kShflXor, "__shfl_xor_sync", __VA_ARGS__)
#define __ballot_sync(mask, p) \
  ::tpamp::simt::ballot(TPAMP_SIMT_SITE, "__ballot_sync", (mask), (p) ? 1 : 0)
#define __any_sync(mask, p) \
  (::tpamp::simt::ballot(TPAMP_SIMT_SITE, "__any_sync", (mask), (p) ? 1 : 0) != 0u)
#define __all_sync(mask, p)                                                               \
  ([&](unsigned int m_) {                                                                 \
    return ::tpamp::simt::ballot(TPAMP_SIMT_SITE, "__all_sync", m_, (p) ? 1 : 0) == m_;   \
  }(mask))
#define __syncwarp(...) ::tpamp::simt::syncwarp(TPAMP_SIMT_SITE __VA_OPT__(, ) __VA_ARGS__)
#define __activemask() ::tpamp::simt::active_mask()

namespace tpamp {
namespace simt {
inline void syncwarp(Site site, unsigned int mask = 0xffffffffu) {
  warp_op(site, kSyncWarp, "__syncwarp", mask, 0, 0, kWarpSize);
}
}  // namespace simt
}  // namespace tpamp

// Atomics: the fibers of a launch share one OS thread, but the sanitizer builds must see them as
// atomic operations (__atomic builtins are instrumented as such).
template <typename T>
inline T tpamp_simt_atomic_update(T* addr, T (*f)(T, T), T val) {
  T old = __atomic_load_n(addr, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(addr, &old, f(old, val), false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomicAdd(T* addr, T val) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(addr, val, __ATOMIC_RELAXED);
  } else {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomicAdd on float or double");
    using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
    U* u = reinterpret_cast<U*>(addr);
    U old = __atomic_load_n(u, __ATOMIC_RELAXED);
    for (;;) {
      T o;
      std::memcpy(&o, &old, sizeof(T));
      const T n = o + val;
      U nu;
      std::memcpy(&nu, &n, sizeof(T));
      if (__atomic_compare_exchange_n(u, &old, nu, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        return o;
      }
    }
  }
}
template <typename T>
inline T atomicSub(T* addr, T val) { return __atomic_fetch_sub(addr, val, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicAnd(T* addr, T val) { return __atomic_fetch_and(addr, val, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicOr(T* addr, T val) { return __atomic_fetch_or(addr, val, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicXor(T* addr, T val) { return __atomic_fetch_xor(addr, val, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicExch(T* addr, T val) { return __atomic_exchange_n(addr, val, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicCAS(T* addr, T compare, T val) {
  __atomic_compare_exchange_n(addr, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
template <typename T>
inline T atomicMax(T* addr, T val) {
  return tpamp_simt_atomic_update<T>(addr, [](T a, T b) { return a < b ? b : a; }, val);
}
template <typename T>
inline T atomicMin(T* addr, T val) {
  return tpamp_simt_atomic_update<T>(addr, [](T a, T b) { return b < a ? b : a; }, val);
}
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_block() __atomic_thread_fence(__ATOMIC_SEQ_CST)
template <typename T>
inline T __ldg(const T* p) { return *p; }
