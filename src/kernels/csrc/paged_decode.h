/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence attends to the sequence's cached tokens, read in place from
 * its blocks (no gathered copy). A sequence is one unit of work (one KV head of it when
 * there are fewer sequences than twice the threads). Its cache is walked in tiles
 * of up to 16 consecutive rows of one block; for each KV head, the tile's keys and values are
 * loaded once and serve every query head of the head's group, and softmax is computed online,
 * one tile at a time.
 *
 * A head's 16 scores of a tile come from 16 partial-sum vectors (vec16.h) added together in a
 * transpose-and-add tree instead of 16 horizontal sums, and their exponentials are one vector
 * polynomial; for head dims 16, 32, 64 and 128 with groups of up to 8 query heads the tile's queries
 * and accumulators are compile-time arrays, kept in registers. With the cache in L2, the
 * default model's shape (float32, 2 threads) runs at 44 GB/s against 19.5 for the scalar
 * row-at-a-time loops this replaced; from memory, 64 sequences of 96-192 tokens x 30 layers
 * take 22.1 ms against 27.4 in blocks in order and 24.2 against 33.6 in scattered blocks
 * (bfloat16: 15.5 / 16.6 ms against 16.5 / 24.4). Calling libm's expf once per score, as this
 * kernel first did, cost more than the rest of the arithmetic and lost to the row loops.
 *
 * Layouts (element strides):
 *   query      [seqs, heads, dim], token stride q_stride, head stride dim
 *   k/v cache  [blocks, block_size, kv_heads, dim], contiguous
 *   tables     [seqs, table_stride] int32 block ids
 *   seq_lens   [seqs] int32, 1..table capacity
 *   out        [seqs, heads, dim], token stride out_stride
 * dim is a multiple of 16.
 *
 * With a sliding window (window > 0) only a sequence's last `window` tokens are read; with
 * softcap > 0 each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2).
 * Rows of a block past the sequence's length are never loaded (they may hold anything).
 * Instantiated once per element type (paged_decode_f32.c, paged_decode_bf16.c): the
 * specialised tiles took 11 s to compile in one unit; two units build side by side.
 * Compiled with -O3 -march=native -ffast-math -fopenmp; nothing here relies on infinities or
 * NaNs (scores are finite, the running max starts at -FLT_MAX).
 */
#ifndef TRIODE_PAGED_DECODE_H
#define TRIODE_PAGED_DECODE_H

#include <float.h>
#include <stddef.h>
#include <stdint.h>
#include <omp.h>

#include "bf16.h"
#include "exports.h"
#include "vec16.h"

#define MAX_HEADS 64
#define MAX_DIM 256
#define MAX_BLOCK 64

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
 * a share of it before each KV head rather than all at once (more requests than the miss
 * queues hold). At 64 sequences of 96-192 tokens, float32, 30 layers: 25.0 -> 22.6 ms in
 * blocks in order, 29.0 -> 25.1 scattered with the whole tile fetched first; spread out,
 * 23.6 -> 22.1 and 25.0 -> 24.4 more (bfloat16 scattered 18.5 -> 16.6). Two tiles ahead
 * gained nothing; into L1 (prefetcht0) lost 5-10%. */
static inline void prefetch_rows(const char *keys, const char *values, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) {
        __builtin_prefetch(keys + offset, 0, 2);
        __builtin_prefetch(values + offset, 0, 2);
    }
}

/* A sequence's running state, per query head: the pre-scaled query, the accumulator, the
 * running max and the softmax denominator. */
typedef struct {
    f32x16 *query, *acc;
    float *running_max, *denominator;
} State;

/* Row t's vector v of the tile's keys, from `staged` where TILE_BODY staged them. */
#define KEY(STAGE, LOADV, t, v)                                                                 \
    ((STAGE) ? staged[(STAGE) ? (t) : 0][(STAGE) ? (v) : 0] : LOADV(keys + (t) * row_stride + (v) * LANES))

/* One tile (count <= 16 rows, row stride row_stride) of one KV head for its GROUP query
 * heads of VEC vectors each. With GROUP and VEC literals the local arrays are registers.
 * STAGE: the tile's keys are widened to float32 once, into `staged`, and every head of the
 * group reads them there; for bfloat16 keys and groups of more than one head, widening each
 * head's keys again cost more than the stores (the same floats either way, so the same bits). */
