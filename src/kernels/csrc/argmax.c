/* Row-wise argmax of float32 rows, for the sampler's greedy rows (kernels.cpu_argmax).
 *
 * torch's CPU argmax over the last dimension runs at about 1 ns an element (64 rows of the
 * default model's 49152 logits: 2.6 ms, a few percent of a 64-sequence decode step; one row
 * 74 us with its thread team asleep). Here each row is one pass of vector compares (vec.h)
 * that keep every lane's best value and its first index, reduced at the end; rows are split
 * across the OpenMP team only when there are many elements.
 *
 * The result is torch's: the first index of the maximum, and where a row holds a NaN the
 * first NaN's index (NaNs are found from their bits, which -ffast-math leaves alone).
 * Layout: x [rows, cols] with row stride x_stride, cols >= 1; out [rows] int64.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Below this many elements a call runs on the calling thread: waking a sleeping OpenMP
 * thread costs tens of microseconds on these VMs (see elementwise.c). Measured alternately,
 * with the team asleep: 8 rows of 49152 took 143-159 us in parallel and 74-76 alone, 16 rows
 * 223-229 and 162-169. */
#define PARALLEL_MIN_ELEMENTS (1 << 20)

static inline int is_nan(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

static inline i32v nan_lanes(f32v v) {
    return ((i32v)v & 0x7fffffff) > 0x7f800000;
}

static int64_t first_nan(const float *x, int64_t cols) {
    for (int64_t c = 0; c < cols; c++)
        if (is_nan(x[c])) return c;
    return -1;
}

static int64_t row_argmax(const float *x, int64_t cols) {
    float best_value = x[0];
    int64_t best_index = 0, c = 0;
    int nan = is_nan(x[0]);
    if (cols >= LANES) {
        const i32v lane = LANE_INDEX;
        f32v best = load_f32(x);
        i32v best_at = lane, at = lane, nans = nan_lanes(best);
        for (c = LANES; c + LANES <= cols; c += LANES) {
            const f32v v = load_f32(x + c);
            at += LANES;
            const i32v greater = v > best;
            best = select(greater, v, best);
            best_at = (best_at & ~greater) | (at & greater);
            nans |= nan_lanes(v);
        }
        for (int l = 0; l < LANES; l++) {
            nan |= nans[l] != 0;
            if (best[l] > best_value || (best[l] == best_value && best_at[l] < best_index))
                best_value = best[l], best_index = best_at[l];
        }
    } else {
        c = 1;
    }
    for (; c < cols; c++) {
        nan |= is_nan(x[c]);
        if (x[c] > best_value) best_value = x[c], best_index = c;
    }
    return nan ? first_nan(x, cols) : best_index;
}

int triode_argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out)
{
    if (rows < 0 || cols < 1 || cols > INT32_MAX) return -1;
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * x_stride, cols);
    return 0;
}
