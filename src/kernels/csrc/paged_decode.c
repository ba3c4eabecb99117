/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence attends to the sequence's cached tokens, read in place from
 * its blocks (no gathered copy). A sequence is one unit of work: its blocks are read whole
 * and in order (each cached row, all KV heads, is loaded once and serves every query head of
 * its group), and softmax is computed online, one block at a time.
 *
 * Layouts (element strides):
 *   query      [seqs, heads, dim], token stride q_stride, head stride dim
 *   k/v cache  [blocks, block_size, kv_heads, dim], contiguous
 *   tables     [seqs, table_stride] int32 block ids
 *   seq_lens   [seqs] int32, 1..table capacity
 *   out        [seqs, heads, dim], token stride out_stride
 *
 * Compiled by kernels.native with -O3 -march=native -ffast-math -fopenmp; nothing
 * here relies on infinities or NaNs (scores are finite, the running max starts at -FLT_MAX).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEADS 64
#define MAX_DIM 256
#define MAX_BLOCK 64

typedef struct {
    float query[MAX_HEADS * MAX_DIM]; /* pre-scaled */
    float acc[MAX_HEADS * MAX_DIM];
    float scores[MAX_HEADS][MAX_BLOCK];
    float running_max[MAX_HEADS], denominator[MAX_HEADS];
    float row[MAX_DIM];
} Scratch;

/* One sequence; ELEM is float or uint16_t (bfloat16 bits). */
#define DEFINE_SEQUENCE(NAME, ELEM, LOAD, STORE)                                                 \
static inline __attribute__((always_inline)) void NAME(                                        \
    Scratch *s, const ELEM *query, const ELEM *k_cache, const ELEM *v_cache,                   \
    const int32_t *table, int seq_len, ELEM *out, int heads, int kv_heads, const int dim,      \
    int block_size, float scale)                                                                \
{                                                                                               \
    const int group = heads / kv_heads;                                                         \
    const int64_t row_stride = (int64_t)kv_heads * dim;                                         \
    for (int h = 0; h < heads; h++) {                                                           \
        for (int d = 0; d < dim; d++) s->query[h * dim + d] = LOAD(query[h * dim + d]) * scale; \
        memset(s->acc + h * dim, 0, sizeof(float) * dim);                                       \
        s->running_max[h] = -FLT_MAX;                                                           \
        s->denominator[h] = 0.0f;                                                               \
    }                                                                                           \
    for (int start = 0; start < seq_len; start += block_size) {                                \
        const int count = seq_len - start < block_size ? seq_len - start : block_size;         \
        const int64_t base = (int64_t)table[start / block_size] * block_size * row_stride;     \
        for (int p = 0; p < count; p++) {                                                       \
            for (int kv = 0; kv < kv_heads; kv++) {                                             \
                const ELEM *key = k_cache + base + p * row_stride + kv * dim;                   \
                for (int d = 0; d < dim; d++) s->row[d] = LOAD(key[d]);                         \
                for (int h = kv * group; h < (kv + 1) * group; h++) {                           \
                    const float *q = s->query + h * dim;                                        \
                    float dot = 0.0f;                                                           \
                    for (int d = 0; d < dim; d++) dot += q[d] * s->row[d];                      \
                    s->scores[h][p] = dot;                                                      \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int h = 0; h < heads; h++) {                                                       \
            float *scores = s->scores[h];                                                       \
            float block_max = s->running_max[h];                                                \
            for (int p = 0; p < count; p++) block_max = scores[p] > block_max ? scores[p] : block_max; \
            const float rescale = expf(s->running_max[h] - block_max);                          \
            float sum = 0.0f;                                                                   \
            for (int p = 0; p < count; p++) {                                                   \
                scores[p] = expf(scores[p] - block_max);                                        \
                sum += scores[p];                                                               \
            }                                                                                   \
            s->denominator[h] = s->denominator[h] * rescale + sum;                              \
            s->running_max[h] = block_max;                                                      \
            float *acc = s->acc + h * dim;                                                      \
            for (int d = 0; d < dim; d++) acc[d] *= rescale;                                    \
        }                                                                                       \
        for (int p = 0; p < count; p++) {                                                       \
            for (int kv = 0; kv < kv_heads; kv++) {                                             \
                const ELEM *value = v_cache + base + p * row_stride + kv * dim;                 \
                for (int d = 0; d < dim; d++) s->row[d] = LOAD(value[d]);                       \
                for (int h = kv * group; h < (kv + 1) * group; h++) {                           \
                    const float weight = s->scores[h][p];                                       \
                    float *acc = s->acc + h * dim;                                              \
                    for (int d = 0; d < dim; d++) acc[d] += weight * s->row[d];                 \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int h = 0; h < heads; h++) {                                                           \
        const float inverse = 1.0f / s->denominator[h];                                         \
        for (int d = 0; d < dim; d++) out[h * dim + d] = STORE(s->acc[h * dim + d] * inverse);  \
    }                                                                                           \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_SEQUENCE(sequence_f32, float, LOAD_F32, STORE_F32)
DEFINE_SEQUENCE(sequence_bf16, uint16_t, bf16_to_float, float_to_bf16)

/* Returns 0, -1 for a shape beyond the limits above, -2 when out of memory. The dim of the
 * default models is specialised so that the inner loops have a constant trip count. */
#define DEFINE_ENTRY(NAME, SEQUENCE, ELEM)                                                      \
int NAME(const ELEM *query, int64_t q_stride, const ELEM *k_cache, const ELEM *v_cache,        \
         const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, ELEM *out,      \
         int64_t out_stride, int num_seqs, int heads, int kv_heads, int dim, int block_size,   \
         float scale)                                                                           \
{                                                                                               \
    if (dim < 1 || dim > MAX_DIM || block_size < 1 || block_size > MAX_BLOCK ||                 \
        kv_heads < 1 || heads > MAX_HEADS || heads % kv_heads)                                   \
        return -1;                                                                              \
    int failed = 0;                                                                             \
    _Pragma("omp parallel")                                                                     \
    {                                                                                           \
        Scratch *scratch = malloc(sizeof(Scratch));                                             \
        if (!scratch) {                                                                         \
            _Pragma("omp atomic write")                                                         \
            failed = 1;                                                                         \
        }                                                                                       \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int seq = 0; seq < num_seqs; seq++) {                                              \
            if (!scratch) continue;                                                             \
            const ELEM *q = query + seq * q_stride;                                             \
            const int32_t *table = tables + seq * table_stride;                                 \
            ELEM *o = out + seq * out_stride;                                                   \
            if (dim == 64)                                                                      \
                SEQUENCE(scratch, q, k_cache, v_cache, table, seq_lens[seq], o, heads,          \
                         kv_heads, 64, block_size, scale);                                      \
            else                                                                                \
                SEQUENCE(scratch, q, k_cache, v_cache, table, seq_lens[seq], o, heads,          \
                         kv_heads, dim, block_size, scale);                                     \
        }                                                                                       \
        free(scratch);                                                                          \
    }                                                                                           \
    return failed ? -2 : 0;                                                                     \
}

DEFINE_ENTRY(triode_paged_decode_f32, sequence_f32, float)
DEFINE_ENTRY(triode_paged_decode_bf16, sequence_bf16, uint16_t)
