/* One tile of decode attention over the paged KV cache (paged_decode.h): up to LANES (vec.h)
 * cached rows of one block, for one KV head and the query heads of its group, softmax
 * computed online. Where a tile lies in the cache, fetching the next one, and the tile's
 * arithmetic. */
#ifndef TRIODE_PAGED_DECODE_TILE_H
#define TRIODE_PAGED_DECODE_TILE_H

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Rows of a sequence's cache from token `start`: within one block, at most one tile. */
static inline int tile_rows(int start, int seq_len, int block_size) {
    const int left_in_block = block_size - start % block_size, left = seq_len - start;
    const int rows = left < LANES ? left : LANES;
    return left_in_block < rows ? left_in_block : rows;
}

/* Element offset of token `token`'s row in the cache. */
static inline int64_t row_offset(const int32_t *table, int token, int block_size, int64_t row_stride) {
    return ((int64_t)table[token / block_size] * block_size + token % block_size) * row_stride;
}

/* Into L2, ahead of use: the tiles are read one KV head at a time (a strided pattern the
 * hardware prefetchers follow poorly), so the next tile is fetched while this one is computed,
 * a share of it with each KV head's tile. At 64 sequences of 96-192 tokens, float32, 30
 * layers, with the whole next tile fetched before the first KV head: 25.0 -> 22.6 ms in
 * blocks in order, 29.0 -> 25.1 scattered; a share before each KV head, 23.6 -> 22.1 and
 * 25.0 -> 24.4 more.
 * Each share is then spread over the tile's score stage, a few lines with each pair of rows of
 * each head (TILE_BODY): issued in one burst, the requests outran the miss queues and the
 * computation waited on the memory instead of overlapping it. 128 decodes of 100-600 tokens
 * from memory, 30 layers (AMD EPYC Zen 5, 2 threads): bfloat16 46.2-46.3 -> 31.0-31.3 ms
 * (23.7 -> 35.3 GB/s of KV), float32 77.9-78.9 -> 57.7 (28 -> 38 GB/s). Spread over the value
 * stage too, 33.5 and 59.3 ms; all in the first head's stage, 38.7 and 80.2. Two tiles ahead
 * gained nothing; into L1 (prefetcht0) lost 5-10% (both with the burst). */
typedef struct {
    const char *keys, *values;
    int64_t bytes; /* from each of keys and values; 0 for nothing */
} Ahead;

/* The parts of the next tile's share each head's scores fetch (TILE_BODY): one with each pair
 * of rows, but one a head for tiles whose keys are staged (STAGE) in 8-lane vectors. The AVX2
 * build on the Zen 5, 128 decodes from memory: bfloat16 (staged) 45-51 ms with one part a head
 * against 47-68 with a part each pair; float32 58-72 with a part each pair against 64-78. On
 * AVX-512 without BF16 staged tiles gained from a part each pair (34.5-37.2 against 36.5-38.3). */
#define FETCH_PARTS(STAGE) ((STAGE) && LANES == 8 ? 1 : LANES / 2)

/* Part `part` of `parts` of the lines `ahead` covers. */
static inline void prefetch_part(const Ahead *ahead, int part, int parts) {
    const int64_t lines = (ahead->bytes + 63) / 64;
    for (int64_t line = lines * part / parts; line < lines * (part + 1) / parts; line++) {
        __builtin_prefetch(ahead->keys + line * 64, 0, 2);
        __builtin_prefetch(ahead->values + line * 64, 0, 2);
    }
}

/* A sequence's running state, per query head: the pre-scaled query, the accumulator, the
 * running max and the softmax denominator. */
typedef struct {
    f32v *query, *acc;
    float *running_max, *denominator;
} State;

