// lowbit's CPU fast path for fake quantization: one pass over memory per block.
//
// XLA:CPU cannot fuse a reduction into its consumer, so the XLA emulation reads every block
// twice (block maxima, then scale and round). This XLA FFI handler does both while the
// block is in L1, for 1-D blocks along one axis. It computes exactly what the XLA path
// (lowbit/qarray.py, lowbit/numerics.py) computes, operation for operation, and
// tests/test_native.py checks that bit for bit; change one, change the other.
//
// Layout. x is float32 [nbatch, outer, L, inner] (row-major, the quantized axis of length L
// already zero-padded to a multiple of the block). A "unit" is `block` consecutive rows of
// one (batch, outer): `block * inner` contiguous floats holding `inner` blocks, one per
// column. nbatch comes from vmap (vmap_method="broadcast_all"): the key and the tensor amax
// carry one entry per batch element, and the stochastic-rounding index restarts at zero in
// each, as in the XLA path under vmap.
//
// Floating point. XLA:CPU runs with denormals flushed (FTZ and DAZ); every worker here sets
// the same mode for the duration of its work, so products, comparisons and roundings agree
// with the XLA path on subnormal inputs and results.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
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

// MurmurHash3's 32-bit finaliser (lowbit.numerics.fmix32).
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

// lowbit.numerics.round_to_grid for |v|, nearest-even: (|v| + M) - M with M from |v|'s own
// exponent field. `a` is finite, non-negative and at most grid.max.
inline float RoundNearest(float a, const Grid& g) {
  uint32_t field = std::max(Bits(a) >> 23, g.emin_field);
  float magic = Float((field + uint32_t(g.shift)) << 23);
  return (a + magic) - magic;
}

// lowbit.numerics.round_to_grid for |v|, stochastic, driven by 32 random bits.
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

enum Kind { kMxFloat = 0, kMxInt = 1, kNvfp4 = 2 };
enum ScaleMode { kFloor = 0, kCeil = 1, kEven = 2, kRceil = 3 };

// Per-block factors. MX: v = x * in1 [* in2] [* gain], y = (q * out1) * out2.
// NVFP4: v = x * in1 [* gain], zero where in1 == 0, y = (q * out1) * out2 (s, then t).
struct Factors {
  float in1, in2, out1, out2;
  bool finite;
};

struct Config {
  Kind kind;
  ScaleMode mode;
  Grid grid;
  int block;
  int64_t length, inner;
  float gain;
  bool has_gain, stochastic, has_tensor_amax;
};

// qarray._mx_scale_exponent, then the exact power-of-two factors of qarray._quantize_blocks.
// Branch-free, so that a loop over blocks vectorises.
template <ScaleMode M>
__attribute__((always_inline)) inline Factors MxFactors(uint32_t amax_bits, const Grid& g) {
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
  } else {
    e = exponent - g.emax;
  }
  e = amax > 0.0f ? e : -127;
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

// One element: scale, round, rescale.
template <Kind K, bool kSR, bool kGain>
inline float Element(float x, const Factors& f, uint32_t rbits, const Config& c) {
  float v = x * f.in1;
  if constexpr (K == kMxInt) v = v * f.in2;
  if constexpr (kGain) v = v * c.gain;
  if constexpr (K == kNvfp4) v = f.in1 > 0.0f ? v : 0.0f;
  const float a = Saturate(std::fabs(v), c.grid.max);
  float r;
  if constexpr (kSR) {
    r = RoundStochastic(a, rbits, c.grid);
  } else {
    r = RoundNearest(a, c.grid);
  }
  float y = (WithSign<K == kMxInt>(r, v) * f.out1) * f.out2;
  if constexpr (kGain) y = y / c.gain;
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
void MxFactorsOf(const uint32_t* __restrict m, int64_t n, const Grid& g, float* __restrict in1,
                 float* __restrict in2, float* __restrict out1, float* __restrict out2) {
  for (int64_t i = 0; i < n; ++i) {
    const Factors f = MxFactors<M>(m[i], g);
    in1[i] = f.in1;
    in2[i] = f.in2;
    out1[i] = f.out1;
    out2[i] = f.out2;
  }
}

template <Kind K>
void FactorsOf(const uint32_t* m, int64_t n, const Config& c, float t, const Grid& e4m3,
               FactorArrays& out) {
  float* in1 = out.in1.data();
  float* in2 = out.in2.data();
  float* out1 = out.out1.data();
  float* out2 = out.out2.data();
  if constexpr (K == kNvfp4) {
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
        MxFactorsOf<kCeil>(m, n, c.grid, in1, in2, out1, out2);
        break;
      case kEven:
        MxFactorsOf<kEven>(m, n, c.grid, in1, in2, out1, out2);
        break;
      case kRceil:
        MxFactorsOf<kRceil>(m, n, c.grid, in1, in2, out1, out2);
        break;
      default:
        MxFactorsOf<kFloor>(m, n, c.grid, in1, in2, out1, out2);
    }
  }
}

