// kvstack_cpu::copy_slots: implements kvstack.reference.repack.copy_slots on CPU tensors.
//
// A repack moves live K/V rows onto holes of the blocks it keeps. A slot's row [H_kv, D] of
// a pool tensor [num_blocks, block_size, H_kv, D] is one span of memory (or one per head, in
// an interleaved layout), so a move is a memcpy per tensor, straight from source row to
// destination row: one pass over the bytes, no gathered temporary (the torch version reads
// the rows into a temporary, then scatters them: twice the traffic). Copying in place in any order is safe because a plan's
// moves never overlap (vToken I4: no destination is a source).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

void check_pool(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be a CPU tensor, got ", cache.device());
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, H_kv, D], got ",
              cache.dim(), " dims");
  // Each head's D values contiguous; blocks, rows and heads may be strided (K and V can be
  // views of one arena buffer, interleaved).
  TORCH_CHECK(cache.stride(3) == 1 || cache.size(3) == 1, name,
              " must hold each head's D values contiguously, got strides ", cache.strides());
}

// Where slot ``slot``'s row starts in a pool tensor, and how to copy it: one span when its
// heads are adjacent, else one span per head.
struct Rows {
  char* base;
  int64_t block_size, block_bytes, row_bytes, heads, head_bytes, head_stride_bytes;
  explicit Rows(at::Tensor& cache)
      : base(static_cast<char*>(cache.data_ptr())),
        block_size(cache.size(1)),
        block_bytes(cache.stride(0) * cache.element_size()),
        row_bytes(cache.stride(1) * cache.element_size()),
        heads(cache.size(2)),
        head_bytes(cache.size(3) * cache.element_size()),
        head_stride_bytes(cache.stride(2) * cache.element_size()) {
    if (heads == 1 || head_stride_bytes == head_bytes) {  // the row is one span
      head_bytes *= heads;
      heads = 1;
    }
  }
  char* operator()(int64_t slot) const {
    return base + (slot / block_size) * block_bytes + (slot % block_size) * row_bytes;
  }
  void copy(int64_t dst, int64_t src) const {
    char* to = (*this)(dst);
    const char* from = (*this)(src);
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(to + h * head_stride_bytes, from + h * head_stride_bytes, head_bytes);
    }
  }
};

void copy_rows(at::Tensor& key_cache, at::Tensor& value_cache, const int64_t* src,
               const int64_t* dst, int64_t moves) {
  const Rows key(key_cache), value(value_cache);
  // Moves in source order, so that reads walk each freed block from its first row; the
  // rows a few moves ahead are prefetched, since each row is a separate, scattered copy.
  std::vector<int64_t> order(moves);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return src[a] < src[b]; });
  constexpr int64_t kAhead = 8;
  for (int64_t i = 0; i < moves; ++i) {
    if (i + kAhead < moves) {
      const int64_t next = order[i + kAhead];
      __builtin_prefetch(key(src[next]));
      __builtin_prefetch(value(src[next]));
      __builtin_prefetch(key(dst[next]), 1);
      __builtin_prefetch(value(dst[next]), 1);
    }
    const int64_t m = order[i];
    key.copy(dst[m], src[m]);
    value.copy(dst[m], src[m]);
  }
}

void copy_slots(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& src_slots,
                const at::Tensor& dst_slots) {
  check_pool(key_cache, "key_cache");
  check_pool(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() &&
                  key_cache.dtype() == value_cache.dtype(),
              "key_cache and value_cache must match, got ", key_cache.sizes(), " ",
              key_cache.dtype(), " and ", value_cache.sizes(), " ", value_cache.dtype());
  TORCH_CHECK(src_slots.dim() == 1 && dst_slots.dim() == 1 &&
                  src_slots.numel() == dst_slots.numel(),
              "src_slots and dst_slots must be 1-D of one length, got ", src_slots.sizes(),
              " and ", dst_slots.sizes());
  const int64_t moves = src_slots.numel();
  if (moves == 0) {
    return;
  }
  const at::Tensor src = src_slots.to(at::kLong).contiguous();
  const at::Tensor dst = dst_slots.to(at::kLong).contiguous();
  // A slot outside the pool would write outside its memory: refused before anything moves.
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  for (const at::Tensor* t : {&src, &dst}) {
    const int64_t low = t->min().item<int64_t>();
    const int64_t high = t->max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < slots, "slots must be in [0, ", slots, "), got [", low,
                ", ", high, "]");
  }
  copy_rows(key_cache, value_cache, src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), moves);
}

}  // namespace

TORCH_LIBRARY(kvstack_cpu, m) {
  m.def(
      "copy_slots(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor src_slots, "
      "Tensor dst_slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvstack_cpu, CPU, m) { m.impl("copy_slots", &copy_slots); }
