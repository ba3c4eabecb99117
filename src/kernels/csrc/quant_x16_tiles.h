/* The arithmetic of one tile of the 16-row interleaved layout (quant_x16.h) against up to
 * MAX_ROWS activation rows, per block type, for quant_x16.c (AVX-512 with VNNI; included only
 * there, inside its build check). Each 64-byte weight vector is 4 weights of each of the 16
 * rows; sums_add multiplies it by 4 broadcast activation bytes with vpdpbusd into 16 int32 row
 * sums (twice with wide activations: the multiples of 128, then the remainders). Scales are
 * applied per group of 32 (per sub-block for the K types) in float, with one vector of the 16
 * rows' scales.
 */
#ifndef TRIODE_QUANT_X16_TILES_H
#define TRIODE_QUANT_X16_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "q8_activations.h"
#include "quant_x16.h"

#define MAX_ROWS 4

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
/* The lines PREFETCH_BYTES past [from, from + bytes): a stream from memory read with this
 * lead ran at 35.6 GB/s on 2 cores here, 27.4 with none or with 4 KiB (the hardware
 * prefetcher alone, or requests so early they were dropped). The K types' tiles are 2-3 KiB,
 * so they ask for each part's lines as they reach it. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *from, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)from + PREFETCH_BYTES + line, _MM_HINT_T0);
}

static inline __m512i nibbles_low(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline __m512i nibbles_high(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline __m512i load64(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline __m512 halves16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* 4 activation bytes broadcast to every lane (vpdpbusd's signed operand). */
static inline __m512i x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
/* Bits `from`, from + 1 of every byte moved to bits `to`, to + 1 (a shift within 16-bit lanes
 * moves no kept bit across a byte: the mask keeps only the moved ones). */
static inline __m512i move_bits(__m512i v, int from, int to, int mask) {
    const __m512i moved = from < to ? _mm512_slli_epi16(v, to - from) : _mm512_srli_epi16(v, from - to);
    return _mm512_and_si512(moved, _mm512_set1_epi8((char)mask));
}

/* The row sums of one tile's group of 32 weights (or a K type's sub-block) against the tile's
 * activation rows: `dot` for the int8 values, and with wide activations (WIDE) `rest` for
 * their remainders; dot_total gives x_q's sum, 128 * dot + rest. */
typedef struct {
    __m512i dot[MAX_ROWS], rest[MAX_ROWS];
} sums;

static inline __attribute__((always_inline)) void sums_clear(const int rows, const int wide, sums *s) {
    UNROLL
    for (int r = 0; r < rows; r++) {
        s->dot[r] = _mm512_setzero_si512();
        if (wide) s->rest[r] = _mm512_setzero_si512();
    }
}

/* 4 weights of each of the 16 rows (unsigned bytes) of `tiles` tiles (1 or 2: two groups of 16
 * rows) times activations [at, at + 4) of every row. Each broadcast of the activations serves
 * every tile: with one tile, a broadcast for each vpdpbusd, the Q4_1 kernel ran at 63% of the
 * rate vpdpbusd alone reaches (Zen 5, 128 rows of the default model's shapes, int16
 * activations); two tiles at a time took it to 71% (653-754 -> 702-820 GFLOP/s, the LM head's
 * Q8_0 759-797 -> 927-935). Four tiles of two rows, or of three, were no faster. */
static inline __attribute__((always_inline)) void sums_add(
    const int rows, const int wide, sums *s, const __m512i *weights, const int tiles, rows_q8 x, int in, int64_t at)
{
    UNROLL
    for (int r = 0; r < rows; r++) {
        const __m512i q = x4(x.q + (int64_t)r * in + at);
        UNROLL
        for (int i = 0; i < tiles; i++) s[i].dot[r] = _mm512_dpbusd_epi32(s[i].dot[r], weights[i], q);
        if (wide) {
            const __m512i lo = x4(x.lo + (int64_t)r * in + at);
            UNROLL
            for (int i = 0; i < tiles; i++) s[i].rest[r] = _mm512_dpbusd_epi32(s[i].rest[r], weights[i], lo);
        }
    }
}

