// Moving K/V rows between slots of the arena's pool, in place, in one pass.
//
// copy_slots implements kvstack.reference.repack.copy_slots: rows[dst[m]] = rows[src[m]] for K
// and V. vToken's invariant I4 makes a repack's moves alias-free (no slot is both a source and a
// destination), so every row can move at once, in any order.
// append_slots writes a step's new K/V rows into their slots: rows[slots[n]] = new[n]. It is the
// scatter that TokenTable.append ends with (compiled/token_tables.py), as one launch for K and V.
//
// The pool is [num_blocks, block_size, H_kv, D]; a slot s is row s of its [S, H_kv, D] view. One
// thread block per moved row; its threads copy the row's H_kv * D elements (coalesced).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

namespace kvstack {
namespace {

// rows[dst[m]] = from[src == nullptr ? m : src[m]], for K and V together. For copy_slots,
// ``from`` is the pool itself (no __restrict__: it aliases ``rows``), safe because I4 keeps the
// source and destination slots apart. A slot outside the pool is a device assert.
template <typename scalar_t, typename index_t>
__global__ void move_rows_kernel(scalar_t* key_rows, scalar_t* value_rows,
                                 const scalar_t* key_from, const scalar_t* value_from,
                                 const index_t* __restrict__ src, const index_t* __restrict__ dst,
                                 int64_t row_elements, int64_t num_slots, int64_t num_from) {
  const int64_t m = blockIdx.x;
  const int64_t source = src == nullptr ? m : static_cast<int64_t>(src[m]);
  const int64_t target = static_cast<int64_t>(dst[m]);
  CUDA_KERNEL_ASSERT(source >= 0 && source < num_from);
  CUDA_KERNEL_ASSERT(target >= 0 && target < num_slots);
  const int64_t from = source * row_elements;
  const int64_t to = target * row_elements;
  for (int64_t e = threadIdx.x; e < row_elements; e += blockDim.x) {
    key_rows[to + e] = key_from[from + e];
    value_rows[to + e] = value_from[from + e];
  }
}

void check_pool(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.is_cuda() && value_cache.is_cuda(),
              "key_cache and value_cache must be CUDA tensors, got ", key_cache.device(), " and ",
              value_cache.device());
  TORCH_CHECK(key_cache.device() == value_cache.device(),
              "key_cache and value_cache must be on one device, got ", key_cache.device(), " and ",
              value_cache.device());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must both be [num_blocks, block_size, H_kv, D], got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must share a dtype, got ", key_cache.scalar_type(),
              " and ", value_cache.scalar_type());
  // In place: the kernel writes through the pool's own storage, which must be contiguous.
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache and value_cache must be contiguous (the kernel writes them in place)");
}

void check_index(const at::Tensor& index, const char* name, const at::Tensor& pool) {
  TORCH_CHECK(index.device() == pool.device(), name, " is on ", index.device(),
              ", expected the pool's device ", pool.device());
  TORCH_CHECK(index.dim() == 1, name, " must be 1-D, got shape ", index.sizes());
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, name,
              " must be int32 or int64, got ", index.scalar_type());
}

int threads_for(int64_t row_elements) {
  return static_cast<int>(std::min<int64_t>(256, ((row_elements + 31) / 32) * 32));
}

}  // namespace

void copy_slots_cuda(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& src_slots,
                     const at::Tensor& dst_slots) {
  check_pool(key_cache, value_cache);
  check_index(src_slots, "src_slots", key_cache);
  check_index(dst_slots, "dst_slots", key_cache);
  TORCH_CHECK(src_slots.sizes() == dst_slots.sizes() &&
                  src_slots.scalar_type() == dst_slots.scalar_type(),
              "src_slots and dst_slots must have one shape and dtype, got ", src_slots.sizes(),
              " ", src_slots.scalar_type(), " and ", dst_slots.sizes(), " ",
              dst_slots.scalar_type());
  const int64_t moves = src_slots.numel();
  const int64_t row_elements = key_cache.size(2) * key_cache.size(3);
  if (moves == 0 || row_elements == 0) return;
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const auto src = src_slots.contiguous();
  const auto dst = dst_slots.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, key_cache.scalar_type(), "copy_slots", [&] {
        AT_DISPATCH_INDEX_TYPES(src.scalar_type(), "copy_slots_index", [&] {
          move_rows_kernel<scalar_t, index_t><<<moves, threads_for(row_elements), 0, stream>>>(
              key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
              key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
              src.data_ptr<index_t>(), dst.data_ptr<index_t>(), row_elements,
              key_cache.size(0) * key_cache.size(1), key_cache.size(0) * key_cache.size(1));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
}

void append_slots_cuda(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slots,
                       const at::Tensor& keys, const at::Tensor& values) {
  check_pool(key_cache, value_cache);
  check_index(slots, "slots", key_cache);
  const int64_t rows = slots.numel();
  const auto row_shape = key_cache.sizes().slice(2);  // [H_kv, D]
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == rows && keys.sizes().slice(1) == row_shape &&
                  values.sizes() == keys.sizes(),
              "keys and values must both be [N=", rows, ", H_kv, D] with the pool's H_kv and D ",
              row_shape, ", got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(keys.scalar_type() == key_cache.scalar_type() &&
                  values.scalar_type() == key_cache.scalar_type(),
              "keys and values must have the pool's dtype ", key_cache.scalar_type(), ", got ",
              keys.scalar_type(), " and ", values.scalar_type());
  TORCH_CHECK(keys.device() == key_cache.device() && values.device() == key_cache.device(),
              "keys and values must be on the pool's device ", key_cache.device());
  const int64_t row_elements = key_cache.size(2) * key_cache.size(3);
  if (rows == 0 || row_elements == 0) return;
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const auto new_keys = keys.contiguous();
  const auto new_values = values.contiguous();
  const auto dst = slots.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, key_cache.scalar_type(), "append_slots",
      [&] {
        AT_DISPATCH_INDEX_TYPES(dst.scalar_type(), "append_slots_index", [&] {
          move_rows_kernel<scalar_t, index_t><<<rows, threads_for(row_elements), 0, stream>>>(
              key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
              new_keys.data_ptr<scalar_t>(), new_values.data_ptr<scalar_t>(), nullptr,
              dst.data_ptr<index_t>(), row_elements, key_cache.size(0) * key_cache.size(1), rows);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
}

}  // namespace kvstack

TORCH_LIBRARY_FRAGMENT(kvstack_cuda, m) {
  m.def("copy_slots(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor src_slots, "
        "Tensor dst_slots) -> ()");
  m.def("append_slots(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots, Tensor keys, "
        "Tensor values) -> ()");
}

TORCH_LIBRARY_IMPL(kvstack_cuda, CUDA, m) {
  m.impl("copy_slots", &kvstack::copy_slots_cuda);
  m.impl("append_slots", &kvstack::append_slots_cuda);
}
