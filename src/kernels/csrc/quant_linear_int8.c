/* y = x @ w^T (+ bias) with w in GGUF's quantized blocks and x quantized to int8 on the way
 * in, as llama.cpp computes it: the measured faster option next to quant_linear.c's float32
 * path (kernels.quant_linear picks one).
 *
 * Each 32 activations of a row become int8 values x_q with one float scale (max |x| / 127;
 * q8_activations.c).
 * A group of 32 weights stays in its bytes (quant_blocks.h's group_of): one multiply-add
 * instruction (maddubs) takes 32 byte pairs, where the float32 path widens every weight to a
 * float first. With w = scale * q + offset, a group's share of a dot product is
 * scale * x_scale * sum(q * x_q) + offset * x_scale * sum(x_q): exactly w . x_scale * x_q, so
 * the error is sum(w * rounding), as small for the offset types as for the others (with the
 * float sum of x instead, it would be sum((w - offset) * rounding), twice as large). maddubs multiplies
 * unsigned by signed bytes, so Q8_0's signed weights go in as |q| with the sign moved onto
 * the activation, and Q6_K's as q + 32 (0..63), with 32 * scale * sum(x_q) taken off per 16
 * (integer arithmetic: the same sums, two instructions fewer per group). maddubs' 16-bit sums
 * cannot overflow: |q| <= 128 and |x_q| <= 127.
 *
 * Layouts as in quant_linear.c; rows run in tiles of up to MAX_ROWS, the weights decoded
 * once per tile.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exports.h"
#include "quant_x16.h"

#define NOT_BUILT -4

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_blocks.h"

#define MAX_ROWS 4
#define PARALLEL_MIN_WEIGHTS 65536
/* How far ahead of the K-type loop its weights are prefetched, in blocks: 16 streamed an 8B
 * model's Q4_K and Q6_K matrices from memory 3-7% faster than 8 (24-64: no better). */
#define PREFETCH_BLOCKS 16

#include "q8_activations.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Group k of a 32-weight block type's row against every row of the tile, into acc and
 * offsets (w = scale * q + offset: offset * x_scale * sum(x_q) is the offset's share). */
static inline __attribute__((always_inline)) void int8_group(
    const int type, const int rows, rows_q8 x, int in, const uint8_t *w_row, int k, __m256 *acc,
    float *offsets)
{
    const int is_signed = group_is_signed(type), row_groups = in / 32;
    const group_q q = group_of(type, w_row + (int64_t)k * block_bytes(type), 0);
    const __m256i wq = _mm256_set_m128i(q.hi, q.lo);
    const __m256i magnitude = is_signed ? _mm256_sign_epi8(wq, wq) : wq;
    UNROLL
    for (int r = 0; r < rows; r++) {
        __m256i xq = _mm256_loadu_si256((const __m256i *)(x.q + (int64_t)r * in + 32 * k));
        if (is_signed) xq = _mm256_sign_epi8(xq, wq);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xq), _mm256_set1_epi16(1));
        const float x_scale = x.scale[r * row_groups + k];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(q.scale_lo * x_scale), acc[r]);
        offsets[r] += q.offset * x_scale * (float)x.sum[r * row_groups + k];
    }
}

/* The 6-bit scales and mins of a Q4_K / Q5_K block's 8 sub-blocks, one byte each, as two
 * 64-bit words (quant_blocks.h's k_scale_min has the layout): bytes 0-3 hold scales 0-3 and,
 * in their top two bits, the high bits of scales 4-7; bytes 4-7 the same for the mins; bytes
 * 8-11 the low four bits of scales 4-7 (low nibbles) and mins 4-7 (high nibbles). Word-wise
 * it is a dozen instructions for all sixteen (with the shuffles below, Q4_K 201 -> 176 us on
 * a cache-resident 1024 x 4096 matrix, one thread). */