// Units whose blocks are contiguous (inner == 1), in chunks of kChunk blocks (8 KiB for
// blocks of 32, in L1): the block maxima, then all their factors in one vectorised loop,
// then the elements. kBlock > 0 fixes the block size at compile time (16 and 32, the
// formats' own), so the per-block loops unroll. A non-finite block's out1 is NaN, so its
// elements come out NaN from the arithmetic itself.
constexpr int64_t kChunk = 64;

template <Kind K, bool kSR, bool kGain, int kBlock>
void QuantizeContiguous(const float* __restrict x, float* __restrict y, int64_t u0, int64_t u1,
                        int64_t units_per_batch, const Config& c, const RandomStream* streams,
                        const float* tensor_scales, const Grid& e4m3) {
  const int block = kBlock > 0 ? kBlock : c.block;
  uint32_t amax[kChunk];
  FactorArrays fa(kChunk);
  for (int64_t u = u0; u < u1;) {
    const int64_t batch = u / units_per_batch;
    const int64_t n = std::min({kChunk, u1 - u, (batch + 1) * units_per_batch - u});
    const float* __restrict xc = x + u * block;
    float* __restrict yc = y + u * block;
    for (int64_t b = 0; b < n; ++b) amax[b] = AbsMaxBits(xc + b * block, block);
    FactorsOf<K>(amax, n, c, tensor_scales[batch], e4m3, fa);
    const RandomStream stream = streams[batch];
    const uint32_t base = uint32_t((u - batch * units_per_batch) * block);
    for (int64_t b = 0; b < n; ++b) {
      const Factors f{fa.in1[b], fa.in2[b], fa.out1[b], fa.out2[b], true};
      const float* __restrict xb = xc + b * block;
      float* __restrict yb = yc + b * block;
      const uint32_t bbase = base + uint32_t(b * block);
      for (int r = 0; r < block; ++r) {
        const uint32_t rbits = kSR ? stream(bbase + uint32_t(r)) : 0u;
        yb[r] = Element<K, kSR, kGain>(xb[r], f, rbits, c);
      }
    }
    u += n;
  }
}

