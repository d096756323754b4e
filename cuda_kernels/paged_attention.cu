// Paged attention over token tables, split-K with a log-sum-exp merge.
//
// Implements kvstack.reference.attention.paged_attention (and so decode_attention, its case of
// one query per sequence with every slot visible). Layouts, as in the reference:
//
//   query            [B, T_q, H_q, D]            float32, float16 or bfloat16
//   key_cache        [num_blocks, block_size, H_kv, D]   the arena's pool, the query's dtype
//   value_cache      [num_blocks, block_size, H_kv, D]
//   slots            [B, T_k]  int32 or int64, -1 = padding
//   key_positions    [B, T_k]  the slots' dtype
//   query_positions  [B, T_q]
//
// Query i of sequence b sees key j iff slots[b, j] >= 0, key_positions[b, j] <=
// query_positions[b, i] and, with a window W > 0, key_positions[b, j] > query_positions[b, i] - W.
// Scores in float32: s = scale * q . k; lse = log sum exp s (natural log); out = sum softmax(s) v.
// A query that sees no key: lse = -inf, out = 0.
//
// The work: one thread block per (query token, KV head, split of the keys). The block holds
// the query heads of its KV head's group (grouped-query attention: they read the same keys, so
// each K/V row is loaded once for the whole group) and walks its split a chunk of keys at a time
// with the online softmax, then writes a partial output and lse per query head. The splits are
// as many as fill the device when the queries do not (split-K for decode over long contexts;
// one for a prefill chunk). A second kernel merges the splits (the rule of reference/merge.py,
// FlashInfer's merge_state) into the output and lse; a third turns the raw scores into
// attention weights when a policy asked for them (exp(s - lse), 0 where masked). Token tables
// hold slots, not blocks (vToken's page-size-1 view): each key row is gathered by its slot, so
// a table may have holes and blocks of any size. A slot past the pool is a device assert.
//
// No host synchronisation: the splits follow the shapes and the device's multiprocessor count
// (read once per device), so a step can be captured in a CUDA graph.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace kvstack {
namespace {

constexpr int kThreads = 128;  // four warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDPerLane = 8;  // head_dim <= 256: each lane keeps D / 32 key elements
constexpr int kChunk = 256;      // keys per chunk (fewer when shared memory would not hold them)
constexpr int kBlocksPerSM = 4;  // thread blocks per multiprocessor the splits aim for
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffff, value, offset);
  }
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
  }
  return value;
}

// Shared memory of a block, in floats then int64 slots: the group's scaled queries [group, D],
// its output accumulators [group, D], a chunk's scores (then probabilities) [group, chunk], per
// query head the running max, running sum and this chunk's rescale [3, group]; then the chunk's
// visible slots [chunk]. The float count is rounded up to keep the int64 slots aligned.
__host__ __device__ __forceinline__ int slot_offset(int group, int head_dim, int chunk) {
  const int floats = 2 * group * head_dim + group * chunk + 3 * group;
  return floats + (floats & 1);
}

__host__ __device__ __forceinline__ size_t shared_bytes_for(int group, int head_dim, int chunk) {
  return slot_offset(group, head_dim, chunk) * sizeof(float) + chunk * sizeof(int64_t);
}