/* bfloat16 scores and values through AVX-512 BF16, where the CPU has it: `vdpbf16ps`
 * multiplies two vectors of bfloat16 in pairs of neighbouring elements, adding both products to
 * a float32 lane, so a row's keys and values are never widened.
 * - Scores: the query and a cached row, in pairs of neighbouring dimensions. Each lane then sums
 *   other dimensions than the widened keys' (2i and 2i + 1 of every 32, not i of every 16). The
 *   query is rounded to bfloat16 after its scale (exact where the scale is a power of two, as at
 *   head dim 64).
 * - Values: the softmax weights of two rows t and t + 1, rounded to bfloat16 (as Hugging Face's
 *   attention rounds its probabilities to the model's dtype before multiplying the values), and
 *   the two rows' values interleaved dimension by dimension. Interleaving within 128-bit lanes
 *   leaves a head's accumulators in a permuted order (value_dimension), undone when the result
 *   is written.
 * So bfloat16 attention differs in its last bits between CPUs with and without BF16; on one
 * machine every row of a model takes the same path in any batch. Against a float64 reference, a
 * 512-token prompt's outputs are off by 2.07e-4 on average (torch's bfloat16 SDPA, which Hugging
 * Face runs, 2.13e-4; widened keys and float32 weights 1.47e-4, no more than rounding the result),
 * and by 1.00e-4 from SDPA's own outputs (widened, 1.38e-4).
 * At the default model's shape, 30 layers (AMD EPYC Zen 5), widened keys -> scores as pairs
 * (an earlier run): a 512-token prompt 44.6 -> 39.7 ms, 64 decodes of 300 tokens 9.63 -> 8.39,
 * 128 decodes of 100-600 tokens from memory 55.8 -> 51.4; then values as pairs too (best of four
 * runs, alternated): 39.95 -> 37.35, 8.82 -> 7.75, and from memory 50.6 -> 49.7, where reading
 * the cache sets the pace. */
#ifdef __AVX512BF16__
#define BF16_DOTS 1
static inline f32v dot_bf16_pairs(f32v acc, __m512bh a, __m512i b) {
    return (f32v)_mm512_dpbf16_ps((__m512)acc, a, (__m512bh)b);
}
/* Head h's query as bfloat16 pairs, 32 dimensions a vector (VEC even). */
#define BF16_QUERY(DOTS, VEC)                                                                   \
    __m512bh pairs[(DOTS) ? (VEC) / 2 : 1];                                                     \
    if (DOTS) {                                                                                 \
        UNROLL                                                                                  \
        for (int c = 0; c < (VEC) / 2; c++) pairs[c] = _mm512_cvtne2ps_pbh((__m512)q[2 * c + 1], (__m512)q[2 * c]); \
    }
#define BF16_SCORE(sum, t, VEC)                                                                 \
    if ((t) < count) {                                                                          \
        UNROLL                                                                                  \
        for (int c = 0; c < (VEC) / 2; c++)                                                     \
            sum = dot_bf16_pairs(sum, pairs[c], _mm512_loadu_si512((const void *)((const uint16_t *)(keys + (t) * row_stride) + c * 2 * LANES))); \
    }
/* Head h's weights of the tile, as bfloat16: row t's and t + 1's are one 32-bit pair. */
#define BF16_WEIGHTS(DOTS, h, p)                                                                \
    if (DOTS) _mm256_storeu_si256((__m256i *)paired_weights[(DOTS) ? (h) : 0], (__m256i)_mm512_cvtneps_pbh((__m512)(p)));
