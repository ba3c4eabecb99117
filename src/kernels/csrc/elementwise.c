/* The decoder layer's per-token ops, for CPUs: RMSNorm (with the residual add), SiLU-and-
 * multiply, rotary embedding (neox style, in place) and the KV cache write.
 *
 * Each is one pass over its rows. The torch references take 2 to 20 ops per call, each with
 * its own temporary, and at decode sizes most of a call is that dispatch. Results are rounded
 * where the references round (a bfloat16 intermediate is rounded wherever torch would hold
 * one); what differs is float32 arithmetic (exp, the order of a sum), which moves a bfloat16
 * result by an ulp or two where a value lands on a rounding midpoint.
 *
 * Layouts (element strides): rows of x / out are contiguous within a row, rows apart by the
 * given stride; rotary's query and key are [tokens, heads, dim] with contiguous heads, and its
 * cos/sin cache is float32 [max_positions, dim], cos in the first half, sin in the second;
 * the KV write copies key/value rows [tokens, kv_heads, dim] (contiguous heads) into caches
 * [slots, kv_heads, dim].
 * Compiled by kernels.native with -O3 -march=native -ffast-math -fopenmp.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exports.h"

/* Below this many elements (about 11 us of work) a call runs on the calling thread. An element
 * takes about 0.7 ns; waking a sleeping OpenMP thread about 60 us on these VMs, and the
 * worker's threads sleep after 2000 spins, some tens of microseconds (engine.actors.worker_spawn).
 * Between a step's matrix multiplies the other thread is usually still spinning, and a serial
 * op that outlasts its spins puts it to sleep, so that the next parallel region pays the
 * wake-up: at 1 << 17 here, a 128-row bfloat16 decode step's two RMSNorms a layer ran alone, and
 * W1 then W1v woke threads 54k times, against 19k at 1 << 14 (W1v median 24.37 -> 23.70 s, Zen 5,
 * 2026-12-05). A call that finds the team asleep pays the wake-up: SiLU-and-multiply of 256 x 128
 * took 77 us so, where 128 x 128 took 15 us alone. */
#define PARALLEL_MIN_ELEMENTS (1 << 14)

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

/* out = weight * round(s / rms(s)), s = x (+ residual, rounded; then also stored in
 * residual_out). residual and residual_out are NULL together. */
#define DEFINE_RMS_NORM(NAME, ELEM, LOAD, STORE)                                                 \
int NAME(const ELEM *x, int64_t x_stride, const ELEM *residual, int64_t residual_stride,        \
         const ELEM *weight, ELEM *out, ELEM *residual_out, int64_t rows, int hidden, float eps) \
{                                                                                               \
    _Pragma("omp parallel for if (rows * hidden >= PARALLEL_MIN_ELEMENTS)")                     \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const ELEM *source = x + r * x_stride;                                                  \
        float squares = 0.0f;                                                                   \
        if (residual) {                                                                         \
            const ELEM *added = residual + r * residual_stride;                                 \
            ELEM *sum = residual_out + r * hidden;                                              \
            for (int d = 0; d < hidden; d++) {                                                  \
                sum[d] = STORE(LOAD(source[d]) + LOAD(added[d]));                               \
                const float value = LOAD(sum[d]);                                               \
                squares += value * value;                                                       \
            }                                                                                   \
            source = sum;                                                                       \
        } else {                                                                                \
            for (int d = 0; d < hidden; d++) squares += LOAD(source[d]) * LOAD(source[d]);      \
        }                                                                                       \
        const float scale = 1.0f / sqrtf(squares / hidden + eps);                               \
        ELEM *normed = out + r * hidden;                                                        \
        for (int d = 0; d < hidden; d++)                                                        \
            normed[d] = STORE(LOAD(weight[d]) * LOAD(STORE(LOAD(source[d]) * scale)));          \
    }                                                                                           \
    return 0;                                                                                   \
}

/* out [rows, d] = round(silu(gate)) * up, x [rows, 2d] holding gate then up. The exponent is
 * capped below float32's overflow: under -ffast-math (no infinities) expf(x) past 88.7 is
 * undefined, and came out NaN for gates below -88 (a LoRA adapter's activations reach them);
 * with the cap such a gate's silu is -g / 1.65e38, a tiny negative where torch gives -0. */
