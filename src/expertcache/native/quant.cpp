// One-row products straight from ggml quantized blocks (GGUF experts), for decode.
// Loaded by expertcache/kernels/quant_native.py.
//
// A weight is decoded exactly as gguf-py (and ggml's reference dequantization) decodes it: fp16
// scales widened to fp32, the super-block scale times the sub-block scale rounded to fp32, times
// the quant, minus the minimum, each step rounded on its own. This file is built with
// -ffp-contract=off so that the compiler never fuses those steps; `dequantize` below therefore
// equals gguf.quants.dequantize bit for bit, and the tests hold it to that.
//
// A row's product decodes one block at a time into a small buffer and multiplies it into 16 fp32
// lanes, lane j taking the weights at k = j mod 16 in increasing k, then sums the lanes in a fixed
// order. Every output element is one row, summed by one thread: a result depends only on the row
// and the input, never on how rows are split across threads or how many experts a call holds.
// With AVX2 and FMA the lanes are two 8-wide registers updated by fused multiply-adds, and Q4_K,
// Q5_K, Q6_K, Q8_0 and Q5_0 decode straight into registers (same bits, same lanes, no buffer);
// elsewhere, or with EXPERTCACHE_PORTABLE, the lanes are a plain array the compiler vectorises as
// a separate multiply and add. The two builds therefore differ in the last bits of a sum.
//
// ggml's own CPU kernels instead round x to 8 bits (Q8_K) and take integer dot products: faster,
// but each product then carries x's rounding error (~1e-3 relative); here x stays fp32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "rank_rows.h"

// A decode product's thread reads its weights in order, eight rows (or one tile of eight) at a
// time, and asks for the bytes sixteen rows (two tiles) ahead of each block as it reaches that
// block: a few hints per block, spread over the work, not a whole unit's lines in one burst at
// the unit's start. On a CPU whose prefetchers left the kernels waiting on memory, the burst made
// a decode step 0.71x as long, and spreading the same hints 0.78x as long again; asking for the
// second-level cache rather than the first (prefetcht1, not t0) 0.97x again (docs/benchmarks.md,
// the Intel Xeon sections). A hint only: past the weights' end it reads nothing and cannot fault.
inline void ask_for(const uint8_t* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(p + l, 0, 2);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(EXPERTCACHE_PORTABLE)
#define EXPERTCACHE_AVX2 1
#include <immintrin.h>
#endif

namespace {

// ggml's type ids (enum ggml_type) for the types decoded here.
enum Type : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30,
};

const int8_t kIQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float h2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
}

inline float bf2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- block decoders: bytes of one block -> its weights, exactly as gguf-py -----------------

void deq_q8_0(const uint8_t* b, float* y) {
  const float d = h2f(b);
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

void deq_q4_0(const uint8_t* b, float* y) {
  const float d = h2f(b);
  for (int l = 0; l < 16; ++l) {
    y[l] = d * static_cast<float>((b[2 + l] & 15) - 8);
    y[l + 16] = d * static_cast<float>((b[2 + l] >> 4) - 8);
  }
}

void deq_q4_1(const uint8_t* b, float* y) {
  const float d = h2f(b), m = h2f(b + 2);
  for (int l = 0; l < 16; ++l) {
    y[l] = d * static_cast<float>(b[4 + l] & 15) + m;
    y[l + 16] = d * static_cast<float>(b[4 + l] >> 4) + m;
  }
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void deq_q5_0(const uint8_t* b, float* y) {
  const float d = h2f(b);
  const uint32_t qh = u32(b + 2);
  for (int l = 0; l < 16; ++l) {
    const int lo = (b[6 + l] & 15) | (((qh >> l) & 1) << 4), hi = (b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
    y[l] = d * static_cast<float>(lo - 16);
    y[l + 16] = d * static_cast<float>(hi - 16);
  }
}

void deq_q5_1(const uint8_t* b, float* y) {
  const float d = h2f(b), m = h2f(b + 2);
  const uint32_t qh = u32(b + 4);
  for (int l = 0; l < 16; ++l) {
    const int lo = (b[8 + l] & 15) | (((qh >> l) & 1) << 4), hi = (b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
    y[l] = d * static_cast<float>(lo) + m;
    y[l + 16] = d * static_cast<float>(hi) + m;
  }
}

// The K-quant decoders walk 16 weights at a time with one scale and loop-invariant shifts, so
// that the compiler vectorises the inner loop; w = h*128 + s*32 + g*16 + i throughout.
void deq_q2_k(const uint8_t* b, float* y) {
  const uint8_t *sc = b, *qs = b + 16;
  const float d = h2f(b + 80), dmin = h2f(b + 82);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int g = 0; g < 2; ++g) {
        const int j = h * 8 + s * 2 + g;  // sub-block of 16 weights
        const float dl = d * static_cast<float>(sc[j] & 15), ml = dmin * static_cast<float>(sc[j] >> 4);
        const uint8_t* q = qs + h * 32 + g * 16;
        float* o = y + j * 16;
        for (int i = 0; i < 16; ++i) o[i] = dl * static_cast<float>((q[i] >> (2 * s)) & 3) - ml;
      }
}

void deq_q3_k(const uint8_t* b, float* y) {
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  const float d = h2f(b + 108);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int g = 0; g < 2; ++g) {
        const int j = h * 8 + s * 2 + g, bit = h * 4 + s;
        const int low = j < 8 ? (sc[j] & 15) : (sc[j - 8] >> 4), high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        const float dl = d * static_cast<float>((low | (high << 4)) - 32);
        const uint8_t *q = qs + h * 32 + g * 16, *m = hmask + g * 16;
        float* o = y + j * 16;
        // A clear high bit means minus 4.
        for (int i = 0; i < 16; ++i)
          o[i] = dl * static_cast<float>(((q[i] >> (2 * s)) & 3) - 4 + 4 * ((m[i] >> bit) & 1));
      }
}

// Q4_K/Q5_K: the 6-bit scale and minimum of sub-block j from the twelve scale bytes.
inline void k_scale(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void deq_q4_k(const uint8_t* b, float* y) {
  const float d = h2f(b), dmin = h2f(b + 2);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k_scale(b + 4, j, sc, m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const uint8_t* q = qs + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    for (int l = 0; l < 32; ++l) y[j * 32 + l] = dl * static_cast<float>((q[l] >> shift) & 15) - ml;
  }
}

void deq_q5_k(const uint8_t* b, float* y) {
  const float d = h2f(b), dmin = h2f(b + 2);
  const uint8_t *qh = b + 16, *qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k_scale(b + 4, j, sc, m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const uint8_t* q = qs + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4);
      y[j * 32 + l] = dl * static_cast<float>(v) - ml;
    }
  }
}

void deq_q6_k(const uint8_t* b, float* y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = h2f(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)  // low 4 bits: low nibbles of ql for s < 2, high nibbles after
      for (int g = 0; g < 2; ++g) {
        const int j = h * 8 + s * 2 + g;
        const float dl = d * static_cast<float>(sc[j]);
        const uint8_t *lo = ql + h * 64 + (s % 2) * 32 + g * 16, *hi = qh + h * 32 + g * 16;
        float* o = y + j * 16;
        for (int i = 0; i < 16; ++i) {
          const int q = ((lo[i] >> (4 * (s / 2))) & 15) | (((hi[i] >> (2 * s)) & 3) << 4);
          o[i] = dl * static_cast<float>(q - 32);
        }
      }
}

void deq_iq4_nl(const uint8_t* b, float* y) {
  const float d = h2f(b);
  for (int l = 0; l < 16; ++l) {
    y[l] = d * static_cast<float>(kIQ4[b[2 + l] & 15]);
    y[l + 16] = d * static_cast<float>(kIQ4[b[2 + l] >> 4]);
  }
}

void deq_iq4_xs(const uint8_t* b, float* y) {
  const float d = h2f(b);
  const int sh = b[2] | (b[3] << 8);
  const uint8_t *sl = b + 4, *qs = b + 8;
  for (int j = 0; j < 8; ++j) {
    const int ls = ((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    for (int l = 0; l < 16; ++l) {
      y[j * 32 + l] = dl * static_cast<float>(kIQ4[qs[j * 16 + l] & 15]);
      y[j * 32 + 16 + l] = dl * static_cast<float>(kIQ4[qs[j * 16 + l] >> 4]);
    }
  }
}

// Float storage is decoded 32 weights at a time (a "block" here); a row of any length ends with
// a partial group decoded weight by weight.
inline float f2f(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
void deq_f32(const uint8_t* b, float* y) { std::memcpy(y, b, 32 * 4); }
void deq_f16(const uint8_t* b, float* y) {
  for (int i = 0; i < 32; ++i) y[i] = h2f(b + 2 * i);
}
void deq_bf16(const uint8_t* b, float* y) {
  for (int i = 0; i < 32; ++i) y[i] = bf2f(b + 2 * i);
}

// ---- the fixed-order 16-lane sum ---------------------------------------------------------

struct Lanes {
#if defined(EXPERTCACHE_AVX2)
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  // n a multiple of 16.
  void add(const float* w, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), b);
    }
  }
  void add_tail(const float* w, const float* x, int64_t n) {  // n < 16: lanes 0..n-1
    alignas(32) float lw[16] = {0}, lx[16] = {0};
    std::memcpy(lw, w, n * 4);
    std::memcpy(lx, x, n * 4);
    add(lw, lx, 16);
  }
  float sum() const {
    alignas(32) float l[16];
    _mm256_store_ps(l, a);
    _mm256_store_ps(l + 8, b);
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += l[i];
    return s;
  }
#else
  float l[16] = {0};
  void add(const float* w, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
      for (int j = 0; j < 16; ++j) l[j] += w[i + j] * x[i + j];
  }
  void add_tail(const float* w, const float* x, int64_t n) {
    for (int64_t j = 0; j < n; ++j) l[j] += w[j] * x[j];
  }
  float sum() const {
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += l[i];
    return s;
  }
#endif
};

#if defined(EXPERTCACHE_AVX2)
// The hot types decode and multiply in registers, with the same two roundings per weight as the
// plain decoders (mul, then sub) and the same lanes in the same order as decoding a block into a
// buffer and adding it: `gemv` equals `gemv_decoded` bit for bit (the tests hold it to that).

// 8 weights: dl * q - ml, q from the low 8 unsigned bytes of q8.
inline __m256 scale_u8(__m128i q8, __m256 dl, __m256 ml) {
  return _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8))), ml);
}

// 8 weights: dl * q, q from the low 8 signed bytes of q8.
inline __m256 scale_i8(__m128i q8, __m256 dl) {
  return _mm256_mul_ps(dl, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
}

inline void fma8(__m256& acc, __m256 w, const float* x) { acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), acc); }

template <class Put>
inline void walk_q4_k(const uint8_t* b, Put&& put) {
  const float d = h2f(b), dmin = h2f(b + 2);
  const __m128i mask = _mm_set1_epi8(15);
  for (int p = 0; p < 4; ++p) {  // pairs of sub-blocks share 32 bytes: low nibbles, then high
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + p * 32));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + p * 32 + 16));
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * p + half;
      int sc, m;
      k_scale(b + 4, j, sc, m);
      const __m256 dl = _mm256_set1_ps(d * static_cast<float>(sc)), ml = _mm256_set1_ps(dmin * static_cast<float>(m));
      const __m128i a = half ? _mm_and_si128(_mm_srli_epi16(q0, 4), mask) : _mm_and_si128(q0, mask);
      const __m128i c = half ? _mm_and_si128(_mm_srli_epi16(q1, 4), mask) : _mm_and_si128(q1, mask);
      put(scale_u8(a, dl, ml), j * 32);
      put(scale_u8(_mm_srli_si128(a, 8), dl, ml), j * 32 + 8);
      put(scale_u8(c, dl, ml), j * 32 + 16);
      put(scale_u8(_mm_srli_si128(c, 8), dl, ml), j * 32 + 24);
    }
  }
}

