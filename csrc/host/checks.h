// Host-side argument checks shared by the CPU and CUDA launchers (header-only, host code).
// Every failure is a c10::Error naming the op, the argument, the bad value and what was expected.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace tpamp {

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Every tensor of a list: defined, on `device`, float32/float16/bfloat16, and
// non-overlapping-and-dense (its elements fill one block of memory, in any dimension order, so a
// kernel may walk data_ptr()[0 .. numel) linearly).
inline void check_float_list(const char* op, const char* name, at::TensorList ts,
                             const at::Device& device) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(),
                ", expected ", device, " (all tensors on one device)");
    TORCH_CHECK(is_float_type(t.scalar_type()), op, ": ", name, "[", i, "] has dtype ",
                t.scalar_type(), "; expected float32, float16 or bfloat16");
    TORCH_CHECK(t.numel() <= 1 || t.is_non_overlapping_and_dense(), op, ": ", name, "[", i,
                "] must be non-overlapping and dense, got sizes ", t.sizes(), " and strides ",
                t.strides());
  }
}

// dsts[i] has the shape of srcs[i] and the same element order in memory (same strides), so the
// k-th element in memory of one is the k-th of the other.
inline void check_same_layout(const char* op, const char* src_name, at::TensorList srcs,
                              const char* dst_name, at::TensorList dsts) {
  TORCH_CHECK(srcs.size() == dsts.size(), op, ": ", dst_name, " has ", dsts.size(),
              " tensors, ", src_name, " has ", srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    TORCH_CHECK(dsts[i].sizes() == srcs[i].sizes(), op, ": ", dst_name, "[", i, "] has shape ",
                dsts[i].sizes(), ", ", src_name, "[", i, "] has shape ", srcs[i].sizes());
    TORCH_CHECK(srcs[i].numel() <= 1 || dsts[i].strides() == srcs[i].strides(), op, ": ",
                dst_name, "[", i, "] has strides ", dsts[i].strides(), ", ", src_name, "[", i,
                "] has strides ", srcs[i].strides(), "; expected the same memory layout");
  }
}

// The scale argument: absent, or a 1-element float32 tensor on `device`. Returns whether present.
inline bool check_scale(const char* op, const std::optional<at::Tensor>& scale,
                        const at::Device& device) {
  if (!scale.has_value() || !scale->defined()) return false;
  TORCH_CHECK(scale->device() == device, op, ": scale is on ", scale->device(), ", expected ",
              device, " (the tensors' device)");
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1, op,
              ": scale must be a 1-element float32 tensor, got ", scale->scalar_type(),
              " of shape ", scale->sizes());
  return true;
}

// No written memory overlaps any other list entry. `lists` are the op's tensor lists and
// `written[k]` says whether list k is written. The one overlap allowed is an entry with itself
// across lists when `same_index_ok` (out[i] is grads[i]: the same memory, done in place); any other
// overlap -- duplicates in a written list, out[i] overlapping grads[j], a partial overlap --
// raises, because the kernels read and write chunks concurrently.
inline void check_no_overlap(const char* op, const std::vector<at::TensorList>& lists,
                             const std::vector<const char*>& names,
                             const std::vector<bool>& written, bool same_index_ok) {
  struct Range {
    uintptr_t begin, end;
    int list;
    int64_t index;
  };
  std::vector<Range> ranges;
  for (size_t k = 0; k < lists.size(); ++k) {
    for (size_t i = 0; i < lists[k].size(); ++i) {
      const at::Tensor& t = lists[k][i];
      if (t.numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
      ranges.push_back({begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size(),
                        static_cast<int>(k), static_cast<int64_t>(i)});
    }
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Sweep in address order, each range against the earlier ones still open (in practice at most
  // the one same-memory partner: any forbidden overlap raises at once).
  std::vector<const Range*> open;
  for (const Range& r : ranges) {
    open.erase(std::remove_if(open.begin(), open.end(),
                              [&](const Range* o) { return o->end <= r.begin; }),
               open.end());
    for (const Range* o : open) {
      const bool allowed = same_index_ok && r.index == o->index && r.list != o->list &&
                           r.begin == o->begin && r.end == o->end;
      TORCH_CHECK(allowed || !(written[r.list] || written[o->list]), op, ": ", names[o->list],
                  "[", o->index, "] and ", names[r.list], "[", r.index,
                  "] overlap in memory; a written tensor must not share memory with another "
                  "entry (pass each tensor once, and an output either as its own input or "
                  "disjoint memory)");
    }
    open.push_back(&r);
  }
}

// A device scalar the op only reads (scale, found_inf, grad_scale, lr_tensor) must not share
// memory with any tensor the op writes: the CUDA kernels read it in every block while other blocks
// write, so `scale_([x, s], s)` would scale by a mix of old and new values. Refused on every
// device, so both launchers accept the same calls. `scalar` absent or undefined: nothing to check.
inline void check_scalar_not_written(const char* op, const char* name,
                                     const std::optional<at::Tensor>& scalar,
                                     const std::vector<at::TensorList>& lists,
                                     const std::vector<const char*>& names,
                                     const std::vector<bool>& written) {
  if (!scalar.has_value() || !scalar->defined() || scalar->numel() == 0) return;
  const auto sb = reinterpret_cast<uintptr_t>(scalar->data_ptr());
  const uintptr_t se = sb + static_cast<uintptr_t>(scalar->numel()) * scalar->element_size();
  for (size_t k = 0; k < lists.size(); ++k) {
    if (!written[k]) continue;
    for (size_t i = 0; i < lists[k].size(); ++i) {
      const at::Tensor& t = lists[k][i];
      if (!t.defined() || t.numel() == 0) continue;
      const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
      const uintptr_t e = b + static_cast<uintptr_t>(t.numel()) * t.element_size();
      TORCH_CHECK(e <= sb || se <= b, op, ": ", name, " and ", names[k], "[", i,
                  "] overlap in memory; ", name, " is read while ", names[k],
                  " is written, so it must not share memory with it (pass a separate tensor, "
                  "e.g. ", name, ".clone())");
    }
  }
}

}  // namespace tpamp