// Grid: (B * T_q, H_kv, splits). Split z takes keys [z * split_size, (z + 1) * split_size), a
// chunk at a time, with the online softmax (running max and sum, accumulators rescaled when the
// max grows), and writes its partial output and lse per query head.
template <typename scalar_t, typename index_t>
__global__ void paged_attention_split_kernel(
    const scalar_t* __restrict__ query,
    const scalar_t* __restrict__ key_cache,
    const scalar_t* __restrict__ value_cache,
    const index_t* __restrict__ slots,
    const index_t* __restrict__ key_positions,
    const index_t* __restrict__ query_positions,
    float* __restrict__ split_out,  // [splits, B, T_q, H_q, D]
    float* __restrict__ split_lse,  // [splits, B, T_q, H_q]
    float* __restrict__ scores,     // [B, H_q, T_q, T_k] raw scores (-inf masked), or nullptr
    int batch, int t_q, int h_q, int h_kv, int head_dim, int t_k, int chunk, int split_size,
    int64_t num_slots, int64_t window, float scale) {
  extern __shared__ float shared[];
  const int group = h_q / h_kv;
  float* query_sh = shared;                       // [group, D]
  float* acc_sh = query_sh + group * head_dim;    // [group, D]
  float* score_sh = acc_sh + group * head_dim;    // [group, chunk]
  float* max_sh = score_sh + group * chunk;       // [group] running max
  float* sum_sh = max_sh + group;                 // [group] running sum of exp(s - max)
  float* rescale_sh = sum_sh + group;             // [group] this chunk's factor for acc, sum
  int64_t* slot_sh = reinterpret_cast<int64_t*>(shared + slot_offset(group, head_dim, chunk));

  const int token = blockIdx.x;  // b * T_q + i
  const int b = token / t_q;
  const int i = token % t_q;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int first_head = kv_head * group;

  for (int index = threadIdx.x; index < group * head_dim; index += blockDim.x) {
    const int g = index / head_dim;
    const int d = index % head_dim;
    const int64_t at = (static_cast<int64_t>(token) * h_q + first_head + g) * head_dim + d;
    query_sh[index] = scale * static_cast<float>(query[at]);
    acc_sh[index] = 0.f;
  }
  for (int g = threadIdx.x; g < group; g += blockDim.x) {
    max_sh[g] = kNegInf;
    sum_sh[g] = 0.f;
  }
  __syncthreads();

  const int64_t query_position = static_cast<int64_t>(query_positions[token]);
  const int64_t row_stride = static_cast<int64_t>(h_kv) * head_dim;  // one slot's K (or V)
  const int64_t head_offset = static_cast<int64_t>(kv_head) * head_dim;
  const int split_end = min(t_k, (split + 1) * split_size);

  for (int start = split * split_size; start < split_end; start += chunk) {
    const int count = min(chunk, split_end - start);

    // Scores: one warp per key, its lanes across head_dim, every query head of the group.
    for (int j = warp; j < count; j += kWarps) {
      const int64_t at = static_cast<int64_t>(b) * t_k + start + j;
      const int64_t slot = static_cast<int64_t>(slots[at]);
      const int64_t key_position = static_cast<int64_t>(key_positions[at]);
      const bool visible = slot >= 0 && key_position <= query_position &&
                           (window <= 0 || key_position > query_position - window);
      if (!visible) {
        if (lane == 0) slot_sh[j] = -1;
        for (int g = lane; g < group; g += 32) score_sh[g * chunk + j] = kNegInf;
        continue;
      }
      CUDA_KERNEL_ASSERT(slot < num_slots);
      const scalar_t* key_row = key_cache + slot * row_stride + head_offset;
      float key_values[kMaxDPerLane];
#pragma unroll
      for (int step = 0; step < kMaxDPerLane; ++step) {
        const int d = lane + 32 * step;
        key_values[step] = d < head_dim ? static_cast<float>(key_row[d]) : 0.f;
      }
      for (int g = 0; g < group; ++g) {
        float partial = 0.f;
#pragma unroll
        for (int step = 0; step < kMaxDPerLane; ++step) {
          const int d = lane + 32 * step;
          if (d < head_dim) partial += query_sh[g * head_dim + d] * key_values[step];
        }
        const float score = warp_sum(partial);
        if (lane == 0) score_sh[g * chunk + j] = score;
      }
      if (lane == 0) slot_sh[j] = slot;
    }
    __syncthreads();

    // Per query head (one warp each): the new running max; scores become exp(s - max).
    for (int g = warp; g < group; g += kWarps) {
      float* row = score_sh + g * chunk;
      float best = kNegInf;
      for (int j = lane; j < count; j += 32) best = fmaxf(best, row[j]);
      best = fmaxf(warp_max(best), max_sh[g]);
      float total = 0.f;
      for (int j = lane; j < count; j += 32) {
        const float score = row[j];
        if (scores != nullptr) {
          const int64_t at =
              ((static_cast<int64_t>(b) * h_q + first_head + g) * t_q + i) * t_k + start + j;
          scores[at] = score;
        }
        const float p = score == kNegInf ? 0.f : expf(score - best);
        row[j] = p;
        total += p;
      }
      total = warp_sum(total);
      if (lane == 0) {
        // Nothing seen before (max -inf): the accumulators are 0 and stay so under any factor.
        const float rescale = max_sh[g] == kNegInf ? 0.f : expf(max_sh[g] - best);
        rescale_sh[g] = rescale;
        sum_sh[g] = sum_sh[g] * rescale + total;
        max_sh[g] = best;
      }
    }
    __syncthreads();

    // Accumulators: thread per (query head, d), over the chunk's visible keys (coalesced on d).
    for (int index = threadIdx.x; index < group * head_dim; index += blockDim.x) {
      const int g = index / head_dim;
      const int d = index % head_dim;
      const float* probabilities = score_sh + g * chunk;
      float acc = acc_sh[index] * rescale_sh[g];
      for (int j = 0; j < count; ++j) {
        const int64_t slot = slot_sh[j];
        if (slot < 0) continue;
        acc += probabilities[j] * static_cast<float>(value_cache[slot * row_stride + head_offset + d]);
      }
      acc_sh[index] = acc;
    }
    __syncthreads();  // the next chunk overwrites scores and slots
  }

  const int64_t split_token = static_cast<int64_t>(split) * batch * t_q + token;
  for (int index = threadIdx.x; index < group * head_dim; index += blockDim.x) {
    const int g = index / head_dim;
    const int d = index % head_dim;
    const float total = sum_sh[g];
    const int head = first_head + g;
    split_out[(split_token * h_q + head) * head_dim + d] = total > 0.f ? acc_sh[index] / total : 0.f;
    if (d == 0) {
      split_lse[split_token * h_q + head] = total > 0.f ? max_sh[g] + logf(total) : kNegInf;
    }
  }
}

