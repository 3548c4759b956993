// The decode step's one-row bf16 products, and on AVX2 those of a few dozen rows (prefill's
// experts), for `--kernels native` (see expertcache/kernels.py).
//
// torch's one-row bf16 kernel widens every weight to fp32 before its multiply-add and reads the
// weights at about half of what this CPU can stream. On a CPU with AVX512-BF16 a single
// instruction (vdpbf16ps) multiplies 32 bf16 pairs and adds them into 16 fp32 sums, as
// llama.cpp's bf16 path does; with AVX2 the products' input is widened once per call and each
// run of 16 weights in two instructions (`dot_widened`); elsewhere a portable loop widens to fp32
// in 16 independent lanes, which the compiler vectorises without reassociating anything.
//
// Every output element is one row's dot product, summed by one thread in a fixed order over K.
// So a result depends only on the row and the input, never on how rows are split across
// threads or how many experts a call holds: outputs stay identical across cache modes.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "rank_rows.h"

// EXPERTCACHE_PORTABLE builds the portable loop on any CPU (the tests check both builds).
#if defined(__AVX512BF16__) && !defined(EXPERTCACHE_PORTABLE)
#define EXPERTCACHE_BF16_DOT 1
#include <immintrin.h>
#endif
// Decode attention's sums in AVX2 registers (`attend_heads`); the portable loop elsewhere.
#if defined(__AVX2__) && defined(__FMA__) && !defined(EXPERTCACHE_PORTABLE)
#define EXPERTCACHE_AVX2_ATTEND 1
#include <immintrin.h>
#endif

namespace {

using bf16 = at::BFloat16;

inline float widen(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// sum_k row[k] * x[k], accumulated in fp32.
inline float dot(const uint16_t* row, const uint16_t* x, int64_t K) {
#if defined(EXPERTCACHE_BF16_DOT)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    // A decode product reads its rows one after the other: ask for the bytes 16 KiB ahead (into the
    // second-level cache), two lines per step. On an Intel Xeon whose prefetchers left the products
    // waiting on memory, a bf16 decode step then took 0.80x the time, and 0.85x with `dot_widened`'s
    // AVX2 path, which asks the same (docs/benchmarks.md, the Intel Xeon sections). A hint only: past
    // the weights it reads nothing and cannot fault.
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + 16384, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + 16384 + 64, _MM_HINT_T1);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(row + k), (__m512bh)_mm512_loadu_si512(x + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(row + k + 32),
                          (__m512bh)_mm512_loadu_si512(x + k + 32));
  }
  for (; k < K; k += 32) {
    const int64_t left = K - k;
    const __mmask32 m = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, row + k),
                          (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
  float lane[16] = {0};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    for (int i = 0; i < 16; ++i) lane[i] += widen(row[k + i]) * widen(x[k + i]);
  for (int i = 0; k + i < K; ++i) lane[i] += widen(row[k + i]) * widen(x[k + i]);
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += lane[i];
  return s;
#endif
}

// On AVX2 without AVX512-BF16, a product's x is widened once per call into `Widened` order:
// per 16 elements, the 8 at even positions then the 8 at odd ones. A weight run of 16 then
// widens in two instructions (the even elements shifted up by 16 bits, the odd ones masked in
// place) and meets x in two fused multiply-adds, where widening both sides element by element
// took several times the work and kept one core well below the rate memory delivers.
#if defined(__AVX2__) && defined(__FMA__) && !defined(EXPERTCACHE_PORTABLE) && !defined(EXPERTCACHE_BF16_DOT)
#define EXPERTCACHE_AVX2_DOT 1
#include <immintrin.h>
#endif

#if defined(EXPERTCACHE_AVX2_ATTEND)
// The eight lanes' total.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

// x [K] into out [K] in fp32 as `dot_widened` reads it (the tail past the last 16 in order).
inline void widen_ordered(const uint16_t* x, int64_t K, float* out) {
  const int64_t K16 = K - K % 16;
  for (int64_t i = 0; i < K; ++i) out[i < K16 ? i - i % 16 + (i % 2) * 8 + (i % 16) / 2 : i] = widen(x[i]);
}

// x [K] held as `widen_ordered` writes it; empty on the builds that read x as it is.
struct Widened {
  std::vector<float> v;
  Widened() = default;
  Widened(const uint16_t* x, int64_t K) {
#if defined(EXPERTCACHE_AVX2_DOT)
    v.resize(K);
    widen_ordered(x, K, v.data());
#else
    (void)x, (void)K;
#endif
  }
};

// sum_k row[k] * x[k] with x as `Widened` holds it; the portable build and AVX512-BF16 take `dot`.
inline float dot_widened(const uint16_t* row, const uint16_t* x, const Widened& xw, int64_t K) {
#if defined(EXPERTCACHE_AVX2_DOT)
  const float* X = xw.v.data();
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + 16384, _MM_HINT_T1);  // as in `dot`
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 16));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_loadu_ps(X + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w0, odd)), _mm256_loadu_ps(X + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), _mm256_loadu_ps(X + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w1, odd)), _mm256_loadu_ps(X + k + 24), a3);
  }
  for (; k + 16 <= K; k += 16) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_loadu_ps(X + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w0, odd)), _mm256_loadu_ps(X + k + 8), a1);
  }
  float total = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) total += widen(row[k]) * X[k];
  return total;
#else
  (void)xw;
  return dot(row, x, K);
#endif
}

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<bf16>());
}

uint16_t* mutable_bits(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<bf16>()); }

void check_matrix(const torch::Tensor& w, int64_t K, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              what, ": expected a contiguous 2-D bf16 CPU tensor");
  TORCH_CHECK(w.size(1) == K, what, ": expected ", K, " columns, got ", w.size(1));
}

// y [N] = w [N, K] x [K], rounded to bf16 once per element; y [1, N] for a decode step's x [1, K].
torch::Tensor gemv(const torch::Tensor& w, const torch::Tensor& x_in) {
  const bool row = x_in.dim() == 2 && x_in.size(0) == 1;
  const torch::Tensor x = row ? x_in.reshape({-1}).contiguous() : x_in;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 1 && x.is_contiguous(),
              "x: expected a contiguous 1-D (or [1, K]) bf16 CPU tensor");
  const int64_t K = x.size(0);
  check_matrix(w, K, "w");
  const int64_t N = w.size(0);
  auto y = row ? torch::empty({1, N}, x.options()) : torch::empty({N}, x.options());
  const uint16_t* W = bits(w);
  const uint16_t* X = bits(x);
  const Widened xw(X, K);
  bf16* Y = y.data_ptr<bf16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) Y[r] = bf16(dot_widened(W + r * K, X, xw, K));
  });
  return y;
}

