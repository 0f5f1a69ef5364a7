// CPU reduction kernels.
//
// One generic body, written as plain loops that GCC auto-vectorises, is compiled once per
// instruction set (x86-64-v4 with 512-bit vectors, x86-64-v3, and the build's baseline); the
// best one the running CPU supports is chosen once, on first use. Each dtype is a load/store
// traits type (how an element becomes an accumulator value and back) and each op a functor, so
// dtype x op x ISA costs no hand-written variants.
//
// Work goes in blocks: a block of the accumulator stays in L1 while every source streams through
// it once, in source order, so the combination order per element is the documented left-to-right
// one whatever the block size or ISA, and the ISAs produce the same bytes (NaN payloads aside:
// which of two NaNs a sum keeps follows the compiler's operand order).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/errors.h"
#include "reduce/reduce.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define PLAIT_INLINE inline __attribute__((always_inline))
#else
#define PLAIT_INLINE inline
#endif

namespace plait {
namespace {

// Accumulator bytes per block: small enough that acc and the lines in flight stay in L1. Measured
// on an AVX-512 Xeon VM, f32 sum: 1-8 KiB were within noise in cache and with 8 sources, 16 KiB was
// ~10% slower, and 2 KiB streamed 64 MiB about 15% faster than 4 KiB.
constexpr size_t kBlockBytes = 2048;
// Loops run in fixed-length chunks of this many elements so the vectoriser sees a constant trip
// count, which it vectorises even at -O2 (GCC's "very cheap" cost model); only the last chunk of
// a call is scalar.
constexpr size_t kChunk = 64;

template <class To, class From>
PLAIT_INLINE To bit_cast(From f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast size");
  To t;
  std::memcpy(&t, &f, sizeof t);
  return t;
}

// Element i of an untyped, possibly unaligned buffer. memcpy rather than a typed pointer because
// buffers arrive at any byte offset and a misaligned T* is undefined behaviour.
template <class T>
PLAIT_INLINE T get(const unsigned char* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}
template <class T>
PLAIT_INLINE void put(unsigned char* p, size_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

// Branch-free select for values computed with float arithmetic. With a plain ?: GCC sinks the
// float operation into a branch, and the vectoriser then refuses to if-convert it (float ops may
// trap), leaving the loop scalar.
PLAIT_INLINE uint32_t blend(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

// Portable f16 <-> f32 by bit manipulation (the x86 kernels use F16C, below, and these for tails).
// Not _Float16: GCC 12 vectorises its conversions only with AVX512-FP16, which x86-64-v4 lacks.
// These vectorise on any ISA and ignore the FTZ/DAZ flags. Narrowing gives the same bits as
// vcvtps2ph for all 2^32 inputs (nearest even; NaN made quiet, top payload bits kept); widening
// matches vcvtph2ps except that a signalling NaN stays signalling until the store quiets it.
PLAIT_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t em = h & 0x7fffu;
  // Rebias the exponent by 127-15, or by 255-31 so that inf/NaN stay inf/NaN.
  const uint32_t normal = (em << 13) + (em >= 0x7c00u ? 0x70000000u : 0x38000000u);
  // Subnormals and zero: the 10-bit integer times 2^-24 is exact in float.
  const uint32_t sub = bit_cast<uint32_t>(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  return bit_cast<float>(blend(em < 0x400u, sub, normal) | (uint32_t(h & 0x8000u) << 16));
}

PLAIT_INLINE uint16_t f32_to_f16(float f) {
  const uint32_t u = bit_cast<uint32_t>(f);
  const uint32_t x = u & 0x7fffffffu;
  // >= 2^16 rounds to inf whatever the mantissa; NaN keeps its top payload bits, made quiet.
  const uint32_t big = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  // Normal: rebias, then add half an ulp minus one plus the lowest kept bit (ties to even); a
  // carry out of the mantissa correctly bumps the exponent, up to inf.
  const uint32_t normal = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
  // Below 2^-14 the result is subnormal: adding 0.5f makes the FPU round the bits that fall off
  // to nearest even, leaving the f16 mantissa in the low bits.
  const uint32_t sub = bit_cast<uint32_t>(bit_cast<float>(x) + 0.5f) - 0x3f000000u;
  const uint32_t mag = blend(x < 0x38800000u, sub, x >= 0x47800000u ? big : normal);
  return static_cast<uint16_t>(mag | ((u >> 16) & 0x8000u));
}

PLAIT_INLINE float bf16_to_f32(uint16_t h) { return bit_cast<float>(uint32_t(h) << 16); }

PLAIT_INLINE uint16_t f32_to_bf16(float f) {
  const uint32_t u = bit_cast<uint32_t>(f);
  // Rounding a NaN could carry it into inf, so NaN is truncated and made quiet instead.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

template <class F>
PLAIT_INLINE void each(size_t n, F f) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t k = 0; k < kChunk; ++k) f(i + k);
  for (; i < n; ++i) f(i);
}

// ---- Element traits: the in-memory element and the type it is reduced in. Most convert one
// element at a time (load/store); kByBlock types convert a whole block (widen/narrow).

template <class T>
struct Plain {
  using Acc = T;
  static constexpr size_t kSize = sizeof(T);
  static constexpr bool kByBlock = false;
  static PLAIT_INLINE T load(const unsigned char* p, size_t i) { return get<T>(p, i); }
  static PLAIT_INLINE void store(unsigned char* p, size_t i, T v) { put<T>(p, i, v); }
};

// Any nonzero byte reads as true, so outputs are always 0 or 1 and or/and become max/min.
struct Bool : Plain<uint8_t> {
  static PLAIT_INLINE uint8_t load(const unsigned char* p, size_t i) { return p[i] != 0; }
};

// Half types accumulate in float and round once, at the store.
struct BF16 {
  using Acc = float;
  static constexpr size_t kSize = 2;
  static constexpr bool kByBlock = false;
  static PLAIT_INLINE float load(const unsigned char* p, size_t i) {
    return bf16_to_f32(get<uint16_t>(p, i));
  }
  static PLAIT_INLINE void store(unsigned char* p, size_t i, float v) {
    put<uint16_t>(p, i, f32_to_bf16(v));
  }
};

// f16 converts by block so that the x86 kernels can use F16C, one instruction per 8 or 16
// elements where the bit manipulation takes about 25; it made in-L1 f16 sums about 4x faster.
struct F16Bits {
  using Acc = float;
  static constexpr size_t kSize = 2;
  static constexpr bool kByBlock = true;
  static PLAIT_INLINE void widen(float* out, const unsigned char* in, size_t n) {
    each(n, [&](size_t i) { out[i] = f16_to_f32(get<uint16_t>(in, i)); });
  }
  static PLAIT_INLINE void narrow(unsigned char* out, const float* in, size_t n) {
    each(n, [&](size_t i) { put<uint16_t>(out, i, f32_to_f16(in[i])); });
  }
};

#if defined(__x86_64__) && defined(__GNUC__)
// The instructions round to nearest even, as the bit manipulation that finishes the tail does, so
// every ISA stores the same bytes.
struct F16C256 : F16Bits {
  __attribute__((target("avx,f16c"))) static void widen(float* out, const unsigned char* in,
                                                        size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
    }
    F16Bits::widen(out + i, in + 2 * i, n - i);
  }
  __attribute__((target("avx,f16c"))) static void narrow(unsigned char* out, const float* in,
                                                         size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
    }
    F16Bits::narrow(out + 2 * i, in + i, n - i);
  }
};

// The maskz forms with a full mask, because GCC 12's unmasked ones trip a false
// -Wmaybe-uninitialized (GCC PR 105593).
struct F16C512 : F16Bits {
  __attribute__((target("avx512f"))) static void widen(float* out, const unsigned char* in,
                                                       size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 2 * i));
      _mm512_storeu_ps(out + i, _mm512_maskz_cvtph_ps(0xffff, h));
    }
    F16Bits::widen(out + i, in + 2 * i, n - i);
  }
  __attribute__((target("avx512f"))) static void narrow(unsigned char* out, const float* in,
                                                        size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(in + i),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), h);
    }
    F16Bits::narrow(out + 2 * i, in + i, n - i);
  }
};
#endif

