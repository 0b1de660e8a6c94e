// lowbit's CPU fast path for fake quantization: one pass over memory per block, with an
// optional randomised Hadamard transform fused in front.
//
// XLA:CPU cannot fuse a reduction into its consumer, so the XLA emulation reads every block
// twice (block maxima, then scale and round), and a Hadamard transform before it costs
// several more passes. This XLA FFI handler transforms, reduces, scales and rounds a chunk
// while it is in L1/L2. It computes exactly what the XLA path (lowbit/core/qarray.py,
// lowbit/core/numerics.py, and lowbit/core/hadamard.py's butterfly) computes, operation for
// operation, and tests/test_native.py checks that bit for bit; change one, change the other.
//
// Layout. x is float32 [nbatch, P, A, M, C, Q] (row-major, unpadded). Blocks are tiles of
// (block_a, block_c) over the axes A and C: 1-D blocks along an axis have A = M = 1 and
// block_a = 1; 2-D tiles span two axes with M the product of the axes between them. Each
// axis is virtually zero-padded to a multiple of its block (A_pad, C_pad); padded elements
// are neither read nor written, and cannot change a block's amax. Element i's stochastic-
// rounding index is its row-major index in the padded [P, A_pad, M, C_pad, Q] array, as in
// the XLA path. nbatch comes from vmap (vmap_method="broadcast_all"): the key, the tensor
// amax and the signs carry one entry per batch element, and the index restarts at zero in
// each, as in the XLA path under vmap.
//
// Two walks over the array. Q == 1 ("rows"): a band is block_a rows of C contiguous floats,
// cut into segments of whole tiles; tiles are block_c consecutive floats of each row. Q > 1
// ("strided"): a band is the block_a x block_c sub-rows of Q floats that hold a row of tiles
// (one tile per column q; lcm(block_c, hadamard) sub-rows with a transform), cut into column
// segments and vectorised over columns.
//
// Hadamard (1-D blocks only, along C): blocks of `hadamard` consecutive elements along C
// (the axis length is a multiple of it), each multiplied by the signs, then butterfly stages
// h = b/2, ..., 1 replacing (v[i], v[i + h]) by (v[i] + v[i + h], v[i] - v[i + h]), then
// multiplied by float32(1 / sqrt(b)): lowbit.core.hadamard's "butterfly" form, whose arithmetic
// is fixed (the grouping of independent pairs into vectors changes no value). A segment
// (rows) or a band (strided) holds whole Hadamard blocks and whole quantization blocks: it
// is transformed into a buffer, which is then quantized like x. The NVFP4 tensor amax is that
// of the transformed tensor (a first pass transforms and reduces, a second quantizes).
//
// Floating point. XLA:CPU runs with denormals flushed (FTZ and DAZ); every worker here sets
// the same mode for the duration of its work, so products, sums, comparisons and roundings
// agree with the XLA path on subnormal inputs and results. The kernel is compiled with
// -ffp-contract=off (no a * b + c contracted into an FMA; GCC contracts even in ISO C++ mode).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kSignBit = 0x80000000u;
constexpr float kNvfp4TensorDivisor = 448.0f * 6.0f;
constexpr float kE4M3Max = 448.0f;

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float Float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// 2**e for integer e in [-126, 127], from the exponent bits.
inline float Pow2(int e) { return Float(uint32_t(e + 127) << 23); }

// MurmurHash3's 32-bit finaliser (lowbit.core.numerics.fmix32).
inline uint32_t Fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Flush-to-zero and denormals-are-zero for the current thread, restored on destruction.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr |= (uint64_t{1} << 24);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~FlushDenormals() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  uint64_t saved_ = 0;
};

// An element format and everything derived from it that the inner loops use.
struct Grid {
  int mbits, emin, emax, shift;
  float max, step, inv_step, min_normal;
  uint32_t low, emin_field;

  Grid(int mbits_, int emin_, int emax_, float max_)
      : mbits(mbits_), emin(emin_), emax(emax_), shift(23 - mbits_), max(max_) {
    step = Pow2(emin - mbits);
    inv_step = Pow2(mbits - emin);
    min_normal = Pow2(emin);
    low = (1u << shift) - 1u;
    emin_field = uint32_t(emin + 127);
  }
};

// lowbit.core.numerics.round_to_grid for |v|, nearest-even: (|v| + M) - M with M from |v|'s own
// exponent field. `a` is finite, non-negative and at most grid.max.
inline float RoundNearest(float a, const Grid& g) {
  uint32_t field = std::max(Bits(a) >> 23, g.emin_field);
  float magic = Float((field + uint32_t(g.shift)) << 23);
  return (a + magic) - magic;
}

// lowbit.core.numerics.round_to_grid for |v|, stochastic, driven by 32 random bits.
inline float RoundStochastic(float a, uint32_t rbits, const Grid& g) {
  float normal = Float((Bits(a) + (rbits >> (32 - g.shift))) & ~g.low);
  float y = a * g.inv_step;
  float fl = std::floor(y);
  float u = float(int32_t(rbits >> 8)) * 0x1p-24f;
  float sub = (fl + ((u < (y - fl)) ? 1.0f : 0.0f)) * g.step;
  return a < g.min_normal ? sub : normal;
}

// min(|v|, max). Unlike jnp.minimum it turns NaN into max, which changes nothing: a NaN
// element lives in a non-finite block, whose outputs are NaN from its scale factor.
inline float Saturate(float a, float max) { return a < max ? a : max; }

// r >= 0 with v's sign; MX INT8 (two's complement) has no -0.
template <bool kInt>
inline float WithSign(float r, float v) {
  if constexpr (kInt) {
    return r == 0.0f ? 0.0f : std::copysign(r, v);
  } else {
    return Float(Bits(r) | (Bits(v) & kSignBit));
  }
}

// kNvfp4Outer: NVFP4 under TetraJet-v2's double-block scales (rule kDoubleBlock), whose
// elements are not zeroed where the block scale is 0 (x * 0 keeps x's sign, as in the XLA
// path); the Python side never passes it as a kind.
enum Kind { kMxFloat = 0, kMxInt = 1, kNvfp4 = 2, kNvfp4Outer = 3 };
enum ScaleMode { kFloor = 0, kCeil = 1, kEven = 2, kRceil = 3, kOas = 4 };
// NVFP4's block-scale rules beside the plain one (lowbit.core.scales, lowbit.core.qarray):
// Four Over Six (scales.four_over_six), TetraJet-v2's double-block scales
// (qarray._double_block) and MS-EDEN (scales.ms_eden).
enum Rule { kPlainRule = 0, kFourOverSix = 1, kDoubleBlock = 2, kEden = 3 };
// Four Over Six's block error: summed squared, summed absolute, largest absolute.
enum Metric { kMse = 0, kMae = 1, kMaxError = 2 };

// Per-block factors. MX: v = x * in1 [* in2] [* prescale], y = (q * out1) * out2.
// NVFP4: v = x * in1 [* prescale], zero where in1 == 0, y = (q * out1) * out2 (s, then t).
struct Factors {
  float in1, in2, out1, out2;
  bool finite;
};

struct Config {
  Kind kind;
  ScaleMode mode;
  Grid grid;
  float oas_c;  // OAS's multiplier C (scales.oas_constant), float32
  float prescale;
  bool has_prescale, stochastic, has_tensor_amax;
  Rule rule = kPlainRule;
  Metric metric = kMse;
  int64_t tensor_block = 0;     // kDoubleBlock: elements per outer block along C
  float eden_inv_fp4_max = 0;   // kEden: float32(1) / float32(6 / override)
};

// qarray._mx_scale_exponent, then the exact power-of-two factors of qarray._quantize_blocks.
// Branch-free, so that a loop over blocks vectorises.
template <ScaleMode M>
__attribute__((always_inline)) inline Factors MxFactors(uint32_t amax_bits, const Grid& g,
                                                    float oas_c) {
  Factors f;
  f.finite = amax_bits < kInfBits;
  const float amax = Float(amax_bits);
  const uint32_t mant = amax_bits & 0x7FFFFFu;
  const int exponent = int((amax_bits >> 23) & 0xFFu) - 127;
  int e;
  if constexpr (M == kCeil) {
    e = exponent + (mant != 0 ? 1 : 0) - g.emax;
  } else if constexpr (M == kEven) {
    const uint32_t half = 1u << (23 - g.mbits - 1);
    const uint32_t rounded = (amax_bits + half) & ~((1u << (23 - g.mbits)) - 1u);
    e = int((rounded >> 23) & 0xFFu) - 127 - g.emax;
  } else if constexpr (M == kRceil) {
    e = exponent - g.emax + (mant > (Bits(g.max) & 0x7FFFFFu) ? 1 : 0);
  } else if constexpr (M == kOas) {
    // lowbit.core.scales.mx_scale_exponent("oas"): (amax / max) * C rounded to bfloat16
    // (nearest even), its power of two; a scale of 1 below 2**-63 (all-zero blocks too).
    float s = amax / g.max;
    s = s < 0x1p-63f ? 1.0f : s;
    const uint32_t b = Bits(s * oas_c);
    e = int(((b + 0x7FFFu + ((b >> 16) & 1u)) >> 23) & 0xFFu) - 127;
  } else {
    e = exponent - g.emax;
  }
  if constexpr (M != kOas) e = amax > 0.0f ? e : -127;
  e = std::clamp(e, -127, 127);
  const int d_hi = std::clamp(-e, -126, 127);
  const int s_hi = std::clamp(e, -126, 127);
  f.in1 = Pow2(d_hi);
  f.in2 = Pow2(-e - d_hi);
  f.out1 = f.finite ? Pow2(s_hi) : NAN;
  f.out2 = Pow2(e - s_hi);
  return f;
}

// The NVFP4 block factors of qarray._quantize_blocks: t from the tensor amax, s the block
// scale min((amax / 6) / t, 448) rounded to E4M3 (0 unless t > 0), r = (1 / t) / s (0 where
// s == 0). Non-finite blocks come out NaN whatever these are.
__attribute__((always_inline)) inline Factors Nvfp4Factors(uint32_t amax_bits, float t,
                                                       const Grid& e4m3) {
  Factors f;
  f.finite = amax_bits < kInfBits;
  const float amax = Float(amax_bits);
  const float s_in = t > 0.0f ? std::min((amax / 6.0f) / t, kE4M3Max) : 0.0f;
  const float s = RoundNearest(s_in, e4m3);
  f.in1 = s > 0.0f ? (1.0f / t) / s : 0.0f;
  f.in2 = 1.0f;
  f.out1 = f.finite ? s : NAN;
  f.out2 = t;
  return f;
}

// The double-block factors of qarray._double_block for a block with maxima bits amax_bits
// under the outer scale big = (amax_outer / 448) / 6 (1 where that is 0): s = E4M3((amax / big)
// / 6) (2**-9 where that quotient is 0; amax counts as 0 in a non-finite block), saturating;
// r = 1 / (big * s) (0 where that product is below FLT_MIN); values (q * s) * big.
__attribute__((always_inline)) inline Factors DoubleBlockFactors(uint32_t amax_bits, float big,
                                                             const Grid& e4m3) {
  Factors f;
  f.finite = amax_bits < kInfBits;
  const float amax = f.finite ? Float(amax_bits) : 0.0f;
  const float s_raw = (amax / big) / 6.0f;
  const float s = RoundNearest(Saturate(s_raw == 0.0f ? 0x1p-9f : s_raw, kE4M3Max), e4m3);
  const float prod = big * s;  // below FLT_MIN counts as 0, as in qarray._double_block
  f.in1 = prod >= 0x1p-126f ? 1.0f / prod : 0.0f;
  f.in2 = 1.0f;
  f.out1 = f.finite ? s : NAN;
  f.out2 = big;
  return f;
}

