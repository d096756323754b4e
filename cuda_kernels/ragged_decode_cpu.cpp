// kvstack_cpu::ragged_decode: kvstack.reference.ragged.ragged_decode_attention on CPU tensors,
// the decode step of Tangram's ragged pages run from the static work list.
//
// Two phases, the way the list is meant to run:
//   1. each (sequence, work row) is one task: row (g, p, n) reads split p of n of group g's
//      table, positions [p * U / n, (p + 1) * U / n) with U the table's used length, and for
//      every member head only below its own length gives that head's query heads a partial
//      state (out, lse) over those keys (cpu_attention.h's two passes, no gather, no padding);
//   2. each (sequence, KV head) merges the partial states of the rows of its group by
//      log-sum-exp (kvstack.reference.merge's rule): nothing seen gives zeros and -inf, a NaN
//      state (a NaN query or key read) NaN.
// Tasks run in parallel over torch's threads (at::parallel_for); with one thread they run in
// the list's order. Either way the result is the spec's, whatever the splits.
//
// Only what members read is read: a member's live cells, never a table's padding or another
// member's tail. Those cells' slots must lie in the pool, and lengths, members and work must
// hold what the spec allows: the kernel checks that much even when the Python wrapper's checks
// are skipped, so bad input is refused, never read out of bounds.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_attention.h"

namespace {

using kvstack_kernels::Rows;
using kvstack_kernels::Strides;
using kvstack_kernels::strides_of;

struct Layout {
  int64_t batch, groups, width, members, work_rows, q_heads, per_kv, pool_rows;
};

// Phase 1. partial_out [B, W, H_p, per_kv, D] and partial_lse [B, W, H_p, per_kv]: the state of
// each (sequence, row, member, query head of the member's KV head). Entries of a member that is
// no head (-1) are left unwritten; phase 2 never reads them.
template <typename scalar_t, int64_t kHeadDim>
void split_states(const scalar_t* query, const scalar_t* keys, const scalar_t* values,
                  const int64_t* slots, const int64_t* lengths, const int64_t* members,
                  const int64_t* work, float* partial_out, float* partial_lse, const Layout& n,
                  int64_t runtime_head_dim, const Strides& key_strides,
                  const Strides& value_strides, float scale, std::atomic<bool>& bad_slot) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t h_p = n.members, per_kv = n.per_kv;
  at::parallel_for(0, n.batch * n.work_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(per_kv * head_dim), acc(head_dim), row(head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / n.work_rows, w = task % n.work_rows;
      const int64_t group = work[w * 3], part = work[w * 3 + 1], parts = work[w * 3 + 2];
      const int64_t* length = lengths + (b * n.groups + group) * h_p;  // [H_p]
      const int64_t used = *std::max_element(length, length + h_p);
      // In 128 bits: part * used overflows 64 for absurd (but allowed) part counts.
      const auto split_at = [&](int64_t p) {
        return static_cast<int64_t>(static_cast<__int128>(p) * used / parts);
      };
      const int64_t start = split_at(part), stop = split_at(part + 1);
      const int64_t* table = slots + (b * n.groups + group) * n.width;  // [T]
      for (int64_t t = start; t < stop; ++t) {  // cells some member reads
        if (table[t] < 0 || table[t] >= n.pool_rows) {
          bad_slot = true;
        }
      }
      if (bad_slot) {
        continue;
      }
      for (int64_t member = 0; member < h_p; ++member) {
        const int64_t kv_head = members[group * h_p + member];
        if (kv_head < 0) {
          continue;
        }
        // The member's keys in this split: the split's range, cut at its own length.
        const int64_t member_stop = std::max(start, std::min(stop, length[member]));
        const int64_t count = member_stop - start;
        const int64_t head = b * n.q_heads + kv_head * per_kv;  // its first query head
        for (int64_t i = 0; i < per_kv * head_dim; ++i) {
          q[i] = static_cast<float>(query[head * head_dim + i]) * scale;
        }
        const Rows key_rows{table + start, count, key_strides, member * head_dim};
        const Rows value_rows{table + start, count, value_strides, member * head_dim};
        const int64_t state = (task * h_p + member) * per_kv;  // [B, W, H_p, per_kv] index
        kvstack_kernels::score_rows<scalar_t, kHeadDim>(q.data(), per_kv, keys, key_rows,
                                                        head_dim, row, scores);
        kvstack_kernels::softmax_values<scalar_t, kHeadDim>(
            scores, per_kv, values, value_rows, head_dim, acc, partial_out + state * head_dim,
            partial_lse + state, /*nan_out=*/std::numeric_limits<float>::quiet_NaN());
      }
    }
  });
}