template <class Put>
inline void walk_q5_k(const uint8_t* b, Put&& put) {
  const float d = h2f(b), dmin = h2f(b + 2);
  const __m128i mask = _mm_set1_epi8(15), one = _mm_set1_epi8(1);
  const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16));
  const __m128i h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32));
  for (int p = 0; p < 4; ++p) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 48 + p * 32));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 48 + p * 32 + 16));
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * p + half;
      int sc, m;
      k_scale(b + 4, j, sc, m);
      const __m256 dl = _mm256_set1_ps(d * static_cast<float>(sc)), ml = _mm256_set1_ps(dmin * static_cast<float>(m));
      // Bit j of every qh byte (a 16-bit shift moves each byte's bit j to its bit 0), to bit 4.
      const __m128i cnt = _mm_cvtsi32_si128(j);
      const __m128i b0 = _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h0, cnt), one), 4);
      const __m128i b1 = _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h1, cnt), one), 4);
      const __m128i a = _mm_or_si128(half ? _mm_and_si128(_mm_srli_epi16(q0, 4), mask) : _mm_and_si128(q0, mask), b0);
      const __m128i c = _mm_or_si128(half ? _mm_and_si128(_mm_srli_epi16(q1, 4), mask) : _mm_and_si128(q1, mask), b1);
      put(scale_u8(a, dl, ml), j * 32);
      put(scale_u8(_mm_srli_si128(a, 8), dl, ml), j * 32 + 8);
      put(scale_u8(c, dl, ml), j * 32 + 16);
      put(scale_u8(_mm_srli_si128(c, 8), dl, ml), j * 32 + 24);
    }
  }
}

// 16 bytes, byte i 16 where bit i of the two little-endian bytes at `bits` is set, else 0.
inline __m128i bit_bytes16(const uint8_t* bits) {
  uint16_t v;
  std::memcpy(&v, bits, 2);
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(v), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, sel), sel), _mm_set1_epi8(16));
}

template <class Put>
inline void walk_q5_0(const uint8_t* b, Put&& put) {
  const __m256 d = _mm256_set1_ps(h2f(b));
  const __m128i mask = _mm_set1_epi8(15), off = _mm_set1_epi8(16);
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
  const __m128i lo = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(qs, mask), bit_bytes16(b + 2)), off);
  const __m128i hi = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), bit_bytes16(b + 4)), off);
  put(scale_i8(lo, d), 0);
  put(scale_i8(_mm_srli_si128(lo, 8), d), 8);
  put(scale_i8(hi, d), 16);
  put(scale_i8(_mm_srli_si128(hi, 8), d), 24);
}

template <class Put>
inline void walk_q8_0(const uint8_t* b, Put&& put) {
  const __m256 d = _mm256_set1_ps(h2f(b));
  for (int i = 0; i < 32; i += 16) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + i));
    put(scale_i8(q, d), i);
    put(scale_i8(_mm_srli_si128(q, 8), d), i + 8);
  }
}

template <class Put>
inline void walk_q6_k(const uint8_t* b, Put&& put) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = h2f(b + 208);
  const __m128i m4 = _mm_set1_epi8(15), m2 = _mm_set1_epi8(3), off = _mm_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {  // 32 weights: w = h*128 + s*32 + l
      const uint8_t* lp = ql + h * 64 + (s % 2) * 32;
      const uint8_t* hp = qh + h * 32;
      for (int g = 0; g < 2; ++g) {  // 16 weights at a time, one scale each
        __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lp + g * 16));
        lo = s < 2 ? _mm_and_si128(lo, m4) : _mm_and_si128(_mm_srli_epi16(lo, 4), m4);
        __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hp + g * 16));
        hi = _mm_and_si128(_mm_srli_epi16(hi, 2 * s), m2);
        const __m128i q = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), off);  // -32..31
        const int w = h * 128 + s * 32 + g * 16;
        const __m256 dl = _mm256_set1_ps(d * static_cast<float>(sc[w / 16]));
        put(scale_i8(q, dl), w);
        put(scale_i8(_mm_srli_si128(q, 8), dl), w + 8);
      }
    }
  }
}

// Each walk hands its block's weights to `put`, 8 at a time with their offset in the block, in
// increasing order: the products add them into the lanes (lane a for offsets k with k % 16 < 8),
// the decoders store them. The same roundings either way.
#define EXPERTCACHE_WALKERS(X)                                                                      \
  void dot_##X(const uint8_t* b, const float* x, Lanes& L) {                                       \
    walk_##X(b, [&](__m256 w, int k) { fma8((k & 8) ? L.b : L.a, w, x + k); });                    \
  }                                                                                                \
  void deq_##X##_v(const uint8_t* b, float* y) {                                                    \
    walk_##X(b, [&](__m256 w, int k) { _mm256_storeu_ps(y + k, w); });                             \
  }
EXPERTCACHE_WALKERS(q4_k)
EXPERTCACHE_WALKERS(q5_k)
EXPERTCACHE_WALKERS(q5_0)
EXPERTCACHE_WALKERS(q8_0)
EXPERTCACHE_WALKERS(q6_k)
#undef EXPERTCACHE_WALKERS

// F16 and BF16 weights widened in registers (both exactly) into the lanes `Lanes::add` takes them
// in, rather than decoded weight by weight into a buffer: dense F16 and BF16 matrices are kept as
// the file's rows where products take llama.cpp's rounding, and a decode step streams them
// (`rows8_half`). Products only: `dequantize` keeps the plain decoders, which the tests hold to
// gguf-py's bits.
template <bool BF>
inline __m256 half_w8(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (BF) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#if defined(__F16C__)
  return _mm256_cvtph_ps(h);
#else
  alignas(32) float f[8];
  for (int r = 0; r < 8; ++r) f[r] = h2f(p + 2 * r);
  return _mm256_load_ps(f);
#endif
}

template <bool BF>
void dot_half(const uint8_t* b, const float* x, Lanes& L) {
  for (int k = 0; k < 32; k += 16) {
    fma8(L.a, half_w8<BF>(b + 2 * k), x + k);
    fma8(L.b, half_w8<BF>(b + 2 * k + 16), x + k + 8);
  }
}
#endif

using Decoder = void (*)(const uint8_t*, float*);
using BlockDot = void (*)(const uint8_t*, const float*, Lanes&);

struct Format {
  const char* name;
  int block;                       // weights per block
  int bytes;                       // bytes per block
  Decoder decode;
  float (*one)(const uint8_t*) = nullptr;  // float types: one weight (rows of any length)
  BlockDot dot = nullptr;                  // decode and multiply a block in registers, if offered
};

Format format_of(int64_t type) {
  switch (type) {
    case F32: return {"F32", 32, 128, deq_f32, f2f};
#if defined(EXPERTCACHE_AVX2)
    case F16: return {"F16", 32, 64, deq_f16, h2f, dot_half<false>};
    case BF16: return {"BF16", 32, 64, deq_bf16, bf2f, dot_half<true>};
    case Q8_0: return {"Q8_0", 32, 34, deq_q8_0_v, nullptr, dot_q8_0};
    case Q4_K: return {"Q4_K", 256, 144, deq_q4_k_v, nullptr, dot_q4_k};
    case Q6_K: return {"Q6_K", 256, 210, deq_q6_k_v, nullptr, dot_q6_k};
    case Q5_K: return {"Q5_K", 256, 176, deq_q5_k_v, nullptr, dot_q5_k};
    case Q5_0: return {"Q5_0", 32, 22, deq_q5_0_v, nullptr, dot_q5_0};
#else
    case F16: return {"F16", 32, 64, deq_f16, h2f};
    case BF16: return {"BF16", 32, 64, deq_bf16, bf2f};
    case Q8_0: return {"Q8_0", 32, 34, deq_q8_0};
    case Q4_K: return {"Q4_K", 256, 144, deq_q4_k};
    case Q6_K: return {"Q6_K", 256, 210, deq_q6_k};
    case Q5_K: return {"Q5_K", 256, 176, deq_q5_k};
    case Q5_0: return {"Q5_0", 32, 22, deq_q5_0};
#endif
    case Q4_0: return {"Q4_0", 32, 18, deq_q4_0};
    case Q4_1: return {"Q4_1", 32, 20, deq_q4_1};
    case Q5_1: return {"Q5_1", 32, 24, deq_q5_1};
    case Q2_K: return {"Q2_K", 256, 84, deq_q2_k};
    case Q3_K: return {"Q3_K", 256, 110, deq_q3_k};
    case IQ4_NL: return {"IQ4_NL", 32, 18, deq_iq4_nl};
    case IQ4_XS: return {"IQ4_XS", 256, 136, deq_iq4_xs};
    default: TORCH_CHECK(false, "ggml type ", type, " has no native kernel");
  }
}

// The products of a float type's row past its last whole group of 32 (decoded weight by weight)
// added into `acc`.
void add_partial(const Format& fmt, const uint8_t* row, const float* x, int64_t K, Lanes& acc) {
  const int64_t full = K / fmt.block, left = K - full * fmt.block;
  if (!left) return;
  alignas(32) float buf[32];
  const int width = fmt.bytes / fmt.block;
  const uint8_t* p = row + full * fmt.bytes;
  for (int64_t k = 0; k < left; ++k) buf[k] = fmt.one(p + k * width);
  int64_t k = 0;
  for (; k + 16 <= left; k += 16) acc.add(buf + k, x + full * fmt.block + k, 16);
  if (k < left) acc.add_tail(buf + k, x + full * fmt.block + k, left - k);
}

// sum_k W[row, k] x[k] for one row of `fmt` blocks; K a whole number of blocks except for the
// float types, whose last partial group is decoded weight by weight.
float row_dot(const Format& fmt, const uint8_t* row, const float* x, int64_t K, bool fused = true) {
  alignas(32) float buf[256];
  Lanes acc;
  const int64_t full = K / fmt.block;
  if (fmt.dot && fused) {
    for (int64_t i = 0; i < full; ++i) fmt.dot(row + i * fmt.bytes, x + i * fmt.block, acc);
  } else {
    for (int64_t i = 0; i < full; ++i) {
      fmt.decode(row + i * fmt.bytes, buf);
      acc.add(buf, x + i * fmt.block, fmt.block);
    }
  }
  add_partial(fmt, row, x, K, acc);
  return acc.sum();
}

// ---- 8-bit activations: llama.cpp's CPU numerics --------------------------------------------
//
// ggml's CPU products round the activation row to the weight type's partner format first (its
// `vec_dot_type`) and then take integer dot products per block: Q8_0 blocks (32 values, one fp16
// scale) beside Q4_0, Q5_0, Q8_0, IQ4_NL; Q8_1 blocks (the same values and scale, and s, the
// block's sum d * sum(q) stored in fp16) beside Q4_1 and Q5_1; Q8_K blocks (256 values, one fp32
// scale, sums of 16) beside the K-quants and IQ4_XS; the row rounded to fp16 or bf16 beside F16
// and BF16 weights; nothing beside F32. Here a row is rounded the same way (`Act`), and each
// block's product is an exact integer sum times the two scales, so the result is the product of
// the rounded row and the exactly decoded weights, up to the order of the float additions; but
// for Q4_1 and Q5_1, whose minimum m multiplies the fp16 s as ggml's does (d_w d_a sum(q_w q_a)
// + m s; the row's own sum differs by s's rounding, 3e-5 of a product seen). The integer sums are
// exact in any order, and the float steps are the same in the vector and the plain build: the
// two builds give the same bits. Types without an integer kernel multiply their decoded weights
// by the rounded row (`xt`) in fp32.

enum ActKind { A_F32, A_F16, A_BF16, A_Q8_0, A_Q8_1, A_Q8_K };

ActKind act_kind(int64_t type) {
  switch (type) {
    case F32: return A_F32;
    case F16: return A_F16;
    case BF16: return A_BF16;
    case Q8_0: case Q4_0: case Q5_0: case IQ4_NL: return A_Q8_0;
    case Q4_1: case Q5_1: return A_Q8_1;
    default: return A_Q8_K;
  }
}

struct Act {
  ActKind kind = A_F32;
  std::vector<int8_t> q;       // the rounded row's integers (Q8_0, Q8_1, Q8_K)
  std::vector<float> d;        // one scale per block of 32 (Q8_0, Q8_1) or 256 (Q8_K)
  std::vector<float> s;        // Q8_1: fp16(d * sum(q)) of each block, d the scale before its fp16 rounding
  std::vector<int32_t> bsum;   // Q8_K: the sum of each 16 integers
  std::vector<int32_t> bsum32; // Q8_K: the sum of each 32
  std::vector<float> xt;       // the rounded row as floats: d * q, or x rounded to fp16/bf16
};

inline float round_f16(float v) { return static_cast<float>(c10::Half(v)); }
inline float round_bf16(float v) { return static_cast<float>(at::BFloat16(v)); }

