// The SIMT emulator's runtime (see simt.h): fibers, the block scheduler, barriers, warp
// operations and the misuse checks.
//
// Fibers switch with a hand-written x86-64 context switch (callee-saved registers, MXCSR and the
// x87 control word; ~tens of ns) or, elsewhere or with TPAMP_SIMT_UCONTEXT, glibc's ucontext.
// Sanitizers: AddressSanitizer is told about every stack switch
// (__sanitizer_start/finish_switch_fiber); ThreadSanitizer sees one fiber per CUDA thread index
// (__tsan_create_fiber / __tsan_switch_to_fiber, synchronising only fiber -> launching thread),
// and the happens-before edges CUDA gives: launch start -> every thread, every thread -> launch
// end, a barrier's arrivals -> its departures, a warp operation's lanes -> each other (two sync
// objects used alternately, so an early arrival at the next barrier is no edge into this one); plus
// block -> next block (static __shared__ storage is reused by every block, so races between
// blocks of one launch are not reported). The runtime's own
// bookkeeping is hidden from ThreadSanitizer (no_sanitize), so its reports name kernel lines only.

#include "simt.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#if !defined(__x86_64__) || defined(TPAMP_SIMT_UCONTEXT)
#define TPAMP_SIMT_USE_UCONTEXT 1
#include <ucontext.h>
#endif

#if defined(__SANITIZE_THREAD__)
#define TPAMP_SIMT_TSAN 1
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_set_fiber_name(void* fiber, const char* name);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#define TPAMP_SIMT_NO_TSAN __attribute__((no_sanitize("thread")))
#else
#define TPAMP_SIMT_NO_TSAN
#endif

#if defined(__SANITIZE_ADDRESS__)
#define TPAMP_SIMT_ASAN 1
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                     size_t* size_old);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
}
#endif

