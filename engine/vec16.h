/* Vectors for the native kernels (engine/native.py compiles them with this folder on the include path and keys
 * its cache on this file too), in GCC vector extensions: v16, 16 floats (one AVX-512 register), and vk, the
 * target's own width (v16 with AVX-512, 8 floats otherwise; see below), which every hot loop uses: without AVX-512
 * GCC keeps v16 values in memory. */
#ifndef SPLITSERVE_VEC16_H
#define SPLITSERVE_VEC16_H
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16f(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16f(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* a bfloat16's value */
static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 to bfloat16, rounded to nearest even as c10::BFloat16 does; NaN stays a (quiet) NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* the sum of a vector's lanes as a tree of halvings (4 shuffles and adds, not 15 scalar adds) */
static inline float hsum16(v16 v) {
    v += __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

/* 2^f for |f| <= 0.5 by Horner's rule, highest degree first (relative error ~2e-7): the exp(x <= 0) of the
 * attention kernels, x*log2(e) = n + f with 2^n put into the exponent bits */
#define EXP2_POLY {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f, 5.5504108664821580e-2f, \
                   2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f}

/* lanewise a where the mask is set, else b */
static inline v16 pick(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }

/* the largest lane */
static inline float hmax(v16 v) { /* a tree of halvings, as hsum16 (the maximum does not depend on the order) */
    v16 s = __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = pick(s > v, s, v);
    s = __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v = pick(s > v, s, v);
    s = __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v = pick(s > v, s, v);
    return v[0] > v[1] ? v[0] : v[1];
}

/* exp(x) lanewise for x <= 0: x*log2(e) = n + f, |f| <= 0.5, 2^f by EXP2_POLY,
 * 2^n into the exponent bits. n is rounded by truncating t - 0.5 (t <= 0), not
 * by adding and subtracting a large constant, which reassociating compilers fold away. One body for every width
 * (V a float vector, VI the int32 vector of its lanes, PICK their lanewise choice). */
#define DEFINE_EXP_NONPOSITIVE(NAME, V, VI, PICK) \
    static inline V NAME(V x) { \
        const V lo = (V){0} - 87.0f; \
        x = PICK(x < lo, lo, x); \
        const V t = x * 1.44269504088896341f; \
        const VI n = __builtin_convertvector(t - 0.5f, VI); \
        const V f = t - __builtin_convertvector(n, V); \
        static const float c[] = EXP2_POLY; \
        V p = (V){0} + c[0]; \
        for (int i = 1; i < 7; i++) p = p * f + c[i]; \
        return p * (V)((n + 127) << 23); \
    }
DEFINE_EXP_NONPOSITIVE(exp16, v16, v16i, pick)

#ifdef __AVX512F__
#include <immintrin.h>
/* exp(x) lanewise with EXP2_POLY, 2^n applied by VSCALEFPS (no integer round trip) and rounded to nearest, so any
 * sign of x (the clamp at -87 keeps the result a normal float; large x overflows to inf) */
static inline __m512 exp16_scalef(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    static const float c[] = EXP2_POLY;
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}
#endif

/* The target's own vector width, for loops whose vectors must live in registers: GCC keeps a 64-byte vector
 * type in registers only where AVX-512 gives it 64-byte registers and elsewhere holds every such value in memory,
 * loading and storing around each operation (a v16 loop on an AVX2-only Zen 1 host ran 3-8x slower than the same
 * loop on 8-float vectors). So vk is v16 with AVX-512 and 8 floats otherwise; VK is its lane count. */
#ifdef __AVX512F__
#define VK 16
typedef v16 vk;
typedef v16i vki;
static inline float hsumk(vk v) { return hsum16(v); }
static inline float hmaxk(vk v) { return hmax(v); }
#define pickk pick
#define expk exp16
#else
#define VK 8
typedef float vk __attribute__((vector_size(32)));
typedef int32_t vki __attribute__((vector_size(32)));
static inline float hsumk(vk v) { /* hsum16's halving tree on 8 lanes */
    v += __builtin_shuffle(v, (vki){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vki){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vki){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}
static inline vk pickk(vki m, vk a, vk b) { return (vk)(((vki)a & m) | ((vki)b & ~m)); }
static inline float hmaxk(vk v) {
    vk s = __builtin_shuffle(v, (vki){4, 5, 6, 7, 0, 1, 2, 3});
    v = pickk(s > v, s, v);
    s = __builtin_shuffle(v, (vki){2, 3, 0, 1, 6, 7, 4, 5});
    v = pickk(s > v, s, v);
    return v[0] > v[1] ? v[0] : v[1];
}
DEFINE_EXP_NONPOSITIVE(expk, vk, vki, pickk)
#endif

static inline vk loadk(const float *p) {
    vk v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storek(float *p, vk v) { memcpy(p, &v, sizeof v); }

/* c + a * b, one rounding where the target has FMA, as an operation the compiler does not reassociate: native.py
 * builds with -fassociative-math, under which two `acc += x * w` in one loop body may become
 * acc + (x0 * w0 + x1 * w1), a different sum (without FMA, an empty asm keeps each step's result apart). */
#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
static inline vk fmak(vk c, vk a, vk b) {
#if defined(__AVX512F__)
    return (vk)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX__)
    return (vk)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    c += a * b;
    __asm__("" : "+x"(c));
    return c;
#endif
}

/* VK bfloat16 values widened to float32 (a bfloat16 is the top half of a float32). With AVX2 and no AVX-512,
 * one VPMOVZXWD from memory: GCC tuned for Zen 1 split the generic form into two 128-bit halves and a VINSERTI128
 * (the few-rows GEMM over bfloat16 weights at 8-11 rows, 2 threads, Zen 1: 1.15x faster this way). */
#if !defined(__AVX512F__) && defined(__AVX2__)
#include <immintrin.h>
static inline vk loadk_bf16(const uint16_t *p) {
    return (vk)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}

/* Half h of 2 * VK bfloat16 values widened to float32 with one interleave of zeros (no shift): VPUNPCKLWD and
 * VPUNPCKHWD work within 128-bit lanes, so half 0 holds elements 0-3 and 8-11, half 1 elements 4-7 and 12-15.
 * Used where both operands come in that order (the few-rows GEMM widens its x rows into it). */
#define BF16_HALVES 2
static inline vk loadk_bf16_half(const uint16_t *p, const int h) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    return (vk)(h ? _mm256_unpackhi_epi16(z, v) : _mm256_unpacklo_epi16(z, v));
}
#else
static inline vk loadk_bf16(const uint16_t *p) {
    typedef uint32_t u32k __attribute__((vector_size(VK * 4)));
    typedef uint16_t u16k __attribute__((vector_size(VK * 2)));
    u16k h;
    memcpy(&h, p, sizeof h);
    return (vk)(__builtin_convertvector(h, u32k) << 16);
}

#define BF16_HALVES 1 /* loadk_bf16_half: elements in order, VK at a time */
static inline vk loadk_bf16_half(const uint16_t *p, const int h) { return loadk_bf16(p + h * VK); }
#endif

/* each lane rounded to bfloat16 (to nearest even, as f32_to_bf16), kept as a float32 */
static inline vk roundk_bf16(vk v) {
    const vki u = (vki)v, nan = (u & 0x7fffffff) > 0x7f800000;
    const vki r = (u + 0x7fff + ((u >> 16) & 1)) & (int32_t)0xffff0000u;
    return (vk)((nan & 0x7fc00000) | (r & ~nan));
}

/* VK float32 values rounded to bfloat16 and stored */
static inline void storek_bf16(uint16_t *p, vk v) {
    typedef uint32_t u32k __attribute__((vector_size(VK * 4)));
    typedef uint16_t u16k __attribute__((vector_size(VK * 2)));
    const u16k h = __builtin_convertvector((u32k)roundk_bf16(v) >> 16, u16k);
    memcpy(p, &h, sizeof h);
}
#endif