// ---- Ops. Integer arithmetic goes through unsigned (at least unsigned int, so uint8 operands do
// not promote to a signed int that could overflow) because signed overflow is undefined.

template <class T>
using Wide = decltype(std::make_unsigned_t<T>() + 0u);

struct Sum {
  template <class T>
  static PLAIT_INLINE T apply(T a, T b) {
    if constexpr (std::is_integral<T>::value)
      return static_cast<T>(Wide<T>(a) + Wide<T>(b));
    else
      return a + b;
  }
};

struct Prod {
  template <class T>
  static PLAIT_INLINE T apply(T a, T b) {
    if constexpr (std::is_integral<T>::value)
      return static_cast<T>(Wide<T>(a) * Wide<T>(b));
    else
      return a * b;
  }
};

// Float min/max propagate NaN, like numpy.minimum/maximum: if either operand is NaN the result is
// NaN (the earlier operand's when both are). Written as a compare-select plus a NaN fix-up, which
// maps onto vminps/vmaxps and a blend, so it stays vectorised. Between -0 and +0 the later operand
// wins; either is a correct answer and the order is fixed, so ranks still agree bitwise.
struct Min {
  template <class T>
  static PLAIT_INLINE T apply(T a, T b) {
    const T m = a < b ? a : b;
    if constexpr (std::is_floating_point<T>::value)
      return a != a ? a : m;
    else
      return m;
  }
};