// The outer scale of an outer block whose largest finite |x| has bits amax_bits.
inline float OuterScale(uint32_t amax_bits) {
  const float big = (Float(amax_bits) / kE4M3Max) / 6.0f;
  return big == 0.0f ? 1.0f : big;
}

// One element: scale, round, rescale.
template <Kind K, bool kSR, bool kPrescale>
inline float Element(float x, const Factors& f, uint32_t rbits, const Config& c) {
  float v = x * f.in1;
  if constexpr (K == kMxInt) v = v * f.in2;
  if constexpr (kPrescale) v = v * c.prescale;
  if constexpr (K == kNvfp4) v = f.in1 > 0.0f ? v : 0.0f;  // (kNvfp4Outer: x * 0 stays)
  const float a = Saturate(std::fabs(v), c.grid.max);
  float r;
  if constexpr (kSR) {
    r = RoundStochastic(a, rbits, c.grid);
  } else {
    r = RoundNearest(a, c.grid);
  }
  float y = (WithSign<K == kMxInt>(r, v) * f.out1) * f.out2;
  if constexpr (kPrescale) y = y / c.prescale;
  return y;
}

struct RandomStream {
  uint32_t ka = 0, kb = 0;
  inline uint32_t operator()(uint32_t idx) const { return Fmix32((idx ^ ka) * 0x9E3779B9u + kb); }
};

RandomStream StreamOf(const uint32_t* key) {
  RandomStream s;
  s.ka = Fmix32(key[1] ^ Fmix32(key[0] + 0x7F4A7C15u));
  s.kb = Fmix32(s.ka ^ 0x2545F491u);
  return s;
}

// Runs f(task) for task in [0, n) on the caller and the XLA intra-op pool. Work is split in
// contiguous ranges, one per thread: interleaved small chunks made two threads fault in the
// pages of a fresh output buffer side by side, measured 1.2x slower than halves.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& f) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, f]() {
    FlushDenormals ftz;
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= n) break;
      f(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t k = 0; k < helpers; ++k) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

// Largest |x| bit pattern over n floats (NaN and Inf included: the integer order of
// non-negative floats puts +Inf above every finite value and NaN above +Inf).
inline uint32_t AbsMaxBits(const float* __restrict x, int64_t n) {
  uint32_t acc = 0;
  for (int64_t j = 0; j < n; ++j) acc = std::max(acc, Bits(x[j]) & kAbsMask);
  return acc;
}

// Largest finite |x| bit pattern over n floats (NaN and Inf count as zero).
inline uint32_t FiniteAbsMaxBits(const float* __restrict x, int64_t n) {
  uint32_t acc = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t a = Bits(x[j]) & kAbsMask;
    acc = std::max(acc, a & (0u - uint32_t(a < kInfBits)));
  }
  return acc;
}

// Per-block factors of n blocks with maxima m, as four arrays (a loop that vectorises).
struct FactorArrays {
  std::vector<float> in1, in2, out1, out2;
  explicit FactorArrays(int64_t n) : in1(n), in2(n), out1(n), out2(n) {}
};

template <ScaleMode M>
void MxFactorsOf(const uint32_t* __restrict m, int64_t n, const Grid& g, float oas_c,
                 float* __restrict in1, float* __restrict in2, float* __restrict out1,
                 float* __restrict out2) {
  for (int64_t i = 0; i < n; ++i) {
    const Factors f = MxFactors<M>(m[i], g, oas_c);
    in1[i] = f.in1;
    in2[i] = f.in2;
    out1[i] = f.out1;
    out2[i] = f.out2;
  }
}

template <Kind K>
void FactorsOf(const uint32_t* m, int64_t n, const Config& c, float t, const float* tile_t,
               const Grid& e4m3, FactorArrays& out) {
  float* in1 = out.in1.data();
  float* in2 = out.in2.data();
  float* out1 = out.out1.data();
  float* out2 = out.out2.data();
  if constexpr (K == kNvfp4Outer) {
    for (int64_t i = 0; i < n; ++i) {
      const Factors f = DoubleBlockFactors(m[i], tile_t[i], e4m3);
      in1[i] = f.in1;
      in2[i] = f.in2;
      out1[i] = f.out1;
      out2[i] = f.out2;
    }
  } else if constexpr (K == kNvfp4) {
    for (int64_t i = 0; i < n; ++i) {
      const Factors f = Nvfp4Factors(m[i], t, e4m3);
      in1[i] = f.in1;
      in2[i] = f.in2;
      out1[i] = f.out1;
      out2[i] = f.out2;
    }
  } else {
    switch (c.mode) {
      case kCeil:
        MxFactorsOf<kCeil>(m, n, c.grid, c.oas_c, in1, in2, out1, out2);
        break;
      case kEven:
        MxFactorsOf<kEven>(m, n, c.grid, c.oas_c, in1, in2, out1, out2);
        break;
      case kRceil:
        MxFactorsOf<kRceil>(m, n, c.grid, c.oas_c, in1, in2, out1, out2);
        break;
      case kOas:
        MxFactorsOf<kOas>(m, n, c.grid, c.oas_c, in1, in2, out1, out2);
        break;
      default:
        MxFactorsOf<kFloor>(m, n, c.grid, c.oas_c, in1, in2, out1, out2);
    }
  }
}

// --------------------------------------------------------------------------------------------
// The Hadamard butterfly (lowbit.core.hadamard, method="butterfly"), on 8-float vectors (GCC/Clang
// vector extensions: AVX2/AVX-512 on x86, NEON pairs elsewhere).

typedef float V8 __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));

inline V8 Load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store8(float* p, V8 v) { std::memcpy(p, &v, sizeof(v)); }

inline V8 Splat8(float f) { return V8{f, f, f, f, f, f, f, f}; }

// The butterfly stage h (4, 2 or 1) inside a vector: lane i and its partner i ^ h become
// v[i] + v[i + h] (lower) and v[i - h] - v[i] (upper), computed as partner + v * (+-1):
// addition commutes and a - b is a + (-b), exactly.
template <int H>
inline V8 LaneStage(V8 v) {
#if defined(__clang__)
  V8 s;
  if constexpr (H == 4) {
    s = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  } else if constexpr (H == 2) {
    s = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  } else {
    s = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  }
#else
  const V8i partner = {0 ^ H, 1 ^ H, 2 ^ H, 3 ^ H, 4 ^ H, 5 ^ H, 6 ^ H, 7 ^ H};
  const V8 s = __builtin_shuffle(v, partner);
#endif
  const V8 sign = {(0 & H) ? -1.0f : 1.0f, (1 & H) ? -1.0f : 1.0f, (2 & H) ? -1.0f : 1.0f,
                   (3 & H) ? -1.0f : 1.0f, (4 & H) ? -1.0f : 1.0f, (5 & H) ? -1.0f : 1.0f,
                   (6 & H) ? -1.0f : 1.0f, (7 & H) ? -1.0f : 1.0f};
  return s + v * sign;
}

// Butterfly stages h = N/2, ..., 1 over N values (floats, or vectors of independent lanes).
template <int N, int H = N / 2, typename V>
__attribute__((always_inline)) inline void Stages(V* v) {
  if constexpr (H >= 1) {
#pragma GCC unroll 128
    for (int g = 0; g < N; g += 2 * H) {
#pragma GCC unroll 128
      for (int i = g; i < g + H; ++i) {
        const V a = v[i], b = v[i + H];
        v[i] = a + b;
        v[i + H] = a - b;
      }
    }
    Stages<N, H / 2>(v);
  }
}

// The transform of each block of B consecutive floats of x[0, n) into y (n a multiple of B).
template <int B>
void HadamardRow(const float* __restrict x, float* __restrict y, int64_t n,
                 const float* signs, float scale) {
  constexpr int N = B / 8;
  V8 sv[N];
  for (int k = 0; k < N; ++k) sv[k] = signs ? Load8(signs + 8 * k) : Splat8(1.0f);
  const V8 sc = Splat8(scale);
  for (int64_t o = 0; o < n; o += B) {
    V8 v[N];
    for (int k = 0; k < N; ++k) v[k] = Load8(x + o + 8 * k);
    if (signs) {
      for (int k = 0; k < N; ++k) v[k] = v[k] * sv[k];
    }
    Stages<N>(v);  // h = B/2 .. 8: across vectors
    for (int k = 0; k < N; ++k) {
      const V8 w = LaneStage<1>(LaneStage<2>(LaneStage<4>(v[k])));
      Store8(y + o + 8 * k, w * sc);
    }
  }
}

// The first two stages (h = B/2, B/4) of the transform down each column of B rows
// (rows[r][0, n), times the signs when given) into buf (row r at buf + r * ld): rows are read
// four at a time and in order, so the hardware prefetcher follows them.
template <int B>
void HadamardColumnsIn(const float* const* rows, float* __restrict buf, int64_t ld, int64_t n,
                       const float* signs) {
  constexpr int Q4 = B / 4;
  for (int i = 0; i < Q4; ++i) {
    const float* __restrict x0 = rows[i];
    const float* __restrict x1 = rows[i + Q4];
    const float* __restrict x2 = rows[i + 2 * Q4];
    const float* __restrict x3 = rows[i + 3 * Q4];
    float* __restrict y0 = buf + i * ld;
    float* __restrict y1 = buf + (i + Q4) * ld;
    float* __restrict y2 = buf + (i + 2 * Q4) * ld;
    float* __restrict y3 = buf + (i + 3 * Q4) * ld;
    auto pass = [&](float s0, float s1, float s2, float s3, auto with_signs) {
      for (int64_t j = 0; j < n; ++j) {
        float v0 = x0[j], v1 = x1[j], v2 = x2[j], v3 = x3[j];
        if constexpr (decltype(with_signs)::value) {
          v0 = v0 * s0;
          v1 = v1 * s1;
          v2 = v2 * s2;
          v3 = v3 * s3;
        }
        const float t0 = v0 + v2, t2 = v0 - v2, t1 = v1 + v3, t3 = v1 - v3;  // h = B/2
        y0[j] = t0 + t1;                                                      // h = B/4
        y1[j] = t0 - t1;
        y2[j] = t2 + t3;
        y3[j] = t2 - t3;
      }
    };
    if (signs) {
      pass(signs[i], signs[i + Q4], signs[i + 2 * Q4], signs[i + 3 * Q4], std::true_type{});
    } else {
      pass(1.0f, 1.0f, 1.0f, 1.0f, std::false_type{});
    }
  }
}

// The remaining stages (h = N/2, ..., 1) down each column of N rows of buf, in place, then
// the scale: 8 columns at a time in registers.
template <int N>
void HadamardColumnsOut(float* __restrict buf, int64_t ld, int64_t n, float scale) {
  const V8 sc = Splat8(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    V8 v[N];
    for (int r = 0; r < N; ++r) v[r] = Load8(buf + r * ld + j);
    Stages<N>(v);
    for (int r = 0; r < N; ++r) Store8(buf + r * ld + j, v[r] * sc);
  }
  for (; j < n; ++j) {
    float v[N];
    for (int r = 0; r < N; ++r) v[r] = buf[r * ld + j];
    Stages<N>(v);
    for (int r = 0; r < N; ++r) buf[r * ld + j] = v[r] * scale;
  }
}

