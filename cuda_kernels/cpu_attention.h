// Shared by the C++ CPU attention kernels (paged_decode_cpu.cpp, ragged_decode_cpu.cpp): where a
// slot's row lies in a paged pool, and the two passes of one decode token's attention over a
// list of rows.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvstack_kernels {

// Where slot s's [H, D] row starts in a pool [N, block_size, H, D], in elements: blocks may be
// strided apart (an arena's K and V blocks interleaved), rows within a block too.
struct Strides {
  int64_t block_size, block, slot;
  int64_t row(int64_t s) const { return (s / block_size) * block + (s % block_size) * slot; }
};

// A pool [N, block_size, H, D] whose slots each hold their H x D values as one row.
inline Strides strides_of(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, H, D], got ",
              cache.dim(), " dims");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3), name,
              " must hold each slot's H x D values contiguously, got strides ", cache.strides());
  return Strides{cache.size(1), cache.stride(0), cache.stride(1)};
}

// The rows a decode token attends to: n slots of a pool, each read at `offset` elements into
// its slot's row (its KV head's D values).
struct Rows {
  const int64_t* slots;
  int64_t n;
  Strides strides;
  int64_t offset;
  // Computed per read rather than stored per row: a table of offsets made the kernel slower.
  int64_t at(int64_t i) const { return strides.row(slots[i]) + offset; }
};

// One decode token per sequence over pools of the query's dtype: what both attention kernels
// read (each checks its own tables).
inline void check_query_and_pools(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache) {
  TORCH_CHECK(query.dim() == 4 && query.size(1) == 1,
              "query must be [B, 1, H_q, D] (one decode token), got ", query.sizes());
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.dtype() == query.dtype() &&
                  value_cache.dtype() == query.dtype(),
              "key_cache and value_cache must match each other and the query's dtype, got ",
              key_cache.sizes(), " ", key_cache.dtype(), ", ", value_cache.sizes(), " ",
              value_cache.dtype(), " and ", query.dtype());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(2) > 0 && key_cache.size(3) == query.size(3),
              "key_cache must be [num_blocks, block_size, H, D] with H > 0 and the query's D = ",
              query.size(3), ", got ", key_cache.sizes());
}

// Pass 1: scores[g * n + i] = q_g . key_i for the G query heads (q [G, D], already scaled) that
// share the n keys. One pass over the keys, each read once for the G heads; a key in bf16/fp16
// is widened once into `row` [D].
template <typename scalar_t, int64_t kHeadDim>
inline void score_rows(const float* __restrict__ q, int64_t group, const scalar_t* keys,
                       const Rows& key_rows, int64_t runtime_head_dim, std::vector<float>& row,
                       std::vector<float>& scores) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t n = key_rows.n;
  scores.assign(group * n, 0.0f);  // [G, n]
  float* __restrict__ out = scores.data();
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* key = keys + key_rows.at(i);
    const float* k = row.data();
    if constexpr (std::is_same_v<scalar_t, float>) {
      k = key;
    } else {
      for (int64_t d = 0; d < head_dim; ++d) {
        row[d] = static_cast<float>(key[d]);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict__ qg = q + g * head_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) {
        dot += qg[d] * k[d];
      }
      out[g * n + i] = dot;
    }
  }
}

// Pass 2, per query head g: the softmax of its scores [n] and the weighted sum of the n values,
// into out + g * head_dim [D] and lse[g] (natural log).
// No rows, or every score -inf (infinite keys): zeros and -inf, attention over nothing. A NaN
// score (a NaN query, or a NaN key it reads) makes lse NaN and out `nan_out` (the caller's spec
// says which: the paged rule keeps out 0, a ragged split's state is NaN), never a result that
// looks valid. Each head's D accumulators stay in registers (one pass for all G heads would
// hold G * D of them).
//
// With `weights` (else nullptr): head g's probabilities, written at weights + g * weights_stride
// + columns[i] (the row's column in the caller's table); cells of no row are left as they are.
template <typename scalar_t, int64_t kHeadDim>
inline void softmax_values(std::vector<float>& scores, int64_t group, const scalar_t* values,
                           const Rows& value_rows, int64_t runtime_head_dim,
                           std::vector<float>& acc, float* out, float* lse, float nan_out,
                           float* weights = nullptr, const int64_t* columns = nullptr,
                           int64_t weights_stride = 0) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t n = value_rows.n;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < group; ++g) {
    float* out_row = out + g * head_dim;
    float* __restrict__ p = scores.data() + g * n;
    float top = minus_inf;
    bool any_nan = false;
    for (int64_t i = 0; i < n; ++i) {
      top = p[i] > top ? p[i] : top;
      any_nan |= std::isnan(p[i]);
    }
    if (any_nan) {
      std::fill(out_row, out_row + head_dim, nan_out);
      lse[g] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (top == minus_inf) {
      std::fill(out_row, out_row + head_dim, 0.0f);
      lse[g] = minus_inf;
      continue;
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      p[i] = std::exp(p[i] - top);
      sum += p[i];
    }
    float* __restrict__ acc_g = acc.data();
    std::fill(acc_g, acc_g + head_dim, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* __restrict__ value = values + value_rows.at(i);
      for (int64_t d = 0; d < head_dim; ++d) {
        acc_g[d] += p[i] * static_cast<float>(value[d]);
      }
    }
    const float inverse = 1.0f / sum;
    for (int64_t d = 0; d < head_dim; ++d) {
      out_row[d] = acc_g[d] * inverse;
    }
    lse[g] = top + std::log(sum);
    if (weights != nullptr) {
      float* weights_g = weights + g * weights_stride;
      for (int64_t i = 0; i < n; ++i) {
        weights_g[columns[i]] = p[i] * inverse;
      }
    }
  }
}

}  // namespace kvstack_kernels
