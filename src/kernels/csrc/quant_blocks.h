/* GGUF's quantized blocks, decoded 32 weights at a time into float32 vectors (AVX2, AVX-512).
 *
 * The blocks are GGUF's own byte layouts (ggml's block_q4_0 ... block_q6_K), read where the
 * file put them: a weight row is its blocks back to back. A group is 32 consecutive weights
 * of a row; a block holds block_groups(type) of them. decode_group(type, block, g, w) gives
 * them in the NV vectors w, scales and offsets applied, so a caller multiplies them into any
 * number of activation rows while they sit in registers.
 *
 * The type numbers are GGUF's (GGMLQuantizationType).
 */
#ifndef TRIODE_QUANT_BLOCKS_H
#define TRIODE_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>
#include <omp.h>

#define UNROLL _Pragma("GCC unroll 16")

/* Runs tile(first, last) over [0, out): split into one contiguous share per thread of a new
 * team, or on the calling thread alone. The loops are instantiated once either way; the
 * serial case opens no OpenMP construct at all (a caller with a team of its own,
 * decode_stack.c, calls it thousands of times a step). */
#define RUN_SHARES(parallel, out, tile, ...)                                                    \
    do {                                                                                        \
        if (!(parallel)) {                                                                      \
            tile(__VA_ARGS__, 0, (out));                                                        \
            break;                                                                              \
        }                                                                                       \
        _Pragma("omp parallel")                                                                 \
        {                                                                                       \
            const int64_t share = ((out) + omp_get_num_threads() - 1) / omp_get_num_threads(); \
            const int64_t first = share * omp_get_thread_num();                                 \
            if (first < (out)) tile(__VA_ARGS__, first, first + share < (out) ? first + share : (out)); \
        }                                                                                       \
    } while (0)

enum {
    TYPE_Q4_0 = 2,
    TYPE_Q4_1 = 3,
    TYPE_Q8_0 = 8,
    TYPE_Q4_K = 12,
    TYPE_Q5_K = 13,
    TYPE_Q6_K = 14,
};

/* A vector of VL float32 lanes: AVX-512 (16) or AVX2 (8), by the compiler's target. A group
 * of 32 weights is NV of them. Bytes are widened with the instructions named here: the
 * compilers' generic conversions of byte vectors do it lane by lane, 5x slower. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef __m512 vf;
static inline vf vf_splat(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
/* 16 bytes -> one vector of their values, unsigned or signed. */
static inline void widen_u8(__m128i q, vf *out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
static inline void widen_i8(__m128i q, vf *out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
#elif defined(__AVX2__)
#include <immintrin.h>
#define VL 8
typedef __m256 vf;
static inline vf vf_splat(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline void widen_u8(__m128i q, vf *out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q)));
}
static inline void widen_i8(__m128i q, vf *out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
}
#else
#error "triode's quantized kernels need AVX2 or AVX-512 (x86-64-v3 or newer)"
#endif
#define NV (32 / VL)

static inline float half_to_float(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

static inline __m128i load_16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline __m128i low_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(0x0F)); }
static inline __m128i high_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)); }
/* Bits shift .. shift + width - 1 of every byte, for a shift known once inlined. */
static inline __m128i bits(__m128i q, int shift, int width) {
    return _mm_and_si128(_mm_srli_epi16(q, shift), _mm_set1_epi8((char)((1 << width) - 1)));
}

/* w[0 .. NV) = scale * q + offset for the 32 byte values in lo (weights 0..15) and hi. */
static inline __attribute__((always_inline)) void scaled(
    __m128i lo, __m128i hi, int is_signed, float scale_lo, float scale_hi, float offset, vf *w)
{
    vf wide[NV];
    if (is_signed) {
        widen_i8(lo, wide);
        widen_i8(hi, wide + NV / 2);
    } else {
        widen_u8(lo, wide);
        widen_u8(hi, wide + NV / 2);
    }
    UNROLL
    for (int v = 0; v < NV; v++)
        w[v] = vf_fma(wide[v], vf_splat(v < NV / 2 ? scale_lo : scale_hi), vf_splat(offset));
}

