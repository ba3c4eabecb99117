/* y = x @ w^T (+ bias) for a few rows of x, for CPUs.
 *
 * With one to eight rows (a decode step of a small batch) a linear layer is a pass over its
 * weights: each weight row is read once, from memory, and used for every row of x while it
 * sits in L1. The general matrix-multiply kernels of torch's CPU build reach about a third
 * of this machine's memory bandwidth at these shapes; this loop streams the weight rows in
 * order, split across the OpenMP threads by output rows.
 *
 * Layouts (element strides): x [rows, in] with row stride x_stride; w [out, in] contiguous;
 * bias [out] or NULL; y [rows, out] with row stride y_stride. Sums are in float32.
 */
#include <stdint.h>

#include "bf16.h"

#define MAX_ROWS 8
#define LANES 16
/* Fewer weights than this run on the calling thread: the pass takes a few microseconds, less
 * than waking a sleeping OpenMP thread costs on these VMs (tens of microseconds). */
#define PARALLEL_MIN_WEIGHTS 65536

/* One output row j for ROWS rows of x; ROWS is a constant after inlining, so the partial
 * sums stay in vector registers and each loaded weight vector feeds ROWS fused multiply-adds. */
#define DEFINE_ROW(NAME, ELEM, LOAD, STORE)                                                      \
static inline __attribute__((always_inline)) void NAME(                                        \
    const int rows, const ELEM *x, int64_t x_stride, const ELEM *w_row, const ELEM *bias,      \
    ELEM *y, int64_t y_stride, int64_t j, int in)                                               \
{                                                                                               \
    float partial[MAX_ROWS][LANES] = {{0}};                                                     \
    int k = 0;                                                                                  \
    for (; k + LANES <= in; k += LANES) {                                                       \
        float weights[LANES];                                                                   \
        for (int l = 0; l < LANES; l++) weights[l] = LOAD(w_row[k + l]);                        \
        for (int r = 0; r < rows; r++)                                                          \
            for (int l = 0; l < LANES; l++)                                                     \
                partial[r][l] += weights[l] * LOAD(x[r * x_stride + k + l]);                    \
    }                                                                                           \
    const float offset = bias ? LOAD(bias[j]) : 0.0f;                                           \
    for (int r = 0; r < rows; r++) {                                                            \
        float sum = 0.0f;                                                                       \
        for (int l = 0; l < LANES; l++) sum += partial[r][l];                                   \
        for (int t = k; t < in; t++) sum += LOAD(w_row[t]) * LOAD(x[r * x_stride + t]);         \
        y[r * y_stride + j] = STORE(sum + offset);                                              \
    }                                                                                           \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_ROW(row_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROW(row_bf16, uint16_t, bf16_to_float, float_to_bf16)

#define CASE(ROW, N)                                                                            \
    case N:                                                                                     \
        _Pragma("omp parallel for schedule(static) if ((int64_t)in * out >= PARALLEL_MIN_WEIGHTS)")                                            \
        for (int64_t j = 0; j < out; j++)                                                       \
            ROW(N, x, x_stride, w + j * in, bias, y, y_stride, j, in);                          \
        break;

/* Returns 0, or -1 when rows is outside 1..MAX_ROWS. */
#define DEFINE_ENTRY(NAME, ROW, ELEM)                                                           \
int NAME(const ELEM *x, int64_t x_stride, const ELEM *w, const ELEM *bias, ELEM *y,            \
         int64_t y_stride, int rows, int in, int64_t out)                                       \
{                                                                                               \
    switch (rows) {                                                                             \
        CASE(ROW, 1) CASE(ROW, 2) CASE(ROW, 3) CASE(ROW, 4)                                     \
        CASE(ROW, 5) CASE(ROW, 6) CASE(ROW, 7) CASE(ROW, 8)                                     \
        default: return -1;                                                                     \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_ENTRY(triode_small_linear_f32, row_f32, float)
DEFINE_ENTRY(triode_small_linear_bf16, row_bf16, uint16_t)

/* Any number of rows, each through the one-row form of the loop: its 16 lanes summed over the
 * input in order, then the lanes in order, so a row's result depends on that row alone, not on
 * how many others the call has (batch invariance; the forms for 2 to 8 rows may round
 * differently under -ffast-math, and did). Each weight row is read from memory once and used
 * for every row of x while it sits in L1. Slower than oneDNN's blocked kernels past a few
 * rows; only `--batch-invariant` runs it. */
#define DEFINE_INVARIANT_ENTRY(NAME, ROW, ELEM)                                                 \
int NAME(const ELEM *x, int64_t x_stride, const ELEM *w, const ELEM *bias, ELEM *y,            \
         int64_t y_stride, int64_t rows, int in, int64_t out)                                   \
{                                                                                               \
    _Pragma("omp parallel for schedule(static) if ((int64_t)in * out >= PARALLEL_MIN_WEIGHTS)") \
    for (int64_t j = 0; j < out; j++)                                                           \
        for (int64_t r = 0; r < rows; r++)                                                      \
            ROW(1, x + r * x_stride, x_stride, w + j * in, bias, y + r * y_stride, y_stride, j, in); \
    return 0;                                                                                   \
}

DEFINE_INVARIANT_ENTRY(triode_invariant_linear_f32, row_f32, float)
DEFINE_INVARIANT_ENTRY(triode_invariant_linear_bf16, row_bf16, uint16_t)