/* acc += the weighted values of rows t and t + 1 (t + 1 < count or not), for every head. */
#define BF16_VALUES(GROUP, VEC)                                                                 \
    for (int t = 0; t < count; t += 2) {                                                        \
        __m512i low[(VEC) / 2 > 0 ? (VEC) / 2 : 1], high[(VEC) / 2 > 0 ? (VEC) / 2 : 1];        \
        UNROLL                                                                                  \
        for (int c = 0; c < (VEC) / 2; c++) {                                                   \
            const uint16_t *const row = (const uint16_t *)(values + t * row_stride) + c * 2 * LANES; \
            const __m512i first = _mm512_loadu_si512((const void *)row);                        \
            const __m512i second = t + 1 < count ? _mm512_loadu_si512((const void *)(row + row_stride)) \
                                                 : _mm512_setzero_si512();                      \
            low[c] = _mm512_unpacklo_epi16(first, second);                                      \
            high[c] = _mm512_unpackhi_epi16(first, second);                                     \
        }                                                                                       \
        UNROLL                                                                                  \
        for (int h = 0; h < (GROUP); h++) {                                                     \
            uint32_t both;                                                                      \
            memcpy(&both, &paired_weights[h][t], sizeof both);                                  \
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)both);                          \
            UNROLL                                                                              \
            for (int c = 0; c < (VEC) / 2; c++) {                                               \
                acc[h][2 * c] = dot_bf16_pairs(acc[h][2 * c], w, low[c]);                       \
                acc[h][2 * c + 1] = dot_bf16_pairs(acc[h][2 * c + 1], w, high[c]);              \
            }                                                                                   \
        }                                                                                       \
    }
#else
#define BF16_DOTS 0
#define BF16_QUERY(DOTS, VEC)
#define BF16_SCORE(sum, t, VEC)
#define BF16_WEIGHTS(DOTS, h, p)
#define BF16_VALUES(GROUP, VEC)
#endif

/* The head dimension that lane i of accumulator vector v holds: 16v + i, unless the values
 * went through BF16_VALUES, whose vectors 2c and 2c + 1 hold dimensions 32c to 32c + 31 as
 * `_mm512_unpacklo_epi16` and `_mm512_unpackhi_epi16` left them, four of every eight each. */
static inline int value_dimension(int v, int i, int in_pairs) {
    return in_pairs ? 32 * (v / 2) + 8 * (i / 4) + 4 * (v % 2) + i % 4 : v * LANES + i;
}

/* Whether a specialised tile of ELEM keys and VEC vectors a head takes its scores as above. */
#define DOTS_FOR(ELEM, VEC) (BF16_DOTS && sizeof(ELEM) < sizeof(float) && (VEC) % 2 == 0)

/* Whether TILE_BODY sums the values head by head, reading each row once per head, instead of
 * row by row for all heads: with 8-lane vectors a group's accumulators (GROUP x VEC, 48 for a
 * prompt pair at head dim 64) outnumber AVX2's 16 registers, and row by row every one of them
 * went to memory and back for each row. Each accumulator takes the same products in the same
 * order, so the bits are the same. AVX2 build, float32, 30 layers at the default model's shape
 * (Zen 5), alternated twice: a 2048-token prompt 1517-1550 -> 1348-1357 ms, a 512-token one
 * 88.1-90.5 -> 81.0-81.4, 64 decodes of 300 tokens 16.2-17.1 -> 14.9-15.4. bfloat16 values
 * would be widened once per head: a 2048-token prompt 1414-1469 -> 1574, so they stay. */
#define HEAD_OUTER(ELEM, GROUP) (LANES == 8 && sizeof(ELEM) == sizeof(float) && (GROUP) > 1)

/* Row t's vector v of the tile's keys, from `staged` where TILE_BODY staged them. */
#define KEY(STAGE, LOADV, t, v)                                                                 \
    ((STAGE) ? staged[(STAGE) ? (t) : 0][(STAGE) ? (v) : 0] : LOADV(keys + (t) * row_stride + (v) * LANES))

