// CPU kernels for the dense quantized matmul y[M, N] = x[M, K] @ W (float32 out), called from XLA
// through the FFI (cpu.py builds and registers them). Formats and layouts are reference.py's:
//
//   float      W float32 [K, N]                          "KN": a row of W is contiguous in N
//   fp8        W E4M3 bytes [K, N], scale float32 [N]     "KN"
//   fp8_block  W E4M3 bytes [N, K], scale float32 [N/bo, K/bi]   "NK": contiguous in K
//   mxfp4      W uint8 [N, K/32, 16], scale E8M0 [N, K/32]       "NK"
//              (or [G, N, K/G/32, 16] and [G, N, K/G/32]: G groups along K, see mx_tile)
//
// Why a kernel: XLA:CPU cannot fuse a dequantization into a dot, so a quantized weight was
// expanded to float in memory before every product (more traffic than the float weight itself),
// and its small-M dots (M = 2..32 rows, a verify block) cost several one-row products. These
// kernels stream the stored bytes once, decode them in registers and use each decoded weight for
// every row of x, with register tiles of (rows of x) × (columns of W):
//
//   KN, up to 8 rows: stream four rows of W side by side in long runs, decode each 16 columns
//       once and FMA them into the rows' accumulators (kept in L1).
//   KN, more rows: decode a 64 × 2048 block once into an L2-resident buffer, multiply it with
//       6 × 64 register tiles while the next block is prefetched.
//   NK: for NB rows of W, for each block along K: decode once, FMA with x[t, block] for TG rows;
//       a horizontal sum per (row, output) at the end. MXFP4's nibbles are decoded with a
//       16-entry table (one permute per 16 values) against x split into even and odd elements.
//
// Vectors are GCC/Clang vector extensions of 16 floats (one AVX-512 register, two AVX2 or four
// NEON ones), so the same code compiles on any target; cpu.py builds it with -march=native.
// Columns are split across XLA's intra-op thread pool (at most JAXSPEC_CPU_THREADS parts).

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
// Without AVX-512 a v16f is two of the 16 AVX2 registers (or four of NEON's 32), so the register
// tiles below are cut to what 16 such registers hold: spilled accumulators cost more than
// everything they save.
#if defined(__AVX512F__)
constexpr bool kNarrow = false;
#else
constexpr bool kNarrow = true;
#endif
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int16_t v16s __attribute__((vector_size(32)));
typedef uint8_t v16b __attribute__((vector_size(16)));

inline v16f load_f(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_f(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }
inline v16f splat(float s) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_set1_ps(s));
#else
  return v16f{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#endif
}
inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Half vectors: the narrow targets' register width (one AVX2 register, two NEON ones). GCC keeps
// arrays of 64-byte vectors in memory on AVX2 (every FMA of a register tile went through the
// stack, ~5 GFLOP/s a core), so the narrow paths below tile with these.
constexpr int kHalf = 8;
typedef float v8f __attribute__((vector_size(32)));
inline v8f load_f8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_f8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
// (Not `v8f{} + s`: adding +0 is no identity for −0, so that costs an add before the broadcast.)
inline v8f splat8(float s) { return v8f{s, s, s, s, s, s, s, s}; }

// ---------------------------------------------------------------------------------------------
// Element decoders: 16 stored elements → 16 floats.
// ---------------------------------------------------------------------------------------------