static inline void k_scales(const uint8_t *packed, uint64_t *scales, uint64_t *mins) {
    uint32_t u[3];
    memcpy(u, packed, sizeof u);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    const uint32_t scales_hi = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    const uint32_t mins_hi = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    *scales = (u[0] & six) | (uint64_t)scales_hi << 32;
    *mins = (u[1] & six) | (uint64_t)mins_hi << 32;
}

/* The 32 unsigned 6-bit values (q + 32) of group g of a Q6_K block. */
static inline __m256i q6_k_values(const uint8_t *b, int g) {
    const int n = g >> 2, s = g & 3;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (s & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, (s >> 1) * 4), _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

/* Group g's two scales (of weights 0..15 and 16..31) as 16-bit lanes for madd, from the
 * block's 16 scales widened once (all_scales): a broadcast of their pair and a byte shuffle,
 * instead of two scalar broadcasts per group. */
static inline __m256i q6_k_scales(__m256i all_scales, int g) {
    const __m256i pair = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(all_scales, _mm256_set1_epi32(g)), pair);
}

/* One K-type block (256 weights) against every row of the tile. The activations have one
 * scale for the block, so the integer sums of its 8 groups, each times its integer scale
 * (madd's second operand), add up before a single float multiply-add per row. */
static inline __attribute__((always_inline)) void k_block(
    const int type, const int rows, rows_q8 x, int in, const uint8_t *b, int block, __m256 *acc)
{
    __m256i sums[MAX_ROWS];
    UNROLL
    for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
    const int8_t *xq = x.q + 256 * block;
    float d, dmin = 0.0f;
    uint64_t scales = 0, mins = 0;
    if (type == TYPE_Q6_K) {
        d = half_to_float(b + 208);
        const __m256i all_scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        UNROLL
        for (int g = 0; g < 8; g++) {
            const __m256i scales = q6_k_scales(all_scales, g);
            const __m256i q = q6_k_values(b, g);
            UNROLL
            for (int r = 0; r < rows; r++) {
                const __m256i xr = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)r * in + 32 * g));
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xr), scales));
            }
        }
        /* The values went in as q + 32 (unsigned, for maddubs): take 32 * scale * sum(x) off
         * for each of the 16 sub-blocks of 16, in one multiply-add over their sums. */
        UNROLL
        for (int r = 0; r < rows; r++) {
            const __m256i xs = _mm256_loadu_si256((const __m256i *)(x.sum16 + r * (in / 16) + 16 * block));
            sums[r] = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(_mm256_madd_epi16(all_scales, xs), 5));
        }
    } else {
        d = half_to_float(b);
        dmin = half_to_float(b + 2);
        k_scales(b + 4, &scales, &mins);
        /* The 8 scales as 16-bit lanes, in both halves: a byte shuffle then broadcasts one. */
        const __m256i wide_scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)scales)));
        const uint8_t *qs = b + (type == TYPE_Q5_K ? 48 : 16), *qh = b + 16;
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        UNROLL
        for (int p = 0; p < 4; p++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            __m256i lo = _mm256_and_si256(packed, nibble);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            if (type == TYPE_Q5_K) {
                const __m256i high = _mm256_loadu_si256((const __m256i *)qh), one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * p), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * p + 1), one), 4));
            }
            const __m256i scale_lo = _mm256_shuffle_epi8(wide_scales, _mm256_set1_epi16((short)(0x0100 + 0x0404 * p)));
            const __m256i scale_hi = _mm256_shuffle_epi8(wide_scales, _mm256_set1_epi16((short)(0x0302 + 0x0404 * p)));
            UNROLL
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + (int64_t)r * in + 64 * p;
                const __m256i dot_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr));
                const __m256i dot_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32)));
                sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(_mm256_madd_epi16(dot_lo, scale_lo),
                                                                     _mm256_madd_epi16(dot_hi, scale_hi)));
            }
        }
    }
    /* Each of the 8 mins twice, as 16-bit lanes: one madd with the activations' sums of 16
     * gives each min times the sum of its 32 activations, and the mins' share goes into the
     * same float accumulator as the scales' (a multiply and a horizontal sum per block and
     * row had been a tenth of the Q4_K loop). */
    const __m128i min_bytes = _mm_cvtsi64_si128((int64_t)mins);
    const __m256i mins_twice = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(min_bytes, min_bytes));
    UNROLL
    for (int r = 0; r < rows; r++) {
        const float x_scale = x.scale[r * (in / 256) + block];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(d * x_scale), acc[r]);
        if (type != TYPE_Q6_K) {
            const __m256i xs = _mm256_loadu_si256((const __m256i *)(x.sum16 + r * (in / 16) + 16 * block));
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins_twice, xs)),
                                      _mm256_set1_ps(dmin * x_scale), acc[r]);
        }
    }
}

