/* float32 vectors as wide as the CPU's registers, for triode's C kernels: GCC/Clang vector
 * extensions of LANES lanes, 16 with AVX-512 and 8 without.
 * Wider than the registers, GCC 12 keeps such a vector in memory, moves it in 8-byte pieces
 * through integer registers, and builds its comparisons and two-vector shuffles from scalar
 * code. With 16 lanes everywhere, the AVX2 build (TRIODE_CPU_ISA=avx2, on an AMD EPYC Zen 5,
 * 2 threads) ran decode attention 6-9x slower than the AVX-512 build, where half-width
 * registers would make it about 2x. At the default model's shape, 30 layers, 16 -> 8 lanes,
 * best of three, alternated twice: a 2048-token prompt float32 3703-3866 -> 1476-1592 ms,
 * bfloat16 3961-4206 -> 1414-1469; 64 decodes of 300 tokens 38.3-41.7 -> 15.8-17.0 and
 * 39.5-46.7 -> 15.0-16.1 (the AVX-512 build: 587-617, 413-422, 11-12, 7.2-8.3). The argmax
 * of 128 rows of 151936 logits took 19-20 ms, now 1.23 (AVX-512: 1.42). */
#ifndef TRIODE_VEC_H
#define TRIODE_VEC_H

#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define LANES 16
#define LANE_INDEX {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#else
#define LANES 8
#define LANE_INDEX {0, 1, 2, 3, 4, 5, 6, 7}
#endif

typedef float f32v __attribute__((vector_size(4 * LANES)));
typedef float f32v_unaligned __attribute__((vector_size(4 * LANES), aligned(4)));
typedef uint16_t u16v_unaligned __attribute__((vector_size(2 * LANES), aligned(2)));
typedef uint32_t u32v __attribute__((vector_size(4 * LANES)));
typedef int32_t i32v __attribute__((vector_size(4 * LANES)));

static inline f32v load_f32(const float *p) { return *(const f32v_unaligned *)p; }

static inline void store_f32(float *p, f32v v) { *(f32v_unaligned *)p = v; }

/* bfloat16 is the upper half of a float32. GCC widens a vector of u16 in two halves, so with
 * AVX-512 or AVX2 the one instruction that does it is named. */
static inline f32v load_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    return (f32v)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    return (f32v)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    return (f32v)(__builtin_convertvector(*(const u16v_unaligned *)p, u32v) << 16);
#endif
}

static inline f32v splat(float x) { return (f32v){0} + x; }

/* a * b + c rounded once. -ffast-math lets GCC fuse `a * b + c` or not, site by site and build
 * by build: in the AVX2 build one path of the LoRA shrink got a multiply and an add where the
 * others fused, and a row's bits then depended on its place in the batch, so the LoRA loops
 * name the fused operation. (Named in attention's dot products, it changed the AVX-512 build's
 * bits, whose chains GCC had reassociated, and slowed it; there the batch-invariance tests
 * check both builds.) */
static inline f32v fma_of(f32v a, f32v b, f32v c) {
#ifdef __AVX512F__
    return (f32v)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (f32v)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* Lanes of a where mask (all ones or zeros per lane) is set, of b elsewhere. */
static inline f32v select(i32v mask, f32v a, f32v b) {
    return (f32v)(((i32v)a & mask) | ((i32v)b & ~mask));
}

/* All ones in lanes 0 to count - 1, zeros in the rest. */
static inline i32v lanes_below(int count) {
    const i32v lane = LANE_INDEX;
    return lane < count;
}

#define SHUFFLE __builtin_shufflevector
/* Loops over heads, vectors and a tile's rows: unrolled, so that their arrays are registers. */
#define UNROLL _Pragma("GCC unroll 16")

static inline f32v max_of(f32v a, f32v b) { return select(a > b, a, b); }

/* e^x for x <= 0, lane by lane: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to
 * r^6 (relative error under 1e-7), 2^n put into the exponent bits. Lanes below -87 give about
 * 1.6e-38 instead of underflowing to subnormals. */
static inline f32v exp_nonpositive(f32v x) {
    x = max_of(x, splat(-87.0f));
    const i32v n = __builtin_convertvector(x * 1.44269504f - 0.5f, i32v);
    const f32v nf = __builtin_convertvector(n, f32v);
    const f32v r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    f32v p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (f32v)((u32v)p + ((u32v)n << 23));
}

/* cap * tanh(x / cap), Gemma 2's soft cap on attention scores; tanh|y| = (1 - e) / (1 + e) with
 * e = e^(-2|y|), an argument exp_nonpositive takes. */
static inline f32v soft_cap(f32v x, float cap) {
    const f32v y = x * (1.0f / cap);
    const i32v negative = y < 0.0f;
    const f32v e = exp_nonpositive(select(negative, y, -y) * 2.0f);
    const f32v t = (1.0f - e) / (1.0f + e);
    return select(negative, -t, t) * cap;
}

/* The horizontal max and sum: the upper half of the lanes folded onto the lower, down to two. */
#if LANES == 16
#define FOLD_TO_EIGHT(v, OP)                                                                    \
    v = OP(v, SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
#define FOLD_TO_TWO(v, OP)                                                                      \
    v = OP(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));                   \
    v = OP(v, SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
#else
#define FOLD_TO_EIGHT(v, OP)
#define FOLD_TO_TWO(v, OP)                                                                      \
    v = OP(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3));                                           \
    v = OP(v, SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1));
#endif
static inline f32v add_of(f32v a, f32v b) { return a + b; }

static inline float lane_max(f32v v) {
    FOLD_TO_EIGHT(v, max_of)
    FOLD_TO_TWO(v, max_of)
    return v[0] > v[1] ? v[0] : v[1];
}

static inline float lane_sum(f32v v) {
    FOLD_TO_EIGHT(v, add_of)
    FOLD_TO_TWO(v, add_of)
    return v[0] + v[1];
}

/* The reduction of LANES partial-sum vectors (one per row) to one vector whose lane t is the sum
 * of row t's lanes: each level adds the two halves of every row's lanes while packing two
 * vectors into one, rows kept in order. pair_rows is the first level, so that callers can
 * reduce rows two at a time instead of holding LANES vectors; finish_rows does the others. */
#if LANES == 16
static inline f32v pair_rows(f32v a, f32v b) {
    return SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

static inline __attribute__((always_inline)) f32v finish_rows(const f32v half[8]) {
    f32v quarter[4], eighth[2];
    UNROLL
    for (int i = 0; i < 4; i++) {
        const f32v a = half[2 * i], b = half[2 * i + 1];
        quarter[i] = SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                     SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    UNROLL
    for (int i = 0; i < 2; i++) {
        const f32v a = quarter[2 * i], b = quarter[2 * i + 1];
        eighth[i] = SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                    SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    const f32v a = eighth[0], b = eighth[1];
    return SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
static inline f32v pair_rows(f32v a, f32v b) {
    return SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline __attribute__((always_inline)) f32v finish_rows(const f32v half[4]) {
    f32v quarter[2];
    UNROLL
    for (int i = 0; i < 2; i++) {
        const f32v a = half[2 * i], b = half[2 * i + 1];
        quarter[i] = SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
                     SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
    }
    const f32v a = quarter[0], b = quarter[1];
    return SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

#endif
