// kvstack_cpu::paged_decode: the decode step (one query token per sequence) of
// kvstack.reference.attention.paged_attention on CPU tensors.
//
// A decode step is memory-bound and small: for each sequence and KV head, one pass over the
// K/V rows its table names, each row read once for the G query heads that share it (GQA),
// then per query head a softmax and one pass over the values (cpu_attention.h), so nothing
// is gathered or padded. What it saves over the torch.compile kernel on CPU is mostly the call:
// a compiled graph's guards and wrappers cost more per call than a decode step's attention
// over a few thousand keys, and a model calls it once per layer per token.
//
// Rule (the reference's): key t of sequence b is visible when its slot is >= 0, its position is
// <= the query's position and, with a window, >= the first visible position; without positions
// (decode_attention over a live view) every slot >= 0 is. Scores are
// (q . k) * scale in float32; lse is the natural log-sum-exp of the visible scores (-inf, and an
// output of zeros, when none is visible; NaN, and zeros, when a score is NaN). Slots outside the pool are refused (a read outside
// its memory), never read. Asked for, the weights are [B, H_q, 1, T] float32: each visible
// key's probability at its column of the table, 0 elsewhere (what eviction policies read).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_attention.h"

namespace {

using kvstack_kernels::Rows;
using kvstack_kernels::Strides;
using kvstack_kernels::strides_of;

// kHeadDim > 0: head_dim known at compile time (fully unrolled, vectorized inner loops);
// 0: any head_dim.
template <typename scalar_t, int64_t kHeadDim>
void decode_rows(const scalar_t* query, const scalar_t* keys, const scalar_t* values,
                 const int64_t* slots, const int64_t* key_positions,
                 const int64_t* query_positions, const int64_t* first_visible, float* out,
                 float* lse, float* weights, int64_t batch, int64_t width, int64_t q_heads, int64_t kv_heads,
                 int64_t runtime_head_dim, int64_t pool_rows, const Strides& key_strides,
                 const Strides& value_strides, float scale, std::atomic<bool>& bad_slot) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t group = q_heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // Per (sequence, KV head): the visible rows, then each query head's scores over them
    // (one pass over the keys), their softmax, and the weighted sum of the values (one pass
    // over the values). Two passes keep every inner loop a plain loop over D or over the keys,
    // which the compiler vectorizes; an online softmax would rescale per key instead.
    std::vector<int64_t> rows, columns;  // the visible keys' slots, and (for weights) columns
    std::vector<float> q(group * head_dim), acc(head_dim), row(head_dim), scores;
    rows.reserve(width);
    columns.reserve(weights == nullptr ? 0 : width);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / kv_heads, h = bh % kv_heads;
      // No positions: every slot of the row is visible (a token table's live view).
      const int64_t query_position = key_positions == nullptr ? 0 : query_positions[b];
      const int64_t first = first_visible == nullptr ? 0 : first_visible[b];
      rows.clear();
      columns.clear();
      for (int64_t t = 0; t < width; ++t) {
        const int64_t slot = slots[b * width + t];
        if (slot < 0) {
          continue;
        }
        if (slot >= pool_rows) {
          bad_slot = true;
          continue;
        }
        if (key_positions != nullptr) {
          const int64_t position = key_positions[b * width + t];
          if (position > query_position || (first_visible != nullptr && position < first)) {
            continue;
          }
        }
        rows.push_back(slot);
        if (weights != nullptr) {
          columns.push_back(t);
        }
      }
      // The G query heads of KV head h are adjacent: h * G .. h * G + G - 1; scaled once.
      const int64_t head = b * q_heads + h * group;
      for (int64_t i = 0; i < group * head_dim; ++i) {
        q[i] = static_cast<float>(query[head * head_dim + i]) * scale;
      }
      const int64_t n = static_cast<int64_t>(rows.size());
      const Rows key_rows{rows.data(), n, key_strides, h * head_dim};
      const Rows value_rows{rows.data(), n, value_strides, h * head_dim};
      kvstack_kernels::score_rows<scalar_t, kHeadDim>(q.data(), group, keys, key_rows, head_dim,
                                                      row, scores);
      kvstack_kernels::softmax_values<scalar_t, kHeadDim>(
          scores, group, values, value_rows, head_dim, acc, out + head * head_dim, lse + head,
          /*nan_out=*/0.0f, weights == nullptr ? nullptr : weights + head * width, columns.data(), width);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode(const at::Tensor& query,
                                                const at::Tensor& key_cache,
                                                const at::Tensor& value_cache,
                                                const at::Tensor& slots,
                                                const at::Tensor& key_positions,
                                                const at::Tensor& query_positions,
                                                const at::Tensor& first_visible, double scale,
                                                bool return_weights) {
  kvstack_kernels::check_query_and_pools(query, key_cache, value_cache);
  const int64_t batch = query.size(0), q_heads = query.size(2), head_dim = query.size(3);
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(q_heads % kv_heads == 0, "query heads must be a multiple of the pool's KV heads, got ",
              query.sizes(), " and ", key_cache.sizes());
  // Empty key_positions: every slot is visible (decode_attention's live view); then
  // query_positions and first_visible are not read.
  const bool positioned = key_positions.numel() > 0;
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == batch &&
                  (!positioned || key_positions.sizes() == slots.sizes()),
              "slots and key_positions must be [B, T] (key_positions may be empty), got ",
              slots.sizes(), " and ", key_positions.sizes());
  TORCH_CHECK(!positioned || query_positions.numel() == batch,
              "query_positions must be [B, 1], got ", query_positions.sizes());
  const bool windowed = positioned && first_visible.numel() > 0;
  TORCH_CHECK(!windowed || first_visible.numel() == batch,
              "first_visible must be empty or [B, 1], got ", first_visible.sizes());
  const Strides key_strides = strides_of(key_cache, "key_cache");
  const Strides value_strides = strides_of(value_cache, "value_cache");
  const at::Tensor q = query.contiguous();
  const at::Tensor slot_table = slots.to(at::kLong).contiguous();
  const at::Tensor positions = key_positions.to(at::kLong).contiguous();
  const at::Tensor query_at = query_positions.to(at::kLong).contiguous();
  const at::Tensor first = first_visible.to(at::kLong).contiguous();
  at::Tensor out = at::empty({batch, 1, q_heads, head_dim}, query.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({batch, 1, q_heads}, query.options().dtype(at::kFloat));
  // [B, H_q, 1, T], zeros where no key is visible; not asked for: an empty tensor.
  const int64_t width = slot_table.size(1);
  at::Tensor weights = at::zeros({return_weights ? batch : 0, q_heads, 1, width},
                                 query.options().dtype(at::kFloat));
  std::atomic<bool> bad_slot{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
        auto run = [&](auto kernel) {
          kernel(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                 value_cache.data_ptr<scalar_t>(), slot_table.data_ptr<int64_t>(),
                 positioned ? positions.data_ptr<int64_t>() : nullptr,
                 positioned ? query_at.data_ptr<int64_t>() : nullptr,
                 windowed ? first.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(),
                 lse.data_ptr<float>(), return_weights ? weights.data_ptr<float>() : nullptr,
                 batch, width, q_heads, kv_heads, head_dim,
                 key_cache.size(0) * key_cache.size(1), key_strides, value_strides,
                 static_cast<float>(scale), bad_slot);
        };
        if (head_dim == 64) {
          run(decode_rows<scalar_t, 64>);
        } else if (head_dim == 128) {
          run(decode_rows<scalar_t, 128>);
        } else {
          run(decode_rows<scalar_t, 0>);
        }
      });
  TORCH_CHECK(!bad_slot, "slots must be -1 or in [0, ", key_cache.size(0) * key_cache.size(1),
              "): a slot names a row outside the pool");
  return {out.to(query.scalar_type()), lse, weights};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstack_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor slots, "
      "Tensor key_positions, Tensor query_positions, Tensor first_visible, float scale, "
      "bool return_weights) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvstack_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
