/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence attends to the sequence's cached tokens, read in place from
 * its blocks (no gathered copy). A sequence is one unit of work. Its cache is walked in tiles
 * of up to 16 consecutive rows of one block; for each KV head, the tile's keys and values are
 * loaded once and serve every query head of the head's group, and softmax is computed online,
 * one tile at a time.
 *
 * Vectors are 16 floats (GCC/Clang vector extensions: AVX-512 registers where the CPU has
 * them, narrower ones elsewhere). A head's 16 scores of a tile come from 16 partial-sum
 * vectors added together in a transpose-and-add tree instead of 16 horizontal sums, and for
 * head dims 64 and 128 with groups of up to 8 query heads the tile's queries and accumulators
 * are compile-time arrays, kept in registers. With the cache in L2, one thread takes 32 ns
 * for a token of one KV head of the default model (float32), against 52 for the scalar loops
 * this replaced. From memory the loads bound it: at 64 sequences x 192 tokens in scattered
 * blocks it reads 12-16 GB/s against 11-12 before. A loop that only reads the same blocks in
 * the same order reaches 16-18 GB/s, 23-24 when it also prefetches as below, 25-27 reading
 * each block whole: the rest of the gap is arithmetic that does not overlap the loads. Over
 * the W1v benchmark, decode attention took 17.1 s against 19.7 s before.
 *
 * Layouts (element strides):
 *   query      [seqs, heads, dim], token stride q_stride, head stride dim
 *   k/v cache  [blocks, block_size, kv_heads, dim], contiguous
 *   tables     [seqs, table_stride] int32 block ids
 *   seq_lens   [seqs] int32, 1..table capacity
 *   out        [seqs, heads, dim], token stride out_stride
 * dim is a multiple of 16.
 *
 * Rows of a block past the sequence's length are never loaded (they may hold anything).
 * Compiled by kernels.native with -O3 -march=native -ffast-math -fopenmp; nothing here relies
 * on infinities or NaNs (scores are finite, the running max starts at -FLT_MAX).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_HEADS 64
#define MAX_DIM 256
#define MAX_BLOCK 64
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
 * hardware prefetchers follow poorly), so the next tile is fetched whole while this one is
 * computed. At 64 sequences of 96-192 tokens in scattered blocks, float32, 30 layers: 35 ->
 * 28 ms. */
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

/* One tile (count <= 16 rows, row stride row_stride) of one KV head for its GROUP query
 * heads of VEC vectors each. With GROUP and VEC literals the local arrays are registers. */
#define TILE_BODY(ELEM, LOADV, GROUP, VEC)                                                      \
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                 \
    const i32x16 valid = lane < count;                                                          \
    float weights[GROUP][LANES], rescale[GROUP];                                                \
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
                for (int v = 0; v < (VEC); v++) even += q[v] * LOADV(keys + t * row_stride + v * LANES); \
            }                                                                                   \
            if (t + 1 < count) {                                                                \
                UNROLL                                                                          \
                for (int v = 0; v < (VEC); v++) odd += q[v] * LOADV(keys + (t + 1) * row_stride + v * LANES); \
            }                                                                                   \
            half[t / 2] = pair_rows(even, odd);                                                 \
        }                                                                                       \
        const f32x16 scores = select(valid, finish_rows(half), splat(-FLT_MAX));                \
        const float previous = running_max[h], tile_max = lane_max(scores);                     \
        const float new_max = tile_max > previous ? tile_max : previous;                        \
        rescale[h] = new_max > previous ? expf(previous - new_max) : 1.0f;                      \
        float shifted[LANES];                                                                   \
        store_f32(shifted, select(valid, scores - new_max, splat(0.0f)));                       \
        UNROLL                                                                                  \
        for (int t = 0; t < LANES; t++) shifted[t] = expf(shifted[t]);                          \
        const f32x16 p = select(valid, load_f32(shifted), splat(0.0f));                         \
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
    float *restrict denominator

#define DEFINE_TILE(SUFFIX, ELEM, LOADV, GROUP, VEC)                                            \
    static void tile_##SUFFIX##_g##GROUP##_v##VEC(TILE_ARGS(ELEM)) { TILE_BODY(ELEM, LOADV, GROUP, VEC) }

/* One sequence: SPECIALISED[v][g] takes a tile for head dim 64 (v = 0) or 128 (v = 1) and
 * groups of g + 1 query heads; any other shape goes one query head at a time, its vector
 * count known only at run time. */