// E4M3 bytes → floats times 2^-8 (the caller folds 2^8 into its scale). The byte's sign goes to
// bit 15 and its 7 magnitude bits to bits 13..7 of an IEEE half: the half's exponent field is
// E4M3's (bias 15 instead of 7, hence 2^-8) and subnormals map to half subnormals, so one
// half → float conversion decodes every finite E4M3 value exactly.
inline v16f fp8_decode_scaled(const uint8_t* p) {
#if defined(__AVX512F__)
  // Sign-extended to 16 bits, shifted left 7: magnitude at bits 13..7, the sign at 15 and 14.
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return reinterpret_cast<v16f>(_mm512_cvtph_ps(h));
#elif defined(__AVX2__) && defined(__F16C__)
  // The same halves on AVX2 + F16C (no AVX-512): two 8-wide half → float conversions.
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  __m256 parts[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
                     _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
  v16f v;
  std::memcpy(&v, parts, sizeof(v));
  return v;
#else
  // Portable: build the float's bits (normal numbers) or scale the mantissa (subnormals).
  v16i b;
  for (int i = 0; i < kLanes; ++i) b[i] = p[i];
  v16i mag = b & 0x7F;
  v16i sign = (b & 0x80) << 24;
  v16i normal_bits = (mag << 20) + ((127 - 15) << 23);  // value · 2^-8, as the fast path
  v16f sub = __builtin_convertvector(mag, v16f) * (1.0f / 131072.0f);  // m · 2^-9 · 2^-8
  v16i is_normal = mag >= 8;
  v16i bits = (normal_bits & is_normal) | (reinterpret_cast<v16i>(sub) & ~is_normal) | sign;
  return reinterpret_cast<v16f>(bits);
#endif
}
// 8 E4M3 bytes → 8 floats times 2^-8, as fp8_decode_scaled.
inline v8f fp8_decode8_scaled(const uint8_t* p) {
#if defined(__AVX2__) && defined(__F16C__)
  __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return reinterpret_cast<v8f>(_mm256_cvtph_ps(h));
#else
  uint8_t padded[kLanes] = {};
  std::memcpy(padded, p, kHalf);
  const v16f v = fp8_decode_scaled(padded);
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
}
// 16 E4M3 bytes → two 8-float halves times 2^-8: one load and one widening for both.
inline void fp8_decode16_scaled(const uint8_t* p, v8f* lo, v8f* hi) {
#if defined(__AVX2__) && defined(__F16C__)
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  *lo = reinterpret_cast<v8f>(_mm256_cvtph_ps(_mm256_castsi256_si128(h)));
  *hi = reinterpret_cast<v8f>(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
#else
  *lo = fp8_decode8_scaled(p);
  *hi = fp8_decode8_scaled(p + kHalf);
#endif
}
constexpr float kFp8Unscale = 256.0f;  // undoes fp8_decode_scaled's 2^-8

// E2M1 codes 0..15 → values (sign bit 3, exponent bits 2–1, mantissa bit 0).
const v16f kE2M1 = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 16 packed bytes (32 codes) → the even elements (low nibbles) and the odd ones (high nibbles).
// (The portable mx_tile's decoder; the AVX-512 mx_tile folds the scale into the table.)
inline void mxfp4_decode(const uint8_t* p, v16f* even, v16f* odd) {
  v16i w;
  for (int i = 0; i < kLanes; ++i) w[i] = p[i];
  *even = __builtin_shuffle(kE2M1, kE2M1, w & 0xF);
  *odd = __builtin_shuffle(kE2M1, kE2M1, (w >> 4) & 0xF);
}

// E8M0 → 2^(s − 127). s = 0 is 2^-127, a float32 subnormal; 0xFF (NaN) is refused at load.
inline float e8m0(uint8_t s) {
  uint32_t bits = s ? static_cast<uint32_t>(s) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#include "kernel_cpu_kn.inc"  // the "KN" layout (float, fp8): W[k, n] with n contiguous

// ---------------------------------------------------------------------------------------------
// "NK" layout (fp8_block, mxfp4): row n of W is contiguous in K.
// ---------------------------------------------------------------------------------------------

// MXFP4: NB rows of W × TG rows of x. xe/xo: x's even and odd elements, [M, K/2] each. The
// weight may be G groups along K (values [G, N, K/G/32, 16]: a weight with two contraction axes,
// blocked along the last, e.g. an output projection [heads, head_dim, hidden]); group g's blocks
// meet x's elements [g·K/G, (g+1)·K/G).
#if defined(__AVX512F__)
// 16 E8M0 scale bytes → their 16 float32 scales (2^(s − 127); s = 0 is the subnormal 2^-127).
inline __m512 e8m0_16(const uint8_t* p) {
  const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()),
                                               _mm512_slli_epi32(s, 23),
                                               _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(bits);
}

// AVX-512: each block's scale multiplies the 16-entry E2M1 table once (one multiply for 32
// elements), the scales of 16 blocks are decoded together and picked by a permute.
template <int NB, int TG>
void mx_tile(const float* xe, const float* xo, int64_t K, int64_t G, const uint8_t* w,
             const uint8_t* s, int64_t N, float* y, int64_t t0, int64_t n0) {
  const int64_t kb = K / 32 / G, half = K / 2;
  const __m512 table = reinterpret_cast<__m512>(kE2M1);
  v16f acc[NB][TG] = {};
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b0 = 0; b0 < kb; b0 += 16) {
      const int64_t nbk = std::min<int64_t>(16, kb - b0);
      __m512 sv[NB];
      for (int i = 0; i < NB; ++i) {
        const uint8_t* sp = s + (g * N + n0 + i) * kb + b0;
        if (nbk == 16) {
          sv[i] = e8m0_16(sp);
        } else {
          uint8_t padded[16] = {};
          std::memcpy(padded, sp, nbk);
          sv[i] = e8m0_16(padded);
        }
      }
      for (int64_t j = 0; j < nbk; ++j) {
        const __m512i lane = _mm512_set1_epi32(static_cast<int>(j));
        v16f we[NB], wo[NB];
        for (int i = 0; i < NB; ++i) {
          const __m512 lut = _mm512_mul_ps(table, _mm512_permutexvar_ps(lane, sv[i]));
          const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(w + ((g * N + n0 + i) * kb + b0 + j) * 16)));
          we[i] = reinterpret_cast<v16f>(_mm512_permutexvar_ps(q, lut));
          wo[i] = reinterpret_cast<v16f>(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));
        }
        const int64_t at = (g * kb + b0 + j) * kLanes;
        for (int t = 0; t < TG; ++t) {
          const v16f e = load_f(xe + (t0 + t) * half + at);
          const v16f o = load_f(xo + (t0 + t) * half + at);
          for (int i = 0; i < NB; ++i) acc[i][t] += we[i] * e + wo[i] * o;
        }
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int t = 0; t < TG; ++t) y[(t0 + t) * N + n0 + i] = hsum(acc[i][t]);
}
#else
template <int NB, int TG>
void mx_tile(const float* xe, const float* xo, int64_t K, int64_t G, const uint8_t* w,
             const uint8_t* s, int64_t N, float* y, int64_t t0, int64_t n0) {
  const int64_t kb = K / 32 / G, half = K / 2;
  v16f acc[NB][TG] = {};
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < kb; ++b) {
      v16f we[NB], wo[NB];
      for (int i = 0; i < NB; ++i) {
        const int64_t block = (g * N + n0 + i) * kb + b;
        mxfp4_decode(w + block * 16, &we[i], &wo[i]);
        const v16f sc = splat(e8m0(s[block]));
        we[i] *= sc;
        wo[i] *= sc;
      }
      const int64_t at = (g * kb + b) * kLanes;
      for (int t = 0; t < TG; ++t) {
        const v16f e = load_f(xe + (t0 + t) * half + at);
        const v16f o = load_f(xo + (t0 + t) * half + at);
        for (int i = 0; i < NB; ++i) acc[i][t] += we[i] * e + wo[i] * o;
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int t = 0; t < TG; ++t) y[(t0 + t) * N + n0 + i] = hsum(acc[i][t]);
}