static inline __attribute__((always_inline)) __m512i dot_total(const int wide, const sums *s, int r) {
    return wide ? _mm512_add_epi32(_mm512_slli_epi32(s->dot[r], 7), s->rest[r]) : s->dot[r];
}

/* nibbles32 of each tile's area (area[i] + offset) times activations [at, at + 32) of each row. */
static inline __attribute__((always_inline)) void sums_nibbles(
    const int rows, const int wide, sums *s, const uint8_t *const *area, int64_t offset, const int tiles, rows_q8 x,
    int in, int64_t at)
{
    UNROLL
    for (int v = 0; v < 4; v++) {
        __m512i low[2], high[2];
        UNROLL
        for (int i = 0; i < tiles; i++) {
            const __m512i packed = load64(area[i] + offset + 64 * v);
            low[i] = nibbles_low(packed);
            high[i] = nibbles_high(packed);
        }
        sums_add(rows, wide, s, low, tiles, x, in, at + 8 * v);
        sums_add(rows, wide, s, high, tiles, x, in, at + 8 * v + 4);
    }
}

/* A Q4_0 / Q4_1 / Q8_0 tile's block k into acc, from its integer sums. */
static inline __attribute__((always_inline)) void small_scaled(
    const int type, const int rows, const int wide, rows_q8 x, int in, const uint8_t *t, int k, const sums *s,
    __m512 *acc)
{
    const __m512 d = halves16(t);
    const __m512 m = type == TYPE_Q4_1 ? halves16(t + 32) : _mm512_setzero_ps();
    const int groups = in / 32;
    UNROLL
    for (int r = 0; r < rows; r++) {
        const int32_t sum = x.sum[r * groups + k];
        const float x_scale = x.scale[r * groups + k];
        __m512i dot = dot_total(wide, s, r);
        /* Q8_0 went in as q + 128, Q4_0's value is q - 8: the same integer sum of x off again. */
        if (type == TYPE_Q8_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * sum));
        if (type == TYPE_Q4_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * sum));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x_scale)), acc[r]);
        if (type == TYPE_Q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x_scale * (float)sum), acc[r]);
    }
}

/* Block k (32 weights) of `tiles` Q4_0 / Q4_1 / Q8_0 tiles (t[i]) into acc[i]: each tile's
 * arithmetic is the same in a pair as alone, so are its bits. */
static inline __attribute__((always_inline)) void tile_small(
    const int type, const int rows, const int wide, rows_q8 x, int in, const uint8_t *const *t, const int tiles, int k,
    __m512 acc[][MAX_ROWS])
{
    sums s[2];
    UNROLL
    for (int i = 0; i < tiles; i++) sums_clear(rows, wide, &s[i]);
    if (type == TYPE_Q8_0) {
        UNROLL
        for (int v = 0; v < 8; v++) {
            __m512i weights[2];
            UNROLL
            for (int i = 0; i < tiles; i++) weights[i] = load64(t[i] + X16_SMALL_NIBBLES + 64 * v);
            sums_add(rows, wide, s, weights, tiles, x, in, 32 * k + 4 * v);
        }
    } else {
        sums_nibbles(rows, wide, s, t, type == TYPE_Q4_1 ? X16_Q4_1_NIBBLES : X16_SMALL_NIBBLES, tiles, x, in, 32 * k);
    }
    UNROLL
    for (int i = 0; i < tiles; i++) small_scaled(type, rows, wide, x, in, t[i], k, &s[i], acc[i]);
}

/* The 8 scales and 8 mins (6 bits each) of a Q4_K / Q5_K tile's 16 rows, as 16 int32 lanes
 * each, from the packed bytes laid out 16 rows a vector (quant_blocks.h's k_scale_min). */