// Products of a few dozen rows (a prompt's tokens routed to one expert; a prompt's projections)
// on AVX2: y [T, N] = x [T, K] w [N, K]^T, each element summed in fp32 and rounded once. Widening
// the weights to fp32 for a BLAS product costs a write and a read of twice their bytes per call,
// and oneDNN's own bf16 product runs at a seventh of its fp32 one here. Instead each run of 16
// weights is widened in registers (as `dot_widened` does it) and meets TR rows of x at once, so
// a weight read from memory serves TR rows and the sums stay in registers.
//
// Every element is summed in the same order whatever the tile, the row count or the threads: 8
// lanes over K's runs of 16 (even elements, then odd), their total, then the tail past the last
// run. So a row's result does not depend on which other rows share its call.
#if defined(EXPERTCACHE_AVX2_DOT)
template <int NR, int TR>
inline void rows_tile(const uint16_t* w, const float* x, int64_t K, float (*out)[NR]) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int64_t K16 = K - K % 16;
  __m256 acc[TR][NR];
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    // The next tile's rows, a cache line per row every other step: from memory, NR strided rows
    // are streams the hardware prefetcher follows too late (4-16 rows ran at 60% of this rate).
    // Past the last tile the hint names memory beyond the weights, which a prefetch never faults.
    if (k % 32 == 0)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * K + k), _MM_HINT_T0);
    for (int r = 0; r < NR; ++r) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      for (int t = 0; t < TR; ++t) acc[t][r] = _mm256_fmadd_ps(even, _mm256_loadu_ps(x + t * K + k), acc[t][r]);
      const __m256 oddw = _mm256_castsi256_ps(_mm256_and_si256(raw, odd));
      for (int t = 0; t < TR; ++t) acc[t][r] = _mm256_fmadd_ps(oddw, _mm256_loadu_ps(x + t * K + k + 8), acc[t][r]);
    }
  }
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < NR; ++r) {
      float s = sum8(acc[t][r]);
      for (int64_t k = K16; k < K; ++k) s += widen(w[r * K + k]) * x[t * K + k];
      out[t][r] = s;
    }
}

// Rows [n0, n0 + NR) of w against rows [t0, t0 + TR) of x (widened), into y [T, N].
template <int NR, int TR>
inline void rows_block(const uint16_t* W, const float* X, int64_t K, int64_t N, int64_t n0, int64_t t0, bf16* Y) {
  float out[TR][NR];
  rows_tile<NR, TR>(W + n0 * K, X + t0 * K, K, out);
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < NR; ++r) Y[(t0 + t) * N + n0 + r] = bf16(out[t][r]);
}

template <int NR>
inline void rows_strip(const uint16_t* W, const float* X, int64_t K, int64_t N, int64_t n0, int64_t t0,
                       int64_t t1, bf16* Y) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) rows_block<NR, 4>(W, X, K, N, n0, t, Y);
  switch (t1 - t) {
    case 3: rows_block<NR, 3>(W, X, K, N, n0, t, Y); break;
    case 2: rows_block<NR, 2>(W, X, K, N, n0, t, Y); break;
    case 1: rows_block<NR, 1>(W, X, K, N, n0, t, Y); break;
    default: break;
  }
}
#endif

// Rows of x per pass over a thread's weight rows: their fp32 copy (64 x 2048 x 4 bytes) stays in
// a core's L2 while the weights stream past it.
constexpr int64_t kRowsPerPass = 64;

// y [T, N] = x [T, K] w [N, K]^T in bf16, each element's sum in fp32 rounded once.
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x: expected a contiguous 2-D bf16 CPU tensor");
  const int64_t T = x.size(0), K = x.size(1);
  check_matrix(w, K, "w");
  const int64_t N = w.size(0);
  auto y = torch::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const uint16_t* W = bits(w);
  const uint16_t* Xb = bits(x);
  bf16* Y = y.data_ptr<bf16>();
#if defined(EXPERTCACHE_AVX2_DOT)
  std::vector<float> X(T * K);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) widen_ordered(Xb + t * K, K, X.data() + t * K);
  });
  at::parallel_for(0, (N + 2) / 3, 4, [&](int64_t begin, int64_t end) {
    const int64_t n_end = std::min(N, end * 3);
    for (int64_t t0 = 0; t0 < T; t0 += kRowsPerPass) {
      const int64_t t1 = std::min(T, t0 + kRowsPerPass);
      int64_t n = begin * 3;
      for (; n + 3 <= n_end; n += 3) rows_strip<3>(W, X.data(), K, N, n, t0, t1, Y);
      if (n_end - n == 2) rows_strip<2>(W, X.data(), K, N, n, t0, t1, Y);
      else if (n_end - n == 1) rows_strip<1>(W, X.data(), K, N, n, t0, t1, Y);
    }
  });
#else
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = begin; r < end; ++r) Y[t * N + r] = bf16(dot(W + r * K, Xb + t * K, K));
  });
#endif
  return y;
}

// A decode step's MoE output from its experts' rows (`experts` with `out`): y [1, D] = sum over
// ranks a of weights[a] * rows[a], in rank order, in fp32, rounded once to `like`'s dtype. Each
// product is rounded before it is added, as llama.cpp's graph (a multiply, then a chain of adds)
// computes it: the products go through memory, so no fused multiply-add joins the two.
torch::Tensor combine(const torch::Tensor& weights, const torch::Tensor& rows, const torch::Tensor& like) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == torch::kFloat32 && rows.dim() == 2 && rows.is_contiguous(),
              "rows: expected a contiguous fp32 CPU tensor [A, D]");
  const int64_t A = rows.size(0), D = rows.size(1);
  TORCH_CHECK(weights.numel() == A, "weights: expected ", A, " (one per row), got ", weights.numel());
  const torch::Tensor w = weights.to(torch::kFloat32).contiguous();
  const float* W = w.data_ptr<float>();
  const float* R = rows.data_ptr<float>();
  auto y = torch::zeros({1, D}, torch::kFloat32);
  float* acc = y.data_ptr<float>();
  std::vector<float> term(D);
  for (int64_t a = 0; a < A; ++a) {
    for (int64_t d = 0; d < D; ++d) term[d] = W[a] * R[a * D + d];
    for (int64_t d = 0; d < D; ++d) acc[d] += term[d];
  }
  return y.to(like.scalar_type());
}