// x [K] rounded as ggml rounds it for a product with weights of `type`. Q8_0 and Q8_1 as ggml's x86
// quantizers do (scale max|x| / 127 stored as fp16; x * 127 / max|x| rounded to nearest even;
// Q8_1's s from the fp32 scale);
// Q8_K as ggml's reference (the value of largest magnitude maps to -127, ties to even, at most 127).
// The rounded row as floats (`xt`) is formed only where asked for (types without an integer kernel).
void quantize_act(const float* x, int64_t K, int64_t type, Act& a, bool floats) {
  a.kind = act_kind(type);
  if (floats) a.xt.resize(K);
  if (a.kind == A_F32 || a.kind == A_F16 || a.kind == A_BF16) {
    for (int64_t k = 0; k < K; ++k)
      a.xt[k] = a.kind == A_F32 ? x[k] : a.kind == A_F16 ? round_f16(x[k]) : round_bf16(x[k]);
    return;
  }
  const int block = a.kind == A_Q8_K ? 256 : 32;
  TORCH_CHECK(K % block == 0, "x: a row of ", K, " values is not a whole number of ",
              a.kind == A_Q8_0 ? "Q8_0" : a.kind == A_Q8_1 ? "Q8_1" : "Q8_K", " blocks of ", block);
  a.q.resize(K);
  a.d.resize(K / block);
  if (a.kind == A_Q8_1) a.s.resize(K / block);
  if (a.kind == A_Q8_K) {
    a.bsum.resize(K / 16);
    a.bsum32.resize(K / 32);
  }
  for (int64_t b = 0; b < K / block; ++b) {
    const float* xb = x + b * block;
    int8_t* qb = a.q.data() + b * block;
    float amax = 0.f, mx = 0.f;
    bool finite = true;
    for (int i = 0; i < block; ++i) {
      const float ax = std::fabs(xb[i]);
      finite = finite && ax <= std::numeric_limits<float>::max();
      if (ax > amax) { amax = ax; mx = xb[i]; }
    }
    if (!finite) {
      // A NaN or an infinity (an overflow upstream) has no 8-bit value, and the comparison above
      // skips a NaN: rounded as the others, the block's products came out finite, the NaN gone
      // without a trace. Its scale is NaN instead, so every product it enters is NaN, as the
      // float product of the row is, and no non-finite value is converted to an integer.
      std::memset(qb, 0, block);
      a.d[b] = std::numeric_limits<float>::quiet_NaN();
      if (a.kind == A_Q8_1) a.s[b] = a.d[b];
    } else if (a.kind != A_Q8_K) {
      // 127 / amax overflows only for a block of values below 127 / FLT_MAX, whose fp16 scale is
      // 0: its integers are then 0 rather than infinities converted to integers.
      const float dh = round_f16(amax / 127.f), inv = amax != 0.f ? 127.f / amax : 0.f;
      const float id = std::isinf(inv) ? 0.f : inv;
      int32_t sum = 0;
      for (int i = 0; i < block; ++i) {
        qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
        sum += qb[i];
      }
      a.d[b] = dh;
      if (a.kind == A_Q8_1) a.s[b] = round_f16(amax / 127.f * static_cast<float>(sum));
    } else if (amax == 0.f || std::isinf(-127.f / mx)) {  // all zeros, or too small for a scale: zeros
      std::memset(qb, 0, block);
      a.d[b] = 0.f;
    } else {
      const float iscale = -127.f / mx;
      for (int i = 0; i < block; ++i)
        qb[i] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * xb[i]))));
      a.d[b] = 1.f / iscale;
    }
    if (floats)
      for (int i = 0; i < block; ++i) a.xt[b * block + i] = a.d[b] * static_cast<float>(qb[i]);
    if (a.kind == A_Q8_K)
      for (int j = 0; j < block / 16; ++j) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += qb[j * 16 + i];
        a.bsum[b * 16 + j] = s;
        if (j % 2) a.bsum32[b * 8 + j / 2] = a.bsum[b * 16 + j - 1] + s;
      }
  }
}


#if defined(EXPERTCACHE_AVX2)
// 32 signed weights (at least -128) times 32 activations (at least -127): eight int32 sums.
inline __m256i dot_i8(__m256i w, __m256i a) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Eight vectors' lane totals as one vector (lane r: the total of v[r]).
inline __m256i totals8(const __m256i* v) {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}
#endif

// The 32-weight types (one fp16 scale per block): each block's integer sum is exact and formed
// whole, then enters one float sum, scaled by the block's d times the activations' (multiply,
// then add): a row's bits do not depend on how rows are grouped (eight per decode call,
// `rows8_32`; interleaved tiles in prefill, `tile_32`), and the plain build takes the same steps.
struct Acc1 {
  float v = 0.f;
  void add(int32_t total, float scale) { v += scale * static_cast<float>(total); }
  float sum() const { return v; }
};

#if defined(EXPERTCACHE_AVX2)
// A block's 32 weights as signed bytes, in order.
using Ints32 = __m256i (*)(const uint8_t*);
inline __m256i nibbles32(const uint8_t* q) {  // 16 bytes -> low nibbles (weights 0-15), high (16-31)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), m = _mm_set1_epi8(15);
  return _mm256_setr_m128i(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
}
__m256i ints_q8_0(const uint8_t* b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)); }
__m256i ints_q4_0(const uint8_t* b) { return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)); }
// The 32 fifth bits of a Q5 block at p: byte i is 0xff where bit i is set, else 0.
__m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
}
// Q5_0: 0 where the fifth bit is set, else 0xf0, OR-ed onto the nibble gives the weight
// (nibble + 16 * bit - 16) as a signed byte in one step.
__m256i ints_q5_0(const uint8_t* b) {
  return _mm256_or_si256(nibbles32(b + 6), _mm256_andnot_si256(fifth_bits(b + 2), _mm256_set1_epi8(static_cast<char>(0xf0))));
}
// Q4_1's and Q5_1's weights without their minimum: 0-15 (nibbles after d and m), 0-31 (the
// fifth bit, 16, OR-ed on where it is set).
__m256i ints_q4_1(const uint8_t* b) { return nibbles32(b + 4); }
__m256i ints_q5_1(const uint8_t* b) {
  return _mm256_or_si256(nibbles32(b + 8), _mm256_and_si256(fifth_bits(b + 4), _mm256_set1_epi8(16)));
}
__m256i ints_iq4_nl(const uint8_t* b) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4));
  const __m256i n = nibbles32(b + 2);
  return _mm256_setr_m128i(_mm_shuffle_epi8(table, _mm256_castsi256_si128(n)),
                           _mm_shuffle_epi8(table, _mm256_extracti128_si256(n, 1)));
}
#else
using Ints32 = void (*)(const uint8_t*, int8_t*);
void ints_q8_0(const uint8_t* b, int8_t* w) { std::memcpy(w, b + 2, 32); }
void ints_q4_0(const uint8_t* b, int8_t* w) {
  for (int l = 0; l < 16; ++l) {
    w[l] = static_cast<int8_t>((b[2 + l] & 15) - 8);
    w[l + 16] = static_cast<int8_t>((b[2 + l] >> 4) - 8);
  }
}
void ints_q5_0(const uint8_t* b, int8_t* w) {
  const uint32_t qh = u32(b + 2);
  for (int l = 0; l < 16; ++l) {
    w[l] = static_cast<int8_t>(((b[6 + l] & 15) | (((qh >> l) & 1) << 4)) - 16);
    w[l + 16] = static_cast<int8_t>(((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
  }
}
void ints_q4_1(const uint8_t* b, int8_t* w) {
  for (int l = 0; l < 16; ++l) {
    w[l] = static_cast<int8_t>(b[4 + l] & 15);
    w[l + 16] = static_cast<int8_t>(b[4 + l] >> 4);
  }
}
void ints_q5_1(const uint8_t* b, int8_t* w) {
  const uint32_t qh = u32(b + 4);
  for (int l = 0; l < 16; ++l) {
    w[l] = static_cast<int8_t>((b[8 + l] & 15) | (((qh >> l) & 1) << 4));
    w[l + 16] = static_cast<int8_t>((b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
  }
}
void ints_iq4_nl(const uint8_t* b, int8_t* w) {
  for (int l = 0; l < 16; ++l) {
    w[l] = kIQ4[b[2 + l] & 15];
    w[l + 16] = kIQ4[b[2 + l] >> 4];
  }
}
#endif

// Up to four rows against one row of a 32-weight type: each block decoded once, each row's sums
// and float steps those of the row alone. MIN: the type has a minimum m (fp16, after d) whose
// products m * s (the activations' Q8_1 sums) are summed apart and added last, as ggml does.
template <Ints32 INTS, int BYTES, int R, bool MIN = false>
void rows_32(const uint8_t* row, const Act* const* a, int64_t K, float* out) {
  Acc1 acc[R];
  float mins[R] = {};
  for (int64_t i = 0, nb = K / 32; i < nb; ++i) {
    const uint8_t* b = row + i * BYTES;
    const float d = h2f(b);
    if (MIN) {
      const float m = h2f(b + 2);
      for (int t = 0; t < R; ++t) mins[t] += m * a[t]->s[i];
    }
#if defined(EXPERTCACHE_AVX2)
    const __m256i w = INTS(b);
    __m256i v[8];
    for (int t = 0; t < 8; ++t)
      v[t] = t < R ? dot_i8(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t]->q.data() + i * 32)))
                   : _mm256_setzero_si256();
    alignas(32) int32_t tot[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tot), totals8(v));
    for (int t = 0; t < R; ++t) acc[t].add(tot[t], d * a[t]->d[i]);
#else
    alignas(32) int8_t w[32];
    INTS(b, w);
    for (int t = 0; t < R; ++t) {
      const int8_t* aq = a[t]->q.data() + i * 32;
      int32_t total = 0;
      for (int l = 0; l < 32; ++l) total += static_cast<int32_t>(w[l]) * aq[l];
      acc[t].add(total, d * a[t]->d[i]);
    }
#endif
  }
  for (int t = 0; t < R; ++t) out[t] = MIN ? acc[t].sum() + mins[t] : acc[t].sum();
}

template <Ints32 INTS, int BYTES, bool MIN = false>
float row_dot_32(const uint8_t* row, const Act& a, int64_t K) {
  const Act* p = &a;
  float y;
  rows_32<INTS, BYTES, 1, MIN>(row, &p, K, &y);
  return y;
}

// The 256-weight K-quants: each super-block's integers are exact and formed whole (`AccQ45`). A
// call takes up to four activation rows against one weight row: the block is decoded once, and
// each row's sums and float steps are exactly those of a call with that row alone. The plain
// build forms the same integers and takes the same float steps.

// The six-bit scales and minimums of a Q4_K/Q5_K block's twelve scale bytes (`k_scale`'s layout,
// four at a time).
inline void k_scales(const uint8_t* s, uint8_t sc[8], uint8_t m[8]) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
  const uint32_t out[4] = {w[0] & lo6, (w[2] & lo4) | (((w[0] >> 6) & lo2) << 4), w[1] & lo6,
                           ((w[2] >> 4) & lo4) | (((w[1] >> 6) & lo2) << 4)};
  std::memcpy(sc, out, 8);
  std::memcpy(m, out + 2, 8);
}