#define TILE_BODY(ELEM, LOADV, GROUP, VEC, STAGE)                                               \
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                 \
    const i32x16 valid = lane < count;                                                          \
    float weights[GROUP][LANES], rescale[GROUP];                                                \
    f32x16 staged[(STAGE) ? LANES : 1][(STAGE) ? (VEC) : 1];                                    \
    if (STAGE) {                                                                                \
        UNROLL                                                                                  \
        for (int t = 0; t < LANES; t++) {                                                       \
            if (t < count) {                                                                    \
                UNROLL                                                                          \
                for (int v = 0; v < (VEC); v++)                                                 \
                    staged[(STAGE) ? t : 0][(STAGE) ? v : 0] = LOADV(keys + t * row_stride + v * LANES); \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        f32x16 q[VEC], half[LANES / 2];                                                         \
        UNROLL                                                                                  \
        for (int v = 0; v < (VEC); v++) q[v] = query[h * (VEC) + v];                            \
        UNROLL                                                                                  \
        for (int t = 0; t < LANES; t += 2) {                                                    \
            f32x16 even = {0}, odd = {0};                                                       \
            if (t < count) {                                                                    \
                UNROLL                                                                          \
                for (int v = 0; v < (VEC); v++) even += q[v] * KEY(STAGE, LOADV, t, v);        \
            }                                                                                   \
            if (t + 1 < count) {                                                                \
                UNROLL                                                                          \
                for (int v = 0; v < (VEC); v++) odd += q[v] * KEY(STAGE, LOADV, t + 1, v);     \
            }                                                                                   \
            half[t / 2] = pair_rows(even, odd);                                                 \
        }                                                                                       \
        f32x16 raw = finish_rows(half);                                                         \
        if (softcap > 0.0f) raw = soft_cap(raw, softcap);                                       \
        const f32x16 scores = select(valid, raw, splat(-FLT_MAX));                              \
        const float previous = running_max[h], tile_max = lane_max(scores);                     \
        const float new_max = tile_max > previous ? tile_max : previous;                        \
        rescale[h] = new_max > previous ? exp_nonpositive(splat(previous - new_max))[0] : 1.0f; \
        const f32x16 p = select(valid, exp_nonpositive(scores - new_max), splat(0.0f));         \
        store_f32(weights[h], p);                                                               \
        denominator[h] = denominator[h] * rescale[h] + lane_sum(p);                             \
        running_max[h] = new_max;                                                               \
    }                                                                                           \
    f32x16 acc[GROUP][VEC];                                                                     \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        UNROLL                                                                                  \
        for (int v = 0; v < (VEC); v++) acc[h][v] = accumulators[h * (VEC) + v] * rescale[h];   \
    }                                                                                           \
    for (int t = 0; t < count; t++) {                                                           \
        f32x16 row[VEC];                                                                        \
        UNROLL                                                                                  \
        for (int v = 0; v < (VEC); v++) row[v] = LOADV(values + t * row_stride + v * LANES);    \
        UNROLL                                                                                  \
        for (int h = 0; h < (GROUP); h++) {                                                     \
            const f32x16 w = splat(weights[h][t]);                                              \
            UNROLL                                                                              \
            for (int v = 0; v < (VEC); v++) acc[h][v] += w * row[v];                            \
        }                                                                                       \
    }                                                                                           \
    UNROLL                                                                                      \
    for (int h = 0; h < (GROUP); h++) {                                                         \
        UNROLL                                                                                  \
        for (int v = 0; v < (VEC); v++) accumulators[h * (VEC) + v] = acc[h][v];                \
    }

#define TILE_ARGS(ELEM)                                                                         \
    const ELEM *restrict keys, const ELEM *restrict values, int64_t row_stride, int count,      \
    const f32x16 *restrict query, f32x16 *restrict accumulators, float *restrict running_max,   \
    float *restrict denominator, float softcap

#define DEFINE_TILE(SUFFIX, ELEM, LOADV, GROUP, VEC)                                            \
    static void tile_##SUFFIX##_g##GROUP##_v##VEC(TILE_ARGS(ELEM)) {                          \
        TILE_BODY(ELEM, LOADV, GROUP, VEC, sizeof(ELEM) < sizeof(float) && (GROUP) > 1)         \
    }

/* One sequence: SPECIALISED[d][g] takes a tile for head dim 16, 32, 64 or 128 (d = 0..3) and
 * groups of g + 1 query heads; any other shape goes one query head at a time, its vector
 * count known only at run time (at head dim 16, 256 sequences of 40-75 tokens and 2 heads a
 * group, that path took twice as long as the specialised tile). */