#endif  // __AVX512F__

// FP8 with block scales: W[n, k] bytes, scale[n / bo, k / bi]; K need not be a multiple of 16
// (the last partial vector is decoded from a zero-padded copy).
template <int NB, int TG>
void fb_tile(const float* xp, int64_t Kp, int64_t K, const uint8_t* w, const float* s,
             int64_t N, int64_t bo, int64_t bi, float* y, int64_t t0, int64_t n0) {
  const int64_t sk = (K + bi - 1) / bi;
  v16f acc[NB][TG] = {};
  for (int64_t k = 0; k < Kp; k += kLanes) {
    v16f wv[NB];
    for (int i = 0; i < NB; ++i) {
      const int64_t row = n0 + i;
      const uint8_t* src = w + row * K + k;
      if (k + kLanes <= K) {
        wv[i] = fp8_decode_scaled(src);
      } else {
        uint8_t padded[kLanes] = {};
        std::memcpy(padded, src, K - k);
        wv[i] = fp8_decode_scaled(padded);
      }
      wv[i] *= splat(s[(row / bo) * sk + k / bi] * kFp8Unscale);
    }
    for (int t = 0; t < TG; ++t) {
      const v16f xv = load_f(xp + (t0 + t) * Kp + k);
      for (int i = 0; i < NB; ++i) acc[i][t] += wv[i] * xv;
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int t = 0; t < TG; ++t) y[(t0 + t) * N + n0 + i] = hsum(acc[i][t]);
}

// Rows [r0, r1) of W (= columns of y) for every row of x, NB = 2 rows of W at a time.
template <class Tile>
void nk_rows(int64_t M, int64_t r0, int64_t r1, Tile tile) {
  constexpr int NB = 2, TG = 8;
  for (int64_t n = r0; n < r1;) {
    const bool pair = n + NB <= r1;
    for (int64_t t = 0; t < M;) {
      const int64_t g = std::min<int64_t>(TG, M - t);
      tile(pair, static_cast<int>(g), t, n);
      t += g;
    }
    n += pair ? NB : 1;
  }
}

// Dispatches (pair?, rows of x) to a compile-time tile.
template <template <int, int> class F, class... A>
void nk_dispatch(bool pair, int g, A... a) {
#define JAXSPEC_NK_CASE(G)                                  \
  case G:                                                   \
    pair ? F<2, G>::run(a...) : F<1, G>::run(a...);         \
    break;
  switch (g) {
    JAXSPEC_NK_CASE(1) JAXSPEC_NK_CASE(2) JAXSPEC_NK_CASE(3) JAXSPEC_NK_CASE(4)
    JAXSPEC_NK_CASE(5) JAXSPEC_NK_CASE(6) JAXSPEC_NK_CASE(7) JAXSPEC_NK_CASE(8)
    default: break;
  }
#undef JAXSPEC_NK_CASE
}

template <int NB, int TG>
struct MxTile {
  template <class... A>
  static void run(A... a) { mx_tile<NB, TG>(a...); }
};
template <int NB, int TG>
struct FbTile {
  template <class... A>
  static void run(A... a) { fb_tile<NB, TG>(a...); }
};

// ---------------------------------------------------------------------------------------------
// Parallel split over columns.
// ---------------------------------------------------------------------------------------------

int64_t max_parts() {
  static const int64_t cap = [] {
    const char* env = std::getenv("JAXSPEC_CPU_THREADS");
    const long v = env ? std::strtol(env, nullptr, 10) : 0;
    return v > 0 ? static_cast<int64_t>(v) : int64_t{1} << 20;
  }();
  return cap;
}

// Runs body(part) for part in [0, parts): the caller claims parts too, so the call completes
// even when every pool thread is busy (it never waits on a part nobody has started).
template <class Body>
void parallel_parts(ffi::ThreadPool& pool, int64_t parts, Body body) {
  if (parts <= 1) {
    body(0);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, parts, body]() {
    for (int64_t p; (p = shared->next.fetch_add(1)) < parts;) {
      body(p);
      if (shared->done.fetch_add(1) + 1 == parts) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  for (int64_t i = 1; i < parts; ++i) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == parts; });
}

int64_t num_parts(ffi::ThreadPool& pool, int64_t units) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return std::max<int64_t>(1, std::min({threads, max_parts(), units}));
}

