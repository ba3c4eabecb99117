/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence attends to the sequence's cached tokens, read in place from
 * its blocks (no gathered copy). A sequence is one unit of work (one KV head of it when
 * there are fewer sequences than twice the threads). Its cache is walked in tiles of up to
 * LANES (vec.h: 16 with AVX-512, 8 without) consecutive rows of one block (paged_decode_tile.h);
 * for each KV head, the tile's keys and values are loaded once and serve every query head of the
 * head's group, and softmax is computed online, one tile at a time.
 *
 * A prompt's tokens come here as decodes of their own contexts (kernels/paged_attention.py), so
 * neighbouring rows are often two consecutive tokens of one sequence. Such a pair is one unit:
 * the tiles both rows read whole go through the tile for twice the group, both rows' heads at
 * once, so that their independent chains (the score tree, the exponentials, the running max)
 * overlap; each head still takes the same operations in the same order, so the bits are those
 * of the rows one at a time. At the default model's shape, 30 layers, one 512-token prompt:
 * float32 59.6 -> 45.2 ms, bfloat16 (keys then staged, before the dot products of
 * paged_decode_tile.h) 64.6 -> 46.3 (AMD EPYC Zen 5).
 *
 * A head's scores of a tile come from one partial-sum vector a row (vec.h), added together in
 * a transpose-and-add tree instead of a horizontal sum each, and their exponentials are one vector
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
 * dim is a multiple of LANES.
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
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "exports.h"
#include "paged_decode_tile.h"
#include "vec.h"

#define MAX_HEADS 64
#define MAX_DIM 256
#define MAX_BLOCK 64

/* Where pair_ keeps row r's head h (of KV head kv's group, `group` heads a KV head): KV head by
 * KV head, the group's heads of the first row and then of the second, so that the tile for
 * twice the group runs both rows' heads. */
#define PAIR_SLOT(kv, r, h) (((kv) * 2 + (r)) * group + (h) - (kv) * group)

/* Head `at` of `from` into head `head` of `to`: query, accumulator, running max, denominator. */
static inline void move_head(const State *from, int at, const State *to, int head, int vec) {
    for (int v = 0; v < vec; v++) {
        to->query[head * vec + v] = from->query[at * vec + v];
        to->acc[head * vec + v] = from->acc[at * vec + v];
    }
    to->running_max[head] = from->running_max[at];
    to->denominator[head] = from->denominator[at];
}

static const Ahead NOTHING_AHEAD = {NULL, NULL, 0};

/* The sequence's tile from token `next`, all KV heads (nothing past seq_len). */
static inline Ahead next_tile(const void *k_cache, const void *v_cache, int elem_size, const int32_t *table,
                              int next, int seq_len, int block_size, int64_t row_stride) {
    if (next >= seq_len) return NOTHING_AHEAD;
    const int64_t offset = row_offset(table, next, block_size, row_stride) * elem_size;
    const Ahead tile = {(const char *)k_cache + offset, (const char *)v_cache + offset,
                        tile_rows(next, seq_len, block_size) * row_stride * elem_size};
    return tile;
}

/* KV head kv's share of `tile`: the tile's rows are contiguous in their block, all KV heads of
 * a row side by side, so the shares are consecutive ranges of its bytes, one per KV head,
 * rounded to cache lines. */
static inline Ahead kv_share(const Ahead *tile, int kv, int kv_heads) {
    const int64_t share = (tile->bytes / kv_heads + 63) & ~(int64_t)63;
    const int64_t from = kv * share, upto = from + share < tile->bytes ? from + share : tile->bytes;
    const Ahead ahead = {tile->keys + from, tile->values + from, upto > from ? upto - from : 0};
    return ahead;
}

/* One sequence: SPECIALISED[d][g] takes a tile for head dim 16, 32, 64 or 128 (d = 0..3) and
 * groups of g + 1 query heads; any other shape goes one query head at a time, its vector
 * count known only at run time (at head dim 16, 256 sequences of 40-75 tokens and 2 heads a
 * group, that path took twice as long as the specialised tile). */