// A decode step's routing: logits = router [E, D] x [D] (or [1, D]; rounded to bf16, as `gemv`), their
// softmax in fp32, the k largest in descending order (ties: the lower id first), renormalised to
// sum 1 when `normalize`, rounded to bf16 unless `weights_fp32`. Returns (weights [1, k], ids
// [1, k] int64).
std::tuple<torch::Tensor, torch::Tensor> route(const torch::Tensor& x, const torch::Tensor& router, int64_t top_k,
                                               bool normalize, bool weights_fp32) {
  const torch::Tensor logits = gemv(router, x).reshape({-1});
  const int64_t E = logits.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k: expected 1 to ", E, ", got ", top_k);
  const bf16* L = logits.data_ptr<bf16>();
  std::vector<float> p(E);
  float top = -INFINITY;
  for (int64_t e = 0; e < E; ++e) top = std::max(top, static_cast<float>(L[e]));
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(static_cast<float>(L[e]) - top));
  const float inv = 1.f / sum;
  for (float& v : p) v *= inv;
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  auto ids = torch::empty({1, top_k}, torch::kInt64);
  auto w = torch::empty({1, top_k}, torch::kFloat32);
  int64_t* I = ids.data_ptr<int64_t>();
  float* Wt = w.data_ptr<float>();
  float chosen = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    I[j] = order[j];
    chosen += (Wt[j] = p[order[j]]);
  }
  if (normalize)
    for (int64_t j = 0; j < top_k; ++j) Wt[j] /= chosen;
  return {weights_fp32 ? w : w.to(torch::kBFloat16), ids};
}

// Gemma's GeGLU gate: gelu with the tanh approximation, in fp32 with torch's formula and order
// of operations (ATen's Gelu.h): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline float gelu_tanh(float x) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = static_cast<float>(0.044715);
  const float cube = x * x * x;
  return 0.5f * x * (1.f + std::tanh(beta * (x + kappa * cube)));
}

// The gated experts of one decode step, n at a time: for each expert e,
//   gu = gate_up[e] x (rounded to bf16), h = act(gu[:I]) * gu[I:] (each op rounded to bf16,
//   as torch does it on bf16 tensors), y[e] = down[e] h (rounded to bf16);
// act silu (SwiGLU) or gelu_pytorch_tanh (GeGLU), each computed in fp32 as torch computes it.
// Returns [n, D]. Three parallel passes for the whole wave instead of five ops per expert.
// With `out` (fp32 [A, D]) and `rows` (one per expert), expert e's output goes unrounded to row
// rows[e] of `out` instead, which is returned: a decode step's experts in their router ranks,
// for `combine`.
torch::Tensor experts(const torch::Tensor& x, const std::vector<torch::Tensor>& gate_ups,
                      const std::vector<torch::Tensor>& downs, const std::string& act,
                      const c10::optional<torch::Tensor>& out, const std::vector<int64_t>& rows) {
  TORCH_CHECK(act == "silu" || act == "gelu_pytorch_tanh", "act: expected silu or gelu_pytorch_tanh, got ", act);
  const bool gelu = act == "gelu_pytorch_tanh";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 1 && x.is_contiguous(),
              "x: expected a contiguous 1-D bf16 CPU tensor");
  TORCH_CHECK(gate_ups.size() == downs.size(), "expected as many down matrices as gate/up ones");
  const int64_t n = static_cast<int64_t>(gate_ups.size()), D = x.size(0);
  float* const into = rank_rows(out, rows, n, D);
  auto y = into != nullptr ? *out : torch::empty({n, D}, x.options());
  if (n == 0) return y;
  const int64_t I = downs[0].size(1);
  std::vector<const uint16_t*> gu_w(n), dn_w(n);
  for (int64_t e = 0; e < n; ++e) {
    check_matrix(gate_ups[e], D, "gate_up");
    check_matrix(downs[e], I, "down");
    TORCH_CHECK(gate_ups[e].size(0) == 2 * I && downs[e].size(0) == D,
                "expected gate_up [2I, D] and down [D, I] with I = ", I);
    gu_w[e] = bits(gate_ups[e]);
    dn_w[e] = bits(downs[e]);
  }
  const uint16_t* X = bits(x);
  const Widened xw(X, D);
  std::vector<uint16_t> gu(n * 2 * I), h(n * I);
  at::parallel_for(0, n * 2 * I, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t e = r / (2 * I), i = r % (2 * I);
      gu[r] = bf16(dot_widened(gu_w[e] + i * D, X, xw, D)).x;
    }
  });
  at::parallel_for(0, n * I, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t e = r / I, i = r % I;
      const float g = widen(gu[e * 2 * I + i]), u = widen(gu[e * 2 * I + I + i]);
      const float a = widen(bf16(gelu ? gelu_tanh(g) : g / (1.f + std::exp(-g))).x);
      h[r] = bf16(a * u).x;
    }
  });
  std::vector<Widened> hw(n);
  for (int64_t e = 0; e < n; ++e) hw[e] = Widened(h.data() + e * I, I);
  bf16* Y = into != nullptr ? nullptr : y.data_ptr<bf16>();
  at::parallel_for(0, n * D, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t e = r / D, i = r % D;
      const float v = dot_widened(dn_w[e] + i * I, h.data() + e * I, hw[e], I);
      if (into != nullptr)
        into[rows[e] * D + i] = v;
      else
        Y[r] = bf16(v);
    }
  });
  return y;
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous(),
              what, ": expected a contiguous bf16 CPU tensor");
}

// Row i of x [R, C] scaled to unit root-mean-square, then by w (one row [C], or one per row
// [R, C]): in fp32, rounded to bf16, times w, rounded again, as torch does it on bf16 tensors.
// 1 / sqrt(mean(x^2) + eps) of a row, the sum of squares summed as any row's product is.
inline float inv_rms(const uint16_t* x, int64_t C, double eps) {
  return 1.f / std::sqrt(dot(x, x, C) / static_cast<float>(C) + static_cast<float>(eps));
}

void rms_rows(const uint16_t* x, const uint16_t* w, bool per_row, int64_t R, int64_t C, double eps, uint16_t* y) {
  for (int64_t i = 0; i < R; ++i) {
    const uint16_t* xi = x + i * C;
    const uint16_t* wi = per_row ? w + i * C : w;
    const float inv = inv_rms(xi, C, eps);
    for (int64_t c = 0; c < C; ++c)
      y[i * C + c] = bf16(widen(wi[c]) * widen(bf16(widen(xi[c]) * inv).x)).x;
  }
}

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w, double eps) {
  const torch::Tensor x = x_in.contiguous();  // a decode step's rows already are: no copy
  check_rows(x, "x");
  check_rows(w, "weight");
  TORCH_CHECK(x.dim() == 2, "x: expected [rows, columns]");
  const int64_t R = x.size(0), C = x.size(1);
  const bool per_row = w.dim() == 2;
  TORCH_CHECK(per_row ? (w.size(0) == R && w.size(1) == C) : (w.dim() == 1 && w.size(0) == C),
              "weight: expected [", C, "] or [", R, ", ", C, "]");
  auto y = torch::empty_like(x);
  rms_rows(bits(x), bits(w), per_row, R, C, eps, mutable_bits(y));
  return y;
}