#define DEFINE_SEQUENCE(SUFFIX, ELEM, LOADV, STORE)                                             \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 1, 4) DEFINE_TILE(SUFFIX, ELEM, LOADV, 2, 4)               \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 3, 4) DEFINE_TILE(SUFFIX, ELEM, LOADV, 4, 4)               \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 5, 4) DEFINE_TILE(SUFFIX, ELEM, LOADV, 6, 4)               \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 7, 4) DEFINE_TILE(SUFFIX, ELEM, LOADV, 8, 4)               \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 1, 8) DEFINE_TILE(SUFFIX, ELEM, LOADV, 2, 8)               \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 3, 8) DEFINE_TILE(SUFFIX, ELEM, LOADV, 4, 8)               \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 5, 8) DEFINE_TILE(SUFFIX, ELEM, LOADV, 6, 8)               \
    DEFINE_TILE(SUFFIX, ELEM, LOADV, 7, 8) DEFINE_TILE(SUFFIX, ELEM, LOADV, 8, 8)               \
    static void (*const SPECIALISED_##SUFFIX[2][8])(TILE_ARGS(ELEM)) = {                        \
        {tile_##SUFFIX##_g1_v4, tile_##SUFFIX##_g2_v4, tile_##SUFFIX##_g3_v4,                   \
         tile_##SUFFIX##_g4_v4, tile_##SUFFIX##_g5_v4, tile_##SUFFIX##_g6_v4,                   \
         tile_##SUFFIX##_g7_v4, tile_##SUFFIX##_g8_v4},                                         \
        {tile_##SUFFIX##_g1_v8, tile_##SUFFIX##_g2_v8, tile_##SUFFIX##_g3_v8,                   \
         tile_##SUFFIX##_g4_v8, tile_##SUFFIX##_g5_v8, tile_##SUFFIX##_g6_v8,                   \
         tile_##SUFFIX##_g7_v8, tile_##SUFFIX##_g8_v8}};                                        \
    static void tile_##SUFFIX##_one_head(TILE_ARGS(ELEM), const int vec) {                      \
        TILE_BODY(ELEM, LOADV, 1, vec)                                                          \
    }                                                                                           \
    static void sequence_##SUFFIX(const State *s, const ELEM *query, const ELEM *k_cache,       \
                                  const ELEM *v_cache, const int32_t *table, int seq_len,       \
                                  ELEM *out, int heads, int kv_heads, int dim, int block_size,  \
                                  float scale) {                                                \
        const int group = heads / kv_heads, vec = dim / LANES;                                  \
        const int64_t row_stride = (int64_t)kv_heads * dim;                                     \
        void (*specialised)(TILE_ARGS(ELEM)) =                                                  \
            (dim == 64 || dim == 128) && group <= 8 ? SPECIALISED_##SUFFIX[dim == 128][group - 1] \
                                                    : NULL;                                     \
        for (int h = 0; h < heads; h++) {                                                       \
            for (int v = 0; v < vec; v++) {                                                     \
                s->query[h * vec + v] = LOADV(query + h * dim + v * LANES) * scale;             \
                s->acc[h * vec + v] = splat(0.0f);                                              \
            }                                                                                   \
            s->running_max[h] = -FLT_MAX;                                                       \
            s->denominator[h] = 0.0f;                                                           \
        }                                                                                       \
        for (int start = 0, count; start < seq_len; start += count) {                           \
            count = tile_rows(start, seq_len, block_size);                                      \
            const int64_t row = row_offset(table, start, block_size, row_stride);               \
            if (start + count < seq_len) {                                                      \
                const int next = start + count;                                                 \
                const int64_t next_row = row_offset(table, next, block_size, row_stride);       \
                prefetch_rows((const char *)(k_cache + next_row), (const char *)(v_cache + next_row), \
                              tile_rows(next, seq_len, block_size) * row_stride * (int64_t)sizeof(ELEM)); \
            }                                                                                   \
            for (int kv = 0; kv < kv_heads; kv++) {                                             \
                const ELEM *keys = k_cache + row + kv * dim, *values = v_cache + row + kv * dim; \
                const int first = kv * group;                                                   \
                if (specialised) {                                                              \
                    specialised(keys, values, row_stride, count, s->query + first * vec,        \
                                s->acc + first * vec, s->running_max + first, s->denominator + first); \
                    continue;                                                                   \
                }                                                                               \
                for (int h = first; h < first + group; h++)                                     \
                    tile_##SUFFIX##_one_head(keys, values, row_stride, count, s->query + h * vec, \
                                             s->acc + h * vec, s->running_max + h,              \
                                             s->denominator + h, vec);                          \
            }                                                                                   \
        }                                                                                       \
        for (int h = 0; h < heads; h++) {                                                       \
            const float inverse = 1.0f / s->denominator[h];                                     \
            for (int v = 0; v < vec; v++) {                                                     \
                const f32x16 result = s->acc[h * vec + v] * inverse;                            \
                for (int i = 0; i < LANES; i++) out[h * dim + v * LANES + i] = STORE(result[i]); \
            }                                                                                   \
        }                                                                                       \
    }

#define STORE_F32(x) (x)
DEFINE_SEQUENCE(f32, float, load_f32, STORE_F32)
DEFINE_SEQUENCE(bf16, uint16_t, load_bf16, float_to_bf16)

/* Returns 0, or -1 for a shape beyond the limits above. */
#define DEFINE_ENTRY(NAME, SEQUENCE, ELEM)                                                      \
int NAME(const ELEM *query, int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache,         \
         const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, ELEM *out,       \
         int64_t out_stride, int num_seqs, int heads, int kv_heads, int dim, int block_size,    \
         float scale)                                                                           \
{                                                                                               \
    if (dim < LANES || dim > MAX_DIM || dim % LANES || block_size < 1 ||                        \
        block_size > MAX_BLOCK || kv_heads < 1 || heads > MAX_HEADS || heads % kv_heads)        \
        return -1;                                                                              \
    const int vectors = heads * (dim / LANES);                                                  \
    _Pragma("omp parallel")                                                                     \
    {                                                                                           \
        f32x16 queries[vectors], accumulators[vectors];                                         \
        float running_max[heads], denominator[heads];                                           \
        const State state = {queries, accumulators, running_max, denominator};                  \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int seq = 0; seq < num_seqs; seq++)                                                \
            SEQUENCE(&state, query + seq * q_stride, k_cache, v_cache,                          \
                     tables + seq * table_stride, seq_lens[seq], out + seq * out_stride, heads, \
                     kv_heads, dim, block_size, scale);                                         \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_ENTRY(triode_paged_decode_f32, sequence_f32, float)
DEFINE_ENTRY(triode_paged_decode_bf16, sequence_bf16, uint16_t)