/* Every block type decoded here, as X(type, name suffix): the one list that the typed loops
 * of quant_linear.c and quant_linear_int8.c, and their dispatch switches, are made from. */
#define FOR_EACH_QUANT_TYPE(X) \
    X(TYPE_Q4_0, q4_0) X(TYPE_Q4_1, q4_1) X(TYPE_Q8_0, q8_0) X(TYPE_Q4_K, q4_k) X(TYPE_Q5_K, q5_k) X(TYPE_Q6_K, q6_k)

/* Bytes per block and 32-weight groups per block, by type; 0 for a type not decoded here. */
static inline int block_bytes(int type) {
    switch (type) {
        case TYPE_Q4_0: return 18;
        case TYPE_Q4_1: return 20;
        case TYPE_Q8_0: return 34;
        case TYPE_Q4_K: return 144;
        case TYPE_Q5_K: return 176;
        case TYPE_Q6_K: return 210;
        default: return 0;
    }
}

static inline int block_groups(int type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K ? 8 : 1;
}

/* Whether rows of in weights, row_bytes bytes each, are whole blocks of type. */
static inline int valid_shape(int type, int64_t row_bytes, int in) {
    const int weights = 32 * block_groups(type);
    return block_bytes(type) && in > 0 && in % weights == 0
           && row_bytes == (int64_t)(in / weights) * block_bytes(type);
}

/* One group's 32 quantized values as bytes (lo: weights 0..15, hi: 16..31) and how they
 * become weights: w = scale_lo / scale_hi * q + offset. The values are signed bytes for
 * Q8_0 and Q6_K (group_is_signed), unsigned for the rest. Both the float32 path (decode_group)
 * and the int8 path (quant_dot.h) start from here. */
typedef struct {
    __m128i lo, hi;
    float scale_lo, scale_hi, offset;
} group_q;

static inline int group_is_signed(int type) { return type == TYPE_Q8_0 || type == TYPE_Q6_K; }

/* Q4_0: d (f16), 16 bytes of nibbles; weight i is the low nibble of byte i, weight i + 16
 * the high one; w = d * (q - 8). */
static inline group_q group_q4_0(const uint8_t *b) {
    const float d = half_to_float(b);
    const __m128i q = load_16(b + 2);
    return (group_q){low_nibbles(q), high_nibbles(q), d, d, -8.0f * d};
}

/* Q4_1: d, m (f16), nibbles as Q4_0; w = d * q + m. */
static inline group_q group_q4_1(const uint8_t *b) {
    const float d = half_to_float(b);
    const __m128i q = load_16(b + 4);
    return (group_q){low_nibbles(q), high_nibbles(q), d, d, half_to_float(b + 2)};
}

