/* y = x @ w^T (+ bias) with w kept in GGUF's quantized blocks, x and y float32, for CPUs.
 *
 * A decode step multiplies each weight matrix by a few rows, so the step is one pass over
 * the weights, and quantized weights are fewer bytes to pass over: 4.5 to 8.5 bits a weight
 * instead of 32. Each group of 32 weights is decoded once into registers (quant_blocks.h)
 * and multiplied into every row of the tile, float32 throughout, so results stay as close to
 * the dequantized model's as the order of a float32 sum allows. Tiles are up to MAX_ROWS
 * rows; more rows run as several tiles, each decoding the weights again (measured: decoding
 * each weight row once into a buffer for all tiles was no faster at 16 to 64 rows, the
 * multiply-adds dominate), and the caller moves large batches to a dequantized panel and a
 * matrix-multiply library (kernels.quant_linear).
 *
 * Layouts (element strides): x [rows, in] with row stride x_stride; w [out] rows of
 * row_bytes bytes, each in / 32 groups of blocks; bias [out] float32 or NULL; y [rows, out]
 * with row stride y_stride. Also here: rows of w dequantized to float32 (embedding lookups,
 * the panels, loading for a model that runs unquantized).
 */
#include <stdint.h>
#include <stdlib.h>

#include "exports.h"
#include "quant_x16.h"

/* Returned by every entry point of a build for a CPU without AVX2: the kernels need it. */
#define NOT_BUILT -4

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_blocks.h"

#define MAX_ROWS 8
/* The tiles of 1 to 3 rows keep NV partial sums a row, the larger ones one: a call whose
 * results must not depend on how many rows it has (batch invariance) runs tiles of at most
 * this many rows, so every row's sum is added in the same order. */
#define INVARIANT_ROWS 3
/* Below this many weights a call runs on the calling thread (waking the team costs more). */
#define PARALLEL_MIN_WEIGHTS 65536

/* One output row j: its blocks decoded group by group, each group into ROWS rows' fused
 * multiply-adds. TYPE and ROWS are constants after inlining. With fewer than 4 rows each row
 * keeps NV partial sums, so that the adds of one row do not wait on each other. */
static inline __attribute__((always_inline)) void quant_row(
    const int type, const int rows, const float *x, int64_t x_stride, const uint8_t *w_row,
    int in, float *sums)
{
    const int split = rows < 4;
    vf acc[MAX_ROWS][NV];
    UNROLL
    for (int r = 0; r < rows; r++)
        UNROLL
        for (int v = 0; v < NV; v++) acc[r][v] = vf_splat(0.0f);
    const int groups = block_groups(type), bytes = block_bytes(type);
    const int blocks = in / (32 * groups);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *block = w_row + (int64_t)b * bytes;
        for (int g = 0; g < groups; g++) {
            vf w[NV];
            decode_group(type, block, g, w);
            const float *xk = x + (b * groups + g) * 32;
            UNROLL
            for (int r = 0; r < rows; r++)
                UNROLL
                for (int v = 0; v < NV; v++) {
                    vf *sum = &acc[r][split ? v : 0];
                    *sum = vf_fma(w[v], vf_load(xk + r * x_stride + v * VL), *sum);
                }
        }
    }
    UNROLL
    for (int r = 0; r < rows; r++) {
        vf total = acc[r][0];
        if (split)
            UNROLL
            for (int v = 1; v < NV; v++) total = vf_add(total, acc[r][v]);
        sums[r] = vf_sum(total);
    }
}

/* Output features [first, last) against a tile of N rows. */
#define DEFINE_TILE(NAME, TYPE, N)                                                              \
static void NAME##_##N(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,   \
                       const float *bias, float *y, int64_t y_stride, int in, int64_t first,    \
                       int64_t last)                                                            \
{                                                                                               \
    for (int64_t j = first; j < last; j++) {                                                    \
        float sums[MAX_ROWS];                                                                   \
        quant_row(TYPE, N, x, x_stride, w + j * row_bytes, in, sums);                           \
        const float offset = bias ? bias[j] : 0.0f;                                             \
        for (int r = 0; r < N; r++) y[r * y_stride + j] = sums[r] + offset;                     \
    }                                                                                           \
}

