// Decode attention read in place from the paged KV cache: one query token per
// sequence, grouped-query heads, fp32 math whatever the cache dtype.
//
// The torch path gathers every sequence's blocks into a dense copy, then runs two
// small batched matmuls over it; on a CPU that copy (and the one matmul makes of
// the permuted result) costs more than the arithmetic. Here each (sequence, KV
// head) task walks its block table and reads each cached row once, where it lies.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) dst[e] = to_float(src[e]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < n; ++e) s += a[e] * b[e];
  return s;
}

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                      double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
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

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + s * q_seq + (h * group + g) * q_head, qf.data() + g * head_dim, head_dim);
      }
      // Pass 1: scaled scores q.k for every cached token.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t off = table[t / block_size] * c_block + (t % block_size) * c_slot + h * c_head;
        load_row(k_ptr + off, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * head_dim, row.data(), head_dim) * fscale;
      }
      // Softmax per query head, then pass 2: the probability-weighted sum of V.
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        denom[g] = sum;
      }
      for (int64_t t = 0; t < len; ++t) {
        const int64_t off = table[t / block_size] * c_block + (t % block_size) * c_slot + h * c_head;
        load_row(v_ptr + off, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t e = 0; e < head_dim; ++e) a[e] += p * row[e];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out_ptr + s * o_seq + (h * group + g) * head_dim;
        const float inv = 1.f / denom[g];
        for (int64_t e = 0; e < head_dim; ++e) o[e] = static_cast<T>(acc[g * head_dim + e] * inv);
      }
    }
  });
}

// q [S, H, Dh] (rows may be strided), k_cache/v_cache [num_blocks, block_size, Hkv, Dh]
// views with a unit last stride, block_tables [S, max_blocks] int64, context_lens [S]
// int64 (tokens to attend, the new one included: it is already in the cache);
// writes out [S, H * Dh].
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor out,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [S,H,Dh], caches [N,B,Hkv,Dh]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && out.stride(1) == 1, "last dims must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "K and V caches must share strides");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(), "one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "KV heads must divide query heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "int64 block tables");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "int64 context lengths");
  TORCH_CHECK(q.device().is_cpu(), "CPU only");
  switch (q.scalar_type()) {
    case at::kFloat: decode_attention<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale); break;
    case at::kBFloat16: decode_attention<c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, scale); break;
    case at::kHalf: decode_attention<c10::Half>(q, k_cache, v_cache, block_tables, context_lens, out, scale); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention read in place from the paged KV cache");
}