// Units of `block` rows of `inner` floats: `inner` blocks, one per column, processed a row
// at a time across columns (vectorised over columns).
template <Kind K, bool kSR, bool kGain>
void QuantizeStrided(const float* __restrict x, float* __restrict y, int64_t u0, int64_t u1,
                     int64_t units_per_batch, const Config& c, const RandomStream* streams,
                     const float* tensor_scales, const Grid& e4m3) {
  const int block = c.block;
  const int64_t inner = c.inner;
  const int64_t unit_size = block * inner;
  std::vector<uint32_t> amax(inner);
  FactorArrays fa(inner);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t batch = u / units_per_batch;
    const float* __restrict xu = x + u * unit_size;
    float* __restrict yu = y + u * unit_size;
    uint32_t* __restrict m = amax.data();
    for (int64_t i = 0; i < inner; ++i) m[i] = Bits(xu[i]) & kAbsMask;
    for (int r = 1; r < block; ++r) {
      const float* __restrict row = xu + r * inner;
      for (int64_t i = 0; i < inner; ++i) m[i] = std::max(m[i], Bits(row[i]) & kAbsMask);
    }
    FactorsOf<K>(m, inner, c, tensor_scales[batch], e4m3, fa);
    const uint32_t base = uint32_t((u - batch * units_per_batch) * unit_size);
    const RandomStream stream = streams[batch];
    const float* __restrict a1 = fa.in1.data();
    const float* __restrict a2 = fa.in2.data();
    const float* __restrict b1 = fa.out1.data();
    const float* __restrict b2 = fa.out2.data();
    for (int r = 0; r < block; ++r) {
      const float* __restrict xr = xu + r * inner;
      float* __restrict yr = yu + r * inner;
      const uint32_t row_base = base + uint32_t(r * inner);
      for (int64_t i = 0; i < inner; ++i) {
        const Factors f{a1[i], a2[i], b1[i], b2[i], true};
        const uint32_t rbits = kSR ? stream(row_base + uint32_t(i)) : 0u;
        yr[i] = Element<K, kSR, kGain>(xr[i], f, rbits, c);
      }
    }
  }
}

template <Kind K, bool kSR, bool kGain>
void Dispatch(ffi::ThreadPool& pool, const float* x, float* y, int64_t units,
              int64_t units_per_batch, const Config& c, const RandomStream* streams,
              const float* tensor_scales, const Grid& e4m3) {
  const int64_t elements = units * c.block * c.inner;
  const int64_t threads =
      elements < (int64_t{1} << 16) ? 1 : std::max<int64_t>(1, pool.num_threads());
  const int64_t per = (units + threads - 1) / threads;
  const int64_t tasks = (units + per - 1) / per;
  auto task = [&](int64_t t) {
    const int64_t u0 = t * per, u1 = std::min(units, u0 + per);
    if (c.inner > 1) {
      QuantizeStrided<K, kSR, kGain>(x, y, u0, u1, units_per_batch, c, streams, tensor_scales,
                                     e4m3);
    } else if (c.block == 32) {
      QuantizeContiguous<K, kSR, kGain, 32>(x, y, u0, u1, units_per_batch, c, streams,
                                            tensor_scales, e4m3);
    } else if (c.block == 16) {
      QuantizeContiguous<K, kSR, kGain, 16>(x, y, u0, u1, units_per_batch, c, streams,
                                            tensor_scales, e4m3);
    } else {
      QuantizeContiguous<K, kSR, kGain, 0>(x, y, u0, u1, units_per_batch, c, streams,
                                           tensor_scales, e4m3);
    }
  };
  if (tasks == 1) {
    FlushDenormals ftz;
    task(0);
  } else {
    ParallelFor(pool, tasks, task);
  }
}

// The NVFP4 tensor amax of each batch element: the largest finite |x| (NaN and Inf ignored).
void TensorAmax(ffi::ThreadPool& pool, const float* x, int64_t nbatch, int64_t per_batch,
                std::vector<uint32_t>& out) {
  const int64_t total = nbatch * per_batch;
  const int64_t threads =
      total < (int64_t{1} << 16) ? 1 : std::max<int64_t>(1, pool.num_threads());
  const int64_t per = (total + threads - 1) / threads;
  const int64_t tasks = (total + per - 1) / per;
  std::vector<std::vector<uint32_t>> partial(tasks, std::vector<uint32_t>(nbatch, 0u));
  auto task = [&](int64_t t) {
    const int64_t i0 = t * per, i1 = std::min(total, i0 + per);
    for (int64_t i = i0; i < i1;) {
      const int64_t b = i / per_batch;
      const int64_t end = std::min(i1, (b + 1) * per_batch);
      partial[t][b] = std::max(partial[t][b], FiniteAbsMaxBits(x + i, end - i));
      i = end;
    }
  };
  if (tasks == 1) {
    task(0);
  } else {
    ParallelFor(pool, tasks, task);
  }
  out.assign(nbatch, 0u);
  for (const auto& p : partial) {
    for (int64_t b = 0; b < nbatch; ++b) out[b] = std::max(out[b], p[b]);
  }
}