/* Q8_0: d (f16), 32 signed bytes; w = d * q. */
static inline group_q group_q8_0(const uint8_t *b) {
    const float d = half_to_float(b);
    return (group_q){load_16(b + 2), load_16(b + 18), d, d, 0.0f};
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block, packed in 12 bytes:
 * j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 split between byte j + 4 (low 4 bits
 * each) and the top 2 bits of bytes j - 4 and j. */
static inline void k_scale_min(const uint8_t *scales, int j, float *scale, float *min) {
    if (j < 4) {
        *scale = (float)(scales[j] & 63);
        *min = (float)(scales[j + 4] & 63);
    } else {
        *scale = (float)((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
        *min = (float)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

/* Q4_K: 256 weights, d, dmin (f16), 12 bytes of sub-block scales and mins, 128 bytes of
 * nibbles. Sub-blocks 2p and 2p + 1 are the low and high nibbles of bytes 32p .. 32p + 31;
 * w = d * scale * q - dmin * min. Group g is sub-block g. */
static inline group_q group_q4_k(const uint8_t *b, int g) {
    float scale, min;
    k_scale_min(b + 4, g, &scale, &min);
    scale *= half_to_float(b);
    min *= half_to_float(b + 2);
    const uint8_t *qs = b + 16 + 32 * (g >> 1);
    const int shift = (g & 1) * 4;
    return (group_q){bits(load_16(qs), shift, 4), bits(load_16(qs + 16), shift, 4), scale, scale, -min};
}

/* Q5_K: as Q4_K with a fifth bit per weight: bit g of byte l of qh (32 bytes, before the
 * nibbles) is the high bit of weight l of sub-block g. */
static inline group_q group_q5_k(const uint8_t *b, int g) {
    float scale, min;
    k_scale_min(b + 4, g, &scale, &min);
    scale *= half_to_float(b);
    min *= half_to_float(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48 + 32 * (g >> 1);
    const int shift = (g & 1) * 4;
    const __m128i lo = _mm_or_si128(bits(load_16(qs), shift, 4), _mm_slli_epi16(bits(load_16(qh), g, 1), 4));
    const __m128i hi = _mm_or_si128(bits(load_16(qs + 16), shift, 4), _mm_slli_epi16(bits(load_16(qh + 16), g, 1), 4));
    return (group_q){lo, hi, scale, scale, -min};
}

/* Q6_K: 256 weights as two halves of 128: ql (128 bytes of nibbles), qh (64 bytes of 2-bit
 * pairs), 16 signed 8-bit scales, d (f16). In half n, weight 32s + l (s = 0..3, l = 0..31)
 * takes the low (s < 2) or high nibble of ql[64n + 32 (s & 1) + l] and bits 2s .. 2s+1 of
 * qh[32n + l]; w = d * scale[8n + 2s + l / 16] * (q - 32). Group g is weights 32g .. 32g + 31:
 * half g / 4, s = g % 4. */
static inline group_q group_q6_k(const uint8_t *b, int g) {
    const int n = g >> 2, s = g & 3;
    const uint8_t *ql = b + 64 * n + 32 * (s & 1), *qh = b + 128 + 32 * n;
    const int8_t *scales = (const int8_t *)(b + 192) + 8 * n + 2 * s;
    const float d = half_to_float(b + 208);
    const int nibble = (s >> 1) * 4, pair = 2 * s;
    const __m128i lo = _mm_or_si128(bits(load_16(ql), nibble, 4), _mm_slli_epi16(bits(load_16(qh), pair, 2), 4));
    const __m128i hi = _mm_or_si128(bits(load_16(ql + 16), nibble, 4), _mm_slli_epi16(bits(load_16(qh + 16), pair, 2), 4));
    /* q - 32 in bytes: the 6-bit values become signed. */
    const __m128i bias = _mm_set1_epi8(32);
    return (group_q){_mm_sub_epi8(lo, bias), _mm_sub_epi8(hi, bias), d * scales[0], d * scales[1], 0.0f};
}

/* Group g of the block at b, as bytes and scales. */
static inline __attribute__((always_inline)) group_q group_of(const int type, const uint8_t *b, int g) {
    switch (type) {
        case TYPE_Q4_0: return group_q4_0(b);
        case TYPE_Q4_1: return group_q4_1(b);
        case TYPE_Q8_0: return group_q8_0(b);
        case TYPE_Q4_K: return group_q4_k(b, g);
        case TYPE_Q5_K: return group_q5_k(b, g);
        default: return group_q6_k(b, g);
    }
}

/* Weights 32g .. 32g + 31 of the block at b, in w[0 .. NV). */
static inline __attribute__((always_inline)) void decode_group(const int type, const uint8_t *b, int g, vf *w) {
    const group_q q = group_of(type, b, g);
    scaled(q.lo, q.hi, group_is_signed(type), q.scale_lo, q.scale_hi, q.offset, w);
}

#endif
