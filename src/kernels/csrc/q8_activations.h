/* The activations of the int8 path (quant_linear_int8.c): rows of float32 quantized to int8,
 * as llama.cpp's Q8_0 / Q8_K, in one buffer laid out by q8_rows. Included where AVX2 is built. */
#ifndef TRIODE_Q8_ACTIVATIONS_H
#define TRIODE_Q8_ACTIVATIONS_H

#include <stdint.h>

#include "exports.h"
#include "quant_blocks.h"

/* Row r's activations: int8 values, one scale per span of them (32 for the 32-weight block
 * types, 256 for the K types, whose integer sums then run over a whole block as llama.cpp's
 * Q8_K does), and the integer sum of every 32.
 *
 * The interleaved kernels (quant_x16.c) also take 15-bit activations, x_q = 128 * q + lo with
 * q in [-127, 127] and lo in [-64, 63] (q8_wide_rows; lo non-NULL): two int8 products per
 * weight byte instead of one, and activations 128 times finer. Per 32 values int8 loses what
 * a few large activations leave of the small ones: SmolLM2-135M answered "What is the
 * capital of France?" with "L'Étoile, la Marseillaise, la femme, ..." on int8 activations
 * (as llama.cpp's server does on the same file) and "The capital of France is Paris." on
 * float32 ones or on these, whose logprobs stayed within 1e-3 of float32's. */
typedef struct {
    const int8_t *q;       /* int8 values; of the wide ones, the multiples of 128 */
    const int8_t *lo;      /* the wide ones' remainders, or NULL */
    const float *scale;
    const int32_t *sum;    /* the integer sum of every 32 (of x_q, for the wide ones) */
    const int16_t *sum16;  /* the integer sum of every 16 of q (Q6_K's scales are per 16) */
    const int16_t *sum16_lo;  /* the same of lo */
    const int16_t *whole;  /* the wide ones whole, x_q as int16 (AVX2's Q8_0 kernel), or NULL */
} rows_q8;

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* One activation scale per weight block. */
static inline int q8_span(int type) { return 32 * block_groups(type); }

/* The quantized activations of `rows` rows of `in`, laid out in one buffer of q8_bytes. */
static inline int64_t q8_bytes(int64_t rows, int in) {
    const int64_t groups = rows * (in / 32);
    return rows * in + (int64_t)(sizeof(float) + sizeof(int32_t) + 2 * sizeof(int16_t)) * groups;
}

static inline rows_q8 q8_rows(void *buffer, int64_t rows, int in, int span, int64_t first_row) {
    int8_t *q = buffer;
    float *scale = (float *)(q + rows * in);
    int32_t *sum = (int32_t *)(scale + rows * (in / 32));
    int16_t *sum16 = (int16_t *)(sum + rows * (in / 32));
    return (rows_q8){q + first_row * in, NULL, scale + first_row * (in / span), sum + first_row * (in / 32),
                     sum16 + first_row * (in / 16), NULL, NULL};
}

/* Whether this build multiplies bytes with vpdpbusd: AVX-512 VNNI's, or AVX-VNNI's on 8 lanes
 * (quant_x16_vec.h). One without it keeps the wide activations whole too, as int16, for its
 * Q8_0 kernel (quant_x16_tiles.h). */
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || defined(__AVXVNNI__)
#define HAS_VPDPBUSD 1
#else
#define HAS_VPDPBUSD 0
#endif
#define Q8_KEEPS_WHOLE (!HAS_VPDPBUSD)

/* The wide activations' buffer: q8_rows' layout, then lo, its sums of 16 and x_q whole. */
static inline int64_t q8_wide_bytes(int64_t rows, int in) {
    return q8_bytes(rows, in) + rows * in + (int64_t)sizeof(int16_t) * (rows * (in / 16) + Q8_KEEPS_WHOLE * rows * in);
}

static inline rows_q8 q8_wide_rows(void *buffer, int64_t rows, int in, int span, int64_t first_row) {
    rows_q8 x = q8_rows(buffer, rows, in, span, first_row);
    int8_t *lo = (int8_t *)buffer + q8_bytes(rows, in);
    int16_t *sum16_lo = (int16_t *)(lo + rows * in);
    int16_t *whole = sum16_lo + rows * (in / 16);
    x.lo = lo + first_row * in;
    x.sum16_lo = sum16_lo + first_row * (in / 16);
    x.whole = Q8_KEEPS_WHOLE ? whole + first_row * in : NULL;
    return x;
}

#endif
