/* The arithmetic of one tile of the 16-row interleaved layout (quant_x16.h) against up to
 * MAX_ROWS activation rows, per block type, for quant_x16.c (AVX-512 with VNNI, or AVX2: the
 * vectors of quant_x16_vec.h; included only there, inside its build check). A tile's rows
 * are taken a column at a time: a column is the whole tile in the AVX-512 build, a part of 8
 * of its rows in the AVX2 one. Each weight vector is 4 weights of each of a column's rows;
 * sums_add multiplies it by 4 broadcast activation bytes (dot4) into one int32 sum per row
 * (twice with wide activations: the multiples of 128, then the remainders). Scales are applied
 * per group of 32 (per sub-block for the K types) in float, with one vector of the rows'
 * scales.
 */
#ifndef TRIODE_QUANT_X16_TILES_H
#define TRIODE_QUANT_X16_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "q8_activations.h"
#include "quant_x16.h"
#include "quant_x16_vec.h"

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

static inline ivec nibbles_low(ivec v) { return ivec_and(v, MM(set1_epi8)(15)); }
static inline ivec nibbles_high(ivec v) { return ivec_and(MM(srli_epi16)(v, 4), MM(set1_epi8)(15)); }
/* A column's part of the 64-byte weight vector at `offset` of its tile. */
static inline ivec weights_at(column c, int64_t offset) { return ivec_load(part_of(c, offset, 4)); }
/* A column's rows' float16 scales from the array at `offset` of its tile. */
static inline fvec scales_at(column c, int64_t offset) { return halves_at(part_of(c, offset, 2)); }
/* 4 activation bytes broadcast to every lane (dot4's signed operand). */
static inline ivec x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return MM(set1_epi32)(v);
}
/* Bits `from`, from + 1 of every byte moved to bits `to`, to + 1 (a shift within 16-bit lanes
 * moves no kept bit across a byte: the mask keeps only the moved ones). */
static inline ivec move_bits(ivec v, int from, int to, int mask) {
    const ivec moved = from < to ? MM(slli_epi16)(v, to - from) : MM(srli_epi16)(v, from - to);
    return ivec_and(moved, MM(set1_epi8)((char)mask));
}

/* 4 weights of each row of `columns` columns (unsigned bytes, or Q8_0's: `q8`) times
 * activations [at, at + 4) of every row. Each broadcast of the activations serves every
 * column: with one tile, a broadcast for each vpdpbusd, the Q4_1 kernel ran at 63% of the
 * rate vpdpbusd alone reaches (Zen 5, 128 rows of the default model's shapes, int16
 * activations); two tiles at a time took it to 71% (653-754 -> 702-820 GFLOP/s, the LM head's
 * Q8_0 759-797 -> 927-935). Four tiles of two rows, or of three, were no faster. */
static inline __attribute__((always_inline)) void sums_add(
    const int rows, const int wide, const int q8, sums *s, const ivec *weights, const int columns, rows_q8 x, int in,
    int64_t at)
{
    UNROLL
    for (int r = 0; r < rows; r++) {
        const ivec q = x4(x.q + (int64_t)r * in + at);
        UNROLL
        for (int i = 0; i < columns; i++) s[i].dot[r] = dot4(s[i].dot[r], weights[i], q, q8);
        if (wide) {
            const ivec lo = x4(x.lo + (int64_t)r * in + at);
            UNROLL
            for (int i = 0; i < columns; i++) s[i].rest[r] = dot4(s[i].rest[r], weights[i], lo, q8);
        }
    }
}

/* nibbles32 of each column's area (at `offset` of its tile) times activations [at, at + 32)
 * of each row. */