// A float32 or bfloat16 vector's element i as fp32 (the weights of a DeltaNet layer come in
// either, by checkpoint).
struct Floats {
  const float* f = nullptr;
  const uint16_t* b = nullptr;
  explicit Floats(const torch::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                    (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16),
                what, ": expected a contiguous float32 or bfloat16 CPU tensor");
    if (t.scalar_type() == torch::kFloat32) f = t.data_ptr<float>();
    else b = bits(t);
  }
  float operator[](int64_t i) const { return f ? f[i] : widen(b[i]); }
};

// Row x [C] scaled to unit root-mean-square, in fp32, by w where there is one, rounded once.
// One loop per kind of weight: a choice per element keeps the compiler from vectorising it.
inline void scaled_row(const uint16_t* x, const Floats* w, int64_t C, double eps, uint16_t* y) {
  const float inv = inv_rms(x, C, eps);
  if (w && w->f)
    for (int64_t c = 0; c < C; ++c) y[c] = bf16(widen(x[c]) * inv * w->f[c]).x;
  else if (w)
    for (int64_t c = 0; c < C; ++c) y[c] = bf16(widen(x[c]) * inv * widen(w->b[c])).x;
  else
    for (int64_t c = 0; c < C; ++c) y[c] = bf16(widen(x[c]) * inv).x;
}

// Row x [Dh] with its first R dims rotated by this position's tables C, S [R] (the sign of
// rotate-half folded into S), in fp32 and rounded once; dims R .. Dh-1 as they are.
inline void rotate_row(const uint16_t* x, const uint16_t* C, const uint16_t* S, int64_t Dh, uint16_t* out,
                       int64_t R = -1) {
  R = R < 0 ? Dh : R;
  const int64_t half = R / 2;
  for (int64_t d = 0; d < R; ++d) {
    const float rot = widen(x[d < half ? d + half : d - half]);
    out[d] = bf16(widen(x[d]) * widen(C[d]) + rot * widen(S[d])).x;
  }
  std::memcpy(out + R, x + R, (Dh - R) * sizeof(uint16_t));
}

// Head x [Dh] as decode attention takes a query or key: normalised and scaled (`scaled_row`),
// then its first R dims rotated (`rotate_row`) into out; scratch [Dh].
inline void norm_rotate(const uint16_t* x, const Floats& w, const uint16_t* C, const uint16_t* S, int64_t Dh,
                        int64_t R, double eps, uint16_t* scratch, uint16_t* out) {
  scaled_row(x, &w, Dh, eps, scratch);
  rotate_row(scratch, C, S, Dh, out, R);
}

// RMSNorm normalised and scaled in fp32, rounded once (Gemma 4's norms, and Qwen3.5's with 1 + w
// in the weight): y = bf16(x * inv * w), w fp32 or bf16 [C], or without a weight bf16(x * inv).
// torch takes about eight ops for this; a decode step of those families runs dozens of them.
// x of any shape is taken as rows of its last dim (a decode step's [1, D] or [1, heads, Dh]); y
// has x's shape.
torch::Tensor rms_norm_scaled(const torch::Tensor& x_in, const c10::optional<torch::Tensor>& w, double eps) {
  TORCH_CHECK(x_in.dim() >= 1, "x: expected at least one dim");
  const torch::Tensor x = x_in.contiguous();
  check_rows(x, "x");
  const int64_t C = x.size(-1), R = C ? x.numel() / C : 0;
  const bool has_w = w.has_value() && w->defined();
  if (has_w) TORCH_CHECK(w->dim() == 1 && w->size(0) == C, "weight: expected [", C, "]");
  const c10::optional<Floats> weight = has_w ? c10::make_optional(Floats(*w, "weight")) : c10::nullopt;
  auto y = torch::empty_like(x);
  const uint16_t* X = bits(x);
  uint16_t* Y = mutable_bits(y);
  for (int64_t i = 0; i < R; ++i) scaled_row(X + i * C, weight ? &*weight : nullptr, C, eps, Y + i * C);
  return y;
}

// exp(x) for x <= 0 (softmax scores less their maximum), within about 2 ulp of the exact value,
// 0 below -87: Cody-Waite reduction by ln 2 and Cephes' degree-5 polynomial, without libm. The
// portable build's loop; the AVX2 build takes eight at a time (`exp8_nonpositive`).
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  // n = round(x / ln 2): adding and taking away 1.5 * 2^23 rounds to an integer (no branch, no libm)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float e = poly * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

#if defined(EXPERTCACHE_AVX2_ATTEND)
// Eight bf16 values as fp32 lanes.
inline __m256 widen8(const uint16_t* v) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// exp_nonpositive's reduction and polynomial on eight lanes (with fused multiply-adds, so not
// always the same last bit as the scalar form; a build only ever takes one of the two).
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(c));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(poly, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}
#endif

// NH query heads q [NH, Dh] (fp32) that share one key/value head, over its P cached positions
// K, V [P, Dh] (bf16): out [NH, Dh] = softmax(q K^T * scale) V, in fp32; p [NH, P rounded up to
// a multiple of 8] scratch.
// Each key or value row is widened once for all NH heads, whose sums are independent lanes kept
// in registers (NH x 8 fp32): several times fewer loads than one head at a time.
// With kpos, a row t whose position kpos[t] is negative (empty) or at most lo (out of a sliding
// window) takes no part: its weight is exactly 0.
template <int NH>
void attend_heads(const float* q, const uint16_t* K, const uint16_t* V, int64_t P, int64_t Dh, float scale,
                  const int64_t* kpos, int64_t lo, float* p, float* out) {
  const int64_t D8 = Dh - Dh % 8, P8 = (P + 7) / 8 * 8;
  const auto masked = [&](int64_t t) { return kpos && (kpos[t] < 0 || kpos[t] <= lo); };
  for (int64_t t = 0; t < P; ++t) {
    if (masked(t)) {
      for (int j = 0; j < NH; ++j) p[j * P8 + t] = -INFINITY;
      continue;
    }
    const uint16_t* kt = K + t * Dh;
    float sums[NH];
#if defined(EXPERTCACHE_AVX2_ATTEND)
    __m256 lane[NH];
    for (int j = 0; j < NH; ++j) lane[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 k8 = widen8(kt + d);
      for (int j = 0; j < NH; ++j) lane[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * Dh + d), k8, lane[j]);
    }
    for (int j = 0; j < NH; ++j) sums[j] = sum8(lane[j]);
#else
    float lane[NH][8] = {};
    for (int64_t d = 0; d < D8; d += 8) {
      float k8[8];
      for (int i = 0; i < 8; ++i) k8[i] = widen(kt[d + i]);
      for (int j = 0; j < NH; ++j)
        for (int i = 0; i < 8; ++i) lane[j][i] += q[j * Dh + d + i] * k8[i];
    }
    for (int j = 0; j < NH; ++j) {
      sums[j] = 0.f;
      for (int i = 0; i < 8; ++i) sums[j] += lane[j][i];
    }
#endif
    for (int j = 0; j < NH; ++j) {
      float s = sums[j];
      for (int64_t d = D8; d < Dh; ++d) s += q[j * Dh + d] * widen(kt[d]);
      p[j * P8 + t] = s * scale;
    }
  }
  for (int j = 0; j < NH; ++j) {
    float* pj = p + j * P8;
    float top = -INFINITY;
    for (int64_t t = 0; t < P; ++t) top = std::max(top, pj[t]);
#if defined(EXPERTCACHE_AVX2_ATTEND)
    // Eight at a time over the padded row (its tail is never read again): GCC does not
    // vectorise the scalar form, whose clamp is a branch under -ftrapping-math.
    for (int64_t t = 0; t < P; t += 8)
      _mm256_storeu_ps(pj + t, exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(pj + t), _mm256_set1_ps(top))));