/* One tile (count <= LANES rows, row stride row_stride) of one KV head for its GROUP query
 * heads of VEC vectors each. With GROUP and VEC literals the local arrays are registers.
 * The heads go through each stage together (every head's scores, then every head's running
 * max, one exp for all their rescales, then their weights): head by head, each head's chain
 * of dependent steps (dot products, the reduction across rows, the max, the exp, the sum)
 * ran alone, and the core waited on it. Each value is computed as before, so the bits are
 * the same; at the default model's shape, 30 layers, 2 threads (Zen 5), best of three runs:
 * a 2048-token prompt float32 744 -> 567-573 ms, bfloat16 596 -> 400-412; 8 prompts of 64
 * tokens 8.64 -> 6.82-6.89 and 8.26 -> 6.28-6.36; 64 decodes of 300 tokens 15.6 -> 12.3-12.4
 * and 8.22 -> 6.65-6.74.
 * STAGE: the tile's keys are widened to float32 once, into `staged`, and every head of the
 * group reads them there; for bfloat16 keys and groups of more than one head, widening each
 * head's keys again cost more than the stores (the same floats either way, so the same bits).
 * DOTS: the scores and the values' sums come from bfloat16 dot products (above), and nothing
 * is staged.
 * `ahead` (TILE_ARGS): the lines to fetch for the next tile, in parts over the heads' scores
 * (Ahead, FETCH_PARTS). A prompt pair passes nothing: its tiles compute long enough for
 * the hardware prefetchers, and fetching there took a 2048-token prompt from 572 to 691 ms
 * (float32) and 397 to 558 (bfloat16). */
