/* y = x @ w^T (+ bias) for w in the 16-row interleaved layout (quant_x16.h) and x quantized to
 * int8 (q8_activations.h), on CPUs with AVX-512 VNNI or AVX2 (quant_x16_vec.h: the same bits
 * in both); and the layout's conversions.
 *
 * A tile (16 rows' block k) is multiplied into up to MAX_ROWS activation rows at once: each
 * weight vector is 4 weights of each of the tile's rows (of 8 of them with AVX2), and one dot4
 * adds their products with 4 broadcast activation bytes into one int32 sum per row. With
 * AVX-512 all but Q6_K take two tiles side by side, so that each broadcast serves two
 * vpdpbusd; with AVX2 each broadcast serves a tile's two parts. The integer sums of a
 * group of 32 (or of a K type's sub-block) are scaled once, by the rows' scales loaded as
 * one vector, so the float work is a few instructions per 512 weight-activation products. The
 * arithmetic is quant_linear_int8.c's (the same integer sums, the same activation scales), in
 * another order of float additions.
 *
 * Output features [first, last) may cut a tile: the tile is computed whole and only the lanes
 * in range are stored (decode_stack.c claims chunks of 16 columns, so only a matrix's parts
 * that start off a multiple of 16 pay this).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exports.h"
#include "quant_x16.h"

#define NOT_BUILT -4

/* A block's bytes for each type this layout keeps, else 0: quant_blocks.h's block_bytes,
 * which this portable part cannot include (it needs AVX2). */
static int kept_block_bytes(int type) {
    switch (type) {
        case 2: return 18;
        case 3: return 20;
        case 8: return 34;
        case 12: return 144;
        case 13: return 176;
        case 14: return 210;
        default: return 0;
    }
}

/* Rows of a matrix, interleaved into dst: 0, -1 for a type not kept here, -2 when out is not
 * a multiple of 16 or `block` is not the type's. Portable C: it runs once per matrix at load. */
int triode_quant_x16_interleave(int type, const uint8_t *src, int64_t row_bytes, int64_t out, int block,
                                uint8_t *dst)
{
    if (!kept_block_bytes(type)) return -1;
    if (out % X16_ROWS || block != kept_block_bytes(type) || row_bytes % block) return -2;
    const int64_t blocks = row_bytes / block, groups = out / X16_ROWS;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t k = 0; k < blocks; k++) {
            uint8_t *tile = dst + (g * blocks + k) * X16_ROWS * block;
            for (int r = 0; r < X16_ROWS; r++) x16_place(type, tile, r, src + (g * X16_ROWS + r) * row_bytes + k * block);
        }
    return 0;
}

/* Row `row` of an interleaved matrix in GGUF's layout (row_bytes bytes into out). */
void triode_quant_x16_row(int type, const uint8_t *w, int64_t row_bytes, int block, int64_t row, uint8_t *out)
{
    const int64_t blocks = row_bytes / block;
    const uint8_t *group = w + row / X16_ROWS * X16_ROWS * row_bytes;
    for (int64_t k = 0; k < blocks; k++)
        x16_take(type, group + k * X16_ROWS * block, (int)(row % X16_ROWS), out + k * block);
}

#include "quant_x16_vec.h"

#ifdef X16_BUILT
#include "q8_activations.h"
#include "quant_x16_tiles.h"

#define PARALLEL_MIN_WEIGHTS 65536

/* Whether the kernel takes two groups of 16 rows at a time, each activation broadcast serving
 * both (quant_x16_tiles.h's sums_add): with AVX-512, but for Q6_K, whose tile keeps two sets
 * of sums already (its two halves' scales differ): for two tiles that is 32 accumulators,
 * more than the registers. AVX2's two parts of one tile are already two columns. */
static inline int pairs_groups(int type) { return type != TYPE_Q6_K && X16_PARTS == 1; }

/* Features [first, last) of acc, the sums of the X16_LANES features from `base`, plus the
 * bias; a column wholly outside them stores nothing. */
static inline __attribute__((always_inline)) void x16_store(
    const int rows, const fvec *acc, const float *bias, float *y, int64_t y_stride, int64_t base, int64_t first,
    int64_t last)
{
    const int lo = first > base ? (int)(first - base) : 0;
    const int hi = last < base + X16_LANES ? (int)(last - base) : X16_LANES;
    if (lo >= hi) return;
    UNROLL
    for (int r = 0; r < rows; r++) store_lanes(y + r * y_stride + base, acc[r], bias ? bias + base : NULL, lo, hi);
}