#else
    for (int64_t t = 0; t < P; ++t) pj[t] = exp_nonpositive(pj[t] - top);
#endif
    if (kpos)  // the exp's clamp leaves a masked row a tiny weight, not 0
      for (int64_t t = 0; t < P; ++t) pj[t] = masked(t) ? 0.f : pj[t];
    float total = 0.f;
    for (int64_t t = 0; t < P; ++t) total += pj[t];
    const float inv = 1.f / total;
    for (int64_t t = 0; t < P; ++t) pj[t] *= inv;
  }
  std::fill(out, out + NH * Dh, 0.f);
  for (int64_t t0 = 0; t0 < P; t0 += 64) {  // 64 value rows at a time stay in L1 across the columns
    const int64_t t1 = std::min(P, t0 + 64);
    for (int64_t d = 0; d < D8; d += 8) {
#if defined(EXPERTCACHE_AVX2_ATTEND)
      __m256 lane[NH];
      for (int j = 0; j < NH; ++j) lane[j] = _mm256_loadu_ps(out + j * Dh + d);
      for (int64_t t = t0; t < t1; ++t) {
        const __m256 v8 = widen8(V + t * Dh + d);
        for (int j = 0; j < NH; ++j) lane[j] = _mm256_fmadd_ps(_mm256_set1_ps(p[j * P8 + t]), v8, lane[j]);
      }
      for (int j = 0; j < NH; ++j) _mm256_storeu_ps(out + j * Dh + d, lane[j]);
#else
      float lane[NH][8];
      for (int j = 0; j < NH; ++j)
        for (int i = 0; i < 8; ++i) lane[j][i] = out[j * Dh + d + i];
      for (int64_t t = t0; t < t1; ++t) {
        float v8[8];
        for (int i = 0; i < 8; ++i) v8[i] = widen(V[t * Dh + d + i]);
        for (int j = 0; j < NH; ++j) {
          const float w = p[j * P8 + t];
          for (int i = 0; i < 8; ++i) lane[j][i] += w * v8[i];
        }
      }
      for (int j = 0; j < NH; ++j)
        for (int i = 0; i < 8; ++i) out[j * Dh + d + i] = lane[j][i];
#endif
    }
    for (int64_t d = D8; d < Dh; ++d)
      for (int64_t t = t0; t < t1; ++t)
        for (int j = 0; j < NH; ++j) out[j * Dh + d] += p[j * P8 + t] * widen(V[t * Dh + d]);
  }
}

// Attention over a layer's cache for one token's H query heads (q [H, Dh], bf16): rows 0 .. n-1
// of kc, vc [G, capacity, Dh], masked by kpos/lo as `attend_heads` says (kpos null: none);
// returns [1, H * Dh] (bf16) like `like`, or [H * Dh] for a one-dim `like`.
torch::Tensor attend_cache(const std::vector<uint16_t>& q, const torch::Tensor& kc, const torch::Tensor& vc, int64_t n,
                           const int64_t* kpos, int64_t lo, double scale, int64_t H, int64_t G,
                           const torch::Tensor& like) {
  const int64_t Dh = kc.size(2), cap = kc.size(1), R = H / G;
  std::vector<float> qf(H * Dh);
  for (int64_t i = 0; i < H * Dh; ++i) qf[i] = widen(q[i]);
  const uint16_t* K = bits(kc);
  const uint16_t* V = bits(vc);
  auto y = like.dim() == 2 ? torch::empty({1, H * Dh}, like.options()) : torch::empty({H * Dh}, like.options());
  uint16_t* Y = mutable_bits(y);
  // The R query heads of a key/value group in blocks of up to 8 (`attend_heads`), one block per
  // task: each key and value row is read once per block rather than once per head.
  const int64_t HB = std::min<int64_t>(R, 8), blocks = (R + HB - 1) / HB;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, G * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(HB * ((n + 7) / 8 * 8)), acc(HB * Dh);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u / blocks, h0 = g * R + (u % blocks) * HB, nh = std::min(HB, g * R + R - h0);
      const uint16_t *Kg = K + g * cap * Dh, *Vg = V + g * cap * Dh;
      for (int64_t j = 0; j < nh;) {  // in blocks of 8, 4, 2 and 1 heads
        const int64_t m = nh - j >= 8 ? 8 : nh - j >= 4 ? 4 : nh - j >= 2 ? 2 : 1;
        const float* qj = qf.data() + (h0 + j) * Dh;
        float *pj = p.data(), *aj = acc.data();
        if (m == 8) attend_heads<8>(qj, Kg, Vg, n, Dh, sc, kpos, lo, pj, aj);
        else if (m == 4) attend_heads<4>(qj, Kg, Vg, n, Dh, sc, kpos, lo, pj, aj);
        else if (m == 2) attend_heads<2>(qj, Kg, Vg, n, Dh, sc, kpos, lo, pj, aj);
        else attend_heads<1>(qj, Kg, Vg, n, Dh, sc, kpos, lo, pj, aj);
        for (int64_t i = 0; i < m * Dh; ++i) Y[(h0 + j) * Dh + i] = bf16(aj[i]).x;
        j += m;
      }
    }
  });
  return y;
}