namespace tpamp {
namespace simt {
namespace {

// ---------------------------------------------------------------------------------------------
// Context switch.

#ifndef TPAMP_SIMT_USE_UCONTEXT
extern "C" void tpamp_simt_switch(void** save_sp, void* new_sp);
extern "C" void tpamp_simt_entry();
asm(R"(
    .text
    .p2align 4
    .globl tpamp_simt_switch
    .hidden tpamp_simt_switch
    .type tpamp_simt_switch,@function
tpamp_simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tpamp_simt_switch,.-tpamp_simt_switch

    .p2align 4
    .globl tpamp_simt_entry
    .hidden tpamp_simt_entry
    .type tpamp_simt_entry,@function
tpamp_simt_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size tpamp_simt_entry,.-tpamp_simt_entry
)");
#endif

struct Context {
#ifdef TPAMP_SIMT_USE_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

enum class State : uint8_t { kRunnable, kBarrier, kWarp, kDone };

struct Fiber {
  Context ctx;
  char* stack = nullptr;  // lowest usable address (a guard page lies below)
  size_t stack_size = 0;
  void* tsan = nullptr;
  void* asan_fake = nullptr;
  // per block
  int linear = 0;
  uint3 tid{0, 0, 0};
  State state = State::kRunnable;
  Site site{nullptr, 0};  // where it waits
  // barrier
  int bar_kind = 0;
  int bar_pred = 0;
  int bar_result = 0;
  // warp operation
  int warp_kind = 0;
  const char* warp_name = nullptr;
  unsigned int mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 32;
  uint64_t result = 0;
  // ThreadSanitizer: barriers / warp operations this fiber passed in this block (their parity
  // picks the sync object, so an early arrival at the next one is no edge into the last one)
  unsigned int bar_gen = 0;
  unsigned int warp_gen = 0;
};

size_t stack_bytes() {
#if defined(TPAMP_SIMT_ASAN) || defined(TPAMP_SIMT_TSAN)
  return 512 * 1024;
#else
  return 128 * 1024;
#endif
}

// Process-wide state: one launch at a time (a mutex serialises launches from several threads).
std::mutex g_launch_mutex;
std::vector<Fiber*> g_fibers;  // the pool; fiber i serves linear thread index i of every block
Context g_main;
void* g_main_tsan = nullptr;
void* g_main_asan_fake = nullptr;
const void* g_main_stack_bottom = nullptr;
size_t g_main_stack_size = 0;
Fiber* g_current = nullptr;

// The launch being run.
Body g_body = nullptr;
void* g_ctx = nullptr;
const char* g_kernel = "";
Site g_launch_site{"", 0};
dim3 g_grid, g_block;
uint3 g_block_idx{0, 0, 0};
int g_nthreads = 0;
int g_ndone = 0;
std::string g_error;  // set: abort the launch

// ThreadSanitizer synchronisation objects (their addresses).
char g_sync_launch, g_sync_end;
// two of each, used alternately: a sync object shared by consecutive barriers would let a
// thread that arrives early at the next barrier release into the one its peers still leave,
// a false happens-before edge that hides exactly the missing-barrier races
char g_sync_barrier2[2];
char g_sync_warp[kMaxThreadsPerBlock / kWarpSize][2];

TPAMP_SIMT_NO_TSAN const char* short_path(const char* file) {
  if (file == nullptr) return "?";
  // from the last "csrc/" on: the repository-relative path of every tpamp source
  const char* last = nullptr;
  for (const char* p = std::strstr(file, "csrc/"); p != nullptr; p = std::strstr(p + 1, "csrc/")) {
    last = p;
  }
  return last != nullptr ? last : file;
}

TPAMP_SIMT_NO_TSAN std::string where(Site s) {
  return std::string(short_path(s.file)) + ":" + std::to_string(s.line);
}

TPAMP_SIMT_NO_TSAN std::string dim_str(uint3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

TPAMP_SIMT_NO_TSAN std::string context_str() {
  return "kernel " + std::string(g_kernel) + " launched at " + where(g_launch_site) +
         ", block " + dim_str(g_block_idx);
}

TPAMP_SIMT_NO_TSAN void fail(const std::string& what) {
  if (g_error.empty()) g_error = "tpamp SIMT: " + what + " (" + context_str() + ")";
}

TPAMP_SIMT_NO_TSAN std::string thread_str(const Fiber* f) { return "thread " + dim_str(f->tid); }

// ---------------------------------------------------------------------------------------------
// Switching.

TPAMP_SIMT_NO_TSAN void raw_switch(Context* from, Context* to) {
#ifdef TPAMP_SIMT_USE_UCONTEXT
  swapcontext(&from->uc, &to->uc);
#else
  tpamp_simt_switch(&from->sp, to->sp);
#endif
}

// Switch from the main context to fiber f; returns when f switches back.
TPAMP_SIMT_NO_TSAN void resume(Fiber* f) {
  g_current = f;
#ifdef TPAMP_SIMT_ASAN
  __sanitizer_start_switch_fiber(&g_main_asan_fake, f->stack, f->stack_size);
#endif
#ifdef TPAMP_SIMT_TSAN
  __tsan_switch_to_fiber(f->tsan, 1 /* __tsan_switch_to_fiber_no_sync */);
#endif
  raw_switch(&g_main, &f->ctx);
#ifdef TPAMP_SIMT_ASAN
  __sanitizer_finish_switch_fiber(g_main_asan_fake, nullptr, nullptr);
#endif
  g_current = nullptr;
}

// Switch from the current fiber back to the main context (exiting: never resumed).
TPAMP_SIMT_NO_TSAN void yield(bool exiting) {
  Fiber* f = g_current;
#ifdef TPAMP_SIMT_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f->asan_fake, g_main_stack_bottom,
                                 g_main_stack_size);
#else
  (void)exiting;
#endif
#ifdef TPAMP_SIMT_TSAN
  // Synchronising: everything a fiber did happens before what the launching thread does after
  // the launch (also after an error, when abandoned fibers never finish). Fiber -> fiber stays
  // unsynchronised (main -> fiber switches do not acquire), so races between threads show.
  __tsan_switch_to_fiber(g_main_tsan, 0);
#endif
  raw_switch(&f->ctx, &g_main);
#ifdef TPAMP_SIMT_ASAN
  __sanitizer_finish_switch_fiber(f->asan_fake, nullptr, nullptr);
#endif
}

TPAMP_SIMT_NO_TSAN void fiber_main(void* arg) {
  Fiber* f = static_cast<Fiber*>(arg);
#ifdef TPAMP_SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_main_stack_bottom, &g_main_stack_size);
#endif
#ifdef TPAMP_SIMT_TSAN
  __tsan_acquire(&g_sync_launch);
#endif
  try {
    g_body(g_ctx);
  } catch (const std::exception& e) {
    fail(thread_str(f) + " threw: " + e.what());
  } catch (...) {
    fail(thread_str(f) + " threw an exception");
  }
#ifdef TPAMP_SIMT_TSAN
  __tsan_release(&g_sync_end);
#endif
  f->state = State::kDone;
  ++g_ndone;
  yield(true);
  std::abort();  // never resumed
}

#ifdef TPAMP_SIMT_USE_UCONTEXT
void fiber_entry_uc(unsigned int hi, unsigned int lo) {
  const uintptr_t p = (static_cast<uintptr_t>(hi) << 32) | lo;
  fiber_main(reinterpret_cast<void*>(p));
}
#endif

// A fresh stack frame for fiber f, entering fiber_main when first resumed.
TPAMP_SIMT_NO_TSAN void prepare(Fiber* f) {
#ifdef TPAMP_SIMT_ASAN
  __asan_unpoison_memory_region(f->stack, f->stack_size);
#endif
#ifdef TPAMP_SIMT_USE_UCONTEXT
  getcontext(&f->ctx.uc);
  f->ctx.uc.uc_stack.ss_sp = f->stack;
  f->ctx.uc.uc_stack.ss_size = f->stack_size;
  f->ctx.uc.uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(f);
  makecontext(&f->ctx.uc, reinterpret_cast<void (*)()>(&fiber_entry_uc), 2,
              static_cast<unsigned int>(p >> 32), static_cast<unsigned int>(p & 0xffffffffu));
#else
  uintptr_t top = reinterpret_cast<uintptr_t>(f->stack + f->stack_size) & ~uintptr_t{15};
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 80);  // 16-byte aligned
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  std::memcpy(&sp[0], csr, 8);
  sp[1] = 0;                                              // r15
  sp[2] = 0;                                              // r14
  sp[3] = reinterpret_cast<uint64_t>(&fiber_main);        // r13: the function
  sp[4] = reinterpret_cast<uint64_t>(f);                  // r12: its argument
  sp[5] = 0;                                              // rbx
  sp[6] = 0;                                              // rbp
  sp[7] = reinterpret_cast<uint64_t>(&tpamp_simt_entry);  // return address
  sp[8] = 0;
  sp[9] = 0;
  f->ctx.sp = sp;
#endif
}

TPAMP_SIMT_NO_TSAN Fiber* fiber_at(int i) {
  while (static_cast<int>(g_fibers.size()) <= i) {
    Fiber* f = new Fiber();
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t size = stack_bytes();
    void* mem = mmap(nullptr, size + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(mem != MAP_FAILED, "tpamp SIMT: cannot map a fiber stack of ", size, " bytes");
    mprotect(mem, page, PROT_NONE);  // guard page: an overflow faults instead of corrupting
    f->stack = static_cast<char*>(mem) + page;
    f->stack_size = size;
#ifdef TPAMP_SIMT_TSAN
    f->tsan = __tsan_create_fiber(0);
    const std::string name = "SIMT thread " + std::to_string(g_fibers.size());
    __tsan_set_fiber_name(f->tsan, name.c_str());
#endif
    g_fibers.push_back(f);
  }
  return g_fibers[static_cast<size_t>(i)];
}

// ---------------------------------------------------------------------------------------------
// Warp operations.

inline int lane_of(const Fiber* f) { return f->linear % kWarpSize; }
inline int warp_of(const Fiber* f) { return f->linear / kWarpSize; }

TPAMP_SIMT_NO_TSAN std::string mask_str(unsigned int m) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", m);
  return buf;
}

// The source lane of a shuffle (or -1: the lane's own value).
TPAMP_SIMT_NO_TSAN int shuffle_source(int kind, int lane, int arg, int width) {
  const int base = (lane / width) * width;
  switch (kind) {
    case kShflIdx:
      return base + (arg & (width - 1));
    case kShflUp:
      return lane - arg >= base ? lane - arg : -1;
    case kShflDown:
      return lane + arg < base + width ? lane + arg : -1;
    case kShflXor: {
      const int src = lane ^ arg;
      return src < base + width ? src : -1;
    }
    default:
      return -1;
  }
}

// Completes the warp operation `lead` waits at if every lane its mask names is there (and sets
// them runnable); reports misuse: a named lane that exited or does not exist, a named lane at
// another warp operation or with another mask, and (quiescent: no thread can run) a named lane
// waiting at a barrier.
TPAMP_SIMT_NO_TSAN void try_group(Fiber* lead, bool quiescent) {
  const int w = warp_of(lead);
  const int first = w * kWarpSize;
  const unsigned int mask = lead->mask;
  for (int l = 0; l < kWarpSize; ++l) {
    if (!(mask & (1u << l))) continue;
    const int i = first + l;
    if (i >= g_nthreads) {
      fail(std::string(lead->warp_name) + " at " + where(lead->site) + ": mask " +
           mask_str(mask) + " of warp " + std::to_string(w) + " names lane " + std::to_string(l) +
           ", which does not exist (the block has " + std::to_string(g_nthreads) + " threads)");
      return;
    }
    Fiber* f = g_fibers[i];
    if (f->state == State::kDone) {
      fail(std::string(lead->warp_name) + " at " + where(lead->site) + ": mask " +
           mask_str(mask) + " names lane " + std::to_string(l) + " of warp " + std::to_string(w) +
           " (" + thread_str(f) + "), which has exited");
      return;
    }
    if (f->state == State::kWarp) {
      if (f->mask != mask || f->warp_kind != lead->warp_kind ||
          (lead->warp_kind != kSyncWarp && (f->site.file != lead->site.file ||
                                            f->site.line != lead->site.line))) {
        fail("divergent warp operation in warp " + std::to_string(w) + ": " + thread_str(lead) +
             " waits at " + lead->warp_name + " at " + where(lead->site) + " with mask " +
             mask_str(lead->mask) + ", " + thread_str(f) + " at " + f->warp_name + " at " +
             where(f->site) + " with mask " + mask_str(f->mask));
      }
      continue;
    }
    if (quiescent && f->state == State::kBarrier) {
      fail("deadlock: " + thread_str(lead) + " waits at " + lead->warp_name + " at " +
           where(lead->site) + " for lane " + std::to_string(l) + " (" + thread_str(f) +
           "), which waits at __syncthreads at " + where(f->site));
    }
    return;  // a named lane has not arrived yet
  }
  // Every lane of the mask is here: compute each one's result.
  uint64_t ballot = 0;
  for (int l = 0; l < kWarpSize; ++l) {
    if ((mask & (1u << l)) && g_fibers[first + l]->value != 0) ballot |= (1u << l);
  }
  for (int l = 0; l < kWarpSize; ++l) {
    if (!(mask & (1u << l))) continue;
    Fiber* f = g_fibers[first + l];
    if (f->warp_kind == kBallot) {
      f->result = ballot;
    } else if (f->warp_kind == kSyncWarp) {
      f->result = 0;
    } else {
      const int src = shuffle_source(f->warp_kind, l, f->arg, f->width);
      if (src < 0) {
        f->result = f->value;
      } else if (!(mask & (1u << src))) {
        fail(std::string(f->warp_name) + " at " + where(f->site) + ": lane " + std::to_string(l) +
             " (" + thread_str(f) + ") reads lane " + std::to_string(src) +
             ", which its mask " + mask_str(mask) + " does not name (undefined on a GPU)");
        return;
      } else {
        f->result = g_fibers[first + src]->value;
      }
    }
  }
  for (int l = 0; l < kWarpSize; ++l) {
    if (mask & (1u << l)) g_fibers[first + l]->state = State::kRunnable;
  }
}

// Lane `done` exited: a lane of its warp waiting at a warp operation that names it is misuse.
TPAMP_SIMT_NO_TSAN void check_exit(Fiber* done) {
  const int first = warp_of(done) * kWarpSize;
  const unsigned int bit = 1u << lane_of(done);
  for (int i = first; i < std::min(g_nthreads, first + kWarpSize); ++i) {
    Fiber* f = g_fibers[i];
    if (f->state == State::kWarp && (f->mask & bit)) {
      try_group(f, false);
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One block.

TPAMP_SIMT_NO_TSAN bool order_from_env(std::string* name) {
  const char* v = std::getenv("TPAMP_SIMT_ORDER");
  *name = (v == nullptr || *v == '\0') ? "forward" : v;
  return *name == "forward" || *name == "reverse" || *name == "random";
}

// Completes the barrier every live thread waits at, or reports why it cannot complete.
TPAMP_SIMT_NO_TSAN void resolve_quiescent() {
  std::vector<Fiber*> at_barrier;
  std::vector<Fiber*> at_warp;
  Fiber* exited = nullptr;
  for (int i = 0; i < g_nthreads; ++i) {
    Fiber* f = g_fibers[i];
    if (f->state == State::kBarrier) at_barrier.push_back(f);
    if (f->state == State::kWarp) at_warp.push_back(f);
    if (f->state == State::kDone && exited == nullptr) exited = f;
  }
  if (!at_warp.empty()) {
    // Every warp group that cannot complete says why (exited lanes, a barrier, divergence).
    for (Fiber* f : at_warp) {
      if (f->state == State::kWarp) try_group(f, true);
      if (!g_error.empty()) return;
    }
    bool progress = false;
    for (Fiber* f : at_warp) progress = progress || f->state == State::kRunnable;
    if (progress) return;
    Fiber* f = at_warp.front();
    fail("deadlock: " + thread_str(f) + " waits at " + f->warp_name + " at " + where(f->site) +
         " with mask " + mask_str(f->mask) + " and no thread can run");
    return;
  }
  if (at_barrier.empty()) return;  // all done
  Fiber* first = at_barrier.front();
  if (exited != nullptr) {
    fail(thread_str(exited) + " exited while " + std::to_string(at_barrier.size()) +
         " threads wait at __syncthreads at " + where(first->site) +
         " (a barrier must be reached by every thread of the block)");
    return;
  }
  for (Fiber* f : at_barrier) {
    if (f->site.file != first->site.file || f->site.line != first->site.line ||
        f->bar_kind != first->bar_kind) {
      fail("divergent __syncthreads: " + thread_str(first) + " waits at " + where(first->site) +
           ", " + thread_str(f) + " at " + where(f->site));
      return;
    }
  }
  int count = 0;
  for (Fiber* f : at_barrier) count += f->bar_pred;
  int result = 0;
  switch (first->bar_kind) {
    case kBarOr: result = count > 0 ? 1 : 0; break;
    case kBarAnd: result = count == static_cast<int>(at_barrier.size()) ? 1 : 0; break;
    case kBarCount: result = count; break;
    default: break;
  }
  for (Fiber* f : at_barrier) {
    f->bar_result = result;
    f->state = State::kRunnable;
  }
}

TPAMP_SIMT_NO_TSAN void run_block(const std::string& order, std::mt19937_64& rng) {
  const int n = g_nthreads;
  std::vector<int> seq(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    Fiber* f = g_fibers[i];
    f->linear = i;
    const unsigned int bx = g_block.x, by = g_block.y;
    f->tid = uint3{static_cast<unsigned int>(i) % bx, (static_cast<unsigned int>(i) / bx) % by,
                   static_cast<unsigned int>(i) / (bx * by)};
    f->state = State::kRunnable;
    f->bar_gen = 0;
    f->warp_gen = 0;
    prepare(f);
    seq[i] = order == "reverse" ? n - 1 - i : i;
  }
  g_ndone = 0;
  while (g_error.empty()) {
    if (order == "random") std::shuffle(seq.begin(), seq.end(), rng);
    bool ran = false;
    for (int i : seq) {
      Fiber* f = g_fibers[i];
      if (f->state != State::kRunnable) continue;
      ran = true;
      resume(f);
      if (!g_error.empty()) return;
      if (f->state == State::kWarp) {
        try_group(f, false);
      } else if (f->state == State::kDone) {
        check_exit(f);
      }
      if (!g_error.empty()) return;
    }
    if (g_ndone == n) return;
    if (!ran) {
      resolve_quiescent();
      bool any = false;
      for (int i = 0; i < n; ++i) any = any || g_fibers[i]->state == State::kRunnable;
      if (!any && g_error.empty() && g_ndone != n) {
        fail("deadlock: no thread can run");
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The built-ins.

TPAMP_SIMT_NO_TSAN uint3 thread_idx() { return g_current->tid; }
TPAMP_SIMT_NO_TSAN uint3 block_idx() { return g_block_idx; }
TPAMP_SIMT_NO_TSAN dim3 block_dim() { return g_block; }
TPAMP_SIMT_NO_TSAN dim3 grid_dim() { return g_grid; }

TPAMP_SIMT_NO_TSAN int syncthreads(Site site, int kind, int predicate) {
  Fiber* f = g_current;
  TORCH_CHECK(f != nullptr, "tpamp SIMT: __syncthreads at ", where(site), " outside a kernel");
  f->state = State::kBarrier;
  f->site = site;
  f->bar_kind = kind;
  f->bar_pred = predicate;
#ifdef TPAMP_SIMT_TSAN
  char* sync = &g_sync_barrier2[f->bar_gen++ & 1u];
  __tsan_release(sync);
#endif
  yield(false);
#ifdef TPAMP_SIMT_TSAN
  __tsan_acquire(sync);
#endif
  return f->bar_result;
}

TPAMP_SIMT_NO_TSAN uint64_t warp_op(Site site, int kind, const char* name, unsigned int mask,
                                    uint64_t value, int arg, int width) {
  Fiber* f = g_current;
  TORCH_CHECK(f != nullptr, "tpamp SIMT: ", name, " at ", where(site), " outside a kernel");
  const int lane = lane_of(f);
  if (!(mask & (1u << lane))) {
    fail(std::string(name) + " at " + where(site) + ": the mask " + mask_str(mask) +
         " does not name the calling lane " + std::to_string(lane) + " (" + thread_str(f) + ")");
  } else if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0) {
    fail(std::string(name) + " at " + where(site) + ": width " + std::to_string(width) +
         " is not a power of 2 in [1, 32]");
  }
  f->state = State::kWarp;
  f->site = site;
  f->warp_kind = kind;
  f->warp_name = name;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
#ifdef TPAMP_SIMT_TSAN
  char* sync = &g_sync_warp[warp_of(f)][f->warp_gen++ & 1u];
  __tsan_release(sync);
#endif
  yield(false);
#ifdef TPAMP_SIMT_TSAN
  __tsan_acquire(sync);
#endif
  return f->result;
}

TPAMP_SIMT_NO_TSAN unsigned int active_mask() {
  Fiber* f = g_current;
  const int first = warp_of(f) * kWarpSize;
  unsigned int m = 0;
  for (int l = 0; l < kWarpSize && first + l < g_nthreads; ++l) {
    if (g_fibers[first + l]->state != State::kDone) m |= 1u << l;
  }
  return m;
}

TPAMP_SIMT_NO_TSAN void run_launch(Site site, const char* kernel_name, dim3 grid, dim3 block,
                                   size_t shared_bytes, size_t param_bytes, Body body, void* ctx) {
  const std::string at = where(site);
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  TORCH_CHECK(grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && threads >= 1,
              "tpamp SIMT: launch of ", kernel_name, " at ", at, " with grid (", grid.x, ",",
              grid.y, ",", grid.z, ") and block (", block.x, ",", block.y, ",", block.z,
              "): every dimension must be >= 1 (invalid configuration argument)");
  TORCH_CHECK(threads <= kMaxThreadsPerBlock && block.x <= 1024 && block.y <= 1024 &&
                  block.z <= 64,
              "tpamp SIMT: launch of ", kernel_name, " at ", at, " with block (", block.x, ",",
              block.y, ",", block.z, ") = ", threads,
              " threads; the limit is 1024 threads a block (x, y <= 1024, z <= 64)");
  TORCH_CHECK(grid.x <= 0x7fffffffu && grid.y <= 65535 && grid.z <= 65535,
              "tpamp SIMT: launch of ", kernel_name, " at ", at, " with grid (", grid.x, ",",
              grid.y, ",", grid.z, "); the limits are x < 2^31, y, z <= 65535");
  TORCH_CHECK(shared_bytes <= kMaxDynamicSharedBytes, "tpamp SIMT: launch of ", kernel_name,
              " at ", at, " asks for ", shared_bytes,
              " bytes of dynamic shared memory; the limit is 48 KiB (49152)");
  TORCH_CHECK(param_bytes <= kMaxParamBytes, "tpamp SIMT: launch of ", kernel_name, " at ", at,
              " passes ", param_bytes, " bytes of kernel parameters; the limit is 4 KiB (4096)");
  std::string order;
  TORCH_CHECK(order_from_env(&order), "tpamp SIMT: TPAMP_SIMT_ORDER is '", order,
              "'; expected forward, reverse or random");

  std::lock_guard<std::mutex> lock(g_launch_mutex);
  static uint64_t launches = 0;
  const char* seed_env = std::getenv("TPAMP_SIMT_SEED");
  const uint64_t seed = seed_env != nullptr ? std::strtoull(seed_env, nullptr, 10) : 0;
  std::mt19937_64 rng(seed * 1000003u + launches++);

  g_body = body;
  g_ctx = ctx;
  g_kernel = kernel_name;
  g_launch_site = site;
  g_grid = grid;
  g_block = block;
  g_nthreads = static_cast<int>(threads);
  g_error.clear();
  fiber_at(g_nthreads - 1);
#ifdef TPAMP_SIMT_TSAN
  g_main_tsan = __tsan_get_current_fiber();
#endif

  // Blocks one after another, in the schedule order too.
  const uint64_t nblocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> blocks;
  const bool shuffled = order == "random" && nblocks <= (1u << 20);
  if (shuffled) {
    blocks.resize(nblocks);
    for (uint64_t b = 0; b < nblocks; ++b) blocks[b] = b;
    std::shuffle(blocks.begin(), blocks.end(), rng);
  }
  for (uint64_t k = 0; k < nblocks && g_error.empty(); ++k) {
    const uint64_t b = shuffled ? blocks[k] : (order == "reverse" ? nblocks - 1 - k : k);
    g_block_idx = uint3{static_cast<unsigned int>(b % grid.x),
                        static_cast<unsigned int>((b / grid.x) % grid.y),
                        static_cast<unsigned int>(b / (static_cast<uint64_t>(grid.x) * grid.y))};
#ifdef TPAMP_SIMT_TSAN
    // Launch start (and the blocks before, which switched back with synchronisation) happen
    // before this block's threads: static __shared__ storage is one copy reused by every block,
    // where a GPU gives each block its own, so blocks must not look like racing on it.
    __tsan_release(&g_sync_launch);
#endif
    run_block(order, rng);
  }
#ifdef TPAMP_SIMT_TSAN
  __tsan_acquire(&g_sync_end);
#endif
  g_current = nullptr;
  if (!g_error.empty()) {
    std::string msg;
    msg.swap(g_error);
    TORCH_CHECK(false, msg);
  }
}

}  // namespace simt
}  // namespace tpamp