#define DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, VEC)                                          \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 1, VEC) DEFINE_TILE(SUFFIX, ELEM, LOADV, 2, VEC)           \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 3, VEC) DEFINE_TILE(SUFFIX, ELEM, LOADV, 4, VEC)           \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 5, VEC) DEFINE_TILE(SUFFIX, ELEM, LOADV, 6, VEC)           \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 7, VEC) DEFINE_TILE(SUFFIX, ELEM, LOADV, 8, VEC)
#define TILES_FOR_DIM(SUFFIX, VEC)                                                              \
    {tile_##SUFFIX##_g1_v##VEC, tile_##SUFFIX##_g2_v##VEC, tile_##SUFFIX##_g3_v##VEC,           \
     tile_##SUFFIX##_g4_v##VEC, tile_##SUFFIX##_g5_v##VEC, tile_##SUFFIX##_g6_v##VEC,           \
     tile_##SUFFIX##_g7_v##VEC, tile_##SUFFIX##_g8_v##VEC}

static inline int specialised_dim(int dim) {
    return dim == 16 ? 0 : dim == 32 ? 1 : dim == 64 ? 2 : dim == 128 ? 3 : -1;
}

#define DEFINE_SEQUENCE(SUFFIX, ELEM, LOADV, STORE)                                             \
    DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 1) DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 2)   \
    DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 4) DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 8)   \
    static void (*const SPECIALISED_##SUFFIX[4][8])(TILE_ARGS(ELEM)) = {                        \
        TILES_FOR_DIM(SUFFIX, 1), TILES_FOR_DIM(SUFFIX, 2), TILES_FOR_DIM(SUFFIX, 4),           \
        TILES_FOR_DIM(SUFFIX, 8)};                                                              \
    static void tile_##SUFFIX##_one_head(TILE_ARGS(ELEM), const int vec) {                      \
        TILE_BODY(ELEM, LOADV, 1, vec, 0)                                                       \
    }                                                                                           \
    static void sequence_##SUFFIX(const State *s, const ELEM *query, const ELEM *k_cache,       \
                                  const ELEM *v_cache, const int32_t *table, int seq_len,       \
                                  ELEM *out, int heads, int kv_heads, int dim, int block_size,  \
                                  float scale, int window, float softcap, int kv_begin,         \
                                  int kv_end) {                                                 \
        const int group = heads / kv_heads, vec = dim / LANES;                                  \
        const int first_head = kv_begin * group, end_head = kv_end * group;                     \
        const int64_t row_stride = (int64_t)kv_heads * dim;                                     \
        void (*specialised)(TILE_ARGS(ELEM)) =                                                  \
            specialised_dim(dim) >= 0 && group <= 8 ? SPECIALISED_##SUFFIX[specialised_dim(dim)][group - 1] \
                                                    : NULL;                                     \
        for (int h = first_head; h < end_head; h++) {                                           \
            for (int v = 0; v < vec; v++) {                                                     \
                s->query[h * vec + v] = LOADV(query + h * dim + v * LANES) * scale;             \
                s->acc[h * vec + v] = splat(0.0f);                                              \
            }                                                                                   \
            s->running_max[h] = -FLT_MAX;                                                       \
            s->denominator[h] = 0.0f;                                                           \
        }                                                                                       \
        const int first_key = window > 0 && seq_len > window ? seq_len - window : 0;            \
        for (int start = first_key, count; start < seq_len; start += count) {                   \
            count = tile_rows(start, seq_len, block_size);                                      \
            const int64_t row = row_offset(table, start, block_size, row_stride);               \
            int64_t next_row = 0, next_bytes = 0;                                               \
            if (start + count < seq_len) {                                                      \
                const int next = start + count;                                                 \
                next_row = row_offset(table, next, block_size, row_stride);                     \
                next_bytes = tile_rows(next, seq_len, block_size) * row_stride * (int64_t)sizeof(ELEM); \
            }                                                                                   \
            const int64_t share = (next_bytes / kv_heads + 63) & ~(int64_t)63;                   \
            for (int kv = kv_begin; kv < kv_end; kv++) {                                        \
                const int64_t from = kv * share;                                                \
                const int64_t upto = from + share < next_bytes ? from + share : next_bytes;     \
                if (upto > from) /* nothing past the last tile or the next tile's end */        \
                    prefetch_rows((const char *)(k_cache + next_row) + from,                    \
                                  (const char *)(v_cache + next_row) + from, upto - from);      \
                const ELEM *keys = k_cache + row + kv * dim, *values = v_cache + row + kv * dim; \
                const int first = kv * group;                                                   \
                if (specialised) {                                                              \
                    specialised(keys, values, row_stride, count, s->query + first * vec,        \
                                s->acc + first * vec, s->running_max + first, s->denominator + first, \
                                softcap);                                                       \
                    continue;                                                                   \
                }                                                                               \
                for (int h = first; h < first + group; h++)                                     \
                    tile_##SUFFIX##_one_head(keys, values, row_stride, count, s->query + h * vec, \
                                             s->acc + h * vec, s->running_max + h,              \
                                             s->denominator + h, softcap, vec);                 \
            }                                                                                   \
        }                                                                                       \
        for (int h = first_head; h < end_head; h++) {                                           \
            const float inverse = 1.0f / s->denominator[h];                                     \
            for (int v = 0; v < vec; v++) {                                                     \
                const f32x16 result = s->acc[h * vec + v] * inverse;                            \
                for (int i = 0; i < LANES; i++) out[h * dim + v * LANES + i] = STORE(result[i]); \
            }                                                                                   \
        }                                                                                       \
    }