static inline __attribute__((always_inline)) void k_scales16(const uint8_t *packed, __m512i *scales, __m512i *mins) {
    __m128i byte[12];
    UNROLL
    for (int i = 0; i < 12; i++) byte[i] = _mm_loadu_si128((const __m128i *)(packed + 16 * i));
    const __m128i six = _mm_set1_epi8(63), four = _mm_set1_epi8(15), two = _mm_set1_epi8(3);
    UNROLL
    for (int j = 0; j < 4; j++) {
        scales[j] = _mm512_cvtepu8_epi32(_mm_and_si128(byte[j], six));
        mins[j] = _mm512_cvtepu8_epi32(_mm_and_si128(byte[j + 4], six));
        const __m128i top_scale = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(byte[j], 6), two), 4);
        const __m128i top_min = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(byte[j + 4], 6), two), 4);
        scales[j + 4] = _mm512_cvtepu8_epi32(_mm_or_si128(_mm_and_si128(byte[j + 8], four), top_scale));
        mins[j + 4] = _mm512_cvtepu8_epi32(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(byte[j + 8], 4), four), top_min));
    }
}

/* Block k (256 weights) of `tiles` Q4_K / Q5_K tiles (t[i]) into acc[i]: w = d * scale * q -
 * dmin * min. A sub-block's sum is scaled in float: with wide activations, 8 of them times
 * 6-bit scales could pass 2^31. */
static inline __attribute__((always_inline)) void tile_k45(
    const int type, const int rows, const int wide, rows_q8 x, int in, const uint8_t *const *t, const int tiles, int k,
    __m512 acc[][MAX_ROWS])
{
    __m512i scales[2][8], mins[2][8];
    __m512 block[2][MAX_ROWS];
    const int64_t nibbles = type == TYPE_Q4_K ? X16_Q4_K_NIBBLES : X16_Q5_K_NIBBLES;
    UNROLL
    for (int i = 0; i < tiles; i++) {
        k_scales16(t[i] + X16_K_SCALES, scales[i], mins[i]);
        UNROLL
        for (int r = 0; r < rows; r++) block[i][r] = _mm512_setzero_ps();
        prefetch_ahead(t[i], nibbles);
    }
    for (int j = 0; j < 8; j++) {
        sums s[2];
        UNROLL
        for (int i = 0; i < tiles; i++) {
            prefetch_ahead(t[i] + nibbles + 256 * j, 256);
            sums_clear(rows, wide, &s[i]);
        }
        if (type == TYPE_Q4_K) {
            sums_nibbles(rows, wide, s, t, nibbles + 256 * j, tiles, x, in, 256 * k + 32 * j);
        } else {
            __m512i high[2];
            UNROLL
            for (int i = 0; i < tiles; i++) {
                prefetch_ahead(t[i] + X16_Q5_K_HIGH + 64 * j, 64);
                high[i] = load64(t[i] + X16_Q5_K_HIGH + 64 * j);
            }
            UNROLL
            for (int v = 0; v < 4; v++) {
                __m512i lo[2], hi[2];
                UNROLL
                for (int i = 0; i < tiles; i++) {
                    const __m512i packed = load64(t[i] + nibbles + 256 * j + 64 * v);
                    lo[i] = _mm512_or_si512(nibbles_low(packed), move_bits(high[i], 2 * v, 4, 0x10));
                    hi[i] = _mm512_or_si512(nibbles_high(packed), move_bits(high[i], 2 * v + 1, 4, 0x10));
                }
                sums_add(rows, wide, s, lo, tiles, x, in, 256 * k + 32 * j + 8 * v);
                sums_add(rows, wide, s, hi, tiles, x, in, 256 * k + 32 * j + 8 * v + 4);
            }
        }
        UNROLL
        for (int i = 0; i < tiles; i++) {
            const __m512 scale = _mm512_cvtepi32_ps(scales[i][j]);
            UNROLL
            for (int r = 0; r < rows; r++)
                block[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_total(wide, &s[i], r)), scale, block[i][r]);
        }
    }
    const int blocks = in / 256, groups = in / 32;
    UNROLL
    for (int i = 0; i < tiles; i++) {
        const __m512 d = halves16(t[i]), dmin = halves16(t[i] + 32);
        UNROLL
        for (int r = 0; r < rows; r++) {
            const int32_t *group_sums = x.sum + r * groups + 8 * k;
            __m512i mins_sum = _mm512_mullo_epi32(mins[i][0], _mm512_set1_epi32(group_sums[0]));
            UNROLL
            for (int j = 1; j < 8; j++)
                mins_sum = _mm512_add_epi32(mins_sum, _mm512_mullo_epi32(mins[i][j], _mm512_set1_epi32(group_sums[j])));
            const __m512 x_scale = _mm512_set1_ps(x.scale[r * blocks + k]);
            acc[i][r] = _mm512_fmadd_ps(block[i][r], _mm512_mul_ps(d, x_scale), acc[i][r]);
            acc[i][r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins_sum), _mm512_mul_ps(dmin, x_scale), acc[i][r]);
        }
    }
}