void check_kv_cache(const torch::Tensor& kc, const torch::Tensor& vc, int64_t G, int64_t slot, int64_t n) {
  check_rows(kc, "key cache");
  check_rows(vc, "value cache");
  TORCH_CHECK(kc.dim() == 3 && vc.sizes() == kc.sizes() && kc.size(0) == G, "kv cache: expected [G, capacity, Dh]");
  TORCH_CHECK(slot >= 0 && slot < n, "attention: row ", slot, " is not among the ", n, " rows attended over");
  TORCH_CHECK(n <= kc.size(1), "attention: row ", n - 1, " is outside the cache of ", kc.size(1), " rows");
}

// Decode attention for one token, from the q/k/v projection's output to the heads' outputs:
//   qkv [(H + 2G) * Dh]: q for H heads, k and v for G key/value heads;
//   qk_norm [H + G, Dh] (one weight row per head) or empty: RMSNorm of q and k first;
//   cos, sin [Dh]: this position's rotary tables, the sign of rotate-half folded into sin;
//   kc, vc [G, capacity, Dh]: the layer's key/value cache; this token's k and v go to `pos`.
// Scores, softmax and the weighted sum of values run in fp32 per head; returns [H * Dh].
torch::Tensor attend(const torch::Tensor& qkv, const torch::Tensor& qk_norm, double eps, const torch::Tensor& cos,
                     const torch::Tensor& sin, const torch::Tensor& kc, const torch::Tensor& vc, int64_t pos, double scale,
                     int64_t H, int64_t G) {
  for (const torch::Tensor* t : {&qkv, &cos, &sin}) check_rows(*t, "attention input");
  TORCH_CHECK(pos >= 0, "attention: position ", pos, " is negative");
  check_kv_cache(kc, vc, G, pos, pos + 1);
  const int64_t Dh = kc.size(2), cap = kc.size(1);
  TORCH_CHECK(H % G == 0 && Dh % 2 == 0 && qkv.numel() == (H + 2 * G) * Dh && cos.numel() == Dh && sin.numel() == Dh,
              "attention: shapes do not match H=", H, " G=", G, " Dh=", Dh);
  const bool norm = qk_norm.numel() > 0;
  if (norm) {
    check_rows(qk_norm, "qk_norm");
    TORCH_CHECK(qk_norm.numel() == (H + G) * Dh, "qk_norm: expected [", H + G, ", ", Dh, "]");
  }
  const uint16_t* in = bits(qkv);
  std::vector<uint16_t> qk((H + G) * Dh);
  if (norm) rms_rows(in, bits(qk_norm), true, H + G, Dh, eps, qk.data());
  else std::memcpy(qk.data(), in, qk.size() * sizeof(uint16_t));
  // Rotate q and k in fp32, rounded once; k goes straight into the cache, as does v.
  const uint16_t *C = bits(cos), *S = bits(sin);
  std::vector<uint16_t> q(H * Dh);
  uint16_t* K = mutable_bits(kc);
  uint16_t* V = mutable_bits(vc);
  for (int64_t r = 0; r < H + G; ++r)
    rotate_row(qk.data() + r * Dh, C, S, Dh, r < H ? q.data() + r * Dh : K + ((r - H) * cap + pos) * Dh);
  for (int64_t g = 0; g < G; ++g)
    std::memcpy(V + (g * cap + pos) * Dh, in + (H + G + g) * Dh, Dh * sizeof(uint16_t));
  return attend_cache(q, kc, vc, pos + 1, nullptr, 0, scale, H, G, qkv);
}

// Gemma 4's decode attention (models/sliding_attention.py), from the projection's output to the
// heads' outputs, in one call where torch takes about thirty:
//   qkv [(H + 2G) * Dh], or [(H + G) * Dh] with k_eq_v (v is then k as projected);
//   q_norm, k_norm [Dh]: per-head RMSNorms scaled once (`scaled_row`); v's has no weight;
//   cos, sin [Dh]: this position's rotary tables, the sign of rotate-half folded into sin;
//   kc, vc [G, capacity, Dh]: the layer's keys and values (a sliding layer's ring); this token's
//   go to row `slot`, and attention runs over rows 0 .. n-1;
//   kpos (optional, int64 [>= n]): each row's position, masked as `attend_heads` says.
torch::Tensor attend_scaled(const torch::Tensor& qkv, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                            double eps, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kc,
                            const torch::Tensor& vc, int64_t slot, int64_t n, const c10::optional<torch::Tensor>& kpos,
                            int64_t lo, double scale, int64_t H, int64_t G, bool k_eq_v) {
  for (const torch::Tensor* t : {&qkv, &cos, &sin}) check_rows(*t, "attention input");
  check_kv_cache(kc, vc, G, slot, n);
  const int64_t Dh = kc.size(2), cap = kc.size(1);
  TORCH_CHECK(H % G == 0 && Dh % 2 == 0 && qkv.numel() == (H + (k_eq_v ? 1 : 2) * G) * Dh && cos.numel() == Dh &&
                  sin.numel() == Dh && q_norm.numel() == Dh && k_norm.numel() == Dh,
              "attention: shapes do not match H=", H, " G=", G, " Dh=", Dh);
  const int64_t* P = nullptr;
  if (kpos.has_value() && kpos->defined()) {
    TORCH_CHECK(kpos->device().is_cpu() && kpos->scalar_type() == torch::kInt64 && kpos->is_contiguous() &&
                    kpos->numel() >= n, "kpos: expected a contiguous int64 CPU tensor of at least ", n, " positions");
    P = kpos->data_ptr<int64_t>();
  }
  const Floats qw(q_norm, "q_norm"), kw(k_norm, "k_norm");
  const uint16_t *in = bits(qkv), *C = bits(cos), *S = bits(sin);
  uint16_t *K = mutable_bits(kc), *V = mutable_bits(vc);
  std::vector<uint16_t> scratch(Dh), q(H * Dh);
  for (int64_t h = 0; h < H; ++h) norm_rotate(in + h * Dh, qw, C, S, Dh, Dh, eps, scratch.data(), q.data() + h * Dh);
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* k = in + (H + g) * Dh;
    norm_rotate(k, kw, C, S, Dh, Dh, eps, scratch.data(), K + (g * cap + slot) * Dh);
    scaled_row(k_eq_v ? k : in + (H + G + g) * Dh, nullptr, Dh, eps, V + (g * cap + slot) * Dh);
  }
  return attend_cache(q, kc, vc, n, P, lo, scale, H, G, qkv);
}