static inline int unsupported_shape(int heads, int kv_heads, int dim, int block_size) {
    return dim < LANES || dim > MAX_DIM || dim % LANES || block_size < 1 || block_size > MAX_BLOCK
           || kv_heads < 1 || heads > MAX_HEADS || heads % kv_heads;
}

/* Attention whose work (cached token, query head) pairs x (head dim + 32) is below this runs
 * on the calling thread. A pair costs about 3.5 ns at head dim 16 and 6.7 at 64 (hence the
 * + 32), and waking a sleeping OpenMP thread about 60 us on these VMs (the worker's threads
 * sleep soon: engine.actors.workers), so below some 120 us of work a parallel region is
 * slower: with threads asleep, 1 sequence of 128 tokens and 9 heads of 64 took 77 us in
 * parallel and 14 alone, 8 such sequences 79 and 59. */
#define PARALLEL_MIN_WORK (3 << 19)

static inline int parallel_pays(const int32_t *seq_lens, int num_seqs, int heads, int dim, int window) {
    int64_t tokens = 0;
    for (int i = 0; i < num_seqs; i++)
        tokens += window > 0 && seq_lens[i] > window ? window : seq_lens[i];
    return tokens * heads * (dim + 32) >= PARALLEL_MIN_WORK;
}

/* NAME: returns 0, or -1 for a shape beyond the limits above. NAME##_units: units
 * [first, first + count) of the split (attention_units_per_sequence) on the calling thread, for a
 * caller that runs its own team (decode_stack.c); count = 0 checks the shape. */
#define DEFINE_ENTRY(NAME, SEQUENCE, ELEM)                                                      \
static inline void NAME##_unit(const State *state, int unit, int split, const ELEM *query,      \
                               int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache,      \
                               const int32_t *tables, int64_t table_stride,                     \
                               const int32_t *seq_lens, ELEM *out, int64_t out_stride,          \
                               int heads, int kv_heads, int dim, int block_size, float scale,   \
                               int window, float softcap)                                       \
{                                                                                               \
    const int seq = unit / split, per_unit = kv_heads / split, kv_begin = unit % split * per_unit; \
    SEQUENCE(state, query + seq * q_stride, k_cache, v_cache, tables + seq * table_stride,      \
             seq_lens[seq], out + seq * out_stride, heads, kv_heads, dim, block_size, scale,    \
             window, softcap, kv_begin, kv_begin + per_unit);                                   \
}                                                                                               \
int NAME(const ELEM *query, int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache,         \
         const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, ELEM *out,       \
         int64_t out_stride, int num_seqs, int heads, int kv_heads, int dim, int block_size,    \
         float scale, int window, float softcap)                                                \
{                                                                                               \
    if (unsupported_shape(heads, kv_heads, dim, block_size)) return -1;                         \
    const int vectors = heads * (dim / LANES);                                                  \
    const int split = attention_units_per_sequence(num_seqs, kv_heads, omp_get_max_threads()); \
    _Pragma("omp parallel if (parallel_pays(seq_lens, num_seqs, heads, dim, window))")         \
    {                                                                                           \
        f32x16 queries[vectors], accumulators[vectors];                                         \
        float running_max[heads], denominator[heads];                                           \
        const State state = {queries, accumulators, running_max, denominator};                  \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int unit = 0; unit < num_seqs * split; unit++)                                     \
            NAME##_unit(&state, unit, split, query, q_stride, k_cache, v_cache, tables,         \
                        table_stride, seq_lens, out, out_stride, heads, kv_heads, dim,          \
                        block_size, scale, window, softcap);                                    \
    }                                                                                           \
    return 0;                                                                                   \
}                                                                                               \
int NAME##_units(const ELEM *query, int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache, \
                 const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, ELEM *out, \
                 int64_t out_stride, int heads, int kv_heads, int dim, int block_size,          \
                 float scale, int window, float softcap, int split, int first, int count)       \
{                                                                                               \
    if (unsupported_shape(heads, kv_heads, dim, block_size) || split < 1 || kv_heads % split)   \
        return -1;                                                                              \
    if (!count) return 0;                                                                       \
    const int vectors = heads * (dim / LANES);                                                  \
    f32x16 queries[vectors], accumulators[vectors];                                             \
    float running_max[heads], denominator[heads];                                               \
    const State state = {queries, accumulators, running_max, denominator};                      \
    for (int unit = first; unit < first + count; unit++)                                        \
        NAME##_unit(&state, unit, split, query, q_stride, k_cache, v_cache, tables,             \
                    table_stride, seq_lens, out, out_stride, heads, kv_heads, dim, block_size,  \
                    scale, window, softcap);                                                    \
    return 0;                                                                                   \
}

#endif