// ---------------------------------------------------------------------------------------------
// FFI handlers.
// ---------------------------------------------------------------------------------------------

ffi::Error check_2d(const ffi::AnyBuffer& b, const char* what) {
  if (b.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(std::string(what) + " must be 2-D");
  return ffi::Error::Success();
}

// The stored element type a layout reads: float32, or one byte (E4M3 or its uint8 bits).
template <class Rows>
ffi::Error check_type(const ffi::AnyBuffer& b) {
  const auto t = b.element_type();
  const bool ok = Rows::kBytes == 4 ? t == ffi::DataType::F32
                                    : (t == ffi::DataType::U8 || t == ffi::DataType::F8E4M3FN);
  if (!ok) return ffi::Error::InvalidArgument("the weight's element type does not match its format");
  return ffi::Error::Success();
}

template <class Rows>
ffi::Error kn_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     ffi::Result<ffi::Buffer<ffi::F32>> y) {
  if (auto e = check_2d(w, "the weight"); e.failure()) return e;
  if (auto e = check_type<Rows>(w); e.failure()) return e;
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1];
  if (w.dimensions()[0] != K) return ffi::Error::InvalidArgument("x and W disagree on K");
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  float* yp = y->typed_data();
  const int64_t units = (N + 63) / 64;
  const int64_t parts = num_parts(pool, units);
  parallel_parts(pool, parts, [&](int64_t p) {
    const int64_t c0 = std::min(N, units * p / parts * 64);
    const int64_t c1 = std::min(N, units * (p + 1) / parts * 64);
    kn_columns<Rows>(x.typed_data(), M, K, wp, N, yp, c0, c1);
  });
  return ffi::Error::Success();
}