/* Row groups g .. g + tiles - 1 against ROWS activation rows, storing features [first, last). */
static inline __attribute__((always_inline)) void x16_tiles(
    const int type, const int rows, const int wide, rows_q8 x, int in, const uint8_t *w, int64_t row_bytes,
    const float *bias, float *y, int64_t y_stride, int64_t g, const int tiles, int64_t first, int64_t last)
{
    const int block = block_bytes(type), per_block = 32 * block_groups(type), blocks = in / per_block;
    const int64_t tile_bytes = (int64_t)X16_ROWS * block;
    const int columns = tiles * X16_PARTS;
    fvec acc[2][MAX_ROWS];
    UNROLL
    for (int i = 0; i < columns; i++)
        UNROLL
        for (int r = 0; r < rows; r++) acc[i][r] = MM(setzero_ps)();
    for (int k = 0; k < blocks; k++) {
        column c[2];
        UNROLL
        for (int i = 0; i < columns; i++) {
            c[i] = (column){w + (g + i / X16_PARTS) * X16_ROWS * row_bytes + k * tile_bytes, i % X16_PARTS};
            if (tile_bytes <= 1024 && c[i].part == 0) prefetch_ahead(c[i].tile, tile_bytes);
        }
        if (type == TYPE_Q6_K) {
            UNROLL
            for (int i = 0; i < columns; i++) tile_q6_k(rows, wide, x, in, c[i], k, acc[i]);
        } else if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
            tile_k45(type, rows, wide, x, in, c, columns, k, acc);
        } else {
            tile_small(type, rows, wide, x, in, c, columns, k, acc);
        }
    }
    UNROLL
    for (int i = 0; i < columns; i++)
        x16_store(rows, acc[i], bias, y, y_stride, (g + i / X16_PARTS) * X16_ROWS + i % X16_PARTS * X16_LANES, first,
                  last);
}

/* Tiles of row groups [g0, g1) against ROWS activation rows, storing features [first, last). */
static inline __attribute__((always_inline)) void x16_groups(
    const int type, const int rows, const int wide, rows_q8 x, int in, const uint8_t *w, int64_t row_bytes,
    const float *bias, float *y, int64_t y_stride, int64_t first, int64_t last)
{
    for (int64_t g = first / X16_ROWS; g * X16_ROWS < last;) {
        const int tiles = pairs_groups(type) && (g + 1) * X16_ROWS < last ? 2 : 1;
        if (tiles == 2) x16_tiles(type, rows, wide, x, in, w, row_bytes, bias, y, y_stride, g, 2, first, last);
        else x16_tiles(type, rows, wide, x, in, w, row_bytes, bias, y, y_stride, g, 1, first, last);
        g += tiles;
    }
}

/* The activations' view goes by pointer: by value (7 pointers, copied to the stack for each
 * call) a 2048-row matmul took 10% longer here, though the kernels' code was the same. */
#define DEFINE_X16_TILE(N, TYPE, SUFFIX, WIDE)                                                  \
static void x16_##SUFFIX##_##N##_##WIDE(const rows_q8 *x, const uint8_t *w, int64_t row_bytes, const float *bias, \
                                        float *y, int64_t y_stride, int in, int64_t first, int64_t last) \
{                                                                                               \
    x16_groups(TYPE, N, WIDE, *x, in, w, row_bytes, bias, y, y_stride, first, last);            \
}
#define X16_ENTRY(N, SUFFIX, WIDE) x16_##SUFFIX##_##N##_##WIDE,

#define DEFINE_X16(TYPE, SUFFIX)                                                                \
FOR_EACH_ROW_COUNT(DEFINE_X16_TILE, TYPE, SUFFIX, 0) FOR_EACH_ROW_COUNT(DEFINE_X16_TILE, TYPE, SUFFIX, 1) \
static void (*const x16_##SUFFIX[2][MAX_ROWS])(const rows_q8 *, const uint8_t *, int64_t, const float *, float *, \
                                               int64_t, int, int64_t, int64_t) = {               \
    {FOR_EACH_ROW_COUNT(X16_ENTRY, SUFFIX, 0)}, {FOR_EACH_ROW_COUNT(X16_ENTRY, SUFFIX, 1)}};
FOR_EACH_QUANT_TYPE(DEFINE_X16)

#define X16_CASE(TYPE, SUFFIX) \
    case TYPE: x16_##SUFFIX[wide][tile - 1](&xt, w, row_bytes, bias, y + r0 * y_stride, y_stride, in, from, to); break;

/* Features [first, last) of every activation row: within a block of ROW_BLOCK activation rows,
 * each group of 16 features (two with AVX-512, but for Q6_K) against all of them, MAX_ROWS at a
 * time, so that a group's weights come from memory once per block and a block's activations
 * (at most 128 rows of 14336 bytes here) stay in the caches while the groups go by. */
