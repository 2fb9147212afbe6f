// Decode attention read in place from the paged KV cache: one query token per
// sequence, grouped-query heads, fp32 math whatever the cache dtype.
//
// The torch path gathers every sequence's blocks into a dense copy, then runs two
// small batched matmuls over it; on a CPU that copy (and the one matmul makes of
// the permuted result) costs more than the arithmetic. Here each (sequence, KV
// head) task walks its block table and reads each cached row once, where it lies.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// A row of the cache as fp32: the row itself for an fp32 cache, else converted into `buf`.
template <typename T>
inline const float* row_f32(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) buf[e] = to_float(src[e]);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < n; ++e) s += a[e] * b[e];
  return s;
}

// Asks for `rows` rows of `span` elements, `row_stride` apart (one block of a task).
template <typename T>
inline void prefetch_block(const T* base, int64_t rows, int64_t row_stride, int64_t span) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < span; e += kLine) __builtin_prefetch(base + r * row_stride + e);
}

// HeadDim > 0 fixes the row length at compile time (the common 64 and 128), so the
// compiler unrolls the row loops; 0 reads it from the tensor.
template <typename T, int64_t HeadDim>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                      double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = HeadDim > 0 ? HeadDim : q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const int64_t o_seq = out.stride(0);
  // K and V are views of one pool: same strides, different base.
  const int64_t c_block = k_cache.stride(0), c_slot = k_cache.stride(1), c_head = k_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  // A task is one sequence with all its KV heads, so that it reads each block's rows in
  // address order; with fewer sequences than ~2 per thread, split by KV head as well.
  const int64_t head_split = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_task = num_kv_heads / head_split;
  const int64_t rows = heads_per_task * group;  // query heads of one task

  at::parallel_for(0, num_seqs * head_split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * head_dim), acc(rows * head_dim), buf(head_dim), denom(rows), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / head_split, h0 = (task % head_split) * heads_per_task;
      const int64_t len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      const int64_t span = (heads_per_task - 1) * c_head + head_dim;  // elements of one slot's rows
      scores.resize(rows * len);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < head_dim; ++e)
          qf[r * head_dim + e] = to_float(q_ptr[s * q_seq + (h0 * group + r) * q_head + e]);

      // The task's rows of token t in `cache`. At a block's first token it prefetches
      // the next block: blocks are scattered, so the hardware cannot guess the jump.
      auto token_rows = [&](const T* cache, int64_t t) -> const T* {
        const int64_t b = t / block_size, slot = t % block_size;
        if (slot == 0 && b + 1 < max_blocks && (b + 1) * block_size < len)
          prefetch_block(cache + table[b + 1] * c_block + h0 * c_head, block_size, c_slot, span);
        return cache + table[b] * c_block + slot * c_slot + h0 * c_head;
      };

      // Pass 1: scaled scores q.k for every cached token.
      for (int64_t t = 0; t < len; ++t) {
        const T* base = token_rows(k_ptr, t);
        for (int64_t h = 0; h < heads_per_task; ++h) {
          const float* k = row_f32(base + h * c_head, buf.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = h * group + g;
            scores[r * len + t] = dot(qf.data() + r * head_dim, k, head_dim) * fscale;
          }
        }
      }
      // Softmax per query head.
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * len;
        const float mx = *std::max_element(sr, sr + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sr[t] = std::exp(sr[t] - mx);
          sum += sr[t];
        }
        denom[r] = sum;
      }
      // Pass 2: the probability-weighted sum of V.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* base = token_rows(v_ptr, t);
        for (int64_t h = 0; h < heads_per_task; ++h) {
          const float* v = row_f32(base + h * c_head, buf.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = h * group + g;
            const float p = scores[r * len + t];
            float* a = acc.data() + r * head_dim;
#pragma omp simd
            for (int64_t e = 0; e < head_dim; ++e) a[e] += p * v[e];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out_ptr + s * o_seq + (h0 * group + r) * head_dim;
        const float inv = 1.f / denom[r];
        for (int64_t e = 0; e < head_dim; ++e) o[e] = static_cast<T>(acc[r * head_dim + e] * inv);
      }
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                       double scale) {
  switch (q.size(2)) {
    case 64: decode_attention<T, 64>(q, k_cache, v_cache, block_tables, context_lens, out, scale); break;
    case 128: decode_attention<T, 128>(q, k_cache, v_cache, block_tables, context_lens, out, scale); break;
    default: decode_attention<T, 0>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
  }
}

// q [S, H, Dh] (rows may be strided), k_cache/v_cache [num_blocks, block_size, Hkv, Dh]
// views with a unit last stride, block_tables [S, max_blocks] int64, context_lens [S]
// int64 (tokens to attend, the new one included: it is already in the cache);
// writes out [S, H * Dh].
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [S,H,Dh], caches [N,B,Hkv,Dh]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && out.stride(1) == 1, "last dims must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "K and V caches must share strides");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(), "one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "KV heads must divide query heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "int64 block tables");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "int64 context lengths");
  TORCH_CHECK(q.device().is_cpu(), "CPU only");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one table and length per row");
  // The kernel reads raw pointers: a bad length or block id would read out of the pool
  // (and kill the process) where the torch path raises, so check what it will touch.
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "context length ", lens[s], " out of range");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " outside the pool of ", num_blocks);
    }
  }
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale); break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    case at::kHalf: dispatch_head_dim<c10::Half>(q, k_cache, v_cache, block_tables, context_lens, out, scale); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

// A registered op, not a pybind function, so that torch.profiler sees it (and names it)
// and the dispatcher checks its schema.
TORCH_LIBRARY(duet, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor(a!) out, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(duet, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