#define DEFINE_SILU_MUL(NAME, ELEM, LOAD, STORE)                                                 \
static inline void NAME##_span(const ELEM *gate, const ELEM *up, ELEM *product, int n)          \
{                                                                                               \
    for (int i = 0; i < n; i++) {                                                               \
        const float g = LOAD(gate[i]);                                                          \
        product[i] = STORE(LOAD(STORE(g / (1.0f + expf(fminf(-g, 88.0f))))) * LOAD(up[i]));    \
    }                                                                                           \
}                                                                                               \
int NAME(const ELEM *x, int64_t x_stride, ELEM *out, int64_t rows, int d)                       \
{                                                                                               \
    _Pragma("omp parallel for if (rows * d >= PARALLEL_MIN_ELEMENTS)")                          \
    for (int64_t r = 0; r < rows; r++)                                                          \
        NAME##_span(x + r * x_stride, x + r * x_stride + d, out + r * d, d);                    \
    return 0;                                                                                   \
}

/* Rotates heads [tokens, heads, dim] in place; 0, or -1 (nothing rotated) for a position
 * outside the cache. */
#define DEFINE_ROTARY(NAME, ELEM, LOAD, STORE)                                                   \
static inline void NAME##_heads(ELEM *heads_start, int heads, int dim, const float *cos_sin)   \
{                                                                                               \
    const int half = dim / 2;                                                                   \
    for (int h = 0; h < heads; h++) {                                                           \
        ELEM *x = heads_start + h * dim;                                                        \
        for (int i = 0; i < half; i++) {                                                        \
            const float cos = LOAD(STORE(cos_sin[i])), sin = LOAD(STORE(cos_sin[half + i]));    \
            const float x1 = LOAD(x[i]), x2 = LOAD(x[half + i]);                                \
            x[i] = STORE(LOAD(STORE(x1 * cos)) - LOAD(STORE(x2 * sin)));                        \
            x[half + i] = STORE(LOAD(STORE(x2 * cos)) + LOAD(STORE(x1 * sin)));                 \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
int NAME(const int64_t *positions, int64_t tokens, ELEM *query, int64_t query_stride,           \
         int query_heads, ELEM *key, int64_t key_stride, int key_heads, const float *cos_sin,   \
         int64_t max_positions, int dim)                                                        \
{                                                                                               \
    for (int64_t t = 0; t < tokens; t++)                                                        \
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;                       \
    const int64_t elements = tokens * (query_heads + key_heads) * dim;                         \
    _Pragma("omp parallel for if (elements >= PARALLEL_MIN_ELEMENTS)")                          \
    for (int64_t t = 0; t < tokens; t++) {                                                      \
        const float *row = cos_sin + positions[t] * dim;                                        \
        NAME##_heads(query + t * query_stride, query_heads, dim, row);                          \
        NAME##_heads(key + t * key_stride, key_heads, dim, row);                                \
    }                                                                                           \
    return 0;                                                                                   \
}

/* Copies each token's key and value rows (row = kv_heads * dim elements) into its cache slot;
 * 0, or -1 (nothing written) for a slot outside the caches. */
#define DEFINE_WRITE_KV(NAME, ELEM)                                                              \
int NAME(const ELEM *key, int64_t key_stride, const ELEM *value, int64_t value_stride,         \
         ELEM *k_cache, ELEM *v_cache, const int64_t *slots, int64_t tokens, int64_t num_slots, \
         int row)                                                                               \
{                                                                                               \
    for (int64_t t = 0; t < tokens; t++)                                                        \
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;                                   \
    for (int64_t t = 0; t < tokens; t++) {                                                      \
        memcpy(k_cache + slots[t] * row, key + t * key_stride, sizeof(ELEM) * row);             \
        memcpy(v_cache + slots[t] * row, value + t * value_stride, sizeof(ELEM) * row);         \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_RMS_NORM(triode_rms_norm_f32, float, LOAD_F32, STORE_F32)
DEFINE_RMS_NORM(triode_rms_norm_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_SILU_MUL(triode_silu_mul_f32, float, LOAD_F32, STORE_F32)
DEFINE_SILU_MUL(triode_silu_mul_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_ROTARY(triode_rotary_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROTARY(triode_rotary_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_WRITE_KV(triode_write_kv_f32, float)
DEFINE_WRITE_KV(triode_write_kv_bf16, uint16_t)

/* n columns of silu_mul on the calling thread, gate and up given apart (rows x_stride apart,
 * products out_stride apart): a share of the op for a caller that runs its own team
 * (decode_stack.c). The same loop as triode_silu_mul_f32's, so the same results where the
 * share starts at a multiple of 8 columns. */
int triode_silu_mul_columns_f32(const float *gate, const float *up, int64_t x_stride, float *out,
                                int64_t out_stride, int64_t rows, int n)
{
    for (int64_t r = 0; r < rows; r++)
        triode_silu_mul_f32_span(gate + r * x_stride, up + r * x_stride, out + r * out_stride, n);
    return 0;
}