static inline __attribute__((always_inline)) void sums_nibbles(
    const int rows, const int wide, sums *s, const column *c, int64_t offset, const int columns, rows_q8 x, int in,
    int64_t at)
{
    UNROLL
    for (int v = 0; v < 4; v++) {
        ivec low[2], high[2];
        UNROLL
        for (int i = 0; i < columns; i++) {
            const ivec packed = weights_at(c[i], offset + 64 * v);
            low[i] = nibbles_low(packed);
            high[i] = nibbles_high(packed);
        }
        sums_add(rows, wide, 0, s, low, columns, x, in, at + 8 * v);
        sums_add(rows, wide, 0, s, high, columns, x, in, at + 8 * v + 4);
    }
}

/* A Q4_0 / Q4_1 / Q8_0 column's block k into acc, from its integer sums of each row. */
static inline __attribute__((always_inline)) void small_scaled(
    const int type, const int rows, rows_q8 x, int in, column c, int k, const ivec *dots, fvec *acc)
{
    const fvec d = scales_at(c, 0);
    const fvec m = type == TYPE_Q4_1 ? scales_at(c, 32) : MM(setzero_ps)();
    const int groups = in / 32;
    UNROLL
    for (int r = 0; r < rows; r++) {
        const int32_t sum = x.sum[r * groups + k];
        const float x_scale = x.scale[r * groups + k];
        ivec dot = dots[r];
        /* Q8_0 went in as q + 128, Q4_0's value is q - 8: the same integer sum of x off again. */
        if (type == TYPE_Q8_0 && Q8_HOLDS_OFFSET) dot = MM(sub_epi32)(dot, MM(set1_epi32)(128 * sum));
        if (type == TYPE_Q4_0) dot = MM(sub_epi32)(dot, MM(set1_epi32)(8 * sum));
        acc[r] = MM(fmadd_ps)(MM(cvtepi32_ps)(dot), MM(mul_ps)(d, MM(set1_ps)(x_scale)), acc[r]);
        if (type == TYPE_Q4_1) acc[r] = MM(fmadd_ps)(m, MM(set1_ps)(x_scale * (float)sum), acc[r]);
    }
}

#if Q8_KEEPS_WHOLE
/* AVX2's Q8_0 block k against wide activations, x_q whole (int16) times the weights widened to
 * int16 with vpmaddwd: a quarter of the instructions of vpmaddubsw on q and on lo, whose
 * products of Q8_0's bytes fill int16 alone. A column's rows 0-3 (`first`) and 4-7 (`second`)
 * each sum in two lanes a row, weights 0-1 and 2-3 of every 4, added at the end: the same
 * integer as the AVX-512 build's. */
static inline __attribute__((always_inline)) void q8_0_whole_dots(
    const int rows, rows_q8 x, int in, const column *c, const int columns, int k, ivec dots[][MAX_ROWS])
{
    ivec first[2][MAX_ROWS], second[2][MAX_ROWS];
    UNROLL
    for (int i = 0; i < columns; i++)
        UNROLL
        for (int r = 0; r < rows; r++) first[i][r] = second[i][r] = ivec_zero();
    UNROLL
    for (int v = 0; v < 8; v++) {
        ivec low[2], high[2];
        UNROLL
        for (int i = 0; i < columns; i++) {
            const ivec q = _mm256_xor_si256(weights_at(c[i], X16_SMALL_NIBBLES + 64 * v), _mm256_set1_epi8((char)0x80));
            low[i] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
            high[i] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        }
        UNROLL
        for (int r = 0; r < rows; r++) {
            int64_t four;
            memcpy(&four, x.whole + (int64_t)r * in + 32 * k + 4 * v, sizeof four);
            const ivec xs = _mm256_set1_epi64x(four);
            UNROLL
            for (int i = 0; i < columns; i++) {
                first[i][r] = _mm256_add_epi32(first[i][r], _mm256_madd_epi16(low[i], xs));
                second[i][r] = _mm256_add_epi32(second[i][r], _mm256_madd_epi16(high[i], xs));
            }
        }
    }
    UNROLL
    for (int i = 0; i < columns; i++)
        UNROLL
        for (int r = 0; r < rows; r++)
            dots[i][r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(first[i][r], second[i][r]), 0xD8);
}
#endif