// The transform down each column of B rows (rows[r][0, n)) into buf (row r at buf + r * ld).
template <int B>
void HadamardColumns(const float* const* rows, float* buf, int64_t ld, int64_t n,
                     const float* signs, float scale) {
  HadamardColumnsIn<B>(rows, buf, ld, n, signs);
  for (int g = 0; g < 4; ++g) HadamardColumnsOut<B / 4>(buf + g * (B / 4) * ld, ld, n, scale);
}

// The Hadamard transform of one call: block size (0: none), signs of each batch element
// (null: none), and float32(1 / sqrt(block)).
struct Hadamard {
  int block = 0;
  const float* signs = nullptr;
  float scale = 1.0f;

  const float* SignsOf(int64_t batch) const { return signs ? signs + batch * block : nullptr; }

  void Row(const float* x, float* y, int64_t n, const float* s) const {
    switch (block) {
      case 16: return HadamardRow<16>(x, y, n, s, scale);
      case 32: return HadamardRow<32>(x, y, n, s, scale);
      case 64: return HadamardRow<64>(x, y, n, s, scale);
      case 128: return HadamardRow<128>(x, y, n, s, scale);
      default: return HadamardRow<256>(x, y, n, s, scale);
    }
  }

  void Columns(const float* const* rows, float* buf, int64_t ld, int64_t n,
               const float* s) const {
    switch (block) {
      case 16: return HadamardColumns<16>(rows, buf, ld, n, s, scale);
      case 32: return HadamardColumns<32>(rows, buf, ld, n, s, scale);
      case 64: return HadamardColumns<64>(rows, buf, ld, n, s, scale);
      case 128: return HadamardColumns<128>(rows, buf, ld, n, s, scale);
      default: return HadamardColumns<256>(rows, buf, ld, n, s, scale);
    }
  }
};

// --------------------------------------------------------------------------------------------
// Walking the array: items (a segment of a band), their rows, and per-worker scratch.

// Floats per item. Rows walk: kRowsChunk of each of the band's rows (in L1 for 1-D blocks,
// like 64 MX blocks of 32; 2-D tiles' block_a rows sit in L2, and long row pieces keep the
// prefetcher streaming: 16x16 NVFP4 tiles measured 1.27-1.30x of x * 2 + 1 against
// 1.30-1.42x with 2048 floats per band). Strided walk: a band segment of rows of `seg`
// columns (L1/L2), larger with a Hadamard block, whose band has `hadamard` rows or more.
constexpr int64_t kRowsChunk = 2048;
constexpr int64_t kStridedChunk = 8192;
constexpr int64_t kStridedHadamardChunk = 32768;

struct Layout {
  // Per batch element: x is [P, A, M, C, Q], tiles (block_a, block_c) over (A, C).
  int64_t P, A, A_pad, M, C, C_pad, Q, block_a, block_c, hadamard;
  int64_t tensor_block = 0;  // double-block scales: the outer block along C (1-D blocks)
  // Derived.
  bool strided = false;   // Q > 1
  bool merged = false;    // rows walk over one row per batch element (1-D blocks, no padding)
  int64_t per_batch = 0;  // P * A * M * C * Q
  int64_t nab = 0;        // tile rows along A
  int64_t group = 0;      // lcm(block_c, hadamard, tensor_block): C-extent aligned to each
  int64_t nbc = 0;        // tile columns along C (C_pad / block_c)
  int64_t ncg = 0;        // strided: bands along C
  int64_t row_len = 0;    // rows: floats per row
  int64_t nbands = 0;     // per batch element
  int64_t seg = 0;        // rows: floats per segment (a multiple of group); strided: columns
  int64_t nseg = 0;       // segments per band
  int64_t max_rows = 0;   // most rows an item has
  int64_t max_tiles = 0;  // most tiles an item has
  int64_t buf_size = 0;   // floats of transformed values an item needs
  int64_t ld = 0;         // strided: floats between the rows of the buffer

  int64_t Items() const { return nbands * nseg; }

  void Derive() {
    strided = Q > 1;
    per_batch = P * A * M * C * Q;
    nab = (A + block_a - 1) / block_a;
    nbc = C_pad / block_c;
    group = std::lcm(block_c, hadamard > 0 ? hadamard : int64_t{1});
    if (tensor_block > 0) group = std::lcm(group, tensor_block);
    if (!strided) {
      // One row per batch element when rows hold whole blocks (and whole outer blocks).
      merged = block_a == 1 && C == C_pad && (tensor_block == 0 || C % tensor_block == 0);
      row_len = merged ? per_batch : C;
      nbands = merged ? 1 : P * nab * M;
      seg = std::max(group, kRowsChunk / group * group);  // per row: block_a rows in L2
      nseg = (row_len + seg - 1) / seg;
      max_rows = block_a;
      max_tiles = (seg + block_c - 1) / block_c;
      buf_size = seg;
    } else {
      merged = false;
      ncg = (C + group - 1) / group;
      nbands = P * nab * M * ncg;
      const int64_t chunk = hadamard > 0 ? kStridedHadamardChunk : kStridedChunk;
      seg = std::min(Q, std::max<int64_t>(16, chunk / (block_a * group) / 16 * 16));
      nseg = (Q + seg - 1) / seg;
      max_rows = block_a * group;
      max_tiles = seg;
      ld = seg + 16;  // rows one cache line apart from a multiple of 4 KiB: no L1 set conflicts
      buf_size = group * ld;
    }
  }
};

// What one worker reuses from item to item.
struct Scratch {
  std::vector<const float*> in;
  std::vector<float*> out;
  std::vector<uint32_t> index;
  std::vector<float> buf;
  std::vector<const float*> buf_rows;
  std::vector<uint32_t> amax;
  FactorArrays fa;

  explicit Scratch(const Layout& L)
      : in(L.max_rows), out(L.max_rows), index(L.max_rows), amax(L.max_tiles),
        fa(L.max_tiles) {
    if (L.hadamard > 0) {
      buf.resize(L.buf_size);
      for (int64_t r = 0; r < (L.strided ? L.group : 1); ++r) {
        buf_rows.push_back(buf.data() + r * L.ld);
      }
    }
  }
};

// One item's rows: `rows` pointers into x (in) and y (out), each with `n` floats, and the
// stochastic-rounding index of each row's first element. Strided: the rows are rc sub-rows
// (along C) of each of rows / rc rows along A; rows walk: rc = 1.
struct ItemRows {
  int64_t batch, rows, n, rc = 1;
};

ItemRows FillItem(const Layout& L, int64_t item, const float* x, float* y, Scratch& s) {
  ItemRows it;
  it.batch = item / L.Items();
  item -= it.batch * L.Items();
  x += it.batch * L.per_batch;
  if (y) y += it.batch * L.per_batch;
  const int64_t band = item / L.nseg, sg = item % L.nseg;
  const int64_t o = sg * L.seg;
  auto put = [&](int64_t r, int64_t offset, int64_t index) {
    s.in[r] = x + offset;
    s.out[r] = y ? y + offset : nullptr;
    s.index[r] = uint32_t(index);
  };
  if (!L.strided) {
    it.n = std::min(L.seg, L.row_len - o);
    if (L.merged) {
      it.rows = 1;
      put(0, o, o);
      return it;
    }
    const int64_t m = band % L.M, t = band / L.M, ab = t % L.nab, p = t / L.nab;
    const int64_t a0 = ab * L.block_a;
    it.rows = std::min(L.block_a, L.A - a0);
    for (int64_t r = 0; r < it.rows; ++r) {
      const int64_t a = a0 + r;
      put(r, ((p * L.A + a) * L.M + m) * L.C + o, ((p * L.A_pad + a) * L.M + m) * L.C_pad + o);
    }
    return it;
  }
  it.n = std::min(L.seg, L.Q - o);
  int64_t t = band;
  const int64_t cg = t % L.ncg;
  t /= L.ncg;
  const int64_t m = t % L.M;
  t /= L.M;
  const int64_t ab = t % L.nab, p = t / L.nab;
  const int64_t a0 = ab * L.block_a, c0 = cg * L.group;
  const int64_t ra = std::min(L.block_a, L.A - a0), rc = std::min(L.group, L.C - c0);
  it.rows = ra * rc;
  it.rc = rc;
  for (int64_t r = 0; r < ra; ++r) {
    const int64_t a = a0 + r;
    for (int64_t j = 0; j < rc; ++j) {
      const int64_t c = c0 + j;
      put(r * rc + j, (((p * L.A + a) * L.M + m) * L.C + c) * L.Q + o,
          (((p * L.A_pad + a) * L.M + m) * L.C_pad + c) * L.Q + o);
    }
  }
  return it;
}

// Transforms an item's rows into s.buf (a Hadamard item: rows walk, one row of n floats;
// strided, `rows` rows of n columns, row r at s.buf_rows[r]).
void TransformItem(const Layout& L, const Hadamard& h, const ItemRows& it, Scratch& s) {
  const float* signs = h.SignsOf(it.batch);
  if (!L.strided) {
    h.Row(s.in[0], s.buf.data(), it.n, signs);
    return;
  }
  for (int64_t k = 0; k < it.rows; k += L.hadamard) {
    h.Columns(s.in.data() + k, s.buf.data() + k * L.ld, L.ld, it.n, signs);
  }
}

// --------------------------------------------------------------------------------------------
// Quantizing tiles

// The elements of one row of n floats in tiles of `width` (kW, when > 0), tile t with factors
// (a1, a2, b1, b2)[t]. Restrict-qualified parameters (and the copies of c and the stream) let
// the compiler keep the constants in registers with no alias checks per tile.
template <Kind K, bool kSR, bool kPrescale, int kW>
inline void QuantizeRow(const float* __restrict xr, float* __restrict yr, uint32_t base,
                        int64_t n, int64_t width, const float* __restrict a1,
                        const float* __restrict a2, const float* __restrict b1,
                        const float* __restrict b2, const Config& config,
                        const RandomStream& stream) {
  const Config c = config;
  const RandomStream st = stream;
  if constexpr (kW == 1) {
    for (int64_t i = 0; i < n; ++i) {
      const Factors f{a1[i], a2[i], b1[i], b2[i], true};
      const uint32_t rbits = kSR ? st(base + uint32_t(i)) : 0u;
      yr[i] = Element<K, kSR, kPrescale>(xr[i], f, rbits, c);
    }
  } else {
    const int64_t w = kW > 0 ? kW : width;
    const int64_t full = n / w, rem = n - full * w;
    for (int64_t b = 0; b < full; ++b) {
      const Factors f{a1[b], a2[b], b1[b], b2[b], true};
      const uint32_t bbase = base + uint32_t(b * w);
      for (int64_t j = 0; j < w; ++j) {
        const uint32_t rbits = kSR ? st(bbase + uint32_t(j)) : 0u;
        yr[b * w + j] = Element<K, kSR, kPrescale>(xr[b * w + j], f, rbits, c);
      }
    }
    if (rem > 0) {
      const Factors f{a1[full], a2[full], b1[full], b2[full], true};
      const uint32_t bbase = base + uint32_t(full * w);
      for (int64_t j = 0; j < rem; ++j) {
        const uint32_t rbits = kSR ? st(bbase + uint32_t(j)) : 0u;
        yr[full * w + j] = Element<K, kSR, kPrescale>(xr[full * w + j], f, rbits, c);
      }
    }
  }
}