ffi::Error f32_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return kn_matmul<F32Rows>(pool, x, w, y);
}

ffi::Error fp8_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  if (auto e = kn_matmul<Fp8Rows>(pool, x, w, y); e.failure()) return e;
  const int64_t M = x.dimensions()[0], N = w.dimensions()[1];
  float* yp = y->typed_data();
  const float* s = scale.typed_data();
  for (int64_t t = 0; t < M; ++t)
    for (int64_t n = 0; n < N; ++n) yp[t * N + n] *= s[n] * kFp8Unscale;
  return ffi::Error::Success();
}

ffi::Error mxfp4_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::Buffer<ffi::U8> scale, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto dims = w.dimensions();
  const bool grouped = dims.size() == 4;
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int64_t G = grouped ? dims[0] : 1, N = dims[grouped ? 1 : 0];
  if ((dims.size() != 3 && !grouped) || G * dims[dims.size() - 2] * 32 != K)
    return ffi::Error::InvalidArgument("MXFP4 weight must be [N, K/32, 16] or [G, N, K/G/32, 16]");
  // x split into even / odd elements, matching the low / high nibbles of each byte.
  const int64_t half = K / 2;
  std::unique_ptr<float[]> split(new float[2 * M * half]);
  float *xe = split.get(), *xo = split.get() + M * half;
  const float* xp = x.typed_data();
  for (int64_t t = 0; t < M; ++t)
    for (int64_t j = 0; j < half; ++j) {
      xe[t * half + j] = xp[t * K + 2 * j];
      xo[t * half + j] = xp[t * K + 2 * j + 1];
    }
  const uint8_t *wp = w.typed_data(), *sp = scale.typed_data();
  float* yp = y->typed_data();
  const int64_t units = (N + 1) / 2;
  const int64_t parts = num_parts(pool, units);
  parallel_parts(pool, parts, [&](int64_t p) {
    const int64_t r0 = std::min(N, units * p / parts * 2);
    const int64_t r1 = std::min(N, units * (p + 1) / parts * 2);
    nk_rows(M, r0, r1, [&](bool pair, int g, int64_t t, int64_t n) {
      nk_dispatch<MxTile>(pair, g, xe, xo, K, G, wp, sp, N, yp, t, n);
    });
  });
  return ffi::Error::Success();
}

ffi::Error fp8_block_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> y,
                            int64_t block_n, int64_t block_k) {
  if (auto e = check_2d(w, "the weight"); e.failure()) return e;
  if (auto e = check_type<Fp8Rows>(w); e.failure()) return e;
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (w.dimensions()[1] != K) return ffi::Error::InvalidArgument("x and W disagree on K");
  if (block_k % kLanes && (K + block_k - 1) / block_k > 1)
    return ffi::Error::InvalidArgument("fp8_block needs block_k a multiple of 16");
  // x padded to a multiple of 16 columns (zeros meet the zero-padded weight tail).
  const int64_t Kp = (K + kLanes - 1) / kLanes * kLanes;
  std::unique_ptr<float[]> padded(new float[M * Kp]());
  for (int64_t t = 0; t < M; ++t)
    std::memcpy(padded.get() + t * Kp, x.typed_data() + t * K, K * sizeof(float));
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  const float* xp = padded.get();
  const int64_t units = (N + 1) / 2;
  const int64_t parts = num_parts(pool, units);
  parallel_parts(pool, parts, [&](int64_t p) {
    const int64_t r0 = std::min(N, units * p / parts * 2);
    const int64_t r1 = std::min(N, units * (p + 1) / parts * 2);
    nk_rows(M, r0, r1, [&](bool pair, int g, int64_t t, int64_t n) {
      nk_dispatch<FbTile>(pair, g, xp, Kp, K, wp, sp, N, block_n, block_k, yp, t, n);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCpuMatmulF32, f32_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCpuMatmulFp8, fp8_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCpuMatmulFp8Block, fp8_block_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_n")
                                  .Attr<int64_t>("block_k"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCpuMatmulMxfp4, mxfp4_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