// Merge S attention states per row: in_out [S, N, D], in_lse [S, N] -> out [N, D], lse [N].
// lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) out_s; all-empty rows: 0 and -inf.
// Grid: N blocks; threads along D.
template <typename in_t, typename out_t>
__global__ void merge_states_kernel(const in_t* __restrict__ in_out,
                                    const float* __restrict__ in_lse, out_t* __restrict__ out,
                                    float* __restrict__ lse, int states, int64_t rows,
                                    int head_dim) {
  const int64_t row = blockIdx.x;
  float best = kNegInf;
  for (int s = 0; s < states; ++s) best = fmaxf(best, in_lse[s * rows + row]);
  if (best == kNegInf) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      out[row * head_dim + d] = static_cast<out_t>(0.f);
    }
    if (threadIdx.x == 0) lse[row] = kNegInf;
    return;
  }
  float total = 0.f;
  for (int s = 0; s < states; ++s) total += expf(in_lse[s * rows + row] - best);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < states; ++s) {
      const float weight = expf(in_lse[s * rows + row] - best);  // 0 for an empty state
      acc += weight * static_cast<float>(in_out[(s * rows + row) * head_dim + d]);
    }
    out[row * head_dim + d] = static_cast<out_t>(acc / total);
  }
  if (threadIdx.x == 0) lse[row] = best + logf(total);
}

// Raw scores [B, H_q, T_q, T_k] -> attention weights exp(s - lse), 0 where masked or unseen.
__global__ void weights_from_scores_kernel(float* __restrict__ weights,
                                           const float* __restrict__ lse, int64_t total, int t_q,
                                           int h_q, int t_k) {
  for (int64_t at = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; at < total;
       at += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = at / t_k;  // (b * H_q + h) * T_q + i
    const int i = row % t_q;
    const int64_t bh = row / t_q;
    const int h = bh % h_q;
    const int64_t b = bh / h_q;
    const float row_lse = lse[(b * t_q + i) * h_q + h];
    const float score = weights[at];
    weights[at] = (score == kNegInf || row_lse == kNegInf) ? 0.f : expf(score - row_lse);
  }
}

void check_cuda(const at::Tensor& tensor, const char* name, const at::Tensor& like) {
  TORCH_CHECK(tensor.is_cuda(), name, " must be a CUDA tensor, got one on ", tensor.device());
  TORCH_CHECK(tensor.device() == like.device(), name, " is on ", tensor.device(),
              ", expected the query's device ", like.device());
}

// Keys per chunk: kChunk, halved while a block's shared memory would pass the 48 KiB that every
// launch may use without opting in.
int chunk_for(int group, int head_dim) {
  int chunk = kChunk;
  while (chunk > 32 && shared_bytes_for(group, head_dim, chunk) > 48 * 1024) chunk /= 2;
  return chunk;
}