#if defined(EXPERTCACHE_AVX2)
// Eight int32 lanes: x[j] * y[j] + x[j + 8] * y[j + 8].
inline __m256i lane_pairs(const int32_t* x, const int32_t* y) {
  const auto ld = [](const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  return _mm256_add_epi32(_mm256_mullo_epi32(ld(x), ld(y)), _mm256_mullo_epi32(ld(x + 8), ld(y + 8)));
}
#endif

// Q4_K/Q5_K: each super-block's two integer sums (the scaled products, and the minimums times
// the activations' sums of 32) are exact and formed whole, then enter one float sum each: a
// block's float steps do not depend on how its integers were gathered, so a row gives the same
// bits from the file's rows and from the interleaved tiles of eight rows (`Q4KTiles`).
struct AccQ45 {
  float acc = 0.f, mins = 0.f;
  void add(int32_t sum, int32_t msum, float ad, float d, float dmin) {
    acc += (ad * d) * static_cast<float>(sum);
    mins += (ad * dmin) * static_cast<float>(msum);
  }
  float sum() const { return acc - mins; }
};


#if defined(EXPERTCACHE_AVX2)
// One Q4_K/Q5_K super-block `b` (block i of its row) against R activation rows: each row's
// integer sums, eight lanes of the scaled products (`sum`) and eight of the minimums times the
// activations' sums of 32 (`msum`); the whole-block integers are the lanes' totals.
template <bool FIVE, int R>
inline void q45_block(const uint8_t* b, const Act* const* a, int64_t i, __m256i* sum, __m256i* msum) {
  const uint8_t *qh = b + 16, *qs = b + (FIVE ? 48 : 16);
  alignas(8) uint8_t sc8[8], m8[8];
  k_scales(b + 4, sc8, m8);
  // The scales and minimums stay in registers: each scale broadcast by a shuffle, the minimums
  // widened to eight int32 lanes, whose products with the (16-bit) sums of 32 activations a
  // 16-bit multiply-add forms exactly (the upper halves of the minimums are zero).
  const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc8))));
  const __m256i m32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m8)));
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  const __m256i hb = FIVE ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)) : _mm256_setzero_si256();
  for (int t = 0; t < R; ++t) sum[t] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {  // one 32-byte run at a time: few registers live across the rows
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 32));
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (FIVE) {
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * p)), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * p + 1)), one), 4));
    }
    const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * (2 * p))));
    const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * (2 * p + 1))));
    for (int t = 0; t < R; ++t) {
      const int8_t* aq = a[t]->q.data() + i * 256 + p * 64;
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + 32));
      sum[t] = _mm256_add_epi32(sum[t], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), s0),
                                                         _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), s1)));
    }
  }
  for (int t = 0; t < R; ++t)
    msum[t] = _mm256_madd_epi16(m32, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t]->bsum32.data() + i * 8)));
}

#endif


#if defined(EXPERTCACHE_AVX2)
// v[t] and v[4 + t] (t < R): the lanes of row t's two block sums; their totals enter `AccQ45`,
// all eight transposed at once (`totals8`).
template <int R>
inline void add_totals(__m256i* v, AccQ45* acc, const Act* const* a, int64_t i, float d, float dmin) {
  for (int t = R; t < 4; ++t) v[t] = v[4 + t] = _mm256_setzero_si256();
  alignas(32) int32_t tot[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tot), totals8(v));
  for (int t = 0; t < R; ++t) acc[t].add(tot[t], tot[4 + t], a[t]->d[i], d, dmin);
}
#endif

template <bool FIVE, int R>
void rows_q45_k(const uint8_t* row, const Act* const* a, int64_t K, float* out) {
  constexpr int BYTES = FIVE ? 176 : 144;
  AccQ45 acc[R];
  for (int64_t i = 0, nb = K / 256; i < nb; ++i) {
    const uint8_t* b = row + i * BYTES;
    const float d = h2f(b), dmin = h2f(b + 2);
#if defined(EXPERTCACHE_AVX2)
    __m256i v[8];
    q45_block<FIVE, R>(b, a, i, v, v + 4);
    add_totals<R>(v, acc, a, i, d, dmin);
#else
    const uint8_t *qh = b + 16, *qs = b + (FIVE ? 48 : 16);
    uint8_t sc8[8], m8[8];
    k_scales(b + 4, sc8, m8);
    for (int t = 0; t < R; ++t) {
      const int8_t* aq = a[t]->q.data() + i * 256;
      int32_t sum = 0, mins = 0;
      for (int j = 0; j < 8; ++j) {  // sub-block j: 32 weights, bytes (j/2)*32.. of qs
        const uint8_t* q = qs + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int l = 0; l < 32; ++l) {
          int v = (q[l] >> shift) & 15;
          if (FIVE) v |= ((qh[l] >> j) & 1) << 4;
          sum += sc8[j] * v * aq[j * 32 + l];
        }
        mins += m8[j] * a[t]->bsum32[i * 8 + j];
      }
      acc[t].add(sum, mins, a[t]->d[i], d, dmin);
    }
#endif
  }
  for (int t = 0; t < R; ++t) out[t] = acc[t].sum();
}

#if defined(EXPERTCACHE_AVX2)
// One Q6_K super-block against R activation rows: eight lanes of the scaled products of the
// six-bit values (0..63) per row (`sum`), and eight of the offset's terms, 32 x scale x the
// activations' sums of 16 (`off`); the block's integer is the difference of their totals.
template <int R>
inline void q6_block(const uint8_t* b, const Act* const* a, int64_t i, __m256i* sum, __m256i* off) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  alignas(32) int32_t sc32[16];
  for (int j = 0; j < 16; ++j) sc32[j] = 32 * sc[j];
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  for (int t = 0; t < R; ++t) sum[t] = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {  // one 32-weight run at a time: few registers live across the rows
    const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + h * 32));
    for (int s = 0; s < 4; ++s) {
      __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + h * 64 + (s % 2) * 32));
      lo = s < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * s)), m2);
      const int w = h * 128 + s * 32;
      const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  // 0..63
      const __m256i scv = _mm256_setr_m128i(_mm_set1_epi16(sc[w / 16]), _mm_set1_epi16(sc[w / 16 + 1]));
      for (int t = 0; t < R; ++t) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t]->q.data() + i * 256 + w));
        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), scv));
      }
    }
  }
  for (int t = 0; t < R; ++t) off[t] = lane_pairs(sc32, a[t]->bsum.data() + i * 16);
}
#endif

// Q6_K: each super-block's integer (the scaled products minus the offset's terms) is exact and
// formed whole, then enters the float sum as Q4_K's do (`AccQ45`, the offset's total taking the
// place of the minimums' with the block's one scale).
template <int R>
void rows_q6_k(const uint8_t* row, const Act* const* a, int64_t K, float* out) {
  AccQ45 acc[R];
  for (int64_t i = 0, nb = K / 256; i < nb; ++i) {
    const uint8_t* b = row + i * 210;
    const float d = h2f(b + 208);
#if defined(EXPERTCACHE_AVX2)
    __m256i v[8];
    q6_block<R>(b, a, i, v, v + 4);
    add_totals<R>(v, acc, a, i, d, d);
#else
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int t = 0; t < R; ++t) {
      const int8_t* aq = a[t]->q.data() + i * 256;
      int32_t sum = 0, off = 0;
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) {  // the run of 32 weights w .. w + 31
            const int w = h * 128 + s * 32;
            const int qv = ((ql[h * 64 + (s % 2) * 32 + l] >> (4 * (s / 2))) & 15) | (((qh[h * 32 + l] >> (2 * s)) & 3) << 4);
            sum += sc[(w + l) / 16] * qv * aq[w + l];
          }
      for (int j = 0; j < 16; ++j) off += 32 * sc[j] * a[t]->bsum[i * 16 + j];
      acc[t].add(sum, off, a[t]->d[i], d, d);
    }
#endif
  }
  for (int t = 0; t < R; ++t) out[t] = acc[t].sum();
}

#if defined(EXPERTCACHE_AVX2)
// Eight consecutive weight rows (`stride` bytes apart) against one activation row, for decode:
// each row's integers and float steps are those of `rows_q45_k`/`rows_q6_k` with that row alone
// (BLOCK forms them; the block's scales are fp16 at DOFF and MOFF), the eight
// rows' float steps taken side by side in the lanes of one vector. The rows are read one after
// the other over a run of up to 16 blocks (the memory streams as for one row at a time), their
// sums kept for the run.
using BlockSums = void (*)(const uint8_t*, const Act* const*, int64_t, __m256i*, __m256i*);

template <int BYTES, int DOFF, int MOFF, BlockSums BLOCK>
void rows8_k(const uint8_t* row, int64_t stride, const Act& a, int64_t K, float* out) {
  constexpr int RUN = 16;
  const Act* pa = &a;
  __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
  __m256i sum[RUN][8], msum[RUN][8];
  alignas(32) float d[RUN][8], dmin[RUN][8];
  for (int64_t i0 = 0, nb = K / 256; i0 < nb; i0 += RUN) {
    const int n = static_cast<int>(std::min<int64_t>(RUN, nb - i0));
    for (int r = 0; r < 8; ++r)
      for (int k = 0; k < n; ++k) {
        const uint8_t* b = row + r * stride + (i0 + k) * BYTES;
        ask_for(b + 16 * stride, BYTES);
        d[k][r] = h2f(b + DOFF);
        dmin[k][r] = h2f(b + MOFF);
        BLOCK(b, &pa, i0 + k, &sum[k][r], &msum[k][r]);
      }
    for (int k = 0; k < n; ++k) {
      const __m256 ad = _mm256_set1_ps(a.d[i0 + k]);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(ad, _mm256_load_ps(d[k])), _mm256_cvtepi32_ps(totals8(sum[k]))));
      mins = _mm256_add_ps(mins, _mm256_mul_ps(_mm256_mul_ps(ad, _mm256_load_ps(dmin[k])), _mm256_cvtepi32_ps(totals8(msum[k]))));
    }
  }
  _mm256_storeu_ps(out, _mm256_sub_ps(acc, mins));
}

// Eight consecutive rows of a 32-weight type against one activation row, each row's steps those
// of `rows_32` with that row alone. Each row is read as one run of up to 64 blocks, its block
// totals formed eight at a time (`totals8`, lane = block) and kept; the float steps then take
// the eight rows' totals of a block side by side (a gather across the kept rows).
template <Ints32 INTS, int BYTES>
void rows8_32(const uint8_t* row, int64_t stride, const Act& a, int64_t K, float* out) {
  constexpr int RUN = 64;
  __m256 acc = _mm256_setzero_ps();
  alignas(32) int32_t tot[8][RUN];
  alignas(32) float d[RUN][8];
  const __m256i across = _mm256_setr_epi32(0, RUN, 2 * RUN, 3 * RUN, 4 * RUN, 5 * RUN, 6 * RUN, 7 * RUN);
  for (int64_t i0 = 0, nb = K / 32; i0 < nb; i0 += RUN) {
    const int n = static_cast<int>(std::min<int64_t>(RUN, nb - i0));
    for (int r = 0; r < 8; ++r)
      for (int k0 = 0; k0 < n; k0 += 8) {
        __m256i v[8];
        for (int j = 0; j < 8; ++j) {
          const int k = k0 + j;
          if (k >= n) {
            v[j] = _mm256_setzero_si256();
            continue;
          }
          const uint8_t* b = row + r * stride + (i0 + k) * BYTES;
          ask_for(b + 16 * stride, BYTES);
          d[k][r] = h2f(b);
          v[j] = dot_i8(INTS(b), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (i0 + k) * 32)));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(tot[r] + k0), totals8(v));
      }
    for (int k = 0; k < n; ++k) {
      const __m256i t = _mm256_i32gather_epi32(tot[0] + k, across, 4);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(d[k]), _mm256_set1_ps(a.d[i0 + k])),
                                             _mm256_cvtepi32_ps(t)));
    }
  }
  _mm256_storeu_ps(out, acc);
}

// F16 and BF16 rows against rows rounded to fp16 or bf16 (`Act::xt`), each row's lanes and steps
// those of `row_dot` alone: fused multiply-adds on one accumulator pair depend on each other, and
// one row at a time waits on them; several rows at once do not (a decode product of an F16
// [8192, 2048] 2.4x as fast, at the bf16 kernel's speed where the weights come from memory). Up to four activation rows against one weight row (`RowsOf`),
// or eight weight rows, four at a time, against one activation row (`ActDot8`).
template <bool BF, int R>
void rows_half(const uint8_t* row, const Act* const* a, int64_t K, float* out) {
  __m256 lo[R], hi[R];
  const float* x[R];
  for (int t = 0; t < R; ++t) {
    lo[t] = hi[t] = _mm256_setzero_ps();
    x[t] = a[t]->xt.data();
  }
  for (int64_t k = 0, full = K / 32 * 32; k < full; k += 16) {
    const __m256 w0 = half_w8<BF>(row + 2 * k), w1 = half_w8<BF>(row + 2 * k + 16);
    for (int t = 0; t < R; ++t) {
      lo[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + k), lo[t]);
      hi[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + k + 8), hi[t]);
    }
  }
  const Format fmt = {"", 32, 64, nullptr, BF ? bf2f : h2f};
  for (int t = 0; t < R; ++t) {
    Lanes acc;
    acc.a = lo[t];
    acc.b = hi[t];
    add_partial(fmt, row, x[t], K, acc);
    out[t] = acc.sum();
  }
}