struct Max {
  template <class T>
  static PLAIT_INLINE T apply(T a, T b) {
    const T m = a > b ? a : b;
    if constexpr (std::is_floating_point<T>::value)
      return a != a ? a : m;
    else
      return m;
  }
};

struct Args {
  unsigned char* dst;
  const void* const* srcs;
  int nsrc;
  size_t count;
  int divisor;            // > 0 only for avg on a float dtype
  uint32_t partial_srcs;  // bit j: srcs[j] holds partials (see reduce.h)
  bool partial_dst;
};

// Source readers, R being the traits of the form the source is in (an element type, or Plain<Acc>
// for partials). Separate always-inline functions rather than one loop with a per-element test of
// the form, so that every combination is a plain loop the vectoriser takes.
template <class R, class Acc>
PLAIT_INLINE void load_one(Acc* acc, const unsigned char* s, size_t n) {
  each(n, [&](size_t i) { acc[i] = R::load(s, i); });
}
template <class Op, class R0, class R1, class Acc>
PLAIT_INLINE void load_two(Acc* acc, const unsigned char* s0, const unsigned char* s1, size_t n) {
  each(n, [&](size_t i) { acc[i] = Op::apply(R0::load(s0, i), R1::load(s1, i)); });
}
template <class Op, class R, class Acc>
PLAIT_INLINE void fold(Acc* acc, const unsigned char* s, size_t n) {
  each(n, [&](size_t i) { acc[i] = Op::apply(acc[i], R::load(s, i)); });
}

template <class E, class Op>
PLAIT_INLINE void run(const Args& a) {
  using Acc = typename E::Acc;
  using P = Plain<Acc>;  // a partial is the accumulator value itself
  // Partials differ from elements only where the element is narrower than its accumulator; for
  // other types partial() is constant false and the partial paths fold away.
  constexpr bool kPartials = sizeof(Acc) != E::kSize;
  constexpr size_t kBlock = kBlockBytes / sizeof(Acc);
  static_assert(kBlock % kChunk == 0, "blocks must be whole chunks");
  const auto partial = [&](int j) { return kPartials && j < 32 && ((a.partial_srcs >> j) & 1u); };
  const bool partial_dst = kPartials && a.partial_dst;
  // Reading every source into acc before storing is what makes dst == srcs[0] safe.
  alignas(64) Acc acc[kBlock];
  alignas(64) Acc widened[E::kByBlock ? kBlock : 1];
  for (size_t off = 0; off < a.count; off += kBlock) {
    const size_t n = std::min(kBlock, a.count - off);
    const auto src = [&](int j) {
      return static_cast<const unsigned char*>(a.srcs[j]) +
             off * (partial(j) ? sizeof(Acc) : E::kSize);
    };
    const unsigned char* s0 = src(0);
    int j = 1;
    if constexpr (E::kByBlock) {
      if (partial(0))
        load_one<P>(acc, s0, n);
      else
        E::widen(acc, s0, n);
    } else if (a.nsrc > 1) {
      // Folding the second source into the first pass saves a trip through acc: about 10% on
      // in-cache f32 sums and 5% on 64 MiB ones.
      const unsigned char* s1 = src(1);
      if (!partial(0) && !partial(1))
        load_two<Op, E, E>(acc, s0, s1, n);
      else if (!partial(1))
        load_two<Op, P, E>(acc, s0, s1, n);
      else if (!partial(0))
        load_two<Op, E, P>(acc, s0, s1, n);
      else
        load_two<Op, P, P>(acc, s0, s1, n);
      j = 2;
    } else if (partial(0)) {
      load_one<P>(acc, s0, n);
    } else {
      load_one<E>(acc, s0, n);
    }
    for (; j < a.nsrc; ++j) {
      const unsigned char* s = src(j);
      if (partial(j)) {
        fold<Op, P>(acc, s, n);
      } else if constexpr (E::kByBlock) {
        E::widen(widened, s, n);
        each(n, [&](size_t i) { acc[i] = Op::apply(acc[i], widened[i]); });
      } else {
        fold<Op, E>(acc, s, n);
      }
    }
    if constexpr (std::is_floating_point<Acc>::value) {
      // A true division, not a multiply by the reciprocal: 1/3 is inexact and would round twice.
      if (a.divisor > 0) {
        const Acc d = static_cast<Acc>(a.divisor);
        each(n, [&](size_t i) { acc[i] = acc[i] / d; });
      }
    }
    if (partial_dst) {
      unsigned char* d = a.dst + off * sizeof(Acc);
      each(n, [&](size_t i) { P::store(d, i, acc[i]); });
    } else {
      unsigned char* d = a.dst + off * E::kSize;
      if constexpr (E::kByBlock)
        E::narrow(d, acc, n);
      else
        each(n, [&](size_t i) { E::store(d, i, acc[i]); });
    }
  }
}

