/* Activations quantized to int8 for the int8 path (q8_activations.h has the layout): each
 * span of a row (32 activations, or 256 for the K types, one span per weight block) gets one
 * scale, max |x| / 127, and the integer sums of every 32 and every 16 are kept for the
 * weights' offsets and Q6_K's correction; and to the interleaved kernels' wide activations,
 * the same way at 15 bits. Compiled with -O3 -march=native -ffast-math, which divides by the
 * scale's constant as a multiply by its inverse (tests/test_q8_activations.py follows).
 */
#include <stdint.h>
#include <string.h>

#include "exports.h"
#include "quant_x16.h"

#define NOT_BUILT -4

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "q8_activations.h"

/* The largest wide activation: 128 * 127 + 63, so that q stays in [-127, 127]. */
#define WIDE_TOP 16319.0f

static int check_q8(int type, int64_t rows, int in) {
    if (!block_bytes(type)) return -1;
    if (in < 1 || in % q8_span(type)) return -2;
    return rows < 1 ? -3 : 0;
}

/* max |x| over a span (a multiple of 8 values), as its bits: a non-negative float's bits order
 * as its value, and a NaN's lie above an infinity's, so a NaN anywhere in the span comes out
 * (max_ps keeps its second operand when either is NaN, and -ffast-math may fold a float test
 * for one). */
static inline uint32_t max_abs_bits(const float *src, int span) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    __m256i peak = _mm256_setzero_si256();
    for (int i = 0; i < span; i += 8)
        peak = _mm256_max_epu32(peak, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(src + i)), magnitude));
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(peak), _mm256_extracti128_si256(peak, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* Below this magnitude (2^-100) a span is taken as zeros: top / max |x| would overflow to
 * infinity under about 1e-35, and the integers with it. */
#define SMALLEST_PEAK_BITS 0x0d800000u
#define INFINITY_BITS 0x7f800000u

/* A span's scale (max |x| / top) and the factor its values are multiplied by (top / max |x|):
 * 0 and 0 for a span of zeros, NaN and 0 for one holding a NaN or an infinity, so that every
 * output it enters is NaN, as in float arithmetic, and its integers stay 0. */
static inline float span_scale(const float *src, int span, float top, __m256 *inverse) {
    const uint32_t bits = max_abs_bits(src, span);
    float amax;
    memcpy(&amax, &bits, sizeof amax);
    if (bits >= INFINITY_BITS) {
        const uint32_t nan_bits = 0x7fc00000u;
        float nan;
        memcpy(&nan, &nan_bits, sizeof nan);
        *inverse = _mm256_setzero_ps();
        return nan;
    }
    if (bits < SMALLEST_PEAK_BITS) {
        *inverse = _mm256_setzero_ps();
        return 0.0f;
    }
    *inverse = _mm256_set1_ps(top / amax);
    return amax / top;
}

/* 8 values times `inverse`, rounded to the nearest integer (half to even). */
static inline __m256i scaled_integers(const float *src, __m256 inverse) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src), inverse),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* 32 int32 values, each within [-128, 127], as 32 bytes in order: packs work within 128-bit
 * lanes, and the permute puts the bytes back in order. */