#define DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, DIM)                                          \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 1, DIM) DEFINE_TILE(SUFFIX, ELEM, LOADV, 2, DIM)           \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 3, DIM) DEFINE_TILE(SUFFIX, ELEM, LOADV, 4, DIM)           \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 5, DIM) DEFINE_TILE(SUFFIX, ELEM, LOADV, 6, DIM)           \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 7, DIM) DEFINE_TILE(SUFFIX, ELEM, LOADV, 8, DIM)
#define TILES_FOR_DIM(SUFFIX, DIM)                                                              \
    {tile_##SUFFIX##_g1_d##DIM, tile_##SUFFIX##_g2_d##DIM, tile_##SUFFIX##_g3_d##DIM,           \
     tile_##SUFFIX##_g4_d##DIM, tile_##SUFFIX##_g5_d##DIM, tile_##SUFFIX##_g6_d##DIM,           \
     tile_##SUFFIX##_g7_d##DIM, tile_##SUFFIX##_g8_d##DIM}

static inline int specialised_dim(int dim) {
    return dim == 16 ? 0 : dim == 32 ? 1 : dim == 64 ? 2 : dim == 128 ? 3 : -1;
}

/* Whether a tile is compiled for this head dim and group (the rest go a head at a time). */
static inline int has_specialised_tile(int dim, int group) {
    return specialised_dim(dim) >= 0 && group <= 8;
}

#define DEFINE_SEQUENCE(SUFFIX, ELEM, LOADV, STORE)                                             \
    DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 16)                                               \
    DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 32)                                               \
    DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 64)                                               \
    DEFINE_TILES_FOR_DIM(SUFFIX, ELEM, LOADV, 128)                                              \
    static void (*const SPECIALISED_##SUFFIX[4][8])(TILE_ARGS(ELEM)) = {                        \
        TILES_FOR_DIM(SUFFIX, 16), TILES_FOR_DIM(SUFFIX, 32), TILES_FOR_DIM(SUFFIX, 64),        \
        TILES_FOR_DIM(SUFFIX, 128)};                                                            \
    static void tile_##SUFFIX##_one_head(TILE_ARGS(ELEM), const int vec) {                      \
        TILE_BODY(ELEM, LOADV, 1, vec, 0, 0)                                                    \
    }                                                                                           \
    static void tiles_##SUFFIX(const State *s, const ELEM *k_cache, const ELEM *v_cache,        \
                               const int32_t *table, int start, int seq_len, int kv_heads, int dim, \
                               int block_size, int group, float softcap, int kv_begin, int kv_end) { \
        const int vec = dim / LANES;                                                            \
        const int64_t row_stride = (int64_t)kv_heads * dim;                                     \
        void (*specialised)(TILE_ARGS(ELEM)) =                                                  \
            has_specialised_tile(dim, group) ? SPECIALISED_##SUFFIX[specialised_dim(dim)][group - 1] \
                                                    : NULL;                                     \
        for (int count; start < seq_len; start += count) {                                      \
            count = tile_rows(start, seq_len, block_size);                                      \
            const int64_t row = row_offset(table, start, block_size, row_stride);               \
            const Ahead next = next_tile(k_cache, v_cache, sizeof(ELEM), table, start + count, seq_len, \
                                         block_size, row_stride);                               \
            for (int kv = kv_begin; kv < kv_end; kv++) {                                        \
                const Ahead ahead = kv_share(&next, kv, kv_heads);                              \
                const ELEM *keys = k_cache + row + kv * dim, *values = v_cache + row + kv * dim; \
                const int first = kv * group;                                                   \
                if (specialised) {                                                              \
                    specialised(keys, values, row_stride, count, s->query + first * vec,        \
                                s->acc + first * vec, s->running_max + first, s->denominator + first, \
                                softcap, &ahead);                                               \
                    continue;                                                                   \
                }                                                                               \
                for (int h = first; h < first + group; h++)                                     \
                    tile_##SUFFIX##_one_head(keys, values, row_stride, count, s->query + h * vec, \
                                             s->acc + h * vec, s->running_max + h,              \
                                             s->denominator + h, softcap,                       \
                                             h == first ? &ahead : &NOTHING_AHEAD, vec);        \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    static void begin_##SUFFIX(const State *s, int at, const ELEM *query, int vec, float scale) { \
        for (int v = 0; v < vec; v++) {                                                         \
            s->query[at * vec + v] = LOADV(query + v * LANES) * scale;                          \
            s->acc[at * vec + v] = splat(0.0f);                                                 \
        }                                                                                       \
        s->running_max[at] = -FLT_MAX;                                                          \
        s->denominator[at] = 0.0f;                                                              \
    }                                                                                           \
    static void finish_##SUFFIX(const State *s, ELEM *out, int first_head, int end_head, int dim, \
                                int group) {                                                    \
        const int vec = dim / LANES;                                                            \
        /* whether the tiles took the values through BF16_VALUES (the specialised ones do) */   \
        const int in_pairs = DOTS_FOR(ELEM, vec) && has_specialised_tile(dim, group);           \
        for (int h = first_head; h < end_head; h++) {                                           \
            const float inverse = 1.0f / s->denominator[h];                                     \
            for (int v = 0; v < vec; v++) {                                                     \
                const f32v result = s->acc[h * vec + v] * inverse;                              \
                for (int i = 0; i < LANES; i++)                                                 \
                    out[h * dim + value_dimension(v, i, in_pairs)] = STORE(result[i]);          \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    static void sequence_##SUFFIX(const State *s, const ELEM *query, const ELEM *k_cache,       \
                                  const ELEM *v_cache, const int32_t *table, int seq_len,       \
                                  ELEM *out, int heads, int kv_heads, int dim, int block_size,  \
                                  float scale, int window, float softcap, int kv_begin,         \
                                  int kv_end) {                                                 \
        const int group = heads / kv_heads, vec = dim / LANES;                                  \
        for (int h = kv_begin * group; h < kv_end * group; h++)                                 \
            begin_##SUFFIX(s, h, query + h * dim, vec, scale);                                  \
        const int first_key = window > 0 && seq_len > window ? seq_len - window : 0;            \
        tiles_##SUFFIX(s, k_cache, v_cache, table, first_key, seq_len, kv_heads, dim, block_size, \
                       group, softcap, kv_begin, kv_end);                                       \
        finish_##SUFFIX(s, out, kv_begin * group, kv_end * group, dim, group);                  \
    }                                                                                           \
    static void pair_##SUFFIX(const State *pair, const State *const rows[2],                    \
                              const ELEM *const queries[2], const ELEM *k_cache, const ELEM *v_cache, \
                              const int32_t *table, int seq_len, ELEM *const outs[2], int heads, \
                              int kv_heads, int dim, int block_size, float scale, float softcap, \
                              int kv_begin, int kv_end) {                                       \
        const int group = heads / kv_heads, vec = dim / LANES;                                  \
        const int64_t row_stride = (int64_t)kv_heads * dim;                                     \
        void (*const both)(TILE_ARGS(ELEM)) = SPECIALISED_##SUFFIX[specialised_dim(dim)][2 * group - 1]; \
        for (int kv = kv_begin; kv < kv_end; kv++)                                              \
            for (int r = 0; r < 2; r++)                                                         \
                for (int h = kv * group; h < (kv + 1) * group; h++)                             \
                    begin_##SUFFIX(pair, PAIR_SLOT(kv, r, h), queries[r] + h * dim, vec, scale); \
        int start = 0;                                                                          \
        for (int count; start < seq_len; start += count) {                                      \
            count = tile_rows(start, seq_len, block_size);                                      \
            if (count != tile_rows(start, seq_len + 1, block_size)) break;                      \
            const int64_t row = row_offset(table, start, block_size, row_stride);               \
            for (int kv = kv_begin; kv < kv_end; kv++) {                                        \
                const int first = PAIR_SLOT(kv, 0, kv * group);                                 \
                both(k_cache + row + kv * dim, v_cache + row + kv * dim, row_stride, count,     \
                     pair->query + first * vec, pair->acc + first * vec, pair->running_max + first, \
                     pair->denominator + first, softcap, &NOTHING_AHEAD);                       \
            }                                                                                   \
        }                                                                                       \
        for (int kv = kv_begin; kv < kv_end; kv++)                                              \
            for (int r = 0; r < 2; r++)                                                         \
                for (int h = kv * group; h < (kv + 1) * group; h++)                             \
                    move_head(pair, PAIR_SLOT(kv, r, h), rows[r], h, vec);                      \
        for (int r = 0; r < 2; r++) {                                                           \
            tiles_##SUFFIX(rows[r], k_cache, v_cache, table, start, seq_len + r, kv_heads, dim, \
                           block_size, group, softcap, kv_begin, kv_end);                       \
            finish_##SUFFIX(rows[r], outs[r], kv_begin * group, kv_end * group, dim, group);    \
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

/* Whether rows a and a + 1 are two consecutive tokens of one prompt, as pair_ takes them: one
 * token apart, reading the same blocks, every key of each (no window cuts them), and a
 * specialised tile for twice the group. */
static inline int pairable(const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, int a,
                           int group, int dim, int block_size, int window) {
    const int length = seq_lens[a + 1];
    if (length != seq_lens[a] + 1 || (window > 0 && length > window) || !has_specialised_tile(dim, 2 * group))
        return 0;
    const int blocks = (length + block_size - 1) / block_size;
    return !memcmp(tables + a * table_stride, tables + (a + 1) * table_stride, blocks * sizeof(int32_t));
}

/* NAME: returns 0, or -1 for a shape beyond the limits above. NAME##_units: units
 * [first, first + count) of the split (attention_units_per_sequence) on the calling thread, for a
 * caller that runs its own team (decode_stack.c); count = 0 checks the shape. */
#define DEFINE_ENTRY(NAME, SUFFIX, ELEM)                                                        \
static inline void NAME##_unit(const State *state, int unit, int split, const ELEM *query,      \
                               int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache,      \
                               const int32_t *tables, int64_t table_stride,                     \
                               const int32_t *seq_lens, ELEM *out, int64_t out_stride,          \
                               int heads, int kv_heads, int dim, int block_size, float scale,   \
                               int window, float softcap)                                       \
{                                                                                               \
    const int seq = unit / split, per_unit = kv_heads / split, kv_begin = unit % split * per_unit; \
    sequence_##SUFFIX(state, query + seq * q_stride, k_cache, v_cache, tables + seq * table_stride, \
                      seq_lens[seq], out + seq * out_stride, heads, kv_heads, dim, block_size,  \
                      scale, window, softcap, kv_begin, kv_begin + per_unit);                   \
}                                                                                               \
int NAME(const ELEM *query, int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache,         \
         const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, ELEM *out,       \
         int64_t out_stride, int num_seqs, int heads, int kv_heads, int dim, int block_size,    \
         float scale, int window, float softcap)                                                \
{                                                                                               \
    if (unsupported_shape(heads, kv_heads, dim, block_size)) return -1;                         \
    const int vectors = heads * (dim / LANES);                                                  \
    const int split = attention_units_per_sequence(num_seqs, kv_heads, omp_get_max_threads()); \
    const int per_unit = kv_heads / split, group = heads / kv_heads;                            \
    _Pragma("omp parallel if (parallel_pays(seq_lens, num_seqs, heads, dim, window))")         \
    {                                                                                           \
        f32v queries[2][vectors], accumulators[2][vectors];                                     \
        float running_max[2][heads], denominator[2][heads];                                     \
        f32v pair_queries[2 * vectors], pair_accumulators[2 * vectors];                         \
        float pair_max[2 * heads], pair_denominator[2 * heads];                                 \
        const State first = {queries[0], accumulators[0], running_max[0], denominator[0]};      \
        const State second = {queries[1], accumulators[1], running_max[1], denominator[1]};     \
        const State pair = {pair_queries, pair_accumulators, pair_max, pair_denominator};       \
        const State *const rows[2] = {&first, &second};                                         \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int unit = 0; unit < num_seqs * split; unit++) {                                   \
            /* Rows 2k and 2k + 1 pair up where they can; row 2k's unit takes both. */          \
            const int seq = unit / split, part = unit % split, kv_begin = part * per_unit;      \
            const int a = seq & ~1, paired = a + 1 < num_seqs                                   \
                && pairable(tables, table_stride, seq_lens, a, group, dim, block_size, window); \
            if (!paired) {                                                                      \
                NAME##_unit(&first, unit, split, query, q_stride, k_cache, v_cache, tables,     \
                            table_stride, seq_lens, out, out_stride, heads, kv_heads, dim,      \
                            block_size, scale, window, softcap);                                \
            } else if (seq == a) {                                                              \
                const ELEM *const pair_queries_in[2] = {query + a * q_stride, query + (a + 1) * q_stride}; \
                ELEM *const outs[2] = {out + a * out_stride, out + (a + 1) * out_stride};       \
                pair_##SUFFIX(&pair, rows, pair_queries_in, k_cache, v_cache,                   \
                              tables + a * table_stride, seq_lens[a], outs, heads, kv_heads, dim, \
                              block_size, scale, softcap, kv_begin, kv_begin + per_unit);       \
            }                                                                                   \
        }                                                                                       \
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
    f32v queries[vectors], accumulators[vectors];                                               \
    float running_max[heads], denominator[heads];                                               \
    const State state = {queries, accumulators, running_max, denominator};                      \
    for (int unit = first; unit < first + count; unit++)                                        \
        NAME##_unit(&state, unit, split, query, q_stride, k_cache, v_cache, tables,             \
                    table_stride, seq_lens, out, out_stride, heads, kv_heads, dim, block_size,  \
                    scale, window, softcap);                                                    \
    return 0;                                                                                   \
}

#endif