/* Block k (32 weights) of `columns` Q4_0 / Q4_1 / Q8_0 columns (c[i]) into acc[i]: each
 * column's arithmetic is the same beside another as alone, so are its bits. */
static inline __attribute__((always_inline)) void tile_small(
    const int type, const int rows, const int wide, rows_q8 x, int in, const column *c, const int columns, int k,
    fvec acc[][MAX_ROWS])
{
#if Q8_KEEPS_WHOLE
    if (type == TYPE_Q8_0 && wide) {
        ivec dots[2][MAX_ROWS];
        q8_0_whole_dots(rows, x, in, c, columns, k, dots);
        UNROLL
        for (int i = 0; i < columns; i++) small_scaled(type, rows, x, in, c[i], k, dots[i], acc[i]);
        return;
    }
#endif
    sums s[2];
    UNROLL
    for (int i = 0; i < columns; i++) sums_clear(rows, wide, &s[i]);
    if (type == TYPE_Q8_0) {
        UNROLL
        for (int v = 0; v < 8; v++) {
            ivec weights[2];
            UNROLL
            for (int i = 0; i < columns; i++) weights[i] = weights_at(c[i], X16_SMALL_NIBBLES + 64 * v);
            sums_add(rows, wide, 1, s, weights, columns, x, in, 32 * k + 4 * v);
            UNROLL
            for (int i = 0; i < columns; i++) sums_fold(rows, wide, &s[i]);
        }
    } else {
        sums_nibbles(rows, wide, s, c, type == TYPE_Q4_1 ? X16_Q4_1_NIBBLES : X16_SMALL_NIBBLES, columns, x, in, 32 * k);
    }
    UNROLL
    for (int i = 0; i < columns; i++) {
        ivec dots[MAX_ROWS];
        UNROLL
        for (int r = 0; r < rows; r++) dots[r] = dot_total(wide, &s[i], r);
        small_scaled(type, rows, x, in, c[i], k, dots, acc[i]);
    }
}

/* The 8 scales and 8 mins (6 bits each) of a Q4_K / Q5_K column's rows, as int32 lanes, from
 * the packed bytes laid out 16 rows a vector (quant_blocks.h's k_scale_min). */
static inline __attribute__((always_inline)) void k_scales16(column c, ivec *scales, ivec *mins) {
    __m128i byte[12];
    UNROLL
    for (int i = 0; i < 12; i++) byte[i] = bytes_at(part_of(c, X16_K_SCALES + 16 * i, 1));
    const __m128i six = _mm_set1_epi8(63), four = _mm_set1_epi8(15), two = _mm_set1_epi8(3);
    UNROLL
    for (int j = 0; j < 4; j++) {
        scales[j] = widen_bytes(_mm_and_si128(byte[j], six));
        mins[j] = widen_bytes(_mm_and_si128(byte[j + 4], six));
        const __m128i top_scale = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(byte[j], 6), two), 4);
        const __m128i top_min = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(byte[j + 4], 6), two), 4);
        scales[j + 4] = widen_bytes(_mm_or_si128(_mm_and_si128(byte[j + 8], four), top_scale));
        mins[j + 4] = widen_bytes(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(byte[j + 8], 4), four), top_min));
    }
}

/* Block k (256 weights) of `columns` Q4_K / Q5_K columns (c[i]) into acc[i]: w = d * scale * q
 * - dmin * min. A sub-block's sum is scaled in float: with wide activations, 8 of them times
 * 6-bit scales could pass 2^31. */