inline float round_bf16(float v) { return widen(bf16(v).x); }
inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// Qwen3.5's gated attention for one token (models/gated_attention.py), from the projection's
// output to the gated heads' outputs, in one call where torch takes about twenty:
//   qkv [2 H Dh + 2 G Dh]: per head Dh query rows then Dh gate rows, then k, then v;
//   q_norm, k_norm [Dh] (1 + w, fp32 or bf16): per-head RMSNorms scaled once (`scaled_row`);
//   cos, sin [R]: rotary tables of the first R dims of a head (the rest pass through);
//   kc, vc [G, capacity, Dh]: this token's key and value go to row `slot`; attention over rows
//   0 .. n-1; each output rounded to bf16, then times sigmoid(gate) (rounded), as torch does.
torch::Tensor attend_gated(const torch::Tensor& qkv, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                           double eps, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kc,
                           const torch::Tensor& vc, int64_t slot, int64_t n, double scale, int64_t H, int64_t G) {
  for (const torch::Tensor* t : {&qkv, &cos, &sin}) check_rows(*t, "attention input");
  check_kv_cache(kc, vc, G, slot, n);
  const int64_t Dh = kc.size(2), cap = kc.size(1), R = cos.numel();
  TORCH_CHECK(H % G == 0 && qkv.numel() == 2 * (H + G) * Dh && R % 2 == 0 && R <= Dh && sin.numel() == R &&
                  q_norm.numel() == Dh && k_norm.numel() == Dh,
              "attention: shapes do not match H=", H, " G=", G, " Dh=", Dh, " rotary dims=", R);
  const Floats qw(q_norm, "q_norm"), kw(k_norm, "k_norm");
  const uint16_t *in = bits(qkv), *C = bits(cos), *S = bits(sin), *kin = in + 2 * H * Dh, *vin = kin + G * Dh;
  uint16_t *K = mutable_bits(kc), *V = mutable_bits(vc);
  std::vector<uint16_t> scratch(Dh), q(H * Dh);
  for (int64_t h = 0; h < H; ++h)
    norm_rotate(in + 2 * h * Dh, qw, C, S, Dh, R, eps, scratch.data(), q.data() + h * Dh);
  for (int64_t g = 0; g < G; ++g) {
    norm_rotate(kin + g * Dh, kw, C, S, Dh, R, eps, scratch.data(), K + (g * cap + slot) * Dh);
    std::memcpy(V + (g * cap + slot) * Dh, vin + g * Dh, Dh * sizeof(uint16_t));
  }
  torch::Tensor y = attend_cache(q, kc, vc, n, nullptr, 0, scale, H, G, qkv);
  uint16_t* Y = mutable_bits(y);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < Dh; ++d) {
      const float gate = round_bf16(1.f / (1.f + std::exp(-widen(in[(2 * h + 1) * Dh + d]))));
      Y[h * Dh + d] = bf16(widen(Y[h * Dh + d]) * gate).x;
    }
  return y;
}

// One decode step of a Gated DeltaNet layer (models/deltanet.py), from its projections to the
// gated norm's output, in one call where torch takes about forty:
//   qkv [C] (C = 2 Hk dk + Hv dv) and z [Hv dv], b, a [Hv]: the input projections, bf16;
//   conv_w [C, K]: the depthwise causal conv; conv [C, K-1] bf16: its last K-1 inputs, shifted;
//   A, dt_bias [Hv]; norm [dv]: the gated RMSNorm's weight; S [Hv, dk, dv] fp32: the state.
// Each step rounds where torch's does (the conv's sum and SiLU to bf16, beta's sigmoid in bf16,
// the output and the normalised output to bf16); the state update reads S twice and writes it
// once: predicted = k.(S e^g), then S = S e^g + k (x) beta (v - predicted) and o = q.S in one
// pass. Value head h reads key head h / (Hv/Hk) (grouped) or h % Hk (tiled). Returns [Hv dv] bf16.
torch::Tensor deltanet_step(const torch::Tensor& qkv, const torch::Tensor& z, const torch::Tensor& b,
                            const torch::Tensor& a, const torch::Tensor& conv_w, const torch::Tensor& conv,
                            const torch::Tensor& A, const torch::Tensor& dt_bias, const torch::Tensor& norm,
                            const torch::Tensor& S, int64_t Hk, bool tiled, double eps) {
  for (const torch::Tensor* t : {&qkv, &z, &b, &a, &conv}) check_rows(*t, "deltanet input");
  TORCH_CHECK(S.device().is_cpu() && S.scalar_type() == torch::kFloat32 && S.is_contiguous() && S.dim() == 3,
              "state: expected a contiguous float32 CPU tensor [Hv, dk, dv]");
  const int64_t Hv = S.size(0), dk = S.size(1), dv = S.size(2), C = qkv.numel(), K = conv_w.size(-1);
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0 && C == 2 * Hk * dk + Hv * dv && z.numel() == Hv * dv && b.numel() == Hv &&
                  a.numel() == Hv && A.numel() == Hv && dt_bias.numel() == Hv && norm.numel() == dv &&
                  conv_w.numel() == C * K && conv.numel() == C * (K - 1),
              "deltanet_step: shapes do not match Hk=", Hk, " Hv=", Hv, " dk=", dk, " dv=", dv, " C=", C);
  const Floats W(conv_w, "conv weight"), Af(A, "A"), dt(dt_bias, "dt_bias"), nw(norm, "norm weight");
  const bool norm_bf16 = norm.scalar_type() == torch::kBFloat16;
  const uint16_t *X = bits(qkv), *Z = bits(z), *B = bits(b), *Ain = bits(a);
  uint16_t* cs = mutable_bits(conv);
  // The conv over the K-1 kept inputs and this one, summed in fp32 in tap order; then SiLU.
  std::vector<float> mixed(C);
  for (int64_t c = 0; c < C; ++c) {
    uint16_t* row = cs + c * (K - 1);
    float y = 0.f;
    for (int64_t j = 0; j < K; ++j) {
      const float p = widen(j < K - 1 ? row[j] : X[c]) * W[c * K + j];
      y = j ? y + p : p;
    }
    mixed[c] = round_bf16(silu(round_bf16(y)));
    for (int64_t j = 0; j + 1 < K - 1; ++j) row[j] = row[j + 1];
    if (K > 1) row[K - 2] = X[c];
  }
  // q and k L2-normalised per key head (q then scaled by dk^-1/2), in fp32.
  const float qscale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int64_t part = 0; part < 2; ++part)
    for (int64_t h = 0; h < Hk; ++h) {
      float* v = mixed.data() + part * Hk * dk + h * dk;
      float ss = 0.f;
      for (int64_t i = 0; i < dk; ++i) ss += v[i] * v[i];
      const float inv = 1.f / std::sqrt(ss + 1e-6f);
      for (int64_t i = 0; i < dk; ++i) v[i] = part ? v[i] * inv : (v[i] * inv) * qscale;
    }
  auto y = qkv.dim() == 2 ? torch::empty({1, Hv * dv}, qkv.options()) : torch::empty({Hv * dv}, qkv.options());
  uint16_t* Y = mutable_bits(y);
  float* St = S.data_ptr<float>();
  const int64_t R = Hv / Hk;
  at::parallel_for(0, Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pred(dv), o(dv);
    for (int64_t h = begin; h < end; ++h) {
      const int64_t kh = tiled ? h % Hk : h / R;
      const float* q = mixed.data() + kh * dk;
      const float* k = mixed.data() + Hk * dk + kh * dk;
      const float* v = mixed.data() + 2 * Hk * dk + h * dv;
      const float beta = round_bf16(1.f / (1.f + std::exp(-widen(B[h]))));
      const float x = widen(Ain[h]) + dt[h];
      const float decay = std::exp(Af[h] * (x > 20.f ? x : std::log1p(std::exp(x))));
      float* s = St + h * dk * dv;
      std::fill(pred.begin(), pred.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) pred[j] += k[i] * (s[i * dv + j] * decay);
      for (int64_t j = 0; j < dv; ++j) pred[j] = (v[j] - pred[j]) * beta;  // the delta
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) {
          const float n = s[i * dv + j] * decay + k[i] * pred[j];
          s[i * dv + j] = n;
          o[j] += q[i] * n;
        }
      // Gated RMSNorm of the head's output (rounded to bf16 first), weight as is, times SiLU(z).
      float ss = 0.f;
      for (int64_t j = 0; j < dv; ++j) ss += (o[j] = round_bf16(o[j])) * o[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
      for (int64_t j = 0; j < dv; ++j) {
        const float xn = round_bf16(o[j] * inv);
        const float scaled = norm_bf16 ? round_bf16(nw[j] * xn) : nw[j] * xn;
        Y[h * dv + j] = bf16(scaled * silu(widen(Z[h * dv + j]))).x;
      }
    }
  });
  return y;
}