// Splits of the keys: enough blocks to fill the device (kBlocksPerSM per multiprocessor) when
// the queries alone do not, never more than one chunk each. A decode step of a few sequences
// over a long context gets many splits; a prefill chunk, whose queries fill the device, gets
// one, so its partial outputs are no larger than its output.
int splits_for(int device, int64_t query_blocks, int t_k, int chunk) {
  static int multiprocessors[64] = {0};
  int& count = multiprocessors[device % 64];
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  }
  const int64_t wanted = (static_cast<int64_t>(kBlocksPerSM) * count + query_blocks - 1) / query_blocks;
  const int most = (t_k + chunk - 1) / chunk;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, most)));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_attention_cuda(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& slots, const at::Tensor& key_positions, const at::Tensor& query_positions,
    double scale, int64_t window, bool return_weights) {
  check_cuda(query, "query", query);
  check_cuda(key_cache, "key_cache", query);
  check_cuda(value_cache, "value_cache", query);
  check_cuda(slots, "slots", query);
  check_cuda(key_positions, "key_positions", query);
  check_cuda(query_positions, "query_positions", query);
  TORCH_CHECK(query.dim() == 4, "query must be [B, T_q, H_q, D], got shape ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must both be [num_blocks, block_size, H_kv, D], got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "key_cache and value_cache must have the query's dtype ", query.scalar_type(),
              ", got ", key_cache.scalar_type(), " and ", value_cache.scalar_type());
  const int batch = query.size(0), t_q = query.size(1), h_q = query.size(2),
            head_dim = query.size(3);
  const int h_kv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "key_cache has head_dim ", key_cache.size(3),
              ", expected the query's ", head_dim);
  TORCH_CHECK(head_dim >= 1 && head_dim <= 32 * kMaxDPerLane, "head_dim is ", head_dim,
              ", expected 1 to ", 32 * kMaxDPerLane);
  TORCH_CHECK(h_kv > 0 && h_q > 0 && h_q % h_kv == 0, "query has ", h_q,
              " heads, which is not a multiple of key_cache's ", h_kv, " KV heads");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == batch, "slots must be [B=", batch,
              ", T_k], got shape ", slots.sizes());
  const int t_k = slots.size(1);
  TORCH_CHECK(key_positions.sizes() == slots.sizes(), "key_positions must have slots' shape ",
              slots.sizes(), ", got ", key_positions.sizes());
  TORCH_CHECK(query_positions.dim() == 2 && query_positions.size(0) == batch &&
                  query_positions.size(1) == t_q,
              "query_positions must be [", batch, ", ", t_q, "], got ", query_positions.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt,
              "slots must be int32 or int64, got ", slots.scalar_type());
  TORCH_CHECK(key_positions.scalar_type() == at::kLong || key_positions.scalar_type() == at::kInt,
              "key_positions must be int32 or int64, got ", key_positions.scalar_type());
  TORCH_CHECK(query_positions.scalar_type() == at::kLong ||
                  query_positions.scalar_type() == at::kInt,
              "query_positions must be int32 or int64, got ", query_positions.scalar_type());

  const c10::cuda::CUDAGuard guard(query.device());
  const auto float_options = query.options().dtype(at::kFloat);
  auto out = at::empty_like(query, at::MemoryFormat::Contiguous);
  auto lse = at::empty({batch, t_q, h_q}, float_options);
  auto weights = return_weights ? at::empty({batch, h_q, t_q, t_k}, float_options)
                                : at::empty({0}, float_options);
  if (batch == 0 || t_q == 0) return {out, lse, weights};
  if (t_k == 0) {  // nothing to see: the empty state
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    if (return_weights) weights.zero_();
    return {out, lse, weights};
  }
  const auto q = query.contiguous();
  const auto k = key_cache.contiguous();
  const auto v = value_cache.contiguous();
  const auto s = slots.contiguous();
  // Positions in the slots' dtype (a no-op when they have it already, as the caches give them).
  const auto kp = key_positions.to(slots.scalar_type()).contiguous();
  const auto qp = query_positions.to(slots.scalar_type()).contiguous();
  const int group = h_q / h_kv;
  const int chunk = chunk_for(group, head_dim);
  const int splits =
      splits_for(query.get_device(), static_cast<int64_t>(batch) * t_q * h_kv, t_k, chunk);
  const int split_size = (t_k + splits - 1) / splits;
  auto split_out = at::empty({splits, batch, t_q, h_q, head_dim}, float_options);
  auto split_lse = at::empty({splits, batch, t_q, h_q}, float_options);
  const size_t shared_bytes = shared_bytes_for(group, head_dim, chunk);
  TORCH_CHECK(shared_bytes <= 48 * 1024, "paged_attention: ", group, " query heads per KV head of ",
              "head_dim ", head_dim, " need ", shared_bytes, " bytes of shared memory per block, ",
              "more than the 48 KiB it may use");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(static_cast<int64_t>(batch) * t_q <= 2147483647 && h_kv <= 65535,
              "paged_attention: B * T_q = ", static_cast<int64_t>(batch) * t_q, " and H_kv = ",
              h_kv, " pass the grid's limits (2^31 - 1 and 65535)");
  const dim3 grid(batch * t_q, h_kv, splits);  // splits <= kBlocksPerSM * multiprocessors

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, q.scalar_type(), "paged_attention", [&] {
        AT_DISPATCH_INDEX_TYPES(s.scalar_type(), "paged_attention_slots", [&] {
          paged_attention_split_kernel<scalar_t, index_t><<<grid, kThreads, shared_bytes, stream>>>(
              q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
              s.data_ptr<index_t>(), kp.data_ptr<index_t>(), qp.data_ptr<index_t>(),
              split_out.data_ptr<float>(), split_lse.data_ptr<float>(),
              return_weights ? weights.data_ptr<float>() : nullptr, batch, t_q, h_q, h_kv,
              head_dim, t_k, chunk, split_size, k.size(0) * k.size(1), window,
              static_cast<float>(scale));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
        const int64_t rows = static_cast<int64_t>(batch) * t_q * h_q;
        merge_states_kernel<float, scalar_t><<<rows, std::max(1, std::min(head_dim, 256)), 0, stream>>>(
            split_out.data_ptr<float>(), split_lse.data_ptr<float>(), out.data_ptr<scalar_t>(),
            lse.data_ptr<float>(), splits, rows, head_dim);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  if (return_weights) {
    const int64_t total = weights.numel();
    const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
    weights_from_scores_kernel<<<blocks, 256, 0, stream>>>(weights.data_ptr<float>(),
                                                           lse.data_ptr<float>(), total, t_q,
                                                           h_q, t_k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {out, lse, weights};
}

// merge_attention_states: outputs [S, ..., H, D] and lses [S, ..., H] stacked -> (out, lse).
std::tuple<at::Tensor, at::Tensor> merge_attention_states_cuda(const at::Tensor& outputs,
                                                               const at::Tensor& lses) {
  check_cuda(outputs, "outputs", outputs);
  check_cuda(lses, "lses", outputs);
  TORCH_CHECK(outputs.dim() >= 3, "outputs must be [S, ..., H, D], got shape ", outputs.sizes());
  TORCH_CHECK(lses.sizes() == outputs.sizes().slice(0, outputs.dim() - 1),
              "lses must be outputs' shape without D, ", outputs.sizes().slice(0, outputs.dim() - 1),
              ", got ", lses.sizes());
  TORCH_CHECK(outputs.size(0) > 0, "outputs must hold at least one state, got shape ",
              outputs.sizes());
  const c10::cuda::CUDAGuard guard(outputs.device());
  const int states = outputs.size(0);
  const int head_dim = outputs.size(-1);
  const auto in = outputs.contiguous();
  const auto in_lse = lses.contiguous().to(at::kFloat);
  auto out = at::empty(outputs.sizes().slice(1), outputs.options());
  auto lse = at::empty(lses.sizes().slice(1), lses.options().dtype(at::kFloat));
  const int64_t rows = lse.numel();
  if (rows == 0) return {out, lse};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, in.scalar_type(), "merge_states", [&] {
        merge_states_kernel<scalar_t, scalar_t><<<rows, std::max(1, std::min(head_dim, 256)), 0, stream>>>(
            in.data_ptr<scalar_t>(), in_lse.data_ptr<float>(), out.data_ptr<scalar_t>(),
            lse.data_ptr<float>(), states, rows, head_dim);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {out, lse};
}

}  // namespace kvstack

TORCH_LIBRARY_FRAGMENT(kvstack_cuda, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor slots, "
      "Tensor key_positions, Tensor query_positions, float scale, int window, "
      "bool return_weights) -> (Tensor, Tensor, Tensor)");
  m.def("merge_attention_states(Tensor outputs, Tensor lses) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvstack_cuda, CUDA, m) {
  m.impl("paged_attention", &kvstack::paged_attention_cuda);
  m.impl("merge_attention_states", &kvstack::merge_attention_states_cuda);
}