static inline __attribute__((always_inline)) void tile_k45(
    const int type, const int rows, const int wide, rows_q8 x, int in, const column *c, const int columns, int k,
    fvec acc[][MAX_ROWS])
{
    ivec scales[2][8], mins[2][8];
    fvec block[2][MAX_ROWS];
    const int64_t nibbles = type == TYPE_Q4_K ? X16_Q4_K_NIBBLES : X16_Q5_K_NIBBLES;
    UNROLL
    for (int i = 0; i < columns; i++) {
        k_scales16(c[i], scales[i], mins[i]);
        UNROLL
        for (int r = 0; r < rows; r++) block[i][r] = MM(setzero_ps)();
        if (c[i].part == 0) prefetch_ahead(c[i].tile, nibbles);
    }
    for (int j = 0; j < 8; j++) {
        sums s[2];
        UNROLL
        for (int i = 0; i < columns; i++) {
            if (c[i].part == 0) prefetch_ahead(c[i].tile + nibbles + 256 * j, 256);
            sums_clear(rows, wide, &s[i]);
        }
        if (type == TYPE_Q4_K) {
            sums_nibbles(rows, wide, s, c, nibbles + 256 * j, columns, x, in, 256 * k + 32 * j);
        } else {
            ivec high[2];
            UNROLL
            for (int i = 0; i < columns; i++) {
                if (c[i].part == 0) prefetch_ahead(c[i].tile + X16_Q5_K_HIGH + 64 * j, 64);
                high[i] = weights_at(c[i], X16_Q5_K_HIGH + 64 * j);
            }
            UNROLL
            for (int v = 0; v < 4; v++) {
                ivec lo[2], hi[2];
                UNROLL
                for (int i = 0; i < columns; i++) {
                    const ivec packed = weights_at(c[i], nibbles + 256 * j + 64 * v);
                    lo[i] = ivec_or(nibbles_low(packed), move_bits(high[i], 2 * v, 4, 0x10));
                    hi[i] = ivec_or(nibbles_high(packed), move_bits(high[i], 2 * v + 1, 4, 0x10));
                }
                sums_add(rows, wide, 0, s, lo, columns, x, in, 256 * k + 32 * j + 8 * v);
                sums_add(rows, wide, 0, s, hi, columns, x, in, 256 * k + 32 * j + 8 * v + 4);
                if (v == 1) {
                    UNROLL
                    for (int i = 0; i < columns; i++) sums_fold(rows, wide, &s[i]);
                }
            }
        }
        UNROLL
        for (int i = 0; i < columns; i++) {
            const fvec scale = MM(cvtepi32_ps)(scales[i][j]);
            UNROLL
            for (int r = 0; r < rows; r++)
                block[i][r] = MM(fmadd_ps)(MM(cvtepi32_ps)(dot_total(wide, &s[i], r)), scale, block[i][r]);
        }
    }
    const int blocks = in / 256, groups = in / 32;
    UNROLL
    for (int i = 0; i < columns; i++) {
        const fvec d = scales_at(c[i], 0), dmin = scales_at(c[i], 32);
        UNROLL
        for (int r = 0; r < rows; r++) {
            const int32_t *group_sums = x.sum + r * groups + 8 * k;
            ivec mins_sum = MM(mullo_epi32)(mins[i][0], MM(set1_epi32)(group_sums[0]));
            UNROLL
            for (int j = 1; j < 8; j++)
                mins_sum = MM(add_epi32)(mins_sum, MM(mullo_epi32)(mins[i][j], MM(set1_epi32)(group_sums[j])));
            const fvec x_scale = MM(set1_ps)(x.scale[r * blocks + k]);
            acc[i][r] = MM(fmadd_ps)(block[i][r], MM(mul_ps)(d, x_scale), acc[i][r]);
            acc[i][r] = MM(fnmadd_ps)(MM(cvtepi32_ps)(mins_sum), MM(mul_ps)(dmin, x_scale), acc[i][r]);
        }
    }
}

/* The Q6_K correction's integer sums for group g: scale 2g times the sum of x over weights
 * 0..15, plus scale 2g + 1 times that over 16..31 (the sums of 16 of q, or of lo). */