template <bool BF>
void rows8_half(const uint8_t* row, int64_t stride, const Act& a, int64_t K, float* out) {
  const Format fmt = {"", 32, 64, nullptr, BF ? bf2f : h2f};
  const float* x = a.xt.data();
  for (int h = 0; h < 8; h += 4) {
    __m256 lo[4], hi[4];
    for (int r = 0; r < 4; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    const uint8_t* w = row + h * stride;
    for (int64_t k = 0, full = K / 32 * 32; k < full; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      for (int r = 0; r < 4; ++r) {
        if (k % 32 == 0) ask_for(w + r * stride + 16 * stride + 2 * k, 64);
        lo[r] = _mm256_fmadd_ps(half_w8<BF>(w + r * stride + 2 * k), x0, lo[r]);
        hi[r] = _mm256_fmadd_ps(half_w8<BF>(w + r * stride + 2 * k + 16), x1, hi[r]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      Lanes acc;
      acc.a = lo[r];
      acc.b = hi[r];
      add_partial(fmt, w + r * stride, x, K, acc);
      out[h + r] = acc.sum();
    }
  }
}

#endif

// A type's tiles for many-row products: bytes per block of eight rows, weights per block, how
// they are formed from the file's rows, and the kernels for 1-4 activation rows (none on the
// plain build, whose products take the file's rows). A kernel's last argument: how far past each
// block to ask for the weights (`ask_for`; 0 where they are already at hand).
using Tile4 = void (*)(const uint8_t*, const Act* const*, int64_t, float*, int64_t);
struct Tiling {
  int64_t bytes = 0, block = 0;
  void (*form)(const uint8_t*, int64_t, int64_t, uint8_t*) = nullptr;
  Tile4 kern[4] = {nullptr, nullptr, nullptr, nullptr};
};

#if defined(EXPERTCACHE_AVX2)
// Q4_K rows interleaved eight at a time. One super-block column of eight rows takes the 1152
// bytes their blocks take: their d and dmin (fp16, 2 x 16 bytes), their twelve packed scale bytes
// as three 4-byte words side by side ([word][row][4], 96 bytes), then the nibbles, for each
// 32-byte run p and each 4-byte group c of it, the eight rows' 4 bytes side by side
// ([p][c][row][4], 1024 bytes). One 32-byte load then holds 8 weights of each of the eight rows,
// so one activation group of 4 (broadcast) meets eight rows at once and each int32 lane of a sum
// is one row's; the scales unpack in registers, each row's in its own lane (`k_scales`' steps,
// eight rows at once). The block's integers come out whole per row, as `rows_q45_k` forms them,
// and the float steps (`AccQ45`) are the same, so each row's result is bit for bit the one-row
// product's. Being no larger than the rows, the tiles can be held in place of them (dense
// matrices, expert slots); else they are formed when a product starts (`q4k_tiles`).

// The activations' sums bs[2j] and bs[2j + 1] (each fits 16 bits) as the 16-bit pair of every
// 32-bit lane, for a multiply-add with each row's two values in its lane.
inline __m256i sum_pair(const int32_t* bs, int j) {
  return _mm256_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(static_cast<uint16_t>(bs[2 * j + 1])) << 16) |
                                                static_cast<uint16_t>(bs[2 * j])));
}

// Eight rows' products of pairs: for j < N, the rows' two 8-bit values at w[j][row][0..1]
// (widened, signed or not) times `sum_pair(bs, j)`, added up: one int32 lane per row.
template <int N, bool SIGNED>
inline __m256i pair_products(const uint8_t* w, const int32_t* bs) {
  __m256i s = _mm256_setzero_si256();
  for (int j = 0; j < N; ++j) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(SIGNED ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v), sum_pair(bs, j)));
  }
  return s;
}

// Eight rows of eight 4-byte groups (src[r], 32 bytes each) stored group by group: dst + 32 j
// holds group j of rows 0..7 side by side. An 8 x 8 transpose of 32-bit lanes in registers
// instead of a 4-byte copy per group: a prompt's expert products form their tiles per product.
inline void interleave8(const uint8_t* const* src, uint8_t* dst) {
  __m256 v[8], t[8], s[8];
  for (int r = 0; r < 8; ++r) v[r] = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r])));
  for (int r = 0; r < 8; r += 2) {
    t[r] = _mm256_unpacklo_ps(v[r], v[r + 1]);      // r0 r1 of groups 0, 1 | 4, 5
    t[r + 1] = _mm256_unpackhi_ps(v[r], v[r + 1]);  // groups 2, 3 | 6, 7
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    const __m256 *a = t + 4 * h;
    s[4 * h + 0] = _mm256_shuffle_ps(a[0], a[2], _MM_SHUFFLE(1, 0, 1, 0));  // group 0 | 4
    s[4 * h + 1] = _mm256_shuffle_ps(a[0], a[2], _MM_SHUFFLE(3, 2, 3, 2));  // group 1 | 5
    s[4 * h + 2] = _mm256_shuffle_ps(a[1], a[3], _MM_SHUFFLE(1, 0, 1, 0));  // group 2 | 6
    s[4 * h + 3] = _mm256_shuffle_ps(a[1], a[3], _MM_SHUFFLE(3, 2, 3, 2));  // group 3 | 7
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + 32 * j), _mm256_permute2f128_ps(s[j], s[4 + j], 0x20));
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + 32 * (j + 4)), _mm256_permute2f128_ps(s[j], s[4 + j], 0x31));
  }
}

constexpr int64_t kQ4KTile = 1152;

void q4k_tiles(const uint8_t* rows, int64_t stride, int64_t nb, uint8_t* out) {
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* t = out + i * kQ4KTile;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows + r * stride + i * 144;
      std::memcpy(t + 2 * r, b, 2);
      std::memcpy(t + 16 + 2 * r, b + 2, 2);
      for (int k = 0; k < 3; ++k) std::memcpy(t + 32 + 32 * k + 4 * r, b + 4 + 4 * k, 4);
    }
    for (int p = 0; p < 4; ++p) {
      const uint8_t* src[8];
      for (int r = 0; r < 8; ++r) src[r] = rows + r * stride + i * 144 + 16 + p * 32;
      interleave8(src, t + 128 + p * 256);
    }
  }
}

// Shuffles of the bytes of each 32-bit lane into its two 16-bit halves, widened: byte b into both
// (mask b, for b < 4), or bytes 0 and 1 (mask 4) or 2 and 3 (mask 5) into the low and high half.
struct LaneMasks {
  alignas(32) uint8_t m[6][32];
  LaneMasks() {
    for (int k = 0; k < 6; ++k)
      for (int i = 0; i < 32; ++i) {
        const int lane = i / 4 % 4, half = i % 4 / 2, lo = k < 4 ? k : 2 * (k - 4), hi = k < 4 ? k : lo + 1;
        m[k][i] = i % 2 ? 0x80 : static_cast<uint8_t>(4 * lane + (half ? hi : lo));
      }
  }
};
const LaneMasks kLaneMasks;

inline __m256i lane_bytes16(__m256i v, int mask) {
  return _mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(kLaneMasks.m[mask])));
}

inline __m256 half8(const uint8_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int r = 0; r < 8; ++r) f[r] = h2f(p + 2 * r);
  return _mm256_load_ps(f);
#endif
}

// Four of each row's scale bytes of a tile, unpacked in lane r as `k_scales` unpacks them for row
// r: scales 0-3 (which = 0), minimums 0-3 (1), scales 4-7 (2) or minimums 4-7 (3). Computed where
// used, from the tile's words (in the first-level cache), so that few registers stay live.
inline __m256i q4k_tile_scales(const uint8_t* tl, int which) {
  const auto word = [tl](int k) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tl + 32 + 32 * k)); };
  const int k = which % 2;  // the word of the scales (0) or of the minimums (1)
  const __m256i lo6 = _mm256_set1_epi8(0x3f);
  if (which < 2) return _mm256_and_si256(word(k), lo6);
  const __m256i w2 = word(2), m4 = _mm256_set1_epi8(15), lo2 = _mm256_set1_epi8(3);
  const __m256i low = k == 0 ? _mm256_and_si256(w2, m4) : _mm256_and_si256(_mm256_srli_epi32(w2, 4), m4);
  return _mm256_or_si256(low, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(word(k), 6), lo2), 4));
}

// R activation rows (R <= 4) against one tile column of eight weight rows: out[t * 8 + row].
template <int R>
void tile_q4_k(const uint8_t* tiles, const Act* const* a, int64_t K, float* out, int64_t ahead) {
  __m256 acc[R], mins[R];
  for (int t = 0; t < R; ++t) acc[t] = mins[t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t i = 0, nb = K / 256; i < nb; ++i) {
    const uint8_t* tl = tiles + i * kQ4KTile;
    __m256i sum[R];
    for (int t = 0; t < R; ++t) sum[t] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      if (ahead) ask_for(tl + ahead + p * (kQ4KTile / 4), kQ4KTile / 4);
      // Eight groups of 4 add up to at most 8 x 2 x 15 x 127 in each 16-bit lane: no overflow.
      __m256i s0[R], s1[R];
      for (int t = 0; t < R; ++t) s0[t] = s1[t] = _mm256_setzero_si256();
      const uint8_t* q = tl + 128 + p * 256;
      for (int c = 0; c < 8; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        for (int t = 0; t < R; ++t) {
          const int8_t* aq = a[t]->q.data() + i * 256 + p * 64 + c * 4;
          int32_t x0, x1;
          std::memcpy(&x0, aq, 4);
          std::memcpy(&x1, aq + 32, 4);
          s0[t] = _mm256_add_epi16(s0[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
          s1[t] = _mm256_add_epi16(s1[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
        }
      }
      const __m256i sc = q4k_tile_scales(tl, p < 2 ? 0 : 2);  // sub-blocks 2p and 2p + 1
      const __m256i sc0 = lane_bytes16(sc, 2 * (p % 2)), sc1 = lane_bytes16(sc, 2 * (p % 2) + 1);
      for (int t = 0; t < R; ++t)
        sum[t] = _mm256_add_epi32(sum[t], _mm256_add_epi32(_mm256_madd_epi16(s0[t], sc0), _mm256_madd_epi16(s1[t], sc1)));
    }
    const __m256 d = half8(tl), dmin = half8(tl + 16);
    for (int t = 0; t < R; ++t) {
      // The minimums in pairs (2j, 2j + 1), 16 bits each, against the activations' sums of 32.
      const int32_t* bs = a[t]->bsum32.data() + i * 8;
      __m256i msum = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i m = q4k_tile_scales(tl, 1 + 2 * h);
        for (int j = 0; j < 2; ++j)
          msum = _mm256_add_epi32(msum, _mm256_madd_epi16(lane_bytes16(m, 4 + j), sum_pair(bs, 2 * h + j)));
      }
      const __m256 ad = _mm256_set1_ps(a[t]->d[i]);
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(ad, d), _mm256_cvtepi32_ps(sum[t])));
      mins[t] = _mm256_add_ps(mins[t], _mm256_mul_ps(_mm256_mul_ps(ad, dmin), _mm256_cvtepi32_ps(msum)));
    }
  }
  for (int t = 0; t < R; ++t) _mm256_storeu_ps(out + t * 8, _mm256_sub_ps(acc[t], mins[t]));
}

// 32-weight rows interleaved eight at a time, for many-row products: per block of eight rows
// (272 bytes) their d (fp16, 16 bytes), then for each 4-weight group c the eight rows' weights as
// signed bytes side by side ([c][row][4], 256 bytes); the integers and float steps are
// `rows_32`'s, as `tile_q4_k`'s are `rows_q45_k`'s.
constexpr int64_t kTile32 = 272;

template <Ints32 INTS, int BYTES>
void tiles_32(const uint8_t* rows, int64_t stride, int64_t nb, uint8_t* out) {
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* t = out + i * kTile32;
    alignas(32) int8_t w[8][32];  // each row's weights as signed bytes
    const uint8_t* src[8];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows + r * stride + i * BYTES;
      std::memcpy(t + 2 * r, b, 2);
      _mm256_store_si256(reinterpret_cast<__m256i*>(w[r]), INTS(b));
      src[r] = reinterpret_cast<const uint8_t*>(w[r]);
    }
    interleave8(src, t + 16);
  }
}