// The tiles of `rows` rows of n floats: each tile is `width` consecutive floats (the last
// one possibly shorter) of every row, tile t spanning [t * width, (t + 1) * width). kW > 0
// fixes the width at compile time: 1 (strided: one tile per column, vectorised over
// columns), 16 and 32 (the formats' own, so the per-tile loops unroll). Maxima, then all
// the tiles' factors in one vectorised loop, then the elements; a non-finite tile's out1 is
// NaN, so its elements come out NaN from the arithmetic itself.
template <Kind K, bool kSR, bool kPrescale, int kW>
void QuantizeTiles(const float* const* in, float* const* out, const uint32_t* index,
                   int64_t rows, int64_t n, int64_t width, const Config& c,
                   const RandomStream& stream, float t, const float* tile_t, const Grid& e4m3,
                   Scratch& s) {
  const int64_t w = kW > 0 ? kW : width;
  const int64_t full = n / w, rem = n - full * w, tiles = full + (rem > 0 ? 1 : 0);
  uint32_t* __restrict m = s.amax.data();
  if constexpr (kW == 1) {
    const float* __restrict x0 = in[0];
    for (int64_t i = 0; i < n; ++i) m[i] = Bits(x0[i]) & kAbsMask;
    for (int64_t r = 1; r < rows; ++r) {
      const float* __restrict xr = in[r];
      for (int64_t i = 0; i < n; ++i) m[i] = std::max(m[i], Bits(xr[i]) & kAbsMask);
    }
  } else {
    for (int64_t b = 0; b < full; ++b) m[b] = AbsMaxBits(in[0] + b * w, w);
    if (rem > 0) m[full] = AbsMaxBits(in[0] + full * w, rem);
    for (int64_t r = 1; r < rows; ++r) {
      for (int64_t b = 0; b < full; ++b) m[b] = std::max(m[b], AbsMaxBits(in[r] + b * w, w));
      if (rem > 0) m[full] = std::max(m[full], AbsMaxBits(in[r] + full * w, rem));
    }
  }
  FactorsOf<K>(m, tiles, c, t, tile_t, e4m3, s.fa);
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeRow<K, kSR, kPrescale, kW>(in[r], out[r], index[r], n, w, s.fa.in1.data(),
                                   s.fa.in2.data(), s.fa.out1.data(), s.fa.out2.data(), c,
                                   stream);
  }
}

// --------------------------------------------------------------------------------------------
// The rules that need a block's elements together: Four Over Six (two candidates, the better
// kept) and MS-EDEN (an EDEN factor from block sums, a tensor scale from every block).

// What the rules share across an item's tiles (per batch element, per call).
struct RuleState {
  // Four Over Six: the tensor amax and its (encode, decode) (scales.four_over_six_tensor_scales).
  const float* tamax = nullptr;
  const float* encode = nullptr;
  const float* decode = nullptr;
  // MS-EDEN: pass 1 writes each element's code (sign << 7 | 2|q|; the nl blocks of a lane
  // group from block b hold nl * T codes at b * T, element k of the group's l-th block at
  // k * nl + l) and each block's corrected scale s1 (NaN for a non-finite block, at its
  // index in the per-block array), and each task's largest s1 per batch element; pass 2
  // reads them.
  int pass = 1;
  uint8_t* codes = nullptr;
  float* s1 = nullptr;
  int64_t blocks = 0;       // blocks per batch element
  int64_t nbatch = 1;
  float* s1_max = nullptr;  // [task][batch]
  const float* ts = nullptr;      // per batch: max(s1) / 256
  const float* inv_ts = nullptr;  // per batch: 1 / ts (0 where ts == 0)
};

// --------------------------------------------------------------------------------------------
// The rules' per-block work, one SIMD lane per block. A block of Four Over Six or MS-EDEN
// needs its maximum, then scales, then both candidates or the EDEN factor from block sums:
// one block at a time, that is scalar work and horizontal sums per 16 elements (measured
// 1.9-3.6x of a memory pass for the rules, against 1.2-1.4x for plain NVFP4). Here 16 blocks
// go together, element k of block t0 + l in lane l of vector k (a "lane group"), so every
// per-block step is one vector operation and block_sum's halving tree (e[i] + e[i + n/2])
// adds whole vectors, in its own order. Each lane computes what the scalar definitions above
// compute (RoundNearest, Saturate, WithSign, RoundStochastic), operation for operation;
// where a vector form takes another route it yields the same bits: Saturate is minps
// (a < max ? a : max), RoundNearest's (field + shift) << 23 is formed from the exponent bits
// (the same integer), RoundStochastic's floor of y >= 0 is its truncation.

constexpr int kLanes = 16;
// Strided walk: columns ahead that a lane group's rows are prefetched (16 rows are 16 streams).
constexpr int64_t kPrefetch = 64;
#define LB_INLINE __attribute__((always_inline))
typedef float V16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint8_t B16 __attribute__((vector_size(16)));

