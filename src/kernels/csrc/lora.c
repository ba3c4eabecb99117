/* Batched LoRA for CPUs: y[r] += (x[r] @ A[s]) @ B[s] for each row r of a step with an adapter
 * slot s (slots[r] >= 0), float32 activations over float32 or bfloat16 weights (lora.h).
 *
 * Both halves are axpys over contiguous vectors (vec.h), with A and B stored transposed: the
 * shrink adds x[r, i] * A[s][i][j..j+LANES] over i in order (up to 4 rows of one slot sharing
 * each vector of A, A's rows read once, in order), the expand B[s][k][c..c+LANES] * h[r, k]
 * over k in order (4 vectors of columns at once), into a delta that is then added to y. So
 * every output element's sums run in an order fixed by its own row (batch invariance:
 * docs/architecture.md), whatever the other rows, their slots, or how the columns are cut into
 * chunks (each column's lane does the same fused multiply-adds, named: vec.h's fma_of). The
 * decode stack calls the column-range forms from its team; the module path calls
 * triode_lora_f32, which splits rows among OpenMP threads.
 */
#include <stdint.h>

#include "bf16.h"
#include "exports.h"
#include "lora.h"
#include "vec.h"

/* Rows * weights below which triode_lora_f32 stays on the calling thread. */
#define PARALLEL_MIN_WORK (1 << 18)

static inline float weight_at(const lora_matrix *w, const void *base, int64_t index) {
    return w->bf16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

static inline f32v weights_at(const lora_matrix *w, const void *base, int64_t index) {
    return w->bf16 ? load_bf16((const uint16_t *)base + index) : load_f32((const float *)base + index);
}

/* Up to this many consecutive rows of one slot share each loaded vector of A, and up to
 * SHRINK_VECTORS vectors of h's columns are summed at once: independent chains of fused
 * multiply-adds, which the core overlaps, over A's rows read in order, once. */
#define SHRINK_ROWS 4
#define SHRINK_VECTORS 4
/* Vectors of output columns one row's expand sums at once (independent chains). */
#define EXPAND_VECTORS 4

/* h[n, j..j + vectors * LANES) for n < count rows of one slot (a: that slot's A). */
static void shrink_block(const lora_matrix *w, const void *a, int64_t width, const float *x, int64_t x_stride,
                         int count, float *h, int64_t j, int vectors)
{
    f32v sum[SHRINK_ROWS][SHRINK_VECTORS] = {{{0}}};
    for (int64_t i = 0; i < w->in; i++) {
        for (int v = 0; v < vectors; v++) {
            const f32v weights = weights_at(w, a, i * width + j + v * LANES);
            for (int n = 0; n < count; n++) sum[n][v] = fma_of(splat(x[n * x_stride + i]), weights, sum[n][v]);
        }
    }
    for (int n = 0; n < count; n++)
        for (int v = 0; v < vectors; v++) store_f32(h + n * width + j + v * LANES, sum[n][v]);
}

void triode_lora_shrink(const lora_matrix *w, const float *x, int64_t x_stride, const int32_t *slots,
                        int64_t rows, float *h)
{
    const int64_t width = (int64_t)w->parts * w->rank, in = w->in, vectors = width / LANES;
    for (int64_t r = 0; r < rows;) {
        if (slots[r] < 0) {
            r++;
            continue;
        }
        int count = 1;
        while (count < SHRINK_ROWS && r + count < rows && slots[r + count] == slots[r]) count++;
        const int64_t slot = (int64_t)slots[r] * in * width;
        const void *a = w->bf16 ? (const void *)((const uint16_t *)w->a + slot) : (const void *)((const float *)w->a + slot);
        for (int64_t v = 0; v < vectors; v += SHRINK_VECTORS)
            shrink_block(w, a, width, x + r * x_stride, x_stride, count, h + r * width, v * LANES,
                         (int)(vectors - v < SHRINK_VECTORS ? vectors - v : SHRINK_VECTORS));
        for (int n = 0; n < count; n++)
            for (int64_t j = vectors * LANES; j < width; j++) {
                float sum = 0.0f;
                for (int64_t i = 0; i < in; i++) sum += x[(r + n) * x_stride + i] * weight_at(w, a, i * width + j);
                h[(r + n) * width + j] = sum;
            }
        r += count;
    }
}

/* The expand of columns [first, last) of one part, which reads h's values part * rank.. */
static void expand_part(const lora_matrix *w, const float *h, const int32_t *slots, int64_t rows, float *y,
                        int64_t y_stride, int part, int64_t first, int64_t last)
{
    const int64_t rank = w->rank, out = w->out, width = (int64_t)w->parts * rank;
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < 0) continue;
        const int64_t slot = (int64_t)slots[r] * rank * out;
        const float *hr = h + r * width + part * rank;
        float *yr = y + r * y_stride;
        int64_t c = first;
        for (; c + EXPAND_VECTORS * LANES <= last; c += EXPAND_VECTORS * LANES) {
            f32v delta[EXPAND_VECTORS] = {{0}};
            for (int64_t k = 0; k < rank; k++) {
                const f32v hk = splat(hr[k]);
                for (int v = 0; v < EXPAND_VECTORS; v++)
                    delta[v] = fma_of(hk, weights_at(w, w->b, slot + k * out + c + v * LANES), delta[v]);
            }
            for (int v = 0; v < EXPAND_VECTORS; v++)
                store_f32(yr + c + v * LANES, load_f32(yr + c + v * LANES) + delta[v]);
        }
        for (; c + LANES <= last; c += LANES) {
            f32v delta = splat(0.0f);
            for (int64_t k = 0; k < rank; k++) delta = fma_of(splat(hr[k]), weights_at(w, w->b, slot + k * out + c), delta);
            store_f32(yr + c, load_f32(yr + c) + delta);
        }
        for (; c < last; c++) {
            float delta = 0.0f;
            for (int64_t k = 0; k < rank; k++) delta += hr[k] * weight_at(w, w->b, slot + k * out + c);
            yr[c] += delta;
        }
    }
}