#define TILE_CASE(NAME, N)                                                                      \
    case N: RUN_SHARES(parallel, out, NAME##_##N, x, x_stride, w, row_bytes, bias, y, y_stride, in); break;

#define DEFINE_TYPED(NAME, TYPE)                                                                \
DEFINE_TILE(NAME, TYPE, 1) DEFINE_TILE(NAME, TYPE, 2) DEFINE_TILE(NAME, TYPE, 3)                \
DEFINE_TILE(NAME, TYPE, 4) DEFINE_TILE(NAME, TYPE, 5) DEFINE_TILE(NAME, TYPE, 6)                \
DEFINE_TILE(NAME, TYPE, 7) DEFINE_TILE(NAME, TYPE, 8)                                           \
static void NAME(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,        \
                 const float *bias, float *y, int64_t y_stride, int rows, int in, int64_t out,  \
                 int parallel)                                                                  \
{                                                                                               \
    switch (rows) {                                                                             \
        TILE_CASE(NAME, 1) TILE_CASE(NAME, 2) TILE_CASE(NAME, 3) TILE_CASE(NAME, 4)             \
        TILE_CASE(NAME, 5) TILE_CASE(NAME, 6) TILE_CASE(NAME, 7) TILE_CASE(NAME, 8)             \
    }                                                                                           \
}

#define DEFINE_LINEAR(TYPE, SUFFIX) DEFINE_TYPED(linear_##SUFFIX, TYPE)
FOR_EACH_QUANT_TYPE(DEFINE_LINEAR)

#define LINEAR_CASE(TYPE, SUFFIX) \
    case TYPE: linear_##SUFFIX(xt, x_stride, w, row_bytes, bias, yt, y_stride, tile, in, out, parallel); break;

static int quant_linear(int type, const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                        const float *bias, float *y, int64_t y_stride, int64_t rows, int in, int64_t out,
                        int parallel, int max_tile)
{
    if (!block_bytes(type)) return -1;
    if (!valid_shape(type, row_bytes, in)) return -2;
    if (rows < 1) return -3;
    for (int64_t r0 = 0; r0 < rows; r0 += max_tile) {
        const int tile = rows - r0 < max_tile ? (int)(rows - r0) : max_tile;
        const float *xt = x + r0 * x_stride;
        float *yt = y + r0 * y_stride;
        switch (type) { FOR_EACH_QUANT_TYPE(LINEAR_CASE) }
    }
    return 0;
}

/* Returns 0; -1 for a type not decoded here; -2 when in and row_bytes disagree with the
 * type's blocks; -3 for rows < 1. With `invariant`, each row's result is independent of the
 * other rows (tiles of INVARIANT_ROWS). */
int triode_quant_linear(int type, const float *x, int64_t x_stride, const uint8_t *w,
                        int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                        int64_t rows, int in, int64_t out, int invariant)
{
    return quant_linear(type, x, x_stride, w, row_bytes, bias, y, y_stride, rows, in, out,
                        (int64_t)in * out >= PARALLEL_MIN_WEIGHTS, invariant ? INVARIANT_ROWS : MAX_ROWS);
}

/* The same on the calling thread only: a share of the output features for a caller that
 * runs its own team (decode_stack.c), batch invariant when `invariant` is set. out = 0 checks
 * the type and shape. */
int triode_quant_linear_serial(int type, const float *x, int64_t x_stride, const uint8_t *w,
                               int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                               int64_t rows, int in, int64_t out, int invariant)
{
    return quant_linear(type, x, x_stride, w, row_bytes, bias, y, y_stride, rows, in, out, 0,
                        invariant ? INVARIANT_ROWS : MAX_ROWS);
}

static inline __attribute__((always_inline)) void dequantize_row(
    const int type, const uint8_t *w_row, int in, float *out)
{
    const int groups = block_groups(type), bytes = block_bytes(type);
    const int blocks = in / (32 * groups);
    for (int b = 0; b < blocks; b++)
        for (int g = 0; g < groups; g++) {
            vf w[NV];
            decode_group(type, w_row + (int64_t)b * bytes, g, w);
            float *dst = out + (b * groups + g) * 32;
            UNROLL
            for (int v = 0; v < NV; v++) vf_store(dst + v * VL, w[v]);
        }
}

#define DEQUANTIZE_CASE(TYPE, SUFFIX)                                                           \
    case TYPE:                                                                                  \
        _Pragma("omp parallel for schedule(static) if (parallel)")                              \
        for (int64_t i = 0; i < count; i++)                                                     \
            dequantize_row(TYPE, w + (ids ? ids[i] : first + i) * row_bytes, in,                \
                           out + i * out_stride);                                               \
        break;

/* An interleaved matrix's rows (quant_x16.h): each taken back into GGUF's layout, then decoded. */
#define DEQUANTIZE_X16_CASE(TYPE, SUFFIX)                                                       \
    case TYPE:                                                                                  \
        _Pragma("omp parallel if (parallel)")                                                   \
        {                                                                                       \
            uint8_t *row = malloc((size_t)row_bytes);                                           \
            _Pragma("omp for schedule(static)")                                                 \
            for (int64_t i = 0; i < count; i++) {                                               \
                if (!row) continue;                                                             \
                triode_quant_x16_row(TYPE, w, row_bytes, block_bytes(TYPE), ids ? ids[i] : first + i, row); \
                dequantize_row(TYPE, row, in, out + i * out_stride);                            \
            }                                                                                   \
            if (!row) {                                                                         \
                _Pragma("omp atomic write")                                                     \
                failed = 1;                                                                     \
            }                                                                                   \
            free(row);                                                                          \
        }                                                                                       \
        break;

/* out[i, :] = row (ids ? ids[i] : first + i) of w, dequantized, for i < count; w is in GGUF's
 * layout, or interleaved (type | TYPE_X16). Row ids are not checked here (the caller did).
 * Returns 0, or -1 / -2 as triode_quant_linear, -5 when a scratch row cannot be allocated. */
int triode_quant_dequantize(int type, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                            int64_t first, int64_t count, int in, float *out, int64_t out_stride)
{
    const int base = type & ~TYPE_X16;
    if (!block_bytes(base)) return -1;
    if (!valid_shape(base, row_bytes, in)) return -2;
    const int parallel = (int64_t)in * count >= PARALLEL_MIN_WEIGHTS;
    int failed = 0;
    if (type & TYPE_X16) {
        switch (base) { FOR_EACH_QUANT_TYPE(DEQUANTIZE_X16_CASE) }
    } else {
        switch (type) { FOR_EACH_QUANT_TYPE(DEQUANTIZE_CASE) }
    }
    return failed ? -5 : 0;
}

#else

int triode_quant_linear(int type, const float *x, int64_t x_stride, const uint8_t *w,
                        int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                        int64_t rows, int in, int64_t out, int invariant)
{
    return NOT_BUILT;
}

int triode_quant_linear_serial(int type, const float *x, int64_t x_stride, const uint8_t *w,
                               int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                               int64_t rows, int in, int64_t out, int invariant)
{
    return NOT_BUILT;
}

int triode_quant_dequantize(int type, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                            int64_t first, int64_t count, int in, float *out, int64_t out_stride)
{
    return NOT_BUILT;
}

#endif