template <class E>
PLAIT_INLINE void by_op(RedOp op, const Args& a) {
  switch (op) {
    case RedOp::sum:
    case RedOp::avg:
      return run<E, Sum>(a);
    case RedOp::prod:
      return run<E, Prod>(a);
    case RedOp::min:
      return run<E, Min>(a);
    case RedOp::max:
      return run<E, Max>(a);
    case RedOp::kCount:
      return;
  }
}

// Inputs are validated by reduce(); this only routes them.
template <class Half>
PLAIT_INLINE void reduce_any(DType dtype, RedOp op, const Args& a) {
  switch (dtype) {
    case DType::f16:
      return by_op<Half>(op, a);
    case DType::bf16:
      return by_op<BF16>(op, a);
    case DType::f32:
      return by_op<Plain<float>>(op, a);
    case DType::f64:
      return by_op<Plain<double>>(op, a);
    case DType::i8:
      return by_op<Plain<int8_t>>(op, a);
    case DType::u8:
      return by_op<Plain<uint8_t>>(op, a);
    case DType::i32:
      return by_op<Plain<int32_t>>(op, a);
    case DType::i64:
      return by_op<Plain<int64_t>>(op, a);
    case DType::boolean:
      return op == RedOp::sum || op == RedOp::max ? run<Bool, Max>(a) : run<Bool, Min>(a);
    case DType::kCount:
      return;
  }
}

using Kernel = void (*)(DType, RedOp, const Args&);

void reduce_portable(DType dtype, RedOp op, const Args& a) { reduce_any<F16Bits>(dtype, op, a); }

#if defined(__x86_64__) && defined(__GNUC__)
// Same body, compiled for wider ISAs. prefer-vector-width=512 because some -mtune choices
// default to 256-bit vectors even where AVX-512 is available.
__attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))) void reduce_avx512(
    DType dtype, RedOp op, const Args& a) {
  reduce_any<F16C512>(dtype, op, a);
}
__attribute__((target("arch=x86-64-v3"))) void reduce_avx2(DType dtype, RedOp op, const Args& a) {
  reduce_any<F16C256>(dtype, op, a);
}
#endif

struct Isa {
  const char* name;
  Kernel kernel;
};

// PLAIT_REDUCE_ISA=avx2|portable caps the choice, so tests can cover every kernel on one machine;
// it never selects an ISA the CPU lacks.
Isa pick_isa() {
  const char* env = std::getenv("PLAIT_REDUCE_ISA");
  const std::string cap = env ? env : "";
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  // The level names test every feature the matching target() may emit, and OS support for
  // the wider register state.
  const bool v4 = __builtin_cpu_supports("x86-64-v4"), v3 = __builtin_cpu_supports("x86-64-v3");
  if (v4 && cap != "avx2" && cap != "portable") return {"avx512", reduce_avx512};
  if (v3 && cap != "portable") return {"avx2", reduce_avx2};
#endif
  return {"portable", reduce_portable};
}

const Isa& isa() {
  static const Isa chosen = pick_isa();
  return chosen;
}

}  // namespace

void reduce(DType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc, size_t count,
            int avg_divisor, uint32_t partial_srcs, bool partial_dst) {
  if (dtype >= DType::kCount || op >= RedOp::kCount || nsrc < 1) {
    throw InvalidArgument(std::string("reduce: bad arguments: dtype ") + dtype_name(dtype) +
                          ", op " + op_name(op) + ", nsrc " + std::to_string(nsrc) + ", count " +
                          std::to_string(count));
  }
  if (op == RedOp::avg && !is_float(dtype)) {
    throw InvalidArgument(std::string("reduce: avg needs a floating-point dtype, got ") +
                          dtype_name(dtype));
  }
  if (count == 0) return;
  const Args a{static_cast<unsigned char*>(dst),
               srcs,
               nsrc,
               count,
               op == RedOp::avg && avg_divisor > 0 ? avg_divisor : 0,
               partial_srcs,
               partial_dst};
  isa().kernel(dtype, op, a);
}

size_t partial_size(DType dtype) {
  return dtype == DType::f16 || dtype == DType::bf16 ? sizeof(float) : dtype_size(dtype);
}

const char* reduce_isa() { return isa().name; }

}  // namespace plait