template <int R>
void tile_32(const uint8_t* tiles, const Act* const* a, int64_t K, float* out, int64_t ahead) {
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0, nb = K / 32; i < nb; ++i) {
    const uint8_t* tl = tiles + i * kTile32;
    if (ahead) ask_for(tl + ahead, kTile32);
    __m256i sum[R];
    for (int t = 0; t < R; ++t) sum[t] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tl + 16 + c * 32)), av = _mm256_sign_epi8(v, v);
      for (int t = 0; t < R; ++t) {
        int32_t x;
        std::memcpy(&x, a[t]->q.data() + i * 32 + c * 4, 4);
        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(_mm256_set1_epi32(x), v)), ones));
      }
    }
    const __m256 d = half8(tl);
    for (int t = 0; t < R; ++t)
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[t]->d[i])), _mm256_cvtepi32_ps(sum[t])));
  }
  for (int t = 0; t < R; ++t) _mm256_storeu_ps(out + t * 8, acc[t]);
}

// Q6_K rows interleaved eight at a time, for many-row products: per block of eight rows (2320
// bytes) their d (fp16, 16 bytes), the sixteen sub-block scales of each row ([sub-block][row],
// 128 bytes) and again in pairs ([pair][row][2], 128 bytes, for the offset's terms), then the
// six-bit values (0..63) as bytes, for each 4-weight group g the eight rows' side by side
// ([g][row][4], 2048 bytes). The integers and float steps are `rows_q6_k`'s.
constexpr int64_t kQ6KTile = 2320;

void q6k_tiles(const uint8_t* rows, int64_t stride, int64_t nb, uint8_t* out) {
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  alignas(32) uint8_t rows_q[8][256];  // each row's six-bit values as bytes, in order
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* t = out + i * kQ6KTile;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows + r * stride + i * 210;
      const uint8_t *ql = b, *qh = b + 128, *sc = b + 192;
      std::memcpy(t + 2 * r, b + 208, 2);
      for (int j = 0; j < 16; ++j) {
        t[16 + j * 8 + r] = sc[j];
        t[144 + (j / 2) * 16 + r * 2 + j % 2] = sc[j];
      }
      uint8_t* q = rows_q[r];
      for (int h = 0; h < 2; ++h) {
        const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + h * 32));
        for (int s = 0; s < 4; ++s) {
          __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + h * 64 + (s % 2) * 32));
          lo = s < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
          const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * s)), m2);
          _mm256_store_si256(reinterpret_cast<__m256i*>(q + h * 128 + s * 32), _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
        }
      }
    }
    for (int m = 0; m < 8; ++m) {
      const uint8_t* src[8];
      for (int r = 0; r < 8; ++r) src[r] = rows_q[r] + m * 32;
      interleave8(src, t + 272 + m * 256);
    }
  }
}

template <int R>
void tile_q6_k(const uint8_t* tiles, const Act* const* a, int64_t K, float* out, int64_t ahead) {
  __m256 acc[R], offs[R];
  for (int t = 0; t < R; ++t) acc[t] = offs[t] = _mm256_setzero_ps();
  for (int64_t i = 0, nb = K / 256; i < nb; ++i) {
    const uint8_t* tl = tiles + i * kQ6KTile;
    if (ahead) ask_for(tl + ahead, kQ6KTile);
    __m256i sum[R];
    for (int t = 0; t < R; ++t) sum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 16; ++j) {  // sub-block j: groups 4j .. 4j + 3
      const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tl + 16 + j * 8));
      const __m256i scj = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(c, c));
      for (int h = 0; h < 2; ++h) {  // two groups at a time: 2 x 2 x 63 x 127 fits 16 bits
        const int g = 4 * j + 2 * h;
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tl + 272 + g * 32));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tl + 272 + (g + 1) * 32));
        for (int t = 0; t < R; ++t) {
          const int8_t* aq = a[t]->q.data() + i * 256 + g * 4;
          int32_t x0, x1;
          std::memcpy(&x0, aq, 4);
          std::memcpy(&x1, aq + 4, 4);
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v0, _mm256_set1_epi32(x0)),
                                             _mm256_maddubs_epi16(v1, _mm256_set1_epi32(x1)));
          sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(p, scj));
        }
      }
    }
    const __m256 d = half8(tl);
    for (int t = 0; t < R; ++t) {
      const __m256i off = pair_products<8, true>(tl + 144, a[t]->bsum.data() + i * 16);
      const __m256 f = _mm256_mul_ps(_mm256_set1_ps(a[t]->d[i]), d);
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(f, _mm256_cvtepi32_ps(sum[t])));
      offs[t] = _mm256_add_ps(offs[t], _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_slli_epi32(off, 5))));
    }
  }
  for (int t = 0; t < R; ++t) _mm256_storeu_ps(out + t * 8, _mm256_sub_ps(acc[t], offs[t]));
}

Tiling tiling_of(int64_t type) {
  const Tiling t32 = {kTile32, 32, nullptr, {tile_32<1>, tile_32<2>, tile_32<3>, tile_32<4>}};
  Tiling t = t32;
  switch (type) {
    case Q4_K: return {kQ4KTile, 256, q4k_tiles, {tile_q4_k<1>, tile_q4_k<2>, tile_q4_k<3>, tile_q4_k<4>}};
    case Q6_K: return {kQ6KTile, 256, q6k_tiles, {tile_q6_k<1>, tile_q6_k<2>, tile_q6_k<3>, tile_q6_k<4>}};
    case Q8_0: t.form = tiles_32<ints_q8_0, 34>; return t;
    case Q4_0: t.form = tiles_32<ints_q4_0, 18>; return t;
    case Q5_0: t.form = tiles_32<ints_q5_0, 22>; return t;
    case IQ4_NL: t.form = tiles_32<ints_iq4_nl, 18>; return t;
    default: return {};
  }
}
#else
Tiling tiling_of(int64_t) { return {}; }
#endif

// Up to four activation rows against one weight row, for the types with a multi-row kernel.
using Rows4 = void (*)(const uint8_t*, const Act* const*, int64_t, float*);
struct RowsOf {
  Rows4 r[4] = {nullptr, nullptr, nullptr, nullptr};  // for 1, 2, 3, 4 rows
};

template <template <int> class F>
RowsOf rows_table() { return {{F<1>::call, F<2>::call, F<3>::call, F<4>::call}}; }
template <int R> struct Q4K { static void call(const uint8_t* w, const Act* const* a, int64_t K, float* o) { rows_q45_k<false, R>(w, a, K, o); } };
template <int R> struct Q5K { static void call(const uint8_t* w, const Act* const* a, int64_t K, float* o) { rows_q45_k<true, R>(w, a, K, o); } };
template <int R> struct Q6K { static void call(const uint8_t* w, const Act* const* a, int64_t K, float* o) { rows_q6_k<R>(w, a, K, o); } };

#if defined(EXPERTCACHE_AVX2)
template <bool BF>
struct RowsHalf {
  template <int R> struct F { static void call(const uint8_t* w, const Act* const* a, int64_t K, float* o) { rows_half<BF, R>(w, a, K, o); } };
};
#endif

template <Ints32 INTS, int BYTES, bool MIN = false>
struct Rows32 {
  template <int R> struct F { static void call(const uint8_t* w, const Act* const* a, int64_t K, float* o) { rows_32<INTS, BYTES, R, MIN>(w, a, K, o); } };
};

RowsOf rows_of(int64_t type) {
  switch (type) {
    case Q4_K: return rows_table<Q4K>();
    case Q5_K: return rows_table<Q5K>();
    case Q6_K: return rows_table<Q6K>();
    case Q8_0: return rows_table<Rows32<ints_q8_0, 34>::F>();
    case Q4_0: return rows_table<Rows32<ints_q4_0, 18>::F>();
    case Q5_0: return rows_table<Rows32<ints_q5_0, 22>::F>();
    case IQ4_NL: return rows_table<Rows32<ints_iq4_nl, 18>::F>();
    case Q4_1: return rows_table<Rows32<ints_q4_1, 20, true>::F>();
    case Q5_1: return rows_table<Rows32<ints_q5_1, 24, true>::F>();
#if defined(EXPERTCACHE_AVX2)
    case F16: return rows_table<RowsHalf<false>::F>();
    case BF16: return rows_table<RowsHalf<true>::F>();
#endif
    default: return {};
  }
}

template <bool FIVE>
float row_dot_q45_k(const uint8_t* row, const Act& a, int64_t K) {
  const Act* p = &a;
  float y;
  rows_q45_k<FIVE, 1>(row, &p, K, &y);
  return y;
}

float row_dot_q6_k(const uint8_t* row, const Act& a, int64_t K) {
  const Act* p = &a;
  float y;
  rows_q6_k<1>(row, &p, K, &y);
  return y;
}

using RowDot32 = float (*)(const uint8_t*, const Act&, int64_t);

RowDot32 row_dot_32_of(int64_t type) {
  switch (type) {
    case Q8_0: return row_dot_32<ints_q8_0, 34>;
    case Q4_0: return row_dot_32<ints_q4_0, 18>;
    case Q5_0: return row_dot_32<ints_q5_0, 22>;
    case IQ4_NL: return row_dot_32<ints_iq4_nl, 18>;
    case Q4_1: return row_dot_32<ints_q4_1, 20, true>;
    case Q5_1: return row_dot_32<ints_q5_1, 24, true>;
    default: return nullptr;
  }
}

int64_t row_bytes(const Format& fmt, int64_t K) {
  if (fmt.one) return K * (fmt.bytes / fmt.block);
  TORCH_CHECK(K % fmt.block == 0, fmt.name, ": a row of ", K, " weights is not a whole number of blocks of ",
              fmt.block);
  return K / fmt.block * fmt.bytes;
}

void check_raw(const torch::Tensor& w, const Format& fmt, int64_t K, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              what, ": expected a contiguous 2-D uint8 CPU tensor [rows, row bytes]");
  TORCH_CHECK(w.size(1) == row_bytes(fmt, K), what, ": expected ", row_bytes(fmt, K), " bytes per ",
              fmt.name, " row of ", K, " weights, got ", w.size(1));
}

// A one-token input as a vector: x [K], or x [1, K] (a decode step's row) flattened.
torch::Tensor one_row(const torch::Tensor& x) {
  return x.dim() == 2 && x.size(0) == 1 ? x.reshape({-1}).contiguous() : x;
}

// A product's fp32 output as its caller takes it: with `in_dtype`, rounded to x's dtype as `.to`
// rounds (the same conversion), and [1, N] for x [1, K]; else as computed. Done here, these are
// a few dispatches fewer per product from Python, where a decode step runs hundreds of them.
torch::Tensor finish(torch::Tensor y, const torch::Tensor& x, bool in_dtype) {
  if (!in_dtype) return y;
  if (x.scalar_type() != torch::kFloat32) y = y.to(x.scalar_type());
  return x.dim() == 2 && y.dim() == 1 ? y.unsqueeze(0) : y;
}

// x as fp32 (a copy only when it is bf16).
torch::Tensor as_f32(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x: expected a contiguous 1-D float32 or bfloat16 CPU tensor");
  return x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
}

// The integer row product of a type with its rounded row (`Act`), or nullptr: the type's decoded
// weights are then multiplied by the rounded row as floats (`row_dot_act`).
using ActDot = RowDot32;

ActDot act_dot_of(int64_t type) {
  switch (type) {
    case Q4_K: return row_dot_q45_k<false>;
    case Q5_K: return row_dot_q45_k<true>;
    case Q6_K: return row_dot_q6_k;
    default: return row_dot_32_of(type);
  }
}

// One row with the activations rounded as ggml rounds them: integer blocks where the type has
// them, else the decoded weights times the rounded row (`Act::xt`, which `quantize_act` then fills).
float row_dot_act(const Format& fmt, ActDot ad, const uint8_t* row, const Act& a, int64_t K) {
  return ad ? ad(row, a, K) : row_dot(fmt, row, a.xt.data(), K);
}

// Eight consecutive rows against one rounded row at once, where the type has such a kernel: the
// same bits as row by row, for less work per row.
using ActDot8 = void (*)(const uint8_t*, int64_t, const Act&, int64_t, float*);

