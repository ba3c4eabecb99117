/* 16-lane float32 vectors for triode's C kernels: GCC/Clang vector extensions, which are
 * AVX-512 registers where the CPU has them and pairs or quads of narrower ones elsewhere. */
#ifndef TRIODE_VEC16_H
#define TRIODE_VEC16_H

#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_unaligned __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16_unaligned __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline f32x16 load_f32(const float *p) { return *(const f32x16_unaligned *)p; }

static inline void store_f32(float *p, f32x16 v) { *(f32x16_unaligned *)p = v; }

/* bfloat16 is the upper half of a float32. GCC widens a 16 x u16 vector in two halves, so
 * with AVX-512 the one instruction that does it is named. */
static inline f32x16 load_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    return (f32x16)(__builtin_convertvector(*(const u16x16_unaligned *)p, u32x16) << 16);
#endif
}

static inline f32x16 splat(float x) { return (f32x16){0} + x; }

/* Lanes of a where mask (all ones or zeros per lane) is set, of b elsewhere. */
static inline f32x16 select(i32x16 mask, f32x16 a, f32x16 b) {
    return (f32x16)(((i32x16)a & mask) | ((i32x16)b & ~mask));
}

#define SHUFFLE __builtin_shufflevector
/* Loops over heads, vectors and a tile's rows: unrolled, so that their arrays are registers. */
#define UNROLL _Pragma("GCC unroll 16")

static inline f32x16 max_of(f32x16 a, f32x16 b) { return select(a > b, a, b); }

/* e^x for x <= 0, 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to r^6
 * (relative error under 1e-7), 2^n put into the exponent bits. Lanes below -87 give about
 * 1.6e-38 instead of underflowing to subnormals. */
static inline f32x16 exp_nonpositive(f32x16 x) {
    x = max_of(x, splat(-87.0f));
    const i32x16 n = __builtin_convertvector(x * 1.44269504f - 0.5f, i32x16);
    const f32x16 nf = __builtin_convertvector(n, f32x16);
    const f32x16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    f32x16 p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (f32x16)((u32x16)p + ((u32x16)n << 23));
}

/* cap * tanh(x / cap), Gemma 2's soft cap on attention scores; tanh|y| = (1 - e) / (1 + e) with
 * e = e^(-2|y|), an argument exp_nonpositive takes. */
static inline f32x16 soft_cap(f32x16 x, float cap) {
    const f32x16 y = x * (1.0f / cap);
    const i32x16 negative = y < 0.0f;
    const f32x16 e = exp_nonpositive(select(negative, y, -y) * 2.0f);
    const f32x16 t = (1.0f - e) / (1.0f + e);
    return select(negative, -t, t) * cap;
}

static inline float lane_max(f32x16 v) {
    v = max_of(v, SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = max_of(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
    v = max_of(v, SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
    return v[0] > v[1] ? v[0] : v[1];
}

static inline float lane_sum(f32x16 v) {
    f32x16 s = v + SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    s = s + SHUFFLE(s, s, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    s = s + SHUFFLE(s, s, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return s[0] + s[1];
}

/* The reduction of 16 partial-sum vectors (one per row) to one vector whose lane t is the sum
 * of row t's lanes: each level adds the two halves of every row's lanes while packing two
 * vectors into one, rows kept in order. pair_rows is the first level, so that callers can
 * reduce rows two at a time instead of holding 16 vectors; finish_rows does the other three. */
static inline f32x16 pair_rows(f32x16 a, f32x16 b) {
    return SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

static inline __attribute__((always_inline)) f32x16 finish_rows(const f32x16 half[8]) {
    f32x16 quarter[4], eighth[2];
    UNROLL
    for (int i = 0; i < 4; i++) {
        const f32x16 a = half[2 * i], b = half[2 * i + 1];
        quarter[i] = SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                     SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    UNROLL
    for (int i = 0; i < 2; i++) {
        const f32x16 a = quarter[2 * i], b = quarter[2 * i + 1];
        eighth[i] = SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                    SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    const f32x16 a = eighth[0], b = eighth[1];
    return SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#endif
