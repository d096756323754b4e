// The eviction policies' decode fast path, fused: accumulate this step's attention weights into
// each table's scores and pick the table's one victim.
//
// Implements, for a decode step in which every table holds L = budget + 1 live tokens,
//   kvstack.policies.H2O.observe_columns   scores[n, indices[n, j]] += sum_{h, q} weights[n, h, q, j]
//   EvictionPolicy.choose_one_victim_each  victim[n] = candidates[n, argmin_c scores[n, candidates[n, c]]]
// where candidates = live_indices[:, first:end] (the live tokens outside the sinks and the recent
// window). argmin takes the first minimum, the older token on a tie, as the reference does.
// Policies whose score is an accumulated attention sum (H2O) use both parts; one with other
// scores passes no weights and only picks.
//
// One thread block per table: its threads add the columns' weights (each logical index appears
// once per row, so no atomics), then reduce (score, column) pairs to the first minimum.
// Summation order differs from torch's sum over heads: scores agree to float32 rounding, and a
// victim can differ from the reference's only between scores within that rounding.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace kvstack {
namespace {

constexpr int kThreads = 256;

template <typename index_t>
__global__ void accumulate_and_pick_kernel(
    float* __restrict__ scores,           // [N, capacity]: by logical index, updated in place
    const float* __restrict__ weights,    // [N, heads * T_q, W] or nullptr
    const index_t* __restrict__ indices,  // [N, W]: each column's logical index (< 0: padding)
    const index_t* __restrict__ candidates,  // [N, C]: logical indices that may be evicted
    index_t* __restrict__ victims,        // [N]
    int64_t row_stride, int64_t capacity, int rows_per_table, int width, int count) {
  const int64_t table = blockIdx.x;
  float* table_scores = scores + table * row_stride;
  if (weights != nullptr) {
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
      const int64_t index = static_cast<int64_t>(indices[table * width + j]);
      if (index < 0) continue;
      CUDA_KERNEL_ASSERT(index < capacity);
      float received = 0.f;
      for (int r = 0; r < rows_per_table; ++r) {
        received += weights[(table * rows_per_table + r) * width + j];
      }
      table_scores[index] += received;
    }
    __syncthreads();
  }
  __shared__ float best_score[kThreads];
  __shared__ int best_column[kThreads];
  float best = std::numeric_limits<float>::infinity();
  int column = count;  // none yet
  for (int c = threadIdx.x; c < count; c += blockDim.x) {
    const int64_t index = static_cast<int64_t>(candidates[table * count + c]);
    CUDA_KERNEL_ASSERT(index >= 0 && index < capacity);
    // torch.argmin takes NaN for the minimum: a NaN score is below every number here too.
    const float score = isnan(table_scores[index]) ? -INFINITY : table_scores[index];
    if (score < best || (score == best && c < column)) {
      best = score;
      column = c;
    }
  }
  best_score[threadIdx.x] = best;
  best_column[threadIdx.x] = column;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float other = best_score[threadIdx.x + stride];
      const int other_column = best_column[threadIdx.x + stride];
      if (other < best_score[threadIdx.x] ||
          (other == best_score[threadIdx.x] && other_column < best_column[threadIdx.x])) {
        best_score[threadIdx.x] = other;
        best_column[threadIdx.x] = other_column;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    // No column chosen only when every score is +inf: the first, as argmin takes it.
    const int chosen = best_column[0] < count ? best_column[0] : 0;
    victims[table] = candidates[table * count + chosen];
  }
}

}  // namespace

at::Tensor accumulate_and_pick_victims_cuda(at::Tensor& scores, const c10::optional<at::Tensor>& weights,
                                            const at::Tensor& indices, const at::Tensor& candidates) {
  // A view of the policy's grown LogicalScores (its first T columns) will do: rows may be
  // strided, their elements must be adjacent.
  TORCH_CHECK(scores.is_cuda() && scores.dim() == 2 && scores.scalar_type() == at::kFloat &&
                  (scores.size(1) <= 1 || scores.stride(1) == 1),
              "scores must be a float32 CUDA tensor [N, T] with adjacent columns, got ",
              scores.scalar_type(), " ", scores.sizes(), " on ", scores.device());
  const int64_t tables = scores.size(0);
  TORCH_CHECK(candidates.dim() == 2 && candidates.size(0) == tables && candidates.size(1) > 0,
              "candidates must be [N=", tables, ", C >= 1], got ", candidates.sizes());
  TORCH_CHECK(candidates.scalar_type() == at::kLong || candidates.scalar_type() == at::kInt,
              "candidates must be int32 or int64, got ", candidates.scalar_type());
  TORCH_CHECK(indices.scalar_type() == candidates.scalar_type(),
              "indices must have candidates' dtype ", candidates.scalar_type(), ", got ",
              indices.scalar_type());
  TORCH_CHECK(candidates.device() == scores.device() && indices.device() == scores.device(),
              "candidates and indices must be on scores' device ", scores.device());
  const c10::cuda::CUDAGuard guard(scores.device());
  auto victims = at::empty({tables}, candidates.options());
  if (tables == 0) return victims;
  at::Tensor rows;  // [N, heads * T_q, W]
  int width = 0, rows_per_table = 0;
  if (weights.has_value()) {
    const auto& w = *weights;
    TORCH_CHECK(w.dim() == 4 && w.size(0) == tables && w.scalar_type() == at::kFloat &&
                    w.device() == scores.device(),
                "weights must be float32 [N=", tables, ", heads, T_q, W] on scores' device, got ",
                w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(indices.dim() == 2 && indices.size(0) == tables && indices.size(1) == w.size(3),
                "indices must be [N, W] = [", tables, ", ", w.size(3), "], got ", indices.sizes());
    rows = w.contiguous().view({tables, w.size(1) * w.size(2), w.size(3)});
    width = w.size(3);
    rows_per_table = w.size(1) * w.size(2);
  }
  const auto index_rows = indices.contiguous();
  const auto candidate_rows = candidates.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(candidates.scalar_type(), "accumulate_and_pick_victims", [&] {
    accumulate_and_pick_kernel<index_t><<<tables, kThreads, 0, stream>>>(
        scores.data_ptr<float>(), weights.has_value() ? rows.data_ptr<float>() : nullptr,
        index_rows.data_ptr<index_t>(), candidate_rows.data_ptr<index_t>(),
        victims.data_ptr<index_t>(), scores.stride(0), scores.size(1), rows_per_table, width,
        static_cast<int>(candidates.size(1)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return victims;
}

}  // namespace kvstack

TORCH_LIBRARY_FRAGMENT(kvstack_cuda, m) {
  m.def("accumulate_and_pick_victims(Tensor(a!) scores, Tensor? weights, Tensor indices, "
        "Tensor candidates) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvstack_cuda, CUDA, m) {
  m.impl("accumulate_and_pick_victims", &kvstack::accumulate_and_pick_victims_cuda);
}