inline V16 Load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store16(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }
inline V16 Splat16(float f) { return V16{f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
inline U16 SplatU16(uint32_t u) { return U16{u, u, u, u, u, u, u, u, u, u, u, u, u, u, u, u}; }
inline U16 BitsV(V16 v) { return reinterpret_cast<U16>(v); }
inline V16 FloatV(U16 u) { return reinterpret_cast<V16>(u); }
// m ? a : b per lane, m from a comparison (all ones or zero): a masked blend.
#if defined(__clang__)
inline U16 SelU(I16 m, U16 a, U16 b) {
  const U16 mu = reinterpret_cast<U16>(m);
  return (a & mu) | (b & ~mu);
}
inline V16 Sel(I16 m, V16 a, V16 b) { return FloatV(SelU(m, BitsV(a), BitsV(b))); }
#else
inline U16 SelU(I16 m, U16 a, U16 b) { return m ? a : b; }
inline V16 Sel(I16 m, V16 a, V16 b) { return m ? a : b; }
#endif
// a < b ? a : b (NaN a: b), the semantics of x86's minps; and the unsigned maximum.
#if defined(__AVX512F__)
inline V16 MinLt(V16 a, V16 b) {
  return reinterpret_cast<V16>(_mm512_min_ps(reinterpret_cast<__m512>(a),
                                             reinterpret_cast<__m512>(b)));
}
inline U16 MaxU(U16 a, U16 b) {
  return reinterpret_cast<U16>(_mm512_max_epu32(reinterpret_cast<__m512i>(a),
                                                reinterpret_cast<__m512i>(b)));
}
#else
inline V16 MinLt(V16 a, V16 b) { return Sel(a < b, a, b); }
inline U16 MaxU(U16 a, U16 b) { return SelU(a > b, a, b); }
#endif
// min(a, max) for a >= 0 or NaN, keeping NaN (jnp.minimum), where a NaN can reach a result.
inline V16 SaturateNaNV(V16 a, float max) { return MinLt(Splat16(max), a); }
inline U16 Fmix32V(U16 h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
inline U16 StreamV(const RandomStream& st, U16 idx) {
  return Fmix32V((idx ^ st.ka) * 0x9E3779B9u + st.kb);
}
// RoundNearest for a >= 0: ((field + shift) << 23) is (field << 23) + (shift << 23), and
// field << 23 the exponent bits of a, at least those of emin.
inline V16 RoundNearestV(V16 a, U16 emin_bits, U16 shift_bits) {
  const V16 magic = FloatV(MaxU(BitsV(a) & kInfBits, emin_bits) + shift_bits);
  return (a + magic) - magic;
}
inline V16 RoundNearestV(V16 a, const Grid& g) {
  return RoundNearestV(a, SplatU16(g.emin_field << 23), SplatU16(uint32_t(g.shift) << 23));
}
// RoundStochastic: floor(y) of y = a / step >= 0 (below 2**mbits where it is used) is its
// truncation.
inline V16 RoundStochasticV(V16 a, U16 rbits, const Grid& g) {
  const V16 normal = FloatV((BitsV(a) + (rbits >> uint32_t(32 - g.shift))) & ~g.low);
  const V16 y = a * g.inv_step;
  const V16 fl = __builtin_convertvector(__builtin_convertvector(y, I16), V16);
  const V16 u = __builtin_convertvector(reinterpret_cast<I16>(rbits >> 8u), V16) * 0x1p-24f;
  const V16 sub = (fl + Sel(u < (y - fl), Splat16(1.0f), Splat16(0.0f))) * g.step;
  return Sel(a < g.min_normal, sub, normal);
}
// The bfloat16 rounding (nearest even) of finite non-negative float32 v, as float32
// (scales._bf16).
inline V16 Bf16V(V16 v) {
  const U16 b = BitsV(v);
  return FloatV((b + 0x7FFFu + ((b >> 16) & 1u)) & ~0xFFFFu);
}
// scales._e4m3_stochastic: v >= 0 onto the E4M3 grid, the 20 dropped mantissa bits compared
// with noise16 << 4 inside E4M3's normal range, nearest-even (saturating) elsewhere.
inline V16 E4m3StochasticV(V16 v, U16 noise16, const Grid& e4m3) {
  const U16 bits = BitsV(v), mask = SplatU16(0xFFFFFu);
  const I16 up = (bits & mask) > ((noise16 << 4) & mask);
  const V16 dithered = FloatV(SelU(up, bits | mask, bits & ~mask));
  const I16 inside = (v <= kE4M3Max) & (v >= 0x1p-6f);
  return RoundNearestV(SaturateNaNV(Sel(inside, dithered, v), kE4M3Max), e4m3);
}
inline U16 LaneIndex() { return U16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// lowbit.core.scales.block_sum of e[0, n), in place: while n is even, e[i] += e[i + n/2];
// an odd n adds its elements left to right.
inline V16 TreeSumV(V16* e, int64_t n) {
  while (n > 1) {
    if (n % 2) {
      V16 acc = e[0];
      for (int64_t i = 1; i < n; ++i) acc = acc + e[i];
      return acc;
    }
    const int64_t h = n / 2;
    for (int64_t i = 0; i < h; ++i) e[i] = e[i] + e[i + h];
    n = h;
  }
  return e[0];
}
// block_sum over each lane's (ba, bc) tile, e[a * bc + c] (destroyed): the last in-block dim
// (C) first, then A. `rs` holds ba vectors.
template <int kT>
inline V16 TileSumV(V16* e, int64_t ba, int64_t bc, V16* rs) {
  if constexpr (kT == 16) {  // ba == 1, bc == 16
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) e[i] = e[i] + e[i + 8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) e[i] = e[i] + e[i + 4];
    e[0] = e[0] + e[2];
    e[1] = e[1] + e[3];
    return e[0] + e[1];
  } else {
    if (ba == 1) return TreeSumV(e, bc);
    for (int64_t a = 0; a < ba; ++a) rs[a] = TreeSumV(e + a * bc, bc);
    return TreeSumV(rs, ba);
  }
}

// Swaps bit K of the row index with bit K of the lane index between rows a (bit clear) and
// b (bit set); over K = 8, 4, 2, 1 that transposes 16 x 16.
#define LB_SWAP_A(c) (((c) & K) ? 16 + ((c) ^ K) : (c))
#define LB_SWAP_B(c) (((c) & K) ? 16 + (c) : ((c) ^ K))
template <int K>
inline void SwapStage(V16& a, V16& b) {
#if defined(__clang__)
  const V16 na = __builtin_shufflevector(a, b, LB_SWAP_A(0), LB_SWAP_A(1), LB_SWAP_A(2),
      LB_SWAP_A(3), LB_SWAP_A(4), LB_SWAP_A(5), LB_SWAP_A(6), LB_SWAP_A(7), LB_SWAP_A(8),
      LB_SWAP_A(9), LB_SWAP_A(10), LB_SWAP_A(11), LB_SWAP_A(12), LB_SWAP_A(13), LB_SWAP_A(14),
      LB_SWAP_A(15));
  const V16 nb = __builtin_shufflevector(a, b, LB_SWAP_B(0), LB_SWAP_B(1), LB_SWAP_B(2),
      LB_SWAP_B(3), LB_SWAP_B(4), LB_SWAP_B(5), LB_SWAP_B(6), LB_SWAP_B(7), LB_SWAP_B(8),
      LB_SWAP_B(9), LB_SWAP_B(10), LB_SWAP_B(11), LB_SWAP_B(12), LB_SWAP_B(13), LB_SWAP_B(14),
      LB_SWAP_B(15));
#else
  const I16 ma = {LB_SWAP_A(0), LB_SWAP_A(1), LB_SWAP_A(2), LB_SWAP_A(3), LB_SWAP_A(4),
                  LB_SWAP_A(5), LB_SWAP_A(6), LB_SWAP_A(7), LB_SWAP_A(8), LB_SWAP_A(9),
                  LB_SWAP_A(10), LB_SWAP_A(11), LB_SWAP_A(12), LB_SWAP_A(13), LB_SWAP_A(14),
                  LB_SWAP_A(15)};
  const I16 mb = {LB_SWAP_B(0), LB_SWAP_B(1), LB_SWAP_B(2), LB_SWAP_B(3), LB_SWAP_B(4),
                  LB_SWAP_B(5), LB_SWAP_B(6), LB_SWAP_B(7), LB_SWAP_B(8), LB_SWAP_B(9),
                  LB_SWAP_B(10), LB_SWAP_B(11), LB_SWAP_B(12), LB_SWAP_B(13), LB_SWAP_B(14),
                  LB_SWAP_B(15)};
  const V16 na = __builtin_shuffle(a, b, ma);
  const V16 nb = __builtin_shuffle(a, b, mb);
#endif
  a = na;
  b = nb;
}
#undef LB_SWAP_A
#undef LB_SWAP_B

template <int K>
inline void TransposeStage(V16* r) {
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if ((i & K) == 0) SwapStage<K>(r[i], r[i | K]);
  }
}

// 16 x 16 transposed in registers: 2 x 2 blocks (unpck*ps), 4 x 4 (unpck*pd), then 128-bit
// lanes (shuf_f32x4), cheaper than the two-source permutes of SwapStage.
LB_INLINE inline void Transpose16(V16* r) {
#if defined(__AVX512F__)
  __m512 a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = reinterpret_cast<__m512>(r[i]);
  for (int i = 0; i < 16; i += 2) {
    b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
  }
  auto pd = [](__m512 v) { return _mm512_castps_pd(v); };
  for (int i = 0; i < 16; i += 4) {
    a[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b[i]), pd(b[i + 2])));
    a[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b[i]), pd(b[i + 2])));
    a[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b[i + 1]), pd(b[i + 3])));
    a[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b[i + 1]), pd(b[i + 3])));
  }
  for (int h = 0; h < 16; h += 8) {
    for (int j = 0; j < 4; ++j) {
      b[h + j] = _mm512_shuffle_f32x4(a[h + j], a[h + 4 + j], 0x88);
      b[h + 4 + j] = _mm512_shuffle_f32x4(a[h + j], a[h + 4 + j], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm512_shuffle_f32x4(b[j], b[8 + j], 0x88);
    a[8 + j] = _mm512_shuffle_f32x4(b[j], b[8 + j], 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = reinterpret_cast<V16>(a[i]);
#else
  TransposeStage<8>(r);
  TransposeStage<4>(r);
  TransposeStage<2>(r);
  TransposeStage<1>(r);
#endif
}

// The tiles of one chunk, as QuantizeTiles sees them: rows walk, `rows` rows of n floats in
// tiles of block_c; strided, rows = ra * rc sub-rows (rc along C of each of ra rows along A)
// with one tile per column.
struct Chunk {
  const float* const* in;
  float* const* out;
  const uint32_t* index;
  int64_t rows, rc, n;
  bool strided;
};

// Per-worker buffers of the rules: rows walk, a chunk's tiles tile-major (tile t's elements
// at t * T, in-tile order a * block_c + c, zero-padded), in and out, for tiles other than
// 1-D blocks of 16; a lane group's vectors where T is not fixed at compile time; and per
// tile element the stochastic-rounding index of tile 0 (tile t adds t * step).
struct RuleScratch {
  std::vector<float> xb, yb;
  std::vector<V16> X, Y, e6, e4, q6, q4, rs;  // lane groups: T vectors (rs: block_a)
  std::vector<uint32_t> rowbase;
  explicit RuleScratch(const Layout& L) {
    const int64_t T = L.block_a * L.block_c;
    if (!L.strided) {
      const int64_t cap = ((L.seg + L.block_c - 1) / L.block_c + 1) * T;
      xb.resize(cap);
      yb.resize(cap);
    }
    for (auto* v : {&X, &Y, &e6, &e4, &q6, &q4}) v->resize(T);
    rs.resize(L.block_a);
    rowbase.resize(T);
  }
};

inline int64_t TilesOf(const Layout& L, const Chunk& ch) {
  return ch.strided ? ch.n : (ch.n + L.block_c - 1) / L.block_c;
}

// Whether a chunk's tiles are its one row as it lies (1-D blocks, whole tiles): then the
// tile-major buffers are the input and output rows themselves.
inline bool Direct(const Layout& L, const Chunk& ch) {
  return !ch.strided && L.block_a == 1 && ch.n % L.block_c == 0;
}

// The stochastic-rounding index of each element of the chunk's tile 0 into rs.rowbase (in-tile
// order; tile t adds t * step); returns the step.
inline uint32_t RowBase(const Layout& L, const Chunk& ch, RuleScratch& rs) {
  const int64_t ba = L.block_a, bc = L.block_c, T = ba * bc;
  uint32_t* rb = rs.rowbase.data();
  std::fill(rb, rb + T, 0u);
  if (!ch.strided) {
    for (int64_t a = 0; a < std::min(ba, ch.rows); ++a) {
      for (int64_t j = 0; j < bc; ++j) rb[a * bc + j] = ch.index[a] + uint32_t(j);
    }
    return uint32_t(bc);
  }
  for (int64_t r = 0; r < ch.rows; ++r) rb[(r / ch.rc) * bc + r % ch.rc] = ch.index[r];
  return 1u;
}

// Rows walk: the chunk's tiles into rs.xb, tile-major and zero-padded.
inline void GatherChunk(const Layout& L, const Chunk& ch, int64_t tiles, RuleScratch& rs) {
  const int64_t ba = L.block_a, bc = L.block_c, T = ba * bc;
  float* __restrict xb = rs.xb.data();
  std::fill(xb, xb + tiles * T, 0.0f);
  for (int64_t a = 0; a < std::min(ba, ch.rows); ++a) {
    const float* __restrict src = ch.in[a];
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t w = std::min(bc, ch.n - t * bc);
      for (int64_t j = 0; j < w; ++j) xb[t * T + a * bc + j] = src[t * bc + j];
    }
  }
}

// Rows walk: rs.yb back to the chunk's outputs.
inline void ScatterChunk(const Layout& L, const Chunk& ch, int64_t tiles, const RuleScratch& rs) {
  const int64_t ba = L.block_a, bc = L.block_c, T = ba * bc;
  const float* __restrict yb = rs.yb.data();
  for (int64_t a = 0; a < std::min(ba, ch.rows); ++a) {
    float* __restrict dst = ch.out[a];
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t w = std::min(bc, ch.n - t * bc);
      for (int64_t j = 0; j < w; ++j) dst[t * bc + j] = yb[t * T + a * bc + j];
    }
  }
}

// A chunk's tiles in lane groups: f(X, Y, t0, nl) for the groups of nl <= 16 tiles from tile
// t0, X holding their elements (kIn), Y receiving their outputs (kOut), T vectors each.
// Three ways in and out: rows of 1-D blocks of 16 (16 consecutive blocks, transposed in
// registers), the strided walk (a sub-row's 16 columns are one vector: no transposition),
// and any other tile through the tile-major buffers.
template <int kT, bool kIn, bool kOut, typename F>
void ForLaneGroups(const Layout& L, const Chunk& ch, int64_t tiles, RuleScratch& rs,
                   const F& f) {
  const int64_t ba = L.block_a, bc = L.block_c, T = kT > 0 ? kT : ba * bc;
  V16 xl[kT > 0 ? kT : 1], yl[kT > 0 ? kT : 1];
  V16* X = kT > 0 ? xl : rs.X.data();
  V16* Y = kT > 0 ? yl : rs.Y.data();
  if (ch.strided) {
    const bool covered = ch.rows == T;
    for (int64_t t0 = 0; t0 < tiles; t0 += kLanes) {
      const int64_t nl = std::min<int64_t>(kLanes, tiles - t0);
      if constexpr (kIn) {
        if (!covered || nl < kLanes) std::fill(X, X + T, V16{});
        for (int64_t r = 0; r < ch.rows; ++r) {
          const int64_t k = (r / ch.rc) * bc + r % ch.rc;
          if (nl == kLanes) {
            X[k] = Load16(ch.in[r] + t0);
            __builtin_prefetch(ch.in[r] + t0 + kPrefetch);
          } else {
            for (int64_t l = 0; l < nl; ++l) X[k][l] = ch.in[r][t0 + l];
          }
        }
      }
      f(X, Y, t0, nl);
      if constexpr (kOut) {
        for (int64_t r = 0; r < ch.rows; ++r) {
          const int64_t k = (r / ch.rc) * bc + r % ch.rc;
          if (nl == kLanes) {
            Store16(ch.out[r] + t0, Y[k]);
          } else {
            for (int64_t l = 0; l < nl; ++l) ch.out[r][t0 + l] = Y[k][l];
          }
        }
      }
    }
    return;
  }
  const bool direct = Direct(L, ch);
  if constexpr (kT == 16) {
    if (direct) {  // 1-D blocks of 16 along a row: transposed in registers
      const float* in = ch.in[0];
      float* out = ch.out[0];
      for (int64_t t0 = 0; t0 < tiles; t0 += kLanes) {
        const int64_t nl = std::min<int64_t>(kLanes, tiles - t0);
        if constexpr (kIn) {
          if (nl == kLanes) {
#pragma GCC unroll 16
            for (int b = 0; b < 16; ++b) X[b] = Load16(in + (t0 + b) * 16);
            Transpose16(X);
          } else {
            std::fill(X, X + 16, V16{});
            for (int64_t l = 0; l < nl; ++l) {
              for (int k = 0; k < 16; ++k) X[k][l] = in[(t0 + l) * 16 + k];
            }
          }
        }
        f(X, Y, t0, nl);
        if constexpr (kOut) {
          if (nl == kLanes) {
            Transpose16(Y);
#pragma GCC unroll 16
            for (int b = 0; b < 16; ++b) Store16(out + (t0 + b) * 16, Y[b]);
          } else {
            for (int64_t l = 0; l < nl; ++l) {
              for (int k = 0; k < 16; ++k) out[(t0 + l) * 16 + k] = Y[k][l];
            }
          }
        }
      }
      return;
    }
  }
  // Any other tile: through tile-major buffers (tile t's elements at t * T).
  if (kIn && !direct) GatherChunk(L, ch, tiles, rs);
  const float* xb = direct ? ch.in[0] : rs.xb.data();
  float* yb = direct ? ch.out[0] : rs.yb.data();
  for (int64_t t0 = 0; t0 < tiles; t0 += kLanes) {
    const int64_t nl = std::min<int64_t>(kLanes, tiles - t0);
    if constexpr (kIn) {
      if (nl < kLanes) std::fill(X, X + T, V16{});
      for (int64_t l = 0; l < nl; ++l) {
        const float* __restrict xt = xb + (t0 + l) * T;
        for (int64_t k = 0; k < T; ++k) X[k][l] = xt[k];
      }
    }
    f(X, Y, t0, nl);
    if constexpr (kOut) {
      for (int64_t l = 0; l < nl; ++l) {
        float* __restrict yt = yb + (t0 + l) * T;
        for (int64_t k = 0; k < T; ++k) yt[k] = Y[k][l];
      }
    }
  }
  if (kOut && !direct) ScatterChunk(L, ch, tiles, rs);
}

// Four Over Six (scales.four_over_six) of a lane group: per block the maximum, the scales
// of both candidates from the unrounded hp6 and hp4, each candidate's elements and block
// error, the candidate with the lower error (ties keep 6), its values. The constants are
// local vectors and the group body is inlined, so that they stay in registers.
template <bool kSR, bool kPrescale, int kT, Metric kMetric>
void FourOverSixGroups(const Layout& L, const Chunk& ch, const Config& c, const Grid& e4m3,
                       const RandomStream& stream, float tamax, float decode,
                       float encode, RuleScratch& rs) {
  const int64_t ba = L.block_a, bc = L.block_c, T = kT > 0 ? kT : ba * bc;
  const int64_t tiles = TilesOf(L, ch);
  const uint32_t step = kSR ? RowBase(L, ch, rs) : 0u;
  const uint32_t* __restrict rowbase = rs.rowbase.data();
  const Grid g = c.grid, e4 = e4m3;
  const RandomStream st = stream;
  const V16 gmax = Splat16(g.max), prescale = Splat16(c.prescale);
  const V16 big = Splat16(g.max * 256.0f);  // 6 * FOUR_OVER_SIX_E4M3_BOUND = 1536
  const V16 vtamax = Splat16(tamax), vdecode = Splat16(decode), vencode = Splat16(encode);
  const V16 zero = Splat16(0.0f), one = Splat16(1.0f), e4max = Splat16(kE4M3Max);
  const U16 abs_mask = SplatU16(kAbsMask), sign_bit = SplatU16(kSignBit);
  const U16 g_emin = SplatU16(g.emin_field << 23), g_shift = SplatU16(uint32_t(g.shift) << 23);
  const U16 e4_emin = SplatU16(e4.emin_field << 23);
  const U16 e4_shift = SplatU16(uint32_t(e4.shift) << 23);
  V16 q6l[kT > 0 ? kT : 1], q4l[kT > 0 ? kT : 1], e6l[kT > 0 ? kT : 1], e4l[kT > 0 ? kT : 1];
  V16* q6 = kT > 0 ? q6l : rs.q6.data();
  V16* q4 = kT > 0 ? q4l : rs.q4.data();
  V16* e6 = kT > 0 ? e6l : rs.e6.data();
  V16* e4v = kT > 0 ? e4l : rs.e4.data();
  V16* rsum = rs.rs.data();

  auto candidate = [&](const V16* X, V16 hp, bool four, U16 tile_index, V16* q,
                       V16* e) LB_INLINE {
    const V16 s = RoundNearestV(MinLt(e4max, hp), e4_emin, e4_shift);
    const I16 nz = s > zero;
    const V16 r = Sel(nz, one / (vdecode * Sel(nz, s, one)), zero);
#pragma GCC unroll 16
    for (int64_t k = 0; k < T; ++k) {
      const V16 x = X[k];
      V16 v = x * r;
      if constexpr (kPrescale) v = v * prescale;
      v = Sel(nz, v, zero);
      const V16 a = MinLt(FloatV(BitsV(v) & abs_mask), gmax);
      V16 rq;
      if constexpr (kSR) {
        U16 rbits = StreamV(st, tile_index + rowbase[k]);
        if (four) rbits = Fmix32V(rbits ^ 0x5BD1E995u);
        rq = RoundStochasticV(a, rbits, g);
      } else {
        rq = RoundNearestV(a, g_emin, g_shift);
      }
      const V16 qk = FloatV(BitsV(rq) | (BitsV(v) & sign_bit));
      V16 deq = ((qk * s) * vtamax) / big;
      if constexpr (kPrescale) deq = deq / prescale;
      const V16 d = deq - x;
      q[k] = qk;
      if constexpr (kMetric == kMse) {
        e[k] = d * d;
      } else {
        e[k] = FloatV(BitsV(d) & abs_mask);
      }
    }
    return s;
  };
  auto error = [&](V16* e) LB_INLINE {
    if constexpr (kMetric == kMaxError && kT == 16) {
      // The largest error, NaN if any is: only whether err4 < err6 matters, and a NaN (any
      // NaN) makes that false in every order, so pairs may be combined as a tree.
#pragma GCC unroll 8
      for (int h = 8; h >= 1; h /= 2) {
        for (int i = 0; i < h; ++i) {
          e[i] = Sel((e[i + h] > e[i]) | (e[i + h] != e[i + h]), e[i + h], e[i]);
        }
      }
      return e[0];
    } else if constexpr (kMetric == kMaxError) {
      V16 m = e[0];
      for (int64_t k = 1; k < T; ++k) m = Sel((e[k] > m) | (e[k] != e[k]), e[k], m);
      return m;
    } else {
      return TileSumV<kT>(e, ba, bc, rsum);
    }
  };
  ForLaneGroups<kT, true, true>(L, ch, tiles, rs, [&](const V16* X, V16* Y, int64_t t0,
                                                      int64_t) LB_INLINE {
    U16 m = U16{};
#pragma GCC unroll 16
    for (int64_t k = 0; k < T; ++k) m = MaxU(m, BitsV(X[k]) & abs_mask);
    const I16 finite = m < kInfBits;
    const V16 hp6 = (FloatV(m) / gmax) * vencode;
    const V16 hp4 = hp6 * (Splat16(1.5f) + hp6 * zero);
    const U16 tile_index = (LaneIndex() + uint32_t(t0)) * step;
    const V16 s6 = candidate(X, hp6, false, tile_index, q6, e6);
    const V16 s4 = candidate(X, hp4, true, tile_index, q4, e4v);
    const V16 err6 = error(e6);
    const V16 err4 = error(e4v);
    const I16 pick4 = err4 < err6;
    const V16 s = Sel(finite, Sel(pick4, s4, s6), Splat16(NAN));
#pragma GCC unroll 16
    for (int64_t k = 0; k < T; ++k) {
      V16 y = (Sel(pick4, q4[k], q6[k]) * s) * vdecode;
      if constexpr (kPrescale) y = y / prescale;
      Y[k] = y;
    }
  });
}

template <bool kSR, bool kPrescale, int kT>
void FourOverSixTiles(const Layout& L, const Chunk& ch, const Config& c, const Grid& e4m3,
                      const RandomStream& st, float tamax, float encode, float decode,
                      RuleScratch& rs) {
  switch (c.metric) {
    case kMae:
      return FourOverSixGroups<kSR, kPrescale, kT, kMae>(L, ch, c, e4m3, st, tamax, decode,
                                                         encode, rs);
    case kMaxError:
      return FourOverSixGroups<kSR, kPrescale, kT, kMaxError>(L, ch, c, e4m3, st, tamax,
                                                              decode, encode, rs);
    default:
      return FourOverSixGroups<kSR, kPrescale, kT, kMse>(L, ch, c, e4m3, st, tamax, decode,
                                                         encode, rs);
  }
}

// The index of the block holding the element with padded flat index e, in the per-block
// array (the blocked shape with its in-block dims of size 1, as qarray._eden_blocks draws).
inline int64_t BlockOf(const Layout& L, uint32_t e) {
  int64_t t = e;
  const int64_t q = t % L.Q;
  t /= L.Q;
  const int64_t cc = t % L.C_pad;
  t /= L.C_pad;
  const int64_t m = t % L.M;
  t /= L.M;
  const int64_t a = t % L.A_pad, p = t / L.A_pad;
  return (((p * L.nab + a / L.block_a) * L.M + m) * L.nbc + cc / L.block_c) * L.Q + q;
}

// MS-EDEN's pass 1 over a chunk's tiles (scales.ms_eden_blocks): each tile's codes and
// corrected scale s1; returns the largest s1. A lane group's codes are stored at its first
// block's index times T, element k of lane l at k * nl + l (pass 2 reads the same groups).
template <int kT>
float EdenBlocks(const Layout& L, const Chunk& ch, int64_t batch, const Config& c,
                 RuleState& R, RuleScratch& rs) {
  const int64_t ba = L.block_a, bc = L.block_c, T = kT > 0 ? kT : ba * bc;
  const int64_t tiles = TilesOf(L, ch);
  const int64_t block0 = batch * R.blocks + BlockOf(L, ch.index[0]);
  uint8_t* const codes = R.codes;
  float* const s1_out = R.s1;
  const Grid g = c.grid;
  const V16 gmax = Splat16(g.max), inv_fp4_max = Splat16(c.eden_inv_fp4_max);
  const V16 zero = Splat16(0.0f), one = Splat16(1.0f), two = Splat16(2.0f);
  const U16 abs_mask = SplatU16(kAbsMask), sign_bit = SplatU16(kSignBit);
  const U16 g_emin = SplatU16(g.emin_field << 23), g_shift = SplatU16(uint32_t(g.shift) << 23);
  V16 uul[kT > 0 ? kT : 1], uql[kT > 0 ? kT : 1];
  V16* uu = kT > 0 ? uul : rs.e6.data();
  V16* uq = kT > 0 ? uql : rs.e4.data();
  V16* rsum = rs.rs.data();
  V16 best = zero;
  ForLaneGroups<kT, true, false>(L, ch, tiles, rs, [&](const V16* X, V16*, int64_t t0,
                                                       int64_t nl) LB_INLINE {
    uint8_t* __restrict code = codes + (block0 + t0) * T;
    U16 m = U16{};
#pragma GCC unroll 16
    for (int64_t k = 0; k < T; ++k) m = MaxU(m, BitsV(X[k]) & abs_mask);
    const I16 finite = m < kInfBits;
    const V16 s0 = FloatV(BitsV(FloatV(m) * inv_fp4_max) & 0xFFF80000u);
    const I16 live = s0 > zero;
    const V16 inv0 = Sel(live, one / Sel(live, s0, one), zero);
#pragma GCC unroll 16
    for (int64_t k = 0; k < T; ++k) {
      const V16 u = X[k] * inv0;
      const V16 r = RoundNearestV(MinLt(FloatV(BitsV(u) & abs_mask), gmax), g_emin, g_shift);
      const V16 qk = FloatV(BitsV(r) | (BitsV(u) & sign_bit));
      uu[k] = u * u;
      uq[k] = u * qk;
      // |q| * 2 (r: 0 .. 12, an integer) | sign: the code of scalar EdenBlocks.
      const U16 ck = reinterpret_cast<U16>(__builtin_convertvector(r * two, I16)) |
                     ((BitsV(qk) >> 24) & 0x80u);
      const B16 bytes = __builtin_convertvector(ck, B16);
      if (nl == kLanes) {
        std::memcpy(code + k * kLanes, &bytes, kLanes);
      } else {
        for (int64_t l = 0; l < nl; ++l) code[k * nl + l] = bytes[l];
      }
    }
    const V16 xx = TileSumV<kT>(uu, ba, bc, rsum);
    const V16 xy = TileSumV<kT>(uq, ba, bc, rsum);
    const I16 nz = xy != zero;
    const V16 cf = Sel(nz, xx * (one / Sel(nz, xy, one)), one);
    const V16 s1 = Sel(finite, Bf16V(s0 * cf), zero);
    const I16 valid = reinterpret_cast<I16>(LaneIndex()) < int32_t(nl);
    best = Sel(valid & (best < s1), s1, best);
    const V16 stored = Sel(finite, s1, Splat16(NAN));
    if (nl == kLanes) {
      Store16(s1_out + block0 + t0, stored);
    } else {
      for (int64_t l = 0; l < nl; ++l) s1_out[block0 + t0 + l] = stored[l];
    }
  });
  float out = 0.0f;
  for (int l = 0; l < kLanes; ++l) out = std::max(out, best[l]);
  return out;
}

// MS-EDEN's pass 2 over a chunk's tiles (scales.ms_eden_scales): each block's scale s1 / ts
// rounded stochastically onto E4M3 with 16 random bits of its index, values (q * s) * ts
// from the codes (sign << 7 | 2 |q|).
template <int kT>
void EdenValues(const Layout& L, const Chunk& ch, int64_t batch, const Grid& e4m3,
                const RandomStream& stream, const RuleState& R, RuleScratch& rs) {
  const int64_t T = kT > 0 ? kT : L.block_a * L.block_c;
  const int64_t tiles = TilesOf(L, ch);
  const int64_t b0 = BlockOf(L, ch.index[0]);
  const int64_t block0 = batch * R.blocks + b0;
  const uint8_t* const codes = R.codes;
  const float* const s1_in = R.s1;
  const Grid e4 = e4m3;
  const RandomStream st = stream;
  const V16 ts = Splat16(R.ts[batch]), inv = Splat16(R.inv_ts[batch]), half = Splat16(0.5f);
  ForLaneGroups<kT, false, true>(L, ch, tiles, rs, [&](const V16*, V16* Y, int64_t t0,
                                                       int64_t nl) LB_INLINE {
    V16 sv = V16{};
    if (nl == kLanes) {
      sv = Load16(s1_in + block0 + t0);
    } else {
      for (int64_t l = 0; l < nl; ++l) sv[l] = s1_in[block0 + t0 + l];
    }
    const I16 finite = sv == sv;
    const V16 s1 = Sel(finite, sv, Splat16(0.0f));
    const U16 noise = StreamV(st, LaneIndex() + uint32_t(b0 + t0)) >> 16;
    const V16 s = Sel(finite, E4m3StochasticV(s1 * inv, noise, e4), Splat16(NAN));
    const uint8_t* __restrict code = codes + (block0 + t0) * T;
#pragma GCC unroll 16
    for (int64_t k = 0; k < T; ++k) {
      B16 bytes = B16{};
      if (nl == kLanes) {
        std::memcpy(&bytes, code + k * kLanes, kLanes);
      } else {
        for (int64_t l = 0; l < nl; ++l) bytes[l] = code[k * nl + l];
      }
      const U16 ck = __builtin_convertvector(bytes, U16);
      const V16 mag = __builtin_convertvector(reinterpret_cast<I16>(ck & 0x7Fu), V16) * half;
      const V16 q = FloatV(BitsV(mag) | ((ck & 0x80u) << 24));
      Y[k] = (q * s) * ts;
    }
  });
}

// Items [i0, i1): transform (with a Hadamard block), then quantize into y.
template <Kind K, bool kSR, bool kPrescale, int kW>
void QuantizeItems(int64_t i0, int64_t i1, const Layout& L, const Hadamard& h, const float* x,
                   float* y, const Config& c, const RandomStream* streams,
                   const float* tensor_scales, const Grid& e4m3, RuleState* R, int64_t task) {
  Scratch s(L);
  const Rule rule = c.rule;
  std::unique_ptr<RuleScratch> rs;
  if (rule == kFourOverSix || rule == kEden) rs = std::make_unique<RuleScratch>(L);
  std::vector<float> tile_t, outer;
  std::vector<uint32_t> omax;
  const bool eden2 = rule == kEden && R->pass == 2;
  // 1-D blocks of 16 (NVFP4's own): the lane groups' loops unroll.
  const bool b16 = L.block_a == 1 && L.block_c == 16;
  for (int64_t item = i0; item < i1; ++item) {
    const ItemRows it = FillItem(L, item, x, y, s);
    const RandomStream& stream = streams[it.batch];
    const float t = tensor_scales[it.batch];
    const float* const* in = s.in.data();
    int64_t rows = it.rows;
    if (L.hadamard != 0 && !eden2) {
      TransformItem(L, h, it, s);
      in = s.buf_rows.data();
      if (!L.strided) rows = 1;
    }
    // Double-block: the outer scale of each tile (rows walk) or of each outer block's columns
    // (strided), from the finite maxima of the outer blocks.
    if (rule == kDoubleBlock) {
      const int64_t tb = L.tensor_block, bc = L.block_c;
      if (!L.strided) {
        const int64_t tiles = (it.n + bc - 1) / bc, no = (it.n + tb - 1) / tb;
        tile_t.resize(tiles);
        outer.resize(no);
        for (int64_t j = 0; j < no; ++j) {
          outer[j] = OuterScale(FiniteAbsMaxBits(in[0] + j * tb, std::min(tb, it.n - j * tb)));
        }
        for (int64_t k = 0; k < tiles; ++k) tile_t[k] = outer[k * bc / tb];
      } else {
        const int64_t no = (it.rows + tb - 1) / tb;
        tile_t.resize(no * it.n);
        omax.resize(it.n);
        for (int64_t j = 0; j < no; ++j) {
          std::fill(omax.begin(), omax.end(), 0u);
          for (int64_t r = j * tb; r < std::min(it.rows, (j + 1) * tb); ++r) {
            const float* __restrict xr = in[r];
            for (int64_t k = 0; k < it.n; ++k) {
              const uint32_t a = Bits(xr[k]) & kAbsMask;
              omax[k] = std::max(omax[k], a & (0u - uint32_t(a < kInfBits)));
            }
          }
          for (int64_t k = 0; k < it.n; ++k) tile_t[j * it.n + k] = OuterScale(omax[k]);
        }
      }
    }
    auto chunk = [&](int64_t k, int64_t crows, int64_t rc) {
      const Chunk ch{in + k, s.out.data() + k, s.index.data() + k, crows, rc, it.n, L.strided};
      switch (rule) {
        case kFourOverSix:
          if (b16) {
            FourOverSixTiles<kSR, kPrescale, 16>(L, ch, c, e4m3, stream, R->tamax[it.batch],
                                                 R->encode[it.batch], R->decode[it.batch], *rs);
          } else {
            FourOverSixTiles<kSR, kPrescale, 0>(L, ch, c, e4m3, stream, R->tamax[it.batch],
                                                R->encode[it.batch], R->decode[it.batch], *rs);
          }
          return;
        case kEden:
          if (eden2) {
            if (b16) {
              EdenValues<16>(L, ch, it.batch, e4m3, stream, *R, *rs);
            } else {
              EdenValues<0>(L, ch, it.batch, e4m3, stream, *R, *rs);
            }
          } else {
            float& best = R->s1_max[task * R->nbatch + it.batch];
            best = std::max(best, b16 ? EdenBlocks<16>(L, ch, it.batch, c, *R, *rs)
                                          : EdenBlocks<0>(L, ch, it.batch, c, *R, *rs));
          }
          return;
        default: {
          const float* tt = nullptr;
          if (rule == kDoubleBlock) tt = tile_t.data() + (L.strided ? (k / L.tensor_block) * it.n : 0);
          QuantizeTiles<K, kSR, kPrescale, kW>(ch.in, ch.out, ch.index, crows, it.n,
                                               L.strided ? 1 : L.block_c, c, stream, t, tt,
                                               e4m3, s);
        }
      }
    };
    if (!L.strided || L.group == L.block_c) {
      chunk(0, rows, it.rc);
    } else {  // 1-D blocks under a longer group (Hadamard, outer blocks): one tile per column
      for (int64_t k = 0; k < it.rows; k += L.block_c) {
        const int64_t crows = std::min(L.block_c, it.rows - k);
        chunk(k, crows, crows);
      }
    }
  }
}

// The number of contiguous ranges `items` work items are split into: one per thread, one
// below 2**16 elements.
int64_t TasksOf(ffi::ThreadPool& pool, int64_t items, int64_t elements) {
  const int64_t threads =
      elements < (int64_t{1} << 16) ? 1 : std::max<int64_t>(1, pool.num_threads());
  const int64_t per = (items + threads - 1) / threads;
  return (items + per - 1) / per;
}

// Runs task(i0, i1, k) on the k-th of those ranges, on the caller and the pool, with
// denormals flushed.
template <typename F>
void RunItems(ffi::ThreadPool& pool, int64_t items, int64_t elements, const F& task) {
  const int64_t tasks = TasksOf(pool, items, elements);
  const int64_t per = (items + tasks - 1) / tasks;
  auto range = [&](int64_t k) { task(k * per, std::min(items, (k + 1) * per), k); };
  if (tasks == 1) {
    FlushDenormals ftz;
    range(0);
  } else {
    ParallelFor(pool, tasks, range);
  }
}

template <Kind K, bool kSR, bool kPrescale>
void Dispatch(ffi::ThreadPool& pool, const Layout& L, const Hadamard& h, int64_t nbatch,
              const float* x, float* y, const Config& c, const RandomStream* streams,
              const float* tensor_scales, const Grid& e4m3, RuleState* R) {
  const int64_t items = nbatch * L.Items(), elements = nbatch * L.per_batch;
  auto run = [&](auto width) {
    RunItems(pool, items, elements, [&](int64_t i0, int64_t i1, int64_t k) {
      QuantizeItems<K, kSR, kPrescale, decltype(width)::value>(i0, i1, L, h, x, y, c, streams,
                                                               tensor_scales, e4m3, R, k);
    });
  };
  auto pass = [&] {
    if (L.strided) {
      run(std::integral_constant<int, 1>{});
    } else if (L.block_c == 32) {
      run(std::integral_constant<int, 32>{});
    } else if (L.block_c == 16) {
      run(std::integral_constant<int, 16>{});
    } else {
      run(std::integral_constant<int, 0>{});
    }
  };
  if (c.rule != kEden) {
    pass();
    return;
  }
  // MS-EDEN: pass 1 (codes, corrected scales, their maxima per task), the tensor scales
  // ts = max(s1) * (1 / 256) and 1 / ts, pass 2 (values).
  const int64_t tasks = TasksOf(pool, items, elements);
  std::vector<float> maxima(tasks * nbatch, 0.0f), ts(nbatch), inv(nbatch);
  R->s1_max = maxima.data();
  R->pass = 1;
  pass();
  {
    FlushDenormals ftz;
    for (int64_t b = 0; b < nbatch; ++b) {
      float m = 0.0f;
      for (int64_t k = 0; k < tasks; ++k) m = std::max(m, maxima[k * nbatch + b]);
      ts[b] = m * (1.0f / 256.0f);
      inv[b] = ts[b] > 0.0f ? 1.0f / ts[b] : 0.0f;
    }
  }
  R->ts = ts.data();
  R->inv_ts = inv.data();
  R->pass = 2;
  pass();
}

// The NVFP4 tensor amax of each batch element: the largest finite |x| (NaN and Inf ignored),
// of the transformed values with a Hadamard block.
std::vector<uint32_t> TensorAmax(ffi::ThreadPool& pool, const Layout& L, const Hadamard& h,
                                 int64_t nbatch, const float* x) {
  // Work units: elements of x, or items (each transformed first) with a Hadamard block.
  const int64_t elements = nbatch * L.per_batch;
  const int64_t units = L.hadamard == 0 ? elements : nbatch * L.Items();
  std::vector<std::vector<uint32_t>> partial(TasksOf(pool, units, elements),
                                             std::vector<uint32_t>(nbatch, 0u));
  RunItems(pool, units, elements, [&](int64_t u0, int64_t u1, int64_t k) {
    if (L.hadamard == 0) {
      for (int64_t i = u0; i < u1;) {
        const int64_t b = i / L.per_batch;
        const int64_t end = std::min(u1, (b + 1) * L.per_batch);
        partial[k][b] = std::max(partial[k][b], FiniteAbsMaxBits(x + i, end - i));
        i = end;
      }
      return;
    }
    Scratch s(L);
    for (int64_t item = u0; item < u1; ++item) {
      const ItemRows it = FillItem(L, item, x, nullptr, s);
      TransformItem(L, h, it, s);
      uint32_t acc = 0;
      for (int64_t r = 0; r < (L.strided ? it.rows : 1); ++r) {
        acc = std::max(acc, FiniteAbsMaxBits(s.buf_rows[r], it.n));
      }
      partial[k][it.batch] = std::max(partial[k][it.batch], acc);
    }
  });
  std::vector<uint32_t> out(nbatch, 0u);
  for (const auto& p : partial) {
    for (int64_t b = 0; b < nbatch; ++b) out[b] = std::max(out[b], p[b]);
  }
  return out;
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("lowbit_fake_quantize: " + what);
}

ffi::Error FakeQuantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::F32> tensor_amax,
                            ffi::Buffer<ffi::F32> signs, ffi::ResultBuffer<ffi::F32> y,
                            int32_t kind, int32_t scale_mode, int32_t mbits, int32_t emin,
                            int32_t emax, float max, float oas_c, float prescale,
                            int32_t stochastic, int32_t rule, int32_t metric,
                            int64_t tensor_block, float eden_inv_fp4_max,
                            int32_t has_tensor_amax, int64_t outer, int64_t a_len,
                            int64_t a_pad, int64_t mid, int64_t c_len, int64_t c_pad,
                            int64_t inner, int64_t block_a, int64_t block_c, int32_t hadamard,
                            int32_t has_signs, float hadamard_scale) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t nbatch = static_cast<int64_t>(tensor_amax.element_count());
  if (kind < kMxFloat || kind > kNvfp4 || scale_mode < kFloor || scale_mode > kOas) {
    return Invalid("bad kind or scale_mode");
  }
  if (rule < kPlainRule || rule > kEden || metric < kMse || metric > kMaxError ||
      (rule != kPlainRule && kind != kNvfp4)) {
    return Invalid("bad rule or metric (the rules are NVFP4's)");
  }
  if (rule == kDoubleBlock &&
      (block_a != 1 || tensor_block < block_c || tensor_block % block_c != 0)) {
    return Invalid("double-block scales need 1-D blocks and an outer block (" +
                   std::to_string(tensor_block) + ") that is a multiple of the block (" +
                   std::to_string(block_c) + ")");
  }
  Layout L{outer, a_len, a_pad, mid, c_len, c_pad, inner, block_a, block_c, hadamard};
  L.tensor_block = rule == kDoubleBlock ? tensor_block : 0;
  if (std::min({outer, a_len, mid, c_len, inner, block_a, block_c}) < 1 ||
      a_pad % block_a != 0 || a_pad < a_len || a_pad - a_len >= block_a ||
      c_pad % block_c != 0 || c_pad < c_len || c_pad - c_len >= block_c) {
    return Invalid("bad geometry: axis lengths (" + std::to_string(a_len) + ", " +
                   std::to_string(c_len) + ") padded to (" + std::to_string(a_pad) + ", " +
                   std::to_string(c_pad) + ") must be the next multiples of the block (" +
                   std::to_string(block_a) + ", " + std::to_string(block_c) + ")");
  }
  if (hadamard != 0) {
    if (hadamard < 16 || hadamard > 256 || (hadamard & (hadamard - 1)) != 0) {
      return Invalid("the Hadamard block (" + std::to_string(hadamard) +
                     ") must be a power of two in 16..256");
    }
    if (block_a != 1 || c_len % hadamard != 0) {
      return Invalid("a Hadamard transform needs 1-D blocks along an axis whose length (" +
                     std::to_string(c_len) + ") is a multiple of its block (" +
                     std::to_string(hadamard) + ")");
    }
  }
  L.Derive();
  const int64_t signs_per_batch = has_signs ? hadamard : 1;
  if (nbatch < 1 || static_cast<int64_t>(key.element_count()) != 2 * nbatch ||
      n != nbatch * L.per_batch ||
      static_cast<int64_t>(signs.element_count()) != nbatch * signs_per_batch) {
    return Invalid("x, key, tensor_amax and signs disagree on the batch size");
  }
  if (n == 0) return ffi::Error::Success();
  Config c{static_cast<Kind>(kind),
           static_cast<ScaleMode>(scale_mode),
           Grid(mbits, emin, emax, max),
           oas_c,
           prescale,
           prescale != 1.0f,
           stochastic != 0,
           has_tensor_amax != 0};
  c.rule = static_cast<Rule>(rule);
  c.metric = static_cast<Metric>(metric);
  c.tensor_block = L.tensor_block;
  c.eden_inv_fp4_max = eden_inv_fp4_max;
  const Grid e4m3(3, -6, 8, kE4M3Max);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  Hadamard h;
  h.block = hadamard;
  h.signs = (hadamard != 0 && has_signs) ? signs.typed_data() : nullptr;
  h.scale = hadamard_scale;

  std::vector<RandomStream> streams(nbatch);
  if (c.stochastic || c.rule == kEden) {
    for (int64_t b = 0; b < nbatch; ++b) streams[b] = StreamOf(key.typed_data() + 2 * b);
  }
  std::vector<float> tensor_scales(nbatch, 0.0f), tamaxes(nbatch), encode(nbatch),
      decode(nbatch);
  RuleState R;
  R.nbatch = nbatch;
  if (c.kind == kNvfp4 && (c.rule == kPlainRule || c.rule == kFourOverSix)) {
    std::vector<uint32_t> tamax_bits;
    if (!c.has_tensor_amax) tamax_bits = TensorAmax(pool, L, h, nbatch, xp);
    FlushDenormals ftz;
    for (int64_t b = 0; b < nbatch; ++b) {
      const float tamax = c.has_tensor_amax ? tensor_amax.typed_data()[b] : Float(tamax_bits[b]);
      tensor_scales[b] = tamax / kNvfp4TensorDivisor;
      // scales.four_over_six_tensor_scales: encode = 1536 / tamax, decode = 1 / encode, both
      // 0 where tamax is 0 or encode overflows.
      bool live = tamax > 0.0f;
      const float enc = (c.grid.max * 256.0f) / (live ? tamax : 1.0f);
      live = live && std::isfinite(enc);
      tamaxes[b] = tamax;
      encode[b] = live ? enc : 0.0f;
      decode[b] = live ? 1.0f / enc : 0.0f;
    }
  }
  R.tamax = tamaxes.data();
  R.encode = encode.data();
  R.decode = decode.data();
  std::unique_ptr<uint8_t[]> codes;
  std::unique_ptr<float[]> s1;
  if (c.rule == kEden) {
    R.blocks = L.P * L.nab * L.M * L.nbc * L.Q;
    codes.reset(new uint8_t[nbatch * R.blocks * block_a * block_c]);
    s1.reset(new float[nbatch * R.blocks]);
    R.codes = codes.get();
    R.s1 = s1.get();
  }

  // The runtime kind, rounding and prescale pick one of the compiled instantiations.
  auto run = [&](auto kind, auto sr, auto prescale) {
    Dispatch<decltype(kind)::value, decltype(sr)::value, decltype(prescale)::value>(
        pool, L, h, nbatch, xp, yp, c, streams.data(), tensor_scales.data(), e4m3, &R);
  };
  auto with_prescale = [&](auto kind, auto sr) {
    c.has_prescale ? run(kind, sr, std::true_type{}) : run(kind, sr, std::false_type{});
  };
  auto with_rounding = [&](auto kind) {
    c.stochastic ? with_prescale(kind, std::true_type{}) : with_prescale(kind, std::false_type{});
  };
  switch (c.kind) {
    case kMxInt:
      with_rounding(std::integral_constant<Kind, kMxInt>{});
      break;
    case kNvfp4:
      if (c.rule == kDoubleBlock) {
        with_rounding(std::integral_constant<Kind, kNvfp4Outer>{});
      } else {
        with_rounding(std::integral_constant<Kind, kNvfp4>{});
      }
      break;
    default:
      with_rounding(std::integral_constant<Kind, kMxFloat>{});
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitFakeQuantize, FakeQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U32>>()  // key words, [nbatch, 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // tensor amax, [nbatch]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // signs, [nbatch, b or 1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("scale_mode")
                                  .Attr<int32_t>("mbits")
                                  .Attr<int32_t>("emin")
                                  .Attr<int32_t>("emax")
                                  .Attr<float>("max")
                                  .Attr<float>("oas_c")
                                  .Attr<float>("prescale")
                                  .Attr<int32_t>("stochastic")
                                  .Attr<int32_t>("rule")
                                  .Attr<int32_t>("metric")
                                  .Attr<int64_t>("tensor_block")
                                  .Attr<float>("eden_inv_fp4_max")
                                  .Attr<int32_t>("has_tensor_amax")
                                  .Attr<int64_t>("outer")
                                  .Attr<int64_t>("a_len")
                                  .Attr<int64_t>("a_pad")
                                  .Attr<int64_t>("mid")
                                  .Attr<int64_t>("c_len")
                                  .Attr<int64_t>("c_pad")
                                  .Attr<int64_t>("inner")
                                  .Attr<int64_t>("block_a")
                                  .Attr<int64_t>("block_c")
                                  .Attr<int32_t>("hadamard")
                                  .Attr<int32_t>("has_signs")
                                  .Attr<float>("hadamard_scale"));