void triode_lora_expand(const lora_matrix *w, const float *h, const int32_t *slots, int64_t rows, float *y,
                        int64_t y_stride, int64_t first, int64_t last)
{
    int64_t offset = 0;
    for (int p = 0; p < w->parts; offset += w->slices[p], p++) {
        const int64_t from = first > offset ? first : offset;
        const int64_t to = last < offset + w->slices[p] ? last : offset + w->slices[p];
        if (from < to) expand_part(w, h, slots, rows, y, y_stride, p, from, to);
    }
}

/* Every row and column; h: scratch of rows * parts * rank floats. Returns 0, or -1 for a
 * matrix whose slices do not add up to its output columns. */
int triode_lora_f32(const lora_matrix *w, const float *x, int64_t x_stride, const int32_t *slots, int64_t rows,
                    float *h, float *y, int64_t y_stride)
{
    int64_t columns = 0;
    for (int p = 0; p < w->parts; p++) columns += w->slices[p];
    if (w->parts < 1 || w->parts > MAX_LORA_PARTS || columns != w->out || w->rank < 1) return -1;
    const int64_t width = (int64_t)w->parts * w->rank;
    const int parallel = rows * (w->in * width + w->rank * w->out) >= PARALLEL_MIN_WORK;
    const int64_t blocks = (rows + SHRINK_ROWS - 1) / SHRINK_ROWS;
    #pragma omp parallel for schedule(static) if (parallel)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t r = block * SHRINK_ROWS, count = rows - r < SHRINK_ROWS ? rows - r : SHRINK_ROWS;
        triode_lora_shrink(w, x + r * x_stride, x_stride, slots + r, count, h + r * width);
        triode_lora_expand(w, h + r * width, slots + r, count, y + r * y_stride, y_stride, 0, w->out);
    }
    return 0;
}