#define TILE_BODY(ELEM, LOADV, GROUP, VEC, STAGE, DOTS)                                         \
    const i32v valid = lanes_below(count);                                                      \
    float weights[GROUP][LANES], rescale[GROUP];                                                \
    f32v scores[GROUP];                                                                         \
    float new_max[GROUP];                                                                       \
    uint16_t paired_weights[(DOTS) ? (GROUP) : 1][LANES];                                       \
    (void)paired_weights; /* read only where the CPU has BF16 */                                \
    f32v staged[(STAGE) ? LANES : 1][(STAGE) ? (VEC) : 1];                                      \
    if (STAGE) {                                                                                \
        UNROLL                                                                                  \
        for (int t = 0; t < LANES; t++) {                                                       \
            UNROLL                                                                              \
            for (int v = 0; v < (VEC); v++) {                                                   \
                f32v *const slot = &staged[(STAGE) ? t : 0][(STAGE) ? v : 0];                   \
                if (count == LANES) /* a whole tile, most of them: no test per row */           \
                    *slot = LOADV(keys + t * row_stride + v * LANES);                           \
                else /* rows past count are never read; zeroed so that GCC sees them written */ \
                    *slot = t < count ? LOADV(keys + t * row_stride + v * LANES) : splat(0.0f); \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        f32v q[VEC], half[LANES / 2];                                                           \
        UNROLL                                                                                  \
        for (int v = 0; v < (VEC); v++) q[v] = query[h * (VEC) + v];                            \
        BF16_QUERY(DOTS, VEC)                                                                   \
        UNROLL                                                                                  \
        for (int t = 0; t < LANES; t += 2) {                                                    \
            if (t % (LANES / FETCH_PARTS(STAGE)) == 0 && ahead->bytes)                          \
                prefetch_part(ahead, h * FETCH_PARTS(STAGE) + t / (LANES / FETCH_PARTS(STAGE)), \
                              (GROUP) * FETCH_PARTS(STAGE));                                    \
            f32v even = {0}, odd = {0};                                                         \
            if (DOTS) {                                                                         \
                BF16_SCORE(even, t, VEC)                                                        \
                BF16_SCORE(odd, t + 1, VEC)                                                     \
            } else {                                                                            \
                if (t < count) {                                                                \
                    UNROLL                                                                      \
                    for (int v = 0; v < (VEC); v++) even += q[v] * KEY(STAGE, LOADV, t, v);    \
                }                                                                               \
                if (t + 1 < count) {                                                            \
                    UNROLL                                                                      \
                    for (int v = 0; v < (VEC); v++) odd += q[v] * KEY(STAGE, LOADV, t + 1, v); \
                }                                                                               \
            }                                                                                   \
            half[t / 2] = pair_rows(even, odd);                                                 \
        }                                                                                       \
        f32v raw = finish_rows(half);                                                           \
        if (softcap > 0.0f) raw = soft_cap(raw, softcap);                                       \
        scores[h] = select(valid, raw, splat(-FLT_MAX));                                        \
    }                                                                                           \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        const float previous = running_max[h], tile_max = lane_max(scores[h]);                  \
        new_max[h] = tile_max > previous ? tile_max : previous;                                 \
        rescale[h] = previous - new_max[h];                                                     \
    }                                                                                           \
    {                                                                                           \
        _Static_assert((GROUP) <= LANES, "a lane of one exp for each head's rescale");          \
        f32v drops = splat(0.0f);                                                               \
        UNROLL                                                                                  \
        for (int h = 0; h < (GROUP); h++) drops[h] = rescale[h];                                \
        drops = exp_nonpositive(drops); /* exactly 1 where the max did not move */              \
        UNROLL                                                                                  \
        for (int h = 0; h < (GROUP); h++) rescale[h] = drops[h];                                \
    }                                                                                           \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        const f32v p = select(valid, exp_nonpositive(scores[h] - new_max[h]), splat(0.0f));     \
        if (DOTS) {                                                                             \
            BF16_WEIGHTS(DOTS, h, p)                                                            \
        } else {                                                                                \
            store_f32(weights[h], p);                                                           \
        }                                                                                       \
        denominator[h] = denominator[h] * rescale[h] + lane_sum(p);                             \
        running_max[h] = new_max[h];                                                            \
    }                                                                                           \
    f32v acc[GROUP][VEC];                                                                       \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        UNROLL                                                                                  \
        for (int v = 0; v < (VEC); v++) acc[h][v] = accumulators[h * (VEC) + v] * rescale[h];   \
    }                                                                                           \
    if (DOTS) {                                                                                 \
        BF16_VALUES(GROUP, VEC)                                                                 \
    } else if (HEAD_OUTER(ELEM, GROUP)) {                                                       \
        UNROLL                                                                                  \
        for (int h = 0; h < (GROUP); h++)                                                       \
            for (int t = 0; t < count; t++) {                                                   \
                const f32v w = splat(weights[h][t]);                                            \
                UNROLL                                                                          \
                for (int v = 0; v < (VEC); v++)                                                 \
                    acc[h][v] += w * LOADV(values + t * row_stride + v * LANES);                \
            }                                                                                   \
    } else {                                                                                    \
        for (int t = 0; t < count; t++) {                                                       \
            f32v row[VEC];                                                                      \
            UNROLL                                                                              \
            for (int v = 0; v < (VEC); v++) row[v] = LOADV(values + t * row_stride + v * LANES); \
            UNROLL                                                                              \
            for (int h = 0; h < (GROUP); h++) {                                                 \
                const f32v w = splat(weights[h][t]);                                            \
                UNROLL                                                                          \
                for (int v = 0; v < (VEC); v++) acc[h][v] += w * row[v];                        \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        UNROLL                                                                                  \
        for (int v = 0; v < (VEC); v++) accumulators[h * (VEC) + v] = acc[h][v];                \
    }

#define TILE_ARGS(ELEM)                                                                         \
    const ELEM *restrict keys, const ELEM *restrict values, int64_t row_stride, int count,      \
    const f32v *restrict query, f32v *restrict accumulators, float *restrict running_max,       \
    float *restrict denominator, float softcap, const Ahead *ahead

/* The tile for GROUP query heads of head dim DIM, DIM / LANES vectors each. */
#define DEFINE_TILE(SUFFIX, ELEM, LOADV, GROUP, DIM)                                            \
    static void tile_##SUFFIX##_g##GROUP##_d##DIM(TILE_ARGS(ELEM)) {                            \
        enum { VEC = (DIM) / LANES };                                                           \
        TILE_BODY(ELEM, LOADV, GROUP, VEC, sizeof(ELEM) < sizeof(float) && (GROUP) > 1          \
                  && !DOTS_FOR(ELEM, VEC), DOTS_FOR(ELEM, VEC))                                 \
    }

#endif