static inline ivec q6_scaled_sums(ivec pairs, const int16_t *sums16) {
    int32_t two;
    memcpy(&two, sums16, 4);
    return pairs_dot(ivec_zero(), pairs, MM(set1_epi32)(two));
}

/* Block k of a Q6_K column into acc: w = d * scale * (q - 32), q taken as 0..63 (unsigned,
 * for dot4) and 32 * scale * sum(x) over each 16 taken off. */
static inline __attribute__((always_inline)) void tile_q6_k(
    const int rows, const int wide, rows_q8 x, int in, column c, int k, fvec *acc)
{
    fvec block[MAX_ROWS];
    UNROLL
    for (int r = 0; r < rows; r++) block[r] = MM(setzero_ps)();
    if (c.part == 0) prefetch_ahead(c.tile, X16_Q6_K_NIBBLES);
    for (int g = 0; g < 8; g++) {
        if (c.part == 0) {
            prefetch_ahead(c.tile + X16_Q6_K_NIBBLES + 256 * g, 256);
            prefetch_ahead(c.tile + X16_Q6_K_HIGH + 128 * g, 128);
        }
        /* Scales 2g (weights 0..15 of the group) and 2g + 1 of each row as 16-bit pairs. */
        const ivec pairs = signed_pairs_at(part_of(c, X16_Q6_K_SCALES + 32 * g, 2));
        const fvec first = MM(cvtepi32_ps)(MM(srai_epi32)(MM(slli_epi32)(pairs, 16), 16));
        const fvec second = MM(cvtepi32_ps)(MM(srai_epi32)(pairs, 16));
        const int64_t nibbles = X16_Q6_K_NIBBLES + 256 * g, high = X16_Q6_K_HIGH + 128 * g;
        sums halves[2];
        sums_clear(rows, wide, &halves[0]);
        sums_clear(rows, wide, &halves[1]);
        UNROLL
        for (int v = 0; v < 4; v++) {
            const ivec packed = weights_at(c, nibbles + 64 * v), bits = weights_at(c, high + 64 * (v >> 1));
            const int t_lo = 2 * (v & 1);
            const ivec lo = ivec_or(nibbles_low(packed), move_bits(bits, 2 * t_lo, 4, 0x30));
            const ivec hi = ivec_or(nibbles_high(packed), move_bits(bits, 2 * t_lo + 2, 4, 0x30));
            sums_add(rows, wide, 0, &halves[v >> 1], &lo, 1, x, in, 256 * k + 32 * g + 8 * v);
            sums_add(rows, wide, 0, &halves[v >> 1], &hi, 1, x, in, 256 * k + 32 * g + 8 * v + 4);
            sums_fold(rows, wide, &halves[v >> 1]);
        }
        UNROLL
        for (int r = 0; r < rows; r++) {
            const int64_t at = r * (in / 16) + 16 * k + 2 * g;
            ivec offset = q6_scaled_sums(pairs, x.sum16 + at);
            if (wide) offset = MM(add_epi32)(MM(slli_epi32)(offset, 7), q6_scaled_sums(pairs, x.sum16_lo + at));
            block[r] = MM(fmadd_ps)(MM(cvtepi32_ps)(dot_total(wide, &halves[0], r)), first, block[r]);
            block[r] = MM(fmadd_ps)(MM(cvtepi32_ps)(dot_total(wide, &halves[1], r)), second, block[r]);
            block[r] = MM(fnmadd_ps)(MM(cvtepi32_ps)(offset), MM(set1_ps)(32.0f), block[r]);
        }
    }
    const fvec d = scales_at(c, 0);
    UNROLL
    for (int r = 0; r < rows; r++)
        acc[r] = MM(fmadd_ps)(block[r], MM(mul_ps)(d, MM(set1_ps)(x.scale[r * (in / 256) + k])), acc[r]);
}

#endif