static inline __m256i bytes_in_order(const __m256i v[4]) {
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quantize_rows(const float *x, int64_t x_stride, int rows, int in, int span, int8_t *q, float *scale,
                          int32_t *sum, int16_t *sum16)
{
    for (int r = 0; r < rows; r++)
        for (int s = 0; s < in / span; s++) {
            const float *src = x + r * x_stride + s * span;
            __m256 inverse;
            scale[(int64_t)r * (in / span) + s] = span_scale(src, span, 127.0f, &inverse);
            for (int g = 0; g < span / 32; g++) {
                __m256i i32[4];
                for (int i = 0; i < 4; i++) i32[i] = scaled_integers(src + 32 * g + 8 * i, inverse);
                const int64_t k = (int64_t)s * (span / 32) + g;
                _mm256_storeu_si256((__m256i *)(q + (int64_t)r * in + 32 * k), bytes_in_order(i32));
                const int32_t first = hsum8i(_mm256_add_epi32(i32[0], i32[1]));
                const int32_t second = hsum8i(_mm256_add_epi32(i32[2], i32[3]));
                sum[(int64_t)r * (in / 32) + k] = first + second;
                sum16[(int64_t)r * (in / 16) + 2 * k] = (int16_t)first;
                sum16[(int64_t)r * (in / 16) + 2 * k + 1] = (int16_t)second;
            }
        }
}

/* The wide activations (q8_activations.h): x_q = round(x * 16319 / max |x|) over each span,
 * split into 128 * q + lo, 32 at a time as quantize_rows does (the same products and roundings
 * as the scalar loop this replaced, so the same integers). */
static void quantize_wide_rows(const float *x, int64_t x_stride, int rows, int in, int span, rows_q8 out)
{
    int8_t *q = (int8_t *)out.q, *lo = (int8_t *)out.lo;
    float *scale = (float *)out.scale;
    int32_t *sum = (int32_t *)out.sum;
    int16_t *sum16 = (int16_t *)out.sum16, *sum16_lo = (int16_t *)out.sum16_lo, *whole = (int16_t *)out.whole;
    const __m256i half = _mm256_set1_epi32(64);
    for (int r = 0; r < rows; r++)
        for (int s = 0; s < in / span; s++) {
            const float *src = x + r * x_stride + s * span;
            __m256 inverse;
            scale[(int64_t)r * (in / span) + s] = span_scale(src, span, WIDE_TOP, &inverse);
            for (int g = 0; g < span / 32; g++) {
                __m256i value[4], high[4], low[4];
                for (int i = 0; i < 4; i++) {
                    value[i] = scaled_integers(src + 32 * g + 8 * i, inverse);
                    high[i] = _mm256_srai_epi32(_mm256_add_epi32(value[i], half), 7); /* floor */
                    low[i] = _mm256_sub_epi32(value[i], _mm256_slli_epi32(high[i], 7)); /* [-64, 63] */
                }
                const int64_t k = (int64_t)s * (span / 32) + g, at = (int64_t)r * in + 32 * k;
                _mm256_storeu_si256((__m256i *)(q + at), bytes_in_order(high));
                _mm256_storeu_si256((__m256i *)(lo + at), bytes_in_order(low));
                if (Q8_KEEPS_WHOLE)
                    for (int i = 0; i < 4; i += 2)
                        _mm256_storeu_si256((__m256i *)(whole + at + 8 * i),
                                            _mm256_permute4x64_epi64(_mm256_packs_epi32(value[i], value[i + 1]), 0xD8));
                /* The four sums of 16 in one vector: high's two, then low's; value's sum of 32
                 * follows from them, as value = 128 * high + low. */
                const __m256i pairs = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(_mm256_add_epi32(high[0], high[1]), _mm256_add_epi32(high[2], high[3])),
                    _mm256_hadd_epi32(_mm256_add_epi32(low[0], low[1]), _mm256_add_epi32(low[2], low[3])));
                const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
                int32_t sixteen[4];
                _mm_storeu_si128((__m128i *)sixteen, sums);
                sum16[at / 16] = (int16_t)sixteen[0];
                sum16[at / 16 + 1] = (int16_t)sixteen[1];
                sum16_lo[at / 16] = (int16_t)sixteen[2];
                sum16_lo[at / 16 + 1] = (int16_t)sixteen[3];
                sum[at / 32] = 128 * (sixteen[0] + sixteen[1]) + sixteen[2] + sixteen[3];
            }
        }
}

int64_t triode_q8_bytes(int64_t rows, int in) { return q8_bytes(rows, in); }

int64_t triode_q8_wide_bytes(int64_t rows, int in) { return q8_wide_bytes(rows, in); }

/* Rows [first, last) of x [rows, in] quantized for weights of `type`, as int8 activations or
 * (`wide`) wide ones, into their places in a buffer of triode_q8_bytes (triode_q8_wide_bytes)
 * for all the rows: 0, or -1 for a type not decoded, -2 for in not a whole number of spans,
 * -3 for rows < 1 or a range outside them. The threads of a parallel region each take a share
 * of the rows this way (quant_x16.c). */
int triode_q8_quantize_rows(int type, int wide, const float *x, int64_t x_stride, int64_t rows, int in,
                            void *buffer, int64_t first, int64_t last)
{
    type &= ~TYPE_X16; /* the interleaved layout takes the same activations */
    const int status = check_q8(type, rows, in);
    if (status) return status;
    if (first < 0 || last > rows || first > last) return -3;
    const int span = q8_span(type);
    x += first * x_stride;
    if (wide) {
        quantize_wide_rows(x, x_stride, (int)(last - first), in, span, q8_wide_rows(buffer, rows, in, span, first));
    } else {
        const rows_q8 q = q8_rows(buffer, rows, in, span, first);
        quantize_rows(x, x_stride, (int)(last - first), in, span, (int8_t *)q.q, (float *)q.scale,
                      (int32_t *)q.sum, (int16_t *)q.sum16);
    }
    return 0;
}

/* x [rows, in] quantized for weights of `type` into a buffer of triode_q8_bytes: 0, or -1 for
 * a type not decoded, -2 for in not a whole number of spans, -3 for rows < 1. A caller that
 * runs its own team (decode_stack.c) quantizes a matrix's input once this way, then takes
 * its share of the outputs with triode_quant_linear_q8. */
int triode_q8_quantize(int type, const float *x, int64_t x_stride, int64_t rows, int in, void *buffer)
{
    return triode_q8_quantize_rows(type, 0, x, x_stride, rows, in, buffer, 0, rows);
}

#else

int64_t triode_q8_bytes(int64_t rows, int in) { return 0; }

int64_t triode_q8_wide_bytes(int64_t rows, int in) { return 0; }

int triode_q8_quantize_rows(int type, int wide, const float *x, int64_t x_stride, int64_t rows, int in,
                            void *buffer, int64_t first, int64_t last)
{
    return NOT_BUILT;
}

int triode_q8_quantize(int type, const float *x, int64_t x_stride, int64_t rows, int in, void *buffer)
{
    return NOT_BUILT;
}

#endif