// dst <- src, both host uint8 tensors of the same size, contiguous: a slot fill from the RAM
// store. The destination is written with streaming stores (no read of its old lines first, no
// eviction of the cache's contents for bytes the wave reads once), in chunks across the threads,
// each thread's stores fenced before the call returns. On an Intel Xeon a Qwen3-30B-shape
// decode step's fills took 0.7 ms against 1.0 with torch's copy_ (docs/benchmarks.md); the
// bytes are the same.
void copy_bytes(torch::Tensor dst, const torch::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.scalar_type() == torch::kUInt8 &&
                  src.scalar_type() == torch::kUInt8 && dst.is_contiguous() && src.is_contiguous() &&
                  dst.numel() == src.numel(),
              "copy_bytes: expected two contiguous uint8 host tensors of one size, got ", dst.sizes(), " and ",
              src.sizes());
  uint8_t* d = dst.data_ptr<uint8_t>();
  const uint8_t* s = src.data_ptr<uint8_t>();
  constexpr int64_t CHUNK = 1 << 16;
  const int64_t n = dst.numel();
  at::parallel_for(0, (n + CHUNK - 1) / CHUNK, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * CHUNK, hi = std::min(n, end * CHUNK);
#if defined(EXPERTCACHE_AVX2_ATTEND)  // an AVX2 build
    int64_t i = lo;
    const int64_t head = std::min(hi - lo, static_cast<int64_t>(-reinterpret_cast<uintptr_t>(d + lo) & 31));
    std::memcpy(d + i, s + i, head);
    for (i += head; i + 128 <= hi; i += 128)
      for (int k = 0; k < 128; k += 32)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + k),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + k)));
    std::memcpy(d + i, s + i, hi - i);
    _mm_sfence();
#else
    std::memcpy(d + lo, s + lo, hi - lo);
#endif
  });
}

}  // namespace

// Each call releases Python's lock while it runs: it touches tensors only, and other threads
// (the prefetch worker's reads, the server's requests) can run meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(EXPERTCACHE_BF16_DOT)
  m.attr("isa") = "avx512-bf16";
#elif defined(EXPERTCACHE_AVX2_DOT)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "portable";
#endif
  m.def("gemv", &gemv, "y [N] = w [N, K] x [K], bf16, one-row decode product",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_rows", &linear_rows, "y [T, N] = x [T, K] w [N, K]^T, bf16, for products of a few dozen rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("experts", &experts, "a wave of gated experts (silu or gelu_pytorch_tanh) on one token: [n, D]; with "
        "out (fp32 [A, D]) and rows, expert e's output unrounded in out[rows[e]]",
        py::arg("x"), py::arg("gate_ups"), py::arg("downs"), py::arg("act") = "silu", py::arg("out") = py::none(),
        py::arg("rows") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>());
  m.def("combine", &combine, "y [1, D] = sum over ranks of weights[a] * rows[a] (fp32 [A, D]) in fp32, in like's dtype",
        py::call_guard<py::gil_scoped_release>());
  m.def("route", &route, "a decode step's top-k routing: (weights [1, k], ids [1, k])",
        py::arg("x"), py::arg("router"), py::arg("top_k"), py::arg("normalize"), py::arg("weights_fp32") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x [R, C], weight [C] or [R, C]",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_scaled", &rms_norm_scaled, "RMSNorm of each row of x [R, C] scaled in fp32 by weight [C] (or none), rounded once",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("attend", &attend, "decode attention for one token: q/k norm, rotary, kv append, softmax(qk)v",
        py::call_guard<py::gil_scoped_release>());
  m.def("attend_scaled", &attend_scaled, "Gemma 4's decode attention for one token: q/k/v norms scaled once, "
        "rotary, the key and value into a cache row, softmax(qk)v over the rows, masked by position",
        py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("cos"), py::arg("sin"),
        py::arg("kc"), py::arg("vc"), py::arg("slot"), py::arg("n"), py::arg("kpos"), py::arg("lo"), py::arg("scale"),
        py::arg("H"), py::arg("G"), py::arg("k_eq_v"), py::call_guard<py::gil_scoped_release>());
  m.def("attend_gated", &attend_gated, "Qwen3.5's gated decode attention for one token: q/k norms scaled once, "
        "partial rotary, the key and value into a cache row, softmax(qk)v over the rows, times sigmoid(gate)",
        py::call_guard<py::gil_scoped_release>());
  m.def("copy_bytes", &copy_bytes, "dst <- src (host uint8, contiguous, one size) with streaming stores",
        py::call_guard<py::gil_scoped_release>());
  m.def("deltanet_step", &deltanet_step, "one Gated DeltaNet decode step: conv, normalised q/k, state update, gated norm",
        py::call_guard<py::gil_scoped_release>());
}