/* One output row j against ROWS activation rows; TYPE and ROWS are constants once inlined.
 * Even and odd groups (or blocks) add into separate sums, so that consecutive multiply-adds
 * do not wait on each other (with one row they would otherwise be the critical path). */
static inline __attribute__((always_inline)) void int8_row(
    const int type, const int rows, rows_q8 x, int in, const uint8_t *w_row, float *sums)
{
    const int k_type = block_groups(type) > 1, count = k_type ? in / 256 : in / 32;
    __m256 even[MAX_ROWS], odd[MAX_ROWS];
    float even_offsets[MAX_ROWS], odd_offsets[MAX_ROWS];
    UNROLL
    for (int r = 0; r < rows; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        even_offsets[r] = odd_offsets[r] = 0.0f;
    }
    int k = 0;
    const int block_size = block_bytes(type);
    for (; k + 1 < count; k += 2) {
        if (k_type) {
            /* The next blocks' lines, ahead of the hardware prefetcher (measured on an 8B
             * model's 28672 x 4096 gate/up matrix: Q4_K 4.0-4.3 ms instead of 4.5-5.2). */
            const char *ahead = (const char *)(w_row + (int64_t)(k + PREFETCH_BLOCKS) * block_size);
            for (int line = 0; line < 2 * block_size; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
            k_block(type, rows, x, in, w_row + (int64_t)k * block_size, k, even);
            k_block(type, rows, x, in, w_row + (int64_t)(k + 1) * block_size, k + 1, odd);
        } else {
            int8_group(type, rows, x, in, w_row, k, even, even_offsets);
            int8_group(type, rows, x, in, w_row, k + 1, odd, odd_offsets);
        }
    }
    if (k < count) {
        if (k_type) k_block(type, rows, x, in, w_row + (int64_t)k * block_size, k, even);
        else int8_group(type, rows, x, in, w_row, k, even, even_offsets);
    }
    UNROLL
    for (int r = 0; r < rows; r++)
        sums[r] = hsum8(_mm256_add_ps(even[r], odd[r])) + even_offsets[r] + odd_offsets[r];
}

/* Output features [first, last) against a tile of N rows. */
#define DEFINE_TILE(NAME, TYPE, N)                                                              \
static void NAME##_##N(rows_q8 x, const uint8_t *w, int64_t row_bytes, const float *bias,       \
                       float *y, int64_t y_stride, int in, int64_t first, int64_t last)         \
{                                                                                               \
    for (int64_t j = first; j < last; j++) {                                                    \
        float sums[MAX_ROWS];                                                                   \
        int8_row(TYPE, N, x, in, w + j * row_bytes, sums);                                      \
        const float offset = bias ? bias[j] : 0.0f;                                             \
        for (int r = 0; r < N; r++) y[r * y_stride + j] = sums[r] + offset;                     \
    }                                                                                           \
}

