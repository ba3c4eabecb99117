/* The vectors of the interleaved kernels (quant_x16.c, quant_x16_tiles.h), by target: with
 * AVX-512 VNNI a tile's 16 rows are one vector of X16_LANES = 16 lanes; with AVX2 they are
 * X16_PARTS = 2 parts of 8 lanes, part h holding rows 8h .. 8h + 7, whose 4 weights each
 * are bytes 32h .. 32h + 31 of every 64-byte weight vector (quant_x16.h), so the layout is the
 * same in every build.
 *
 * Every build computes the same integers and the same float operations lane by lane, so they
 * give the same bits: vpdpbusd's product of 4 unsigned weight bytes and 4 signed activation
 * bytes (AVX-512 VNNI's, or AVX-VNNI's on 8 lanes) is, on AVX2 alone, vpmaddubsw (pairs into
 * int16, exact: no type's weights reach the saturation, and Q8_0's are made signed below) and
 * vpmaddwd into int32; there Q8_0 against wide activations multiplies them whole, as int16, by
 * vpmaddwd (quant_x16_tiles.h).
 */
#ifndef TRIODE_QUANT_X16_VEC_H
#define TRIODE_QUANT_X16_VEC_H

#include <immintrin.h>
#include <stdint.h>

/* Nothing here builds without AVX2 (quant_x16.c then returns NOT_BUILT), and these headers
 * stop such a build. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "q8_activations.h"
#include "quant_blocks.h"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define X16_BUILT 1
#define X16_LANES 16
#define MM(op) _mm512_##op
#define DPBUSD _mm512_dpbusd_epi32
typedef __m512i ivec;
typedef __m512 fvec;
/* Activation rows a tile takes at once: 2 tiles x 4 rows x 2 sums fill 16 of 32 registers. */
#define MAX_ROWS 4
#define FOR_EACH_ROW_COUNT(M, ...) M(1, __VA_ARGS__) M(2, __VA_ARGS__) M(3, __VA_ARGS__) M(4, __VA_ARGS__)
static inline ivec ivec_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline ivec ivec_and(ivec a, ivec b) { return _mm512_and_si512(a, b); }
static inline ivec ivec_or(ivec a, ivec b) { return _mm512_or_si512(a, b); }
static inline ivec ivec_zero(void) { return _mm512_setzero_si512(); }
/* 16 float16 values; 16 bytes as int32 (the low 16 of `v`); 32 signed bytes as int16. */
static inline fvec halves_at(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline ivec widen_bytes(__m128i v) { return _mm512_cvtepu8_epi32(v); }
static inline __m128i bytes_at(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline ivec signed_pairs_at(const uint8_t *p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline ivec pairs_dot(ivec acc, ivec a, ivec b) { return _mm512_dpwssd_epi32(acc, a, b); }
/* Lanes [lo, hi) of y = v + bias (bias may be NULL). */
static inline void store_lanes(float *y, fvec v, const float *bias, int lo, int hi) {
    const __mmask16 lanes = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
    const fvec b = bias ? _mm512_maskz_loadu_ps(lanes, bias) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y, lanes, _mm512_add_ps(v, b));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define X16_BUILT 1
#define X16_LANES 8
#define MM(op) _mm256_##op
#if HAS_VPDPBUSD
/* Intel's cores from Alder Lake on, and its E-core Xeons: vpdpbusd without AVX-512. */
#define DPBUSD _mm256_dpbusd_avx_epi32
#endif
typedef __m256i ivec;
typedef __m256 fvec;
/* 2 parts x 2 rows x 2 sums: 8 of the 16 registers, the weights and constants the rest. */
#define MAX_ROWS 2
#define FOR_EACH_ROW_COUNT(M, ...) M(1, __VA_ARGS__) M(2, __VA_ARGS__)
static inline ivec ivec_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec ivec_and(ivec a, ivec b) { return _mm256_and_si256(a, b); }
static inline ivec ivec_or(ivec a, ivec b) { return _mm256_or_si256(a, b); }
static inline ivec ivec_zero(void) { return _mm256_setzero_si256(); }
static inline fvec halves_at(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec widen_bytes(__m128i v) { return _mm256_cvtepu8_epi32(v); }
static inline __m128i bytes_at(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
static inline ivec signed_pairs_at(const uint8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}
static inline ivec pairs_dot(ivec acc, ivec a, ivec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
static inline void store_lanes(float *y, fvec v, const float *bias, int lo, int hi) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lanes = _mm256_and_si256(_mm256_cmpgt_epi32(index, _mm256_set1_epi32(lo - 1)),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), index));
    const fvec b = bias ? _mm256_maskload_ps(bias, lanes) : _mm256_setzero_ps();
    _mm256_maskstore_ps(y, lanes, _mm256_add_ps(v, b));
}
#endif

#ifdef DPBUSD
/* The running sums of a column's rows, int32 lanes: `dot` of the int8 values, `rest` of wide
 * activations' remainders (quant_x16_tiles.h's sums_add). */
typedef struct {
    ivec dot[MAX_ROWS], rest[MAX_ROWS];
} sums;
/* acc + the products of 4 unsigned bytes of w and 4 signed bytes of x in each lane; for Q8_0
 * (`q8`) w holds q + 128, and the kernel takes 128 * sum(x) off again. */
#define Q8_HOLDS_OFFSET 1
static inline ivec dot4(ivec acc, ivec w, ivec x, int q8) { (void)q8; return DPBUSD(acc, w, x); }
/* vpdpbusd sums into int32 at once: nothing to fold. */
static inline void sums_fold(int rows, int wide, sums *s) { (void)rows, (void)wide, (void)s; }
static inline __attribute__((always_inline)) void sums_clear(const int rows, const int wide, sums *s) {
    UNROLL
    for (int r = 0; r < rows; r++) {
        s->dot[r] = ivec_zero();
        if (wide) s->rest[r] = ivec_zero();
    }
}
static inline ivec dot_total(int wide, const sums *s, int r) {
    return wide ? MM(add_epi32)(MM(slli_epi32)(s->dot[r], 7), s->rest[r]) : s->dot[r];
}

#elif defined(X16_BUILT)
/* `dot` and `rest` are int16 lanes, a pair per row, that vpmaddubsw's products go into;
 * sums_fold moves them into the int32 `total` (128 * dot + rest) before they could overflow:
 * a product of 4-bit weights is at most 2 * 15 * 127, so a group of 32 weights (8 products)
 * fits, Q5_K's 5 bits allow 4, Q6_K's 6 bits 2, Q8_0's 8 bits 1. Folding per group instead of
 * per product takes one instruction in three off the loop. */
typedef struct {
    ivec dot[MAX_ROWS], rest[MAX_ROWS], total[MAX_ROWS];
} sums;
/* Q8_0's bytes (q + 128) could pass int16 in vpmaddubsw: the signed q = byte ^ 128 goes in as
 * |q| times x with q's sign, and the 128 * sum(x) is never added. */
#define Q8_HOLDS_OFFSET 0
static inline ivec dot4(ivec acc, ivec w, ivec x, int q8) {
    ivec products = _mm256_maddubs_epi16(w, x);
    if (q8) {
        const ivec q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        products = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
    }
    ivec sum = _mm256_add_epi16(acc, products);
    /* Kept in a register as it is: GCC otherwise regroups the chain of integer additions
     * into a tree, computing all of a group's products first, and spills them. */
    __asm__("" : "+x"(sum));
    return sum;
}
static inline ivec folded(int wide, const sums *s, int r) {
    if (!wide) return _mm256_madd_epi16(s->dot[r], _mm256_set1_epi16(1));
    return _mm256_add_epi32(_mm256_madd_epi16(s->dot[r], _mm256_set1_epi16(128)),
                            _mm256_madd_epi16(s->rest[r], _mm256_set1_epi16(1)));
}
static inline __attribute__((always_inline)) void sums_fold(const int rows, const int wide, sums *s) {
    UNROLL
    for (int r = 0; r < rows; r++) {
        s->total[r] = _mm256_add_epi32(s->total[r], folded(wide, s, r));
        s->dot[r] = s->rest[r] = _mm256_setzero_si256();
    }
}
static inline __attribute__((always_inline)) void sums_clear(const int rows, const int wide, sums *s) {
    UNROLL
    for (int r = 0; r < rows; r++) s->dot[r] = s->rest[r] = s->total[r] = _mm256_setzero_si256();
    (void)wide;
}
static inline ivec dot_total(int wide, const sums *s, int r) { return _mm256_add_epi32(s->total[r], folded(wide, s, r)); }
#endif

#ifdef X16_BUILT
#define X16_PARTS (16 / X16_LANES)

/* One part of a tile: the tile's first byte and which X16_LANES rows of its 16. */
typedef struct {
    const uint8_t *tile;
    int part;
} column;

/* A part's bytes of a tile's array that gives each of the 16 rows `bytes` bytes (a weight
 * vector: 4; float16 scales: 2; Q4_K's scale bytes: 1), from `offset`. */
static inline const uint8_t *part_of(column c, int64_t offset, int bytes) {
    return c.tile + offset + (int64_t)c.part * X16_LANES * bytes;
}

#endif

#endif