// Phase 2. For each (sequence, KV head), the log-sum-exp merge of its (row, member) states:
// lse = log sum exp(lse_i), out = sum exp(lse_i - lse) out_i.
void merge_states(const float* partial_out, const float* partial_lse,
                  const std::vector<std::vector<std::pair<int64_t, int64_t>>>& owners,
                  float* out, float* lse, const Layout& n, int64_t head_dim) {
  const int64_t kv_heads = static_cast<int64_t>(owners.size()), per_kv = n.per_kv;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n.batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / kv_heads, kv_head = bk % kv_heads;
      for (int64_t g = 0; g < per_kv; ++g) {
        // States [B, W, H_p, per_kv]: (row w, member i) of sequence b, query head g.
        auto state = [&](const std::pair<int64_t, int64_t>& owner) {
          return ((b * n.work_rows + owner.first) * n.members + owner.second) * per_kv + g;
        };
        float top = minus_inf;
        bool any_nan = false;
        for (const auto& owner : owners[kv_head]) {
          top = std::max(top, partial_lse[state(owner)]);
          any_nan |= std::isnan(partial_lse[state(owner)]);
        }
        const int64_t head = b * n.q_heads + kv_head * per_kv + g;
        float* out_row = out + head * head_dim;
        if (any_nan) {  // a NaN state poisons the merge, as in the reference's
          std::fill(out_row, out_row + head_dim, std::numeric_limits<float>::quiet_NaN());
          lse[head] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        std::fill(out_row, out_row + head_dim, 0.0f);
        if (top == minus_inf) {  // no row saw a key: attention over nothing
          lse[head] = minus_inf;
          continue;
        }
        float sum = 0.0f;
        for (const auto& owner : owners[kv_head]) {
          const float weight = std::exp(partial_lse[state(owner)] - top);
          if (weight == 0.0f) {  // an empty split (its out is zeros) or a negligible one
            continue;
          }
          sum += weight;
          const float* part = partial_out + state(owner) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) {
            out_row[d] += weight * part[d];
          }
        }
        const float inverse = 1.0f / sum;
        for (int64_t d = 0; d < head_dim; ++d) {
          out_row[d] *= inverse;
        }
        lse[head] = top + std::log(sum);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> ragged_decode(const at::Tensor& query,
                                                 const at::Tensor& key_cache,
                                                 const at::Tensor& value_cache,
                                                 const at::Tensor& slots,
                                                 const at::Tensor& lengths,
                                                 const at::Tensor& members,
                                                 const at::Tensor& work, double scale) {
  kvstack_kernels::check_query_and_pools(query, key_cache, value_cache);
  const int64_t batch = query.size(0), q_heads = query.size(2), head_dim = query.size(3);
  const int64_t h_p = key_cache.size(2);
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == batch, "slots must be [B, G, T], got ",
              slots.sizes());
  const int64_t groups = slots.size(1), width = slots.size(2);
  TORCH_CHECK(lengths.dim() == 3 && lengths.size(0) == batch && lengths.size(1) == groups &&
                  lengths.size(2) == h_p,
              "lengths must be [B, G, H_p] = [", batch, ", ", groups, ", ", h_p, "], got ",
              lengths.sizes());
  TORCH_CHECK(members.dim() == 2 && members.size(0) == groups && members.size(1) == h_p,
              "members must be [G, H_p] = [", groups, ", ", h_p, "], got ", members.sizes());
  TORCH_CHECK(work.dim() == 2 && work.size(1) == 3, "work must be [W, 3], got ", work.sizes());
  const at::Tensor member_heads = members.to(at::kLong).contiguous();
  const at::Tensor work_rows = work.to(at::kLong).contiguous();
  const at::Tensor length = lengths.to(at::kLong).contiguous();
  const int64_t* member_at = member_heads.data_ptr<int64_t>();
  const int64_t* work_at = work_rows.data_ptr<int64_t>();
  const int64_t* length_at = length.data_ptr<int64_t>();

  // What the tasks index with, checked here (cheap: the list and the heads are small) so no
  // task reads outside its tensors: KV heads 0 .. H_kv-1, rows naming real groups and splits,
  // lengths within the tables. (That the list tiles each group once is the wrapper's check.)
  int64_t kv_heads = 0;
  for (int64_t i = 0; i < groups * h_p; ++i) {
    TORCH_CHECK(member_at[i] >= -1, "members must be -1 or a KV head, got ", member_at[i]);
    kv_heads += member_at[i] >= 0;
  }
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "query has ", q_heads,
              " heads, expected a multiple of the ", kv_heads, " KV heads members names");
  std::vector<std::vector<std::pair<int64_t, int64_t>>> owners(kv_heads);  // (row, member)
  const int64_t rows = work.size(0);
  for (int64_t w = 0; w < rows; ++w) {
    const int64_t group = work_at[w * 3], part = work_at[w * 3 + 1], parts = work_at[w * 3 + 2];
    TORCH_CHECK(group >= 0 && group < groups && parts >= 1 && part >= 0 && part < parts,
                "work row ", w, " is (", group, ", ", part, ", ", parts,
                "), expected 0 <= group < ", groups, " and 0 <= part < parts");
    for (int64_t member = 0; member < h_p; ++member) {
      const int64_t kv_head = member_at[group * h_p + member];
      if (kv_head >= 0) {
        TORCH_CHECK(kv_head < kv_heads, "members names KV head ", kv_head, ", expected < ",
                    kv_heads, " (each head 0 .. H_kv-1 once)");
        owners[kv_head].emplace_back(w, member);
      }
    }
  }
  for (int64_t i = 0; i < length.numel(); ++i) {
    TORCH_CHECK(length_at[i] >= 0 && length_at[i] <= width, "lengths holds ", length_at[i],
                ", expected 0 <= length <= ", width, " (the tables' width)");
  }

  const Strides key_strides = strides_of(key_cache, "key_cache");
  const Strides value_strides = strides_of(value_cache, "value_cache");
  const Layout n{batch,     groups,          width,
                 h_p,       rows,            q_heads,
                 q_heads / kv_heads,         key_cache.size(0) * key_cache.size(1)};
  const at::Tensor q = query.contiguous();
  const at::Tensor table = slots.to(at::kLong).contiguous();
  const auto floats = query.options().dtype(at::kFloat);
  at::Tensor partial_out = at::empty({batch, rows, h_p, n.per_kv, head_dim}, floats);
  at::Tensor partial_lse = at::empty({batch, rows, h_p, n.per_kv}, floats);
  at::Tensor out = at::empty({batch, 1, q_heads, head_dim}, floats);
  at::Tensor lse = at::empty({batch, 1, q_heads}, floats);
  std::atomic<bool> bad_slot{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "ragged_decode", [&] {
        auto run = [&](auto kernel) {
          kernel(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                 value_cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(), length_at,
                 member_at, work_at, partial_out.data_ptr<float>(),
                 partial_lse.data_ptr<float>(), n, head_dim, key_strides, value_strides,
                 static_cast<float>(scale), bad_slot);
        };
        if (head_dim == 64) {
          run(split_states<scalar_t, 64>);
        } else if (head_dim == 128) {
          run(split_states<scalar_t, 128>);
        } else {
          run(split_states<scalar_t, 0>);
        }
      });
  TORCH_CHECK(!bad_slot, "slots must be in [0, ", n.pool_rows,
              ") where members read: a slot names a row outside the pool");
  merge_states(partial_out.data_ptr<float>(), partial_lse.data_ptr<float>(), owners,
               out.data_ptr<float>(), lse.data_ptr<float>(), n, head_dim);
  return {out.to(query.scalar_type()), lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstack_cpu, m) {
  m.def(
      "ragged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor slots, "
      "Tensor lengths, Tensor members, Tensor work, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvstack_cpu, CPU, m) { m.impl("ragged_decode", &ragged_decode); }