ffi::Error FakeQuantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::F32> tensor_amax,
                            ffi::ResultBuffer<ffi::F32> y, int32_t kind, int32_t scale_mode,
                            int32_t mbits, int32_t emin, int32_t emax, float max, int32_t block,
                            int64_t length, int64_t inner, float gain, int32_t stochastic,
                            int32_t has_tensor_amax) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t nbatch = static_cast<int64_t>(tensor_amax.element_count());
  if (kind < kMxFloat || kind > kNvfp4 || scale_mode < kFloor || scale_mode > kRceil) {
    return ffi::Error::InvalidArgument("lowbit_fake_quantize: bad kind or scale_mode");
  }
  if (block < 1 || length < 1 || inner < 1 || length % block != 0) {
    return ffi::Error::InvalidArgument("lowbit_fake_quantize: the axis length (" +
                                       std::to_string(length) +
                                       ") must be a positive multiple of the block (" +
                                       std::to_string(block) + ")");
  }
  if (nbatch < 1 || static_cast<int64_t>(key.element_count()) != 2 * nbatch ||
      n % (nbatch * length * inner) != 0) {
    return ffi::Error::InvalidArgument(
        "lowbit_fake_quantize: x, key and tensor_amax disagree on the batch size");
  }
  if (n == 0) return ffi::Error::Success();
  Config c{static_cast<Kind>(kind),
           static_cast<ScaleMode>(scale_mode),
           Grid(mbits, emin, emax, max),
           block,
           length,
           inner,
           gain,
           gain != 1.0f,
           stochastic != 0,
           has_tensor_amax != 0};
  const Grid e4m3(3, -6, 8, kE4M3Max);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t per_batch = n / nbatch;
  const int64_t units = n / (int64_t{block} * inner);
  const int64_t units_per_batch = per_batch / (int64_t{block} * inner);

  std::vector<RandomStream> streams(nbatch);
  if (c.stochastic) {
    for (int64_t b = 0; b < nbatch; ++b) streams[b] = StreamOf(key.typed_data() + 2 * b);
  }
  std::vector<float> tensor_scales(nbatch, 0.0f);
  if (c.kind == kNvfp4) {
    FlushDenormals ftz;
    std::vector<uint32_t> tamax_bits;
    if (!c.has_tensor_amax) TensorAmax(pool, xp, nbatch, per_batch, tamax_bits);
    for (int64_t b = 0; b < nbatch; ++b) {
      const float tamax = c.has_tensor_amax ? tensor_amax.typed_data()[b] : Float(tamax_bits[b]);
      tensor_scales[b] = tamax / kNvfp4TensorDivisor;
    }
  }

  // The runtime kind, rounding and gain pick one of the compiled instantiations.
  auto run = [&](auto kind, auto sr, auto gain) {
    Dispatch<decltype(kind)::value, decltype(sr)::value, decltype(gain)::value>(
        pool, xp, yp, units, units_per_batch, c, streams.data(), tensor_scales.data(), e4m3);
  };
  auto with_gain = [&](auto kind, auto sr) {
    c.has_gain ? run(kind, sr, std::true_type{}) : run(kind, sr, std::false_type{});
  };
  auto with_rounding = [&](auto kind) {
    c.stochastic ? with_gain(kind, std::true_type{}) : with_gain(kind, std::false_type{});
  };
  switch (c.kind) {
    case kMxInt:
      with_rounding(std::integral_constant<Kind, kMxInt>{});
      break;
    case kNvfp4:
      with_rounding(std::integral_constant<Kind, kNvfp4>{});
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
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("scale_mode")
                                  .Attr<int32_t>("mbits")
                                  .Attr<int32_t>("emin")
                                  .Attr<int32_t>("emax")
                                  .Attr<float>("max")
                                  .Attr<int32_t>("block")
                                  .Attr<int64_t>("length")
                                  .Attr<int64_t>("inner")
                                  .Attr<float>("gain")
                                  .Attr<int32_t>("stochastic")
                                  .Attr<int32_t>("has_tensor_amax"));