#define TILE_CASE(NAME, N)                                                                      \
    case N: RUN_SHARES(parallel, out, NAME##_##N, x, w, row_bytes, bias, y, y_stride, in); break;

#define DEFINE_TYPED(NAME, TYPE)                                                                \
DEFINE_TILE(NAME, TYPE, 1) DEFINE_TILE(NAME, TYPE, 2) DEFINE_TILE(NAME, TYPE, 3)                \
DEFINE_TILE(NAME, TYPE, 4)                                                                      \
static void NAME(rows_q8 x, const uint8_t *w, int64_t row_bytes, const float *bias, float *y,   \
                 int64_t y_stride, int rows, int in, int64_t out, int parallel)                 \
{                                                                                               \
    switch (rows) { TILE_CASE(NAME, 1) TILE_CASE(NAME, 2) TILE_CASE(NAME, 3) TILE_CASE(NAME, 4) } \
}

#define DEFINE_INT8(TYPE, SUFFIX) DEFINE_TYPED(int8_##SUFFIX, TYPE)
FOR_EACH_QUANT_TYPE(DEFINE_INT8)

#define INT8_CASE(TYPE, SUFFIX) \
    case TYPE: int8_##SUFFIX(xt, w, row_bytes, bias, yt, y_stride, tile, in, out, parallel); break;

static void q8_linear(int type, void *buffer, int64_t rows, int in, const uint8_t *w, int64_t row_bytes,
                      const float *bias, float *y, int64_t y_stride, int64_t out, int parallel)
{
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int tile = rows - r0 < MAX_ROWS ? (int)(rows - r0) : MAX_ROWS;
        const rows_q8 xt = q8_rows(buffer, rows, in, q8_span(type), r0);
        float *yt = y + r0 * y_stride;
        switch (type) { FOR_EACH_QUANT_TYPE(INT8_CASE) }
    }
}

/* Returns 0; -1 for a type not decoded here; -2 when in and row_bytes disagree with the
 * type's blocks; -3 for rows < 1; -5 when the activations' buffer cannot be allocated. */
int triode_quant_linear_int8(int type, const float *x, int64_t x_stride, const uint8_t *w,
                             int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                             int64_t rows, int in, int64_t out)
{
    if (type & TYPE_X16)
        return triode_quant_x16_linear(type, 0, x, x_stride, w, row_bytes, bias, y, y_stride, rows, in, out);
    if (!block_bytes(type)) return -1;
    if (!valid_shape(type, row_bytes, in)) return -2;
    if (rows < 1) return -3;
    void *buffer = malloc((size_t)q8_bytes(rows, in));
    if (!buffer) return -5;
    triode_q8_quantize(type, x, x_stride, rows, in, buffer);
    q8_linear(type, buffer, rows, in, w, row_bytes, bias, y, y_stride, out,
              (int64_t)in * out >= PARALLEL_MIN_WEIGHTS);
    free(buffer);
    return 0;
}

/* y = x @ w^T from x quantized by triode_q8_quantize (q8_activations.c) for weights of this
 * type, on the calling thread: a share of the output features for a caller that runs its own
 * team (decode_stack.c). out = 0 checks the type and shape. An interleaved matrix's share is
 * given as the whole matrix and the features [first, first + out) (tiles are 16 rows). */
int triode_quant_linear_q8(int type, void *buffer, int64_t rows, int in, const uint8_t *w,
                           int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t first,
                           int64_t out)
{
    if (type & TYPE_X16)
        return triode_quant_x16_linear_q8(type, 0, buffer, rows, in, w, row_bytes, bias, y, y_stride, first,
                                          first + out);
    w += first * row_bytes;
    bias = bias ? bias + first : NULL;
    y += first;
    if (!block_bytes(type)) return -1;
    if (!valid_shape(type, row_bytes, in)) return -2;
    if (rows < 1) return -3;
    q8_linear(type, buffer, rows, in, w, row_bytes, bias, y, y_stride, out, 0);
    return 0;
}

#else

int triode_quant_linear_int8(int type, const float *x, int64_t x_stride, const uint8_t *w,
                             int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                             int64_t rows, int in, int64_t out)
{
    return NOT_BUILT;
}

int triode_quant_linear_q8(int type, void *buffer, int64_t rows, int in, const uint8_t *w,
                           int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t first,
                           int64_t out)
{
    return NOT_BUILT;
}

#endif