#define ROW_BLOCK 128

static void x16_range(int type, int wide, void *buffer, int64_t rows, int in, const uint8_t *w, int64_t row_bytes,
                      const float *bias, float *y, int64_t y_stride, int64_t first, int64_t last)
{
    for (int64_t block = 0; block < rows; block += ROW_BLOCK) {
        const int64_t block_end = rows - block < ROW_BLOCK ? rows : block + ROW_BLOCK;
        const int step = pairs_groups(type) ? 2 : 1;
        for (int64_t g = first / X16_ROWS; g * X16_ROWS < last; g += step) {
            const int64_t from = g * X16_ROWS > first ? g * X16_ROWS : first;
            const int64_t to = (g + step) * X16_ROWS < last ? (g + step) * X16_ROWS : last;
            for (int64_t r0 = block; r0 < block_end; r0 += MAX_ROWS) {
                const int tile = block_end - r0 < MAX_ROWS ? (int)(block_end - r0) : MAX_ROWS;
                const rows_q8 xt = wide ? q8_wide_rows(buffer, rows, in, q8_span(type), r0)
                                        : q8_rows(buffer, rows, in, q8_span(type), r0);
                switch (type) { FOR_EACH_QUANT_TYPE(X16_CASE) }
            }
        }
    }
}

static int x16_check(int type, int64_t row_bytes, int in, int64_t rows) {
    if (!(type & TYPE_X16) || !block_bytes(type & ~TYPE_X16)) return -1;
    if (!valid_shape(type & ~TYPE_X16, row_bytes, in)) return -2;
    return rows < 1 ? -3 : 0;
}

/* y = x @ w^T (+ bias) for an interleaved matrix of `out` features (a multiple of 16), x
 * quantized to int8 activations, or to wide ones (`wide`). Returns as triode_quant_linear_int8. */
int triode_quant_x16_linear(int type, int wide, const float *x, int64_t x_stride, const uint8_t *w,
                            int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t rows, int in,
                            int64_t out)
{
    const int status = x16_check(type, row_bytes, in, rows);
    if (status) return status;
    if (out % X16_ROWS) return -2;
    const int base = type & ~TYPE_X16;
    void *buffer = malloc((size_t)(wide ? q8_wide_bytes(rows, in) : q8_bytes(rows, in)));
    if (!buffer) return -5;
    const int64_t groups = out / X16_ROWS;
    if ((int64_t)in * out < PARALLEL_MIN_WEIGHTS) {
        triode_q8_quantize_rows(base, wide, x, x_stride, rows, in, buffer, 0, rows);
        x16_range(base, wide, buffer, rows, in, w, row_bytes, bias, y, y_stride, 0, out);
    } else {
        /* Each thread quantizes a share of the rows first: on the calling thread alone, a
         * 2048-row step's quantization left the other core idle (5.5% of a W1v run by default). */
        #pragma omp parallel
        {
            const int threads = omp_get_num_threads(), me = omp_get_thread_num();
            triode_q8_quantize_rows(base, wide, x, x_stride, rows, in, buffer, rows * me / threads,
                                    rows * (me + 1) / threads);
            #pragma omp barrier
            const int64_t g0 = groups * me / threads, g1 = groups * (me + 1) / threads;
            if (g0 < g1) x16_range(base, wide, buffer, rows, in, w, row_bytes, bias, y, y_stride, g0 * X16_ROWS, g1 * X16_ROWS);
        }
    }
    free(buffer);
    return 0;
}

/* Features [first, last) from activations quantized by triode_q8_quantize_rows (int8, or
 * `wide`), on the calling thread (decode_stack.c's share of a matrix); `w`
 * is the whole matrix. last = first checks the arguments; -2 where first < 0 or last < first. */
int triode_quant_x16_linear_q8(int type, int wide, void *buffer, int64_t rows, int in, const uint8_t *w,
                               int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t first,
                               int64_t last)
{
    const int status = x16_check(type, row_bytes, in, rows);
    if (status) return status;
    if (first < 0 || last < first) return -2;
    if (first < last) x16_range(type & ~TYPE_X16, wide, buffer, rows, in, w, row_bytes, bias, y, y_stride, first, last);
    return 0;
}

#else

int triode_quant_x16_linear(int type, int wide, const float *x, int64_t x_stride, const uint8_t *w,
                            int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t rows, int in,
                            int64_t out)
{
    return NOT_BUILT;
}

int triode_quant_x16_linear_q8(int type, int wide, void *buffer, int64_t rows, int in, const uint8_t *w,
                               int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t first,
                               int64_t last)
{
    return NOT_BUILT;
}

#endif