ActDot8 act_dot8_of(int64_t type) {
#if defined(EXPERTCACHE_AVX2)
  if (type == Q4_K) return rows8_k<144, 0, 2, q45_block<false, 1>>;
  if (type == Q5_K) return rows8_k<176, 0, 2, q45_block<true, 1>>;
  if (type == Q6_K) return rows8_k<210, 208, 208, q6_block<1>>;
  if (type == Q8_0) return rows8_32<ints_q8_0, 34>;
  if (type == Q4_0) return rows8_32<ints_q4_0, 18>;
  if (type == Q5_0) return rows8_32<ints_q5_0, 22>;
  if (type == IQ4_NL) return rows8_32<ints_iq4_nl, 18>;
  if (type == F16) return rows8_half<false>;
  if (type == BF16) return rows8_half<true>;
#endif
  (void)type;
  return nullptr;
}

// Rows [0, n) of one matrix (`stride` bytes apart) times the rounded row, into out[0, n).
void dot_rows_act(const Format& fmt, ActDot ad, ActDot8 ad8, const uint8_t* row, int64_t stride, int64_t n,
                  const Act& a, int64_t K, float* out) {
  int64_t r = 0;
  if (ad8)
    for (; r + 8 <= n; r += 8) ad8(row + r * stride, stride, a, K, out + r);
  for (; r < n; ++r) out[r] = row_dot_act(fmt, ad, row + r * stride, a, K);
}

// y [N] = W x: W [N, K] of ggml type `type` as raw rows [N, row bytes], x [K]; fp32.
// fused=false takes the plain decoders (the reference the register-level ones are tested against);
// act8 rounds x first, as ggml's CPU products do.
torch::Tensor product(const torch::Tensor& w, int64_t type, const torch::Tensor& x_in, bool fused, bool act8) {
  const torch::Tensor x = as_f32(one_row(x_in));
  const Format fmt = format_of(type);
  const int64_t K = x.size(0);
  check_raw(w, fmt, K, "w");
  const int64_t N = w.size(0), stride = w.size(1);
  auto y = torch::empty({N}, x.options().dtype(torch::kFloat32));
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  Act a;
  const ActDot idot = act8 ? act_dot_of(type) : nullptr;
  if (act8) quantize_act(X, K, type, a, !idot);
  const ActDot8 idot8 = act8 ? act_dot8_of(type) : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    if (act8) {
      dot_rows_act(fmt, idot, idot8, W + begin * stride, stride, end - begin, a, K, Y + begin);
      return;
    }
    for (int64_t r = begin; r < end; ++r) Y[r] = row_dot(fmt, W + r * stride, X, K, fused);
  });
  return y;
}

torch::Tensor gemv(const torch::Tensor& w, int64_t type, const torch::Tensor& x, bool act8, bool in_dtype) {
  return finish(product(w, type, x, true, act8), x, in_dtype);
}

torch::Tensor gemv_decoded(const torch::Tensor& w, int64_t type, const torch::Tensor& x) {
  return product(w, type, x, false, false);
}

// Columns [0, 8 * groups) of Y [T, N] (T = acts.size()) from tiles of eight weight rows: formed
// from raw rows `stride` bytes apart into a per-thread buffer of about 16 KB, or read where they
// lie (`formed`: W holds [groups, tile bytes]); each chunk of tiles is taken against each group
// of four activation rows in turn, so that both stay in the first-level cache.
void tile_products(const Tiling& tiling, const uint8_t* W, int64_t stride, bool formed, int64_t groups,
                   const std::vector<Act>& acts, int64_t K, float* Y, int64_t N) {
  const int64_t T = static_cast<int64_t>(acts.size()), nb = K / tiling.block, tile = nb * tiling.bytes;
  const int64_t per = std::max<int64_t>(1, (16 << 10) / tile);
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> buf(formed ? 0 : per * tile);
    for (int64_t g0 = begin; g0 < end; g0 += per) {
      const int64_t g1 = std::min(end, g0 + per);
      const uint8_t* src = W + g0 * tile;
      if (!formed) {
        for (int64_t g = g0; g < g1; ++g) tiling.form(W + g * 8 * stride, stride, nb, buf.data() + (g - g0) * tile);
        src = buf.data();
        // Forming reads a chunk's rows block by block across its eight rows, an order the
        // hardware prefetcher follows late: the next chunk is asked for while this one is used.
        for (int64_t b = g1 * 8 * stride; b < std::min(end, g1 + per) * 8 * stride; b += 64) __builtin_prefetch(W + b);
      }
      for (int64_t t = 0; t < T; t += 4) {
        const int n = static_cast<int>(std::min<int64_t>(4, T - t));
        const Act* group[4];
        for (int j = 0; j < n; ++j) group[j] = &acts[t + j];
        for (int64_t g = g0; g < g1; ++g) {
          float o[32];
          // Held tiles are read from memory by the first group of rows; later ones find them cached.
          tiling.kern[n - 1](src + (g - g0) * tile, group, K, o, formed && t == 0 ? 2 * tile : 0);
          for (int j = 0; j < n; ++j) std::memcpy(Y + (t + j) * N + g * 8, o + j * 8, 8 * sizeof(float));
        }
      }
    }
  });
}

// W [N, K] (raw rows, N a multiple of 8) as tiles of eight rows (`tiling_of`): [N / 8, tile bytes].
torch::Tensor tile_rows(const torch::Tensor& w, int64_t type, int64_t K) {
  const Format fmt = format_of(type);
  check_raw(w, fmt, K, "w");
  const Tiling tiling = tiling_of(type);
  TORCH_CHECK(tiling.form, "tile_rows: ", fmt.name, " has no tiles on this build");
  const int64_t N = w.size(0), stride = w.size(1), nb = K / tiling.block;
  TORCH_CHECK(N % 8 == 0, "tile_rows: expected a multiple of 8 rows, got ", N);
  auto out = torch::empty({N / 8, nb * tiling.bytes}, torch::kUInt8);
  const uint8_t* W = w.data_ptr<uint8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 8, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) tiling.form(W + g * 8 * stride, stride, nb, O + g * nb * tiling.bytes);
  });
  return out;
}

// Y [T, N] = rows of x [T, K] rounded as gemv's act8 rounds them, times W held as tiles
// (`tile_rows`, [N / 8, tile bytes]): gemm_act8's bits, and gemv's for each row.
torch::Tensor gemm_tiles(const torch::Tensor& tiles, int64_t type, const torch::Tensor& x_in, bool in_dtype) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "x: expected a 2-D CPU tensor [rows, K]");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const int64_t T = x.size(0), K = x.size(1);
  const Tiling tiling = tiling_of(type);
  TORCH_CHECK(tiling.form && K % tiling.block == 0 && tiles.device().is_cpu() && tiles.dim() == 2 &&
                  tiles.is_contiguous() && tiles.scalar_type() == torch::kUInt8 &&
                  tiles.size(1) == K / tiling.block * tiling.bytes,
              "gemm_tiles: expected uint8 tiles [N / 8, ", K / std::max<int64_t>(1, tiling.block) * tiling.bytes,
              "] of a type with tiles on this build");
  const int64_t G = tiles.size(0), N = 8 * G;
  auto y = torch::empty({T, N}, torch::kFloat32);
  std::vector<Act> acts(T);
  const float* X = x.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) quantize_act(X + t * K, K, type, acts[t], false);
  });
  tile_products(tiling, tiles.data_ptr<uint8_t>(), 0, true, G, acts, K, y.data_ptr<float>(), N);
  return finish(y, x_in, in_dtype);
}

// Y [T, N]: each row of x [T, K] rounded as `gemv(..., act8=true)` rounds it, times W [N, K] of
// ggml type `type` (raw rows); fp32. Row t of Y equals gemv(w, type, x[t], act8=true) bit for bit:
// the same kernels, eight weight rows interleaved into tiles (`tile_products`) or up to four rows
// of x taken against one decoded weight block at a time.
torch::Tensor gemm_act8(const torch::Tensor& w, int64_t type, const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "x: expected a 2-D CPU tensor [rows, K]");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const Format fmt = format_of(type);
  const int64_t T = x.size(0), K = x.size(1);
  check_raw(w, fmt, K, "w");
  const int64_t N = w.size(0), stride = w.size(1);
  auto y = torch::empty({T, N}, torch::kFloat32);
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  std::vector<Act> acts(T);
  const ActDot ad = act_dot_of(type);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) quantize_act(X + t * K, K, type, acts[t], !ad);
  });
  const RowsOf rows = rows_of(type);
  if (!rows.r[0]) {
    constexpr int64_t TILE = 64;  // activation rows per pass over a chunk of weight rows: they stay in cache
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t0 = 0; t0 < T; t0 += TILE)
        for (int64_t r = begin; r < end; ++r)
          for (int64_t t = t0; t < std::min(T, t0 + TILE); ++t)
            Y[t * N + r] = row_dot_act(fmt, ad, W + r * stride, acts[t], K);
    });
    return y;
  }
  // Eight weight rows at a time as tiles (`tiling_of`; none on the plain build); rows past the
  // last whole eight take the path below, with the same results.
  int64_t done = 0;
  const Tiling tiling = tiling_of(type);
  if (tiling.form && T > 1 && N >= 8) {
    tile_products(tiling, W, stride, false, N / 8, acts, K, Y, N);
    done = N / 8 * 8;
  }
  // A chunk of weight rows against each group of four activation rows in turn: the chunk (about
  // 16 KB) and the group stay in the first-level cache, and the activations stream from the
  // second-level cache once a chunk instead of once a weight row.
  const int64_t chunk = std::max<int64_t>(1, (16 << 10) / stride);
  at::parallel_for(done, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = begin; r0 < end; r0 += chunk) {
      const int64_t r1 = std::min(end, r0 + chunk);
      for (int64_t t = 0; t < T; t += 4) {
        const int n = static_cast<int>(std::min<int64_t>(4, T - t));
        const Act* group[4];
        for (int j = 0; j < n; ++j) group[j] = &acts[t + j];
        for (int64_t r = r0; r < r1; ++r) {
          float o[4];
          rows.r[n - 1](W + r * stride, group, K, o);
          for (int j = 0; j < n; ++j) Y[(t + j) * N + r] = o[j];
        }
      }
    }
  });
  return y;
}

// x [T, K] rounded row by row as ggml rounds a product's activations for weights of `type`, as
// floats (d * q): what the act8 products multiply, for checking the rounding itself.
torch::Tensor round_activations(const torch::Tensor& x_in, int64_t type) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "x: expected a 2-D CPU tensor [rows, K]");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const int64_t T = x.size(0), K = x.size(1);
  auto y = torch::empty({T, K}, torch::kFloat32);
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  format_of(type);  // an unknown type is an error before any work
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    Act a;
    for (int64_t t = begin; t < end; ++t) {
      quantize_act(X + t * K, K, type, a, true);
      std::memcpy(Y + t * K, a.xt.data(), K * 4);
    }
  });
  return y;
}

// n floats rounded to bf16 (to nearest even, as torch rounds). A NaN (a block whose fp16 scale is
// NaN, a float weight that is) stays a NaN, as at::BFloat16 makes it: rounding its bits as a
// number's carried a NaN with a full payload over into -0 or +0.
inline void store_bf16(const float* x, at::BFloat16* y, int64_t n) {
  int64_t k = 0;
#if defined(EXPERTCACHE_AVX2)
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), nan = _mm256_set1_epi32(0x7fc0);
  for (; k + 16 <= n; k += 16) {
    __m256i v[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 f = _mm256_loadu_ps(x + k + 8 * h);
      const __m256i bits = _mm256_castps_si256(f);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
      const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, odd)), 16);
      v[h] = _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    }
    // packus works within 128-bit lanes: put the four quarters back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v[0], v[1]), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + k), packed);
  }
#endif
  for (; k < n; ++k) y[k] = at::BFloat16(x[k]);
}