/* The Q6_K correction's integer sums for group g: scale 2g times the sum of x over weights
 * 0..15, plus scale 2g + 1 times that over 16..31 (the sums of 16 of q, or of lo). */
static inline __m512i q6_scaled_sums(__m512i pairs, const int16_t *sums16) {
    int32_t two;
    memcpy(&two, sums16, 4);
    return _mm512_dpwssd_epi32(_mm512_setzero_si512(), pairs, _mm512_set1_epi32(two));
}

/* Block k of a Q6_K tile into acc: w = d * scale * (q - 32), q taken as 0..63 (unsigned, for
 * vpdpbusd) and 32 * scale * sum(x) over each 16 taken off. */
static inline __attribute__((always_inline)) void tile_q6_k(
    const int rows, const int wide, rows_q8 x, int in, const uint8_t *t, int k, __m512 *acc)
{
    __m512 block[MAX_ROWS];
    UNROLL
    for (int r = 0; r < rows; r++) block[r] = _mm512_setzero_ps();
    prefetch_ahead(t, X16_Q6_K_NIBBLES);
    for (int g = 0; g < 8; g++) {
        prefetch_ahead(t + X16_Q6_K_NIBBLES + 256 * g, 256);
        prefetch_ahead(t + X16_Q6_K_HIGH + 128 * g, 128);
        /* Scales 2g (weights 0..15 of the group) and 2g + 1 of each row as 16-bit pairs. */
        const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(t + X16_Q6_K_SCALES + 32 * g)));
        const __m512 first = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16));
        const __m512 second = _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 16));
        const uint8_t *nibbles = t + X16_Q6_K_NIBBLES + 256 * g, *high = t + X16_Q6_K_HIGH + 128 * g;
        sums halves[2];
        sums_clear(rows, wide, &halves[0]);
        sums_clear(rows, wide, &halves[1]);
        UNROLL
        for (int v = 0; v < 4; v++) {
            const __m512i packed = load64(nibbles + 64 * v), bits = load64(high + 64 * (v >> 1));
            const int t_lo = 2 * (v & 1);
            const __m512i lo = _mm512_or_si512(nibbles_low(packed), move_bits(bits, 2 * t_lo, 4, 0x30));
            const __m512i hi = _mm512_or_si512(nibbles_high(packed), move_bits(bits, 2 * t_lo + 2, 4, 0x30));
            sums_add(rows, wide, &halves[v >> 1], &lo, 1, x, in, 256 * k + 32 * g + 8 * v);
            sums_add(rows, wide, &halves[v >> 1], &hi, 1, x, in, 256 * k + 32 * g + 8 * v + 4);
        }
        UNROLL
        for (int r = 0; r < rows; r++) {
            const int64_t at = r * (in / 16) + 16 * k + 2 * g;
            __m512i offset = q6_scaled_sums(pairs, x.sum16 + at);
            if (wide) offset = _mm512_add_epi32(_mm512_slli_epi32(offset, 7), q6_scaled_sums(pairs, x.sum16_lo + at));
            block[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_total(wide, &halves[0], r)), first, block[r]);
            block[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_total(wide, &halves[1], r)), second, block[r]);
            block[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(offset), _mm512_set1_ps(32.0f), block[r]);
        }
    }
    const __m512 d = halves16(t);
    UNROLL
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_fmadd_ps(block[r], _mm512_mul_ps(d, _mm512_set1_ps(x.scale[r * (in / 256) + k])), acc[r]);
}

#endif