// W [N, K] decoded with the same decoders the products use (bit-identical to gguf-py) into out
// [N, K], float32 or bfloat16 (rounded once, to nearest even, as torch rounds). Rows are split
// across threads; prefill can decode a wave of experts into one reused buffer this way.
void dequantize_into(const torch::Tensor& w, int64_t type, const torch::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous() &&
                  (out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16),
              "out: expected a contiguous 2-D float32 or bfloat16 CPU tensor");
  const Format fmt = format_of(type);
  const int64_t N = out.size(0), K = out.size(1);
  check_raw(w, fmt, K, "w");
  TORCH_CHECK(w.size(0) == N, "w: expected ", N, " rows, as out has, got ", w.size(0));
  const int64_t stride = w.size(1);
  const uint8_t* W = w.data_ptr<uint8_t>();
  const bool f32 = out.scalar_type() == torch::kFloat32;
  float* Yf = f32 ? out.data_ptr<float>() : nullptr;
  at::BFloat16* Yb = f32 ? nullptr : out.data_ptr<at::BFloat16>();
  const int width = fmt.bytes / fmt.block;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float buf[256];
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = W + r * stride;
      for (int64_t k0 = 0; k0 < K; k0 += fmt.block) {
        const int64_t n = std::min<int64_t>(fmt.block, K - k0);  // short only for float types
        if (n == fmt.block) fmt.decode(row + k0 / fmt.block * fmt.bytes, buf);
        else for (int64_t k = 0; k < n; ++k) buf[k] = fmt.one(row + (k0 + k) * width);
        if (f32) std::memcpy(Yf + r * K + k0, buf, n * 4);
        else store_bf16(buf, Yb + r * K + k0, n);
      }
    }
  });
}

torch::Tensor dequantize(const torch::Tensor& w, int64_t type, int64_t K) {
  auto y = torch::empty({w.size(0), K}, torch::kFloat32);
  dequantize_into(w, type, y);
  return y;
}

// Gemma's GeGLU gate: gelu with the tanh approximation, in fp32 with torch's formula and order
// of operations (ATen's Gelu.h): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline float gelu_tanh(float x) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = static_cast<float>(0.044715);
  const float cube = x * x * x;
  return 0.5f * x * (1.f + std::tanh(beta * (x + kappa * cube)));
}

// The activation names of `hidden_act` that the expert calls take: silu (SwiGLU) or
// gelu_pytorch_tanh (GeGLU); true for the second.
bool is_gelu(const std::string& act) {
  TORCH_CHECK(act == "silu" || act == "gelu_pytorch_tanh", "act: expected silu or gelu_pytorch_tanh, got ", act);
  return act == "gelu_pytorch_tanh";
}

// One matrix kind of an expert wave as the call holds it: the file's rows ([N, row bytes]) or,
// `tiled`, their tiles of eight rows (`tile_rows`, [N / 8, tile bytes], with the act8 rounding
// only); `stride`: bytes per row or per tile row.
struct Kind {
  Format fmt;
  ActDot ad = nullptr;
  ActDot8 ad8 = nullptr;
  Tile4 tile = nullptr;
  int64_t stride = 0;
};

Kind kind_of(const std::vector<torch::Tensor>& ws, int64_t type, bool tiled, bool act8, int64_t N, int64_t K,
             const char* what) {
  Kind k{format_of(type)};
  if (act8) {
    k.ad = act_dot_of(type);
    k.ad8 = act_dot8_of(type);
  }
  if (tiled) {
    const Tiling tiling = tiling_of(type);
    TORCH_CHECK(act8 && tiling.form && N % 8 == 0 && K % tiling.block == 0, what,
                ": tiles need act8, a type with tiles on this build and a multiple of 8 rows");
    k.tile = tiling.kern[0];
    for (const auto& w : ws)
      TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                      w.size(0) == N / 8 && w.size(1) == K / tiling.block * tiling.bytes,
                  what, ": expected contiguous uint8 tiles [", N / 8, ", ", K / tiling.block * tiling.bytes, "]");
  } else {
    for (const auto& w : ws) check_raw(w, k.fmt, K, what);
  }
  if (!ws.empty()) k.stride = ws[0].size(1);
  return k;
}

// Rows [i, i + run) of one matrix (starting at `w`) times x (rounded as `a`; as floats `X` where
// `a` is null), into out[0, run). Tiles take whole groups of eight rows: i and run are multiples
// of 8 then.
void kind_rows(const Kind& k, const uint8_t* w, int64_t i, int64_t run, const Act* a, const float* X, int64_t K,
               float* out) {
  if (k.tile) {
    for (int64_t g = 0; g < run / 8; ++g) {
      k.tile(w + (i / 8 + g) * k.stride, &a, K, out + 8 * g, 2 * k.stride);
    }
  } else if (a) {
    dot_rows_act(k.fmt, k.ad, k.ad8, w + i * k.stride, k.stride, run, *a, K, out);
  } else {
    for (int64_t r = 0; r < run; ++r) out[r] = row_dot(k.fmt, w + (i + r) * k.stride, X, K);
  }
}

// A wave of gated experts on one token: for each expert e,
//   g = gate[e] x, u = up[e] x (fp32), h = act(g) * u (fp32), y[e] = down[e] h (fp32),
// act silu (SwiGLU) or gelu_pytorch_tanh (GeGLU).
// gate[e], up[e]: raw rows [I, row bytes of D weights]; down[e]: raw rows [D, row bytes of I];
// each matrix kind has one ggml type for the whole wave (all experts of a layer share a layout),
// and with act8 may be held as tiles (`tiled`: gate, up, down), which give the rows' bits.
// Returns [n, D] float32. Two parallel passes over every row of the wave, one for gate and up,
// one for down; each row is one thread's fixed-order sum, so an expert's output does not depend
// on the wave it runs in or on the thread count. Rows are handed out eight at a time where the
// widths allow (tiles need it).
// With `out` (fp32 [A, D]) and `rows` (one per expert), expert e's output goes to row rows[e] of
// `out` instead, which is returned: a decode step's experts in their router ranks, for the decode
// module's `combine`.
torch::Tensor experts(const torch::Tensor& x_in, const std::vector<torch::Tensor>& gates,
                      const std::vector<torch::Tensor>& ups, const std::vector<torch::Tensor>& downs,
                      int64_t gate_type, int64_t up_type, int64_t down_type, const std::string& act,
                      bool act8, bool in_dtype, const c10::optional<torch::Tensor>& out,
                      const std::vector<int64_t>& rows, const std::vector<bool>& tiled) {
  const bool gelu = is_gelu(act);
  const torch::Tensor x = as_f32(one_row(x_in));
  TORCH_CHECK(gates.size() == ups.size() && ups.size() == downs.size(),
              "experts: expected as many gate, up and down matrices, got ", gates.size(), ", ", ups.size(), ", ",
              downs.size());
  TORCH_CHECK(tiled.empty() || tiled.size() == 3, "tiled: expected none or three flags (gate, up, down)");
  const auto is_tiled = [&tiled](int j) { return !tiled.empty() && tiled[j]; };
  const int64_t n = static_cast<int64_t>(gates.size()), D = x.size(0);
  rank_rows(out, rows, n, D);
  auto y = out.has_value() ? *out : torch::empty({n, D}, torch::kFloat32);
  if (n == 0) return out.has_value() ? y : finish(y, x_in, in_dtype);
  const int64_t I = is_tiled(0) ? gates[0].size(0) * 8 : gates[0].size(0);
  const Kind kg = kind_of(gates, gate_type, is_tiled(0), act8, I, D, "gate"),
             ku = kind_of(ups, up_type, is_tiled(1), act8, I, D, "up"),
             kd = kind_of(downs, down_type, is_tiled(2), act8, D, I, "down");
  std::vector<const uint8_t*> G(n), U(n), Dn(n);
  for (int64_t e = 0; e < n; ++e) {
    TORCH_CHECK(gates[e].size(0) == gates[0].size(0) && ups[e].size(0) * (is_tiled(1) ? 8 : 1) == I &&
                    downs[e].size(0) * (is_tiled(2) ? 8 : 1) == D,
                "experts: expected gate and up [I, *] and down [D, *] with I = ", I, " and D = ", D);
    G[e] = gates[e].data_ptr<uint8_t>();
    U[e] = ups[e].data_ptr<uint8_t>();
    Dn[e] = downs[e].data_ptr<uint8_t>();
  }
  const float* X = x.data_ptr<float>();
  std::vector<float> gu(n * 2 * I), h(n * I);
  // act8: x rounded once for each of gate's and up's partner formats, h once per expert for down's.
  Act ag, au;
  std::vector<Act> ah(act8 ? n : 0);
  if (act8) {
    quantize_act(X, D, gate_type, ag, !kg.ad);
    quantize_act(X, D, up_type, au, !ku.ad);
  }
  // Work is handed out in units of eight rows where every run is whole eights, else row by row.
  const int64_t u1 = I % 8 == 0 ? 8 : 1, u2 = D % 8 == 0 ? 8 : 1;
  at::parallel_for(0, n * 2 * I / u1, std::max<int64_t>(1, 16 / u1), [&](int64_t b, int64_t e_) {
    for (int64_t r = b * u1, end = e_ * u1; r < end;) {  // one run of rows of one matrix at a time
      const int64_t e = r / (2 * I), i = r % (2 * I);
      const bool g = i < I;
      const int64_t i0 = g ? i : i - I, run = std::min(end - r, I - i0);
      kind_rows(g ? kg : ku, g ? G[e] : U[e], i0, run, act8 ? (g ? &ag : &au) : nullptr, X, D, gu.data() + r);
      r += run;
    }
  });
  at::parallel_for(0, n * I, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t e = r / I, i = r % I;
      const float g = gu[e * 2 * I + i], u = gu[e * 2 * I + I + i];
      h[r] = gelu ? gelu_tanh(g) * u : g / (1.f + std::exp(-g)) * u;
    }
  });
  if (act8)
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) quantize_act(h.data() + e * I, I, down_type, ah[e], !kd.ad);
    });
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, n * D / u2, std::max<int64_t>(1, 16 / u2), [&](int64_t b, int64_t e_) {
    for (int64_t r = b * u2, end = e_ * u2; r < end;) {  // one run of one expert's rows at a time
      const int64_t e = r / D, i = r % D, run = std::min(end - r, D - i);
      kind_rows(kd, Dn[e], i, run, act8 ? &ah[e] : nullptr, h.data() + e * I, I,
                Y + (out.has_value() ? rows[e] * D + i : r));
      r += run;
    }
  });
  return out.has_value() ? y : finish(y, x_in, in_dtype);
}

}  // namespace

// Each call releases Python's lock while it runs: it touches tensors only, and other threads
// (the prefetch worker's reads, the server's requests) can run meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(EXPERTCACHE_AVX2)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "portable";
#endif
  m.def("gemv", &gemv, "y [N] = W x, W raw ggml rows [N, row bytes] of a type, x [K] (or [1, K]) fp32/bf16; "
        "fp32; act8 rounds x as ggml's CPU products do; in_dtype: y in x's dtype, [1, N] for x [1, K]",
        py::arg("w"), py::arg("qtype"), py::arg("x"), py::arg("act8") = false, py::arg("in_dtype") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_act8", &gemm_act8, "Y [T, N] = rows of x [T, K] rounded as gemv's act8 rounds them, times raw ggml "
        "rows W [N, row bytes]; fp32; row t equals gemv(w, qtype, x[t], act8=True)",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_rows", &tile_rows, "raw ggml rows [N, row bytes] (N a multiple of 8) as tiles of eight rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_tiles", &gemm_tiles, "gemm_act8 with W as tile_rows's tiles: the same bits; in_dtype: Y in x's dtype",
        py::arg("tiles"), py::arg("qtype"), py::arg("x"), py::arg("in_dtype") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("round_activations", &round_activations, "x [T, K] rounded per row as ggml rounds activations for weights "
        "of a type (fp32 d * q)", py::call_guard<py::gil_scoped_release>());
  m.def("gemv_decoded", &gemv_decoded, "gemv through the plain block decoders: equal to gemv bit for bit",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_into", &dequantize_into, "raw ggml rows [N, row bytes] of a type -> out [N, K], fp32 or bf16",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, "raw ggml rows [N, row bytes] of a type -> fp32 [N, K]",
        py::call_guard<py::gil_scoped_release>());
  m.def("experts", &experts, "a wave of gated experts (silu or gelu_pytorch_tanh) on one token from raw ggml rows: "
        "fp32 [n, D] (in_dtype: in x's dtype); x [D] or [1, D]; with out (fp32 [A, D]) and rows, expert e's output "
        "in out[rows[e]]; tiled: gate, up and down held as tile_rows's tiles (act8 only)", py::arg("x"), py::arg("gates"), py::arg("ups"),
        py::arg("downs"), py::arg("gate_type"), py::arg("up_type"), py::arg("down_type"), py::arg("act") = "silu",
        py::arg("act8") = false, py::arg("in_dtype") = false, py::arg("out") = py::none(),
        py::arg("rows") = std::vector<int64_t>{}, py::arg("tiled") = std::vector<bool>{},
        py::call_guard<py::gil_scoped_release>());
}
