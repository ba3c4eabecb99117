/* GGUF's quantized blocks with 16 weight rows interleaved: the layout of the int8-activation
 * kernels for CPUs with AVX-512 VNNI (quant_x16.c).
 *
 * Why: a few-row decode step multiplies every weight row by the same activations. In GGUF's
 * layout a row's blocks come one after another, so a kernel reduces each row to one number,
 * and the per-32 scales cost a scalar conversion and a broadcast each. Here the blocks of 16
 * consecutive rows sit side by side, so one 64-byte vector holds 4 weights of each of the 16
 * rows: one vpdpbusd multiplies them by 4 broadcast activation bytes into 16 row sums, the
 * 16 rows' scales are one vector load, and nothing is reduced across lanes. This is how
 * llama.cpp's repacked CPU kernels work too; the layout here is triode's own.
 *
 * A matrix [out, row_bytes] (out a multiple of 16) keeps its size and its shape: rows
 * 16G .. 16G + 15 are one stretch of 16 * row_bytes bytes, the tiles of block 0, 1, ... in
 * turn, each tile the 16 rows' block k (16 * block_bytes bytes, as many bytes as GGUF's, the
 * same values in another order). Within a tile, for row r (0..15):
 *
 *   nibbles32(area, r, w): 32 four-bit values w[0..31] as 4 vectors of 64 bytes, vector v
 *     holding at byte 4r + a (a = 0..3) w[8v + a] | w[8v + 4 + a] << 4: its low nibbles are
 *     weights 8v .. 8v + 3 of every row, its high nibbles weights 8v + 4 .. 8v + 7.
 *   Q4_0: d[16] (f16, 32 bytes), nibbles32 of the group's q (32 bytes in, 256 out).
 *   Q4_1: d[16], m[16], nibbles32.
 *   Q8_0: d[16], then 8 vectors of 64 bytes, vector v byte 4r + a = q[4v + a] XOR 0x80 (the
 *     signed value plus 128: vpdpbusd multiplies unsigned by signed bytes; the kernel takes
 *     128 * sum(x) off again).
 *   Q4_K: d[16], dmin[16], the 12 bytes of packed scales and mins as 12 vectors of 16 (byte i
 *     of row r at 16i + r), then nibbles32 of sub-block 0 .. 7 (256 bytes each).
 *   Q5_K: as Q4_K, with before the nibbles the fifth bits, 64 bytes per sub-block: byte
 *     4r + a has at bit 2v the fifth bit of weight 8v + a, at bit 2v + 1 that of 8v + 4 + a.
 *   Q6_K: d[16], the 16 signed scales as 8 pairs (pair p, row r: scales 2p and 2p + 1 at
 *     32p + 2r), the low nibbles as nibbles32 per group of 32 weights (8 x 256 bytes), then the
 *     high two bits, 128 bytes per group: in vector h (0, 1) byte 4r + a holds at bits 2t,
 *     2t + 1 (t = 0..3) those of weight 8v + 4 * (t & 1) + a, v = 2h + t / 2.
 */
#ifndef TRIODE_QUANT_X16_H
#define TRIODE_QUANT_X16_H

#include <stdint.h>
#include <string.h>

/* Set in a type number passed to the kernels: the matrix is in this layout. */
#define TYPE_X16 0x100
#define X16_ROWS 16

/* Bytes from a tile's start to each of its parts, by base type. */
enum {
    X16_Q4_1_NIBBLES = 64,
    X16_SMALL_NIBBLES = 32, /* Q4_0; Q8_0's bytes */
    X16_K_SCALES = 64,      /* Q4_K, Q5_K */
    X16_Q4_K_NIBBLES = 256,
    X16_Q5_K_HIGH = 256,
    X16_Q5_K_NIBBLES = 768,
    X16_Q6_K_SCALES = 32,
    X16_Q6_K_NIBBLES = 288,
    X16_Q6_K_HIGH = 2336,
};

static inline void x16_put_nibbles32(uint8_t *area, int r, const uint8_t *w) {
    for (int v = 0; v < 4; v++)
        for (int a = 0; a < 4; a++) area[64 * v + 4 * r + a] = (uint8_t)(w[8 * v + a] | w[8 * v + 4 + a] << 4);
}

static inline void x16_take_nibbles32(const uint8_t *area, int r, uint8_t *w) {
    for (int v = 0; v < 4; v++)
        for (int a = 0; a < 4; a++) {
            const uint8_t byte = area[64 * v + 4 * r + a];
            w[8 * v + a] = byte & 15;
            w[8 * v + 4 + a] = byte >> 4;
        }
}

/* GGUF's 4-bit layout of 32 weights (byte i: weight i low, weight i + 16 high) and back. */
static inline void x16_split_q4(const uint8_t *q, uint8_t *w) {
    for (int i = 0; i < 16; i++) {
        w[i] = q[i] & 15;
        w[i + 16] = q[i] >> 4;
    }
}

static inline void x16_join_q4(const uint8_t *w, uint8_t *q) {
    for (int i = 0; i < 16; i++) q[i] = (uint8_t)(w[i] | w[i + 16] << 4);
}

/* Sub-block j of a Q4_K / Q5_K block's 128 nibble bytes: low nibbles of bytes 32(j/2).. for
 * even j, high nibbles for odd j. */
static inline void x16_k_sub_nibbles(const uint8_t *qs, int j, uint8_t *w) {
    for (int l = 0; l < 32; l++) w[l] = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
}

/* The fifth bits of Q5_K sub-block j (bit j of qh[l] for weight l) as its x16 dword of row r. */
static inline void x16_q5_high_put(uint8_t *area, int r, const uint8_t *qh, int j) {
    for (int a = 0; a < 4; a++) {
        uint8_t byte = 0;
        for (int v = 0; v < 4; v++) {
            byte |= (uint8_t)(((qh[8 * v + a] >> j) & 1) << (2 * v));
            byte |= (uint8_t)(((qh[8 * v + 4 + a] >> j) & 1) << (2 * v + 1));
        }
        area[4 * r + a] = byte;
    }
}

/* Block row r of tile t (type's own layout above) from GGUF's block b, and back. */
static inline void x16_place(int type, uint8_t *t, int r, const uint8_t *b);
static inline void x16_take(int type, const uint8_t *t, int r, uint8_t *b);

/* Q6_K weight l (0..255) of a GGUF block: its low nibble and its high two bits. */
static inline uint8_t x16_q6_low(const uint8_t *b, int l) {
    const int n = l >> 7, s = (l >> 5) & 3, i = l & 31;
    return (b[64 * n + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15;
}

static inline uint8_t x16_q6_high(const uint8_t *b, int l) {
    const int n = l >> 7, s = (l >> 5) & 3, i = l & 31;
    return (b[128 + 32 * n + i] >> (2 * s)) & 3;
}

static inline void x16_place(int type, uint8_t *t, int r, const uint8_t *b) {
    uint8_t w[32];
    switch (type) {
        case 2: /* Q4_0 */
            memcpy(t + 2 * r, b, 2);
            x16_split_q4(b + 2, w);
            x16_put_nibbles32(t + X16_SMALL_NIBBLES, r, w);
            break;
        case 3: /* Q4_1 */
            memcpy(t + 2 * r, b, 2);
            memcpy(t + 32 + 2 * r, b + 2, 2);
            x16_split_q4(b + 4, w);
            x16_put_nibbles32(t + X16_Q4_1_NIBBLES, r, w);
            break;
        case 8: /* Q8_0 */
            memcpy(t + 2 * r, b, 2);
            for (int v = 0; v < 8; v++)
                for (int a = 0; a < 4; a++) t[X16_SMALL_NIBBLES + 64 * v + 4 * r + a] = b[2 + 4 * v + a] ^ 0x80;
            break;
        case 12: /* Q4_K */
        case 13: /* Q5_K */
            memcpy(t + 2 * r, b, 2);
            memcpy(t + 32 + 2 * r, b + 2, 2);
            for (int i = 0; i < 12; i++) t[X16_K_SCALES + 16 * i + r] = b[4 + i];
            for (int j = 0; j < 8; j++) {
                x16_k_sub_nibbles(b + (type == 12 ? 16 : 48), j, w);
                x16_put_nibbles32(t + (type == 12 ? X16_Q4_K_NIBBLES : X16_Q5_K_NIBBLES) + 256 * j, r, w);
                if (type == 13) x16_q5_high_put(t + X16_Q5_K_HIGH + 64 * j, r, b + 16, j);
            }
            break;
        case 14: /* Q6_K */
            memcpy(t + 2 * r, b + 208, 2);
            for (int p = 0; p < 8; p++) memcpy(t + X16_Q6_K_SCALES + 32 * p + 2 * r, b + 192 + 2 * p, 2);
            for (int g = 0; g < 8; g++) {
                for (int l = 0; l < 32; l++) w[l] = x16_q6_low(b, 32 * g + l);
                x16_put_nibbles32(t + X16_Q6_K_NIBBLES + 256 * g, r, w);
                for (int h = 0; h < 2; h++)
                    for (int a = 0; a < 4; a++) {
                        uint8_t byte = 0;
                        for (int k = 0; k < 4; k++)
                            byte |= (uint8_t)(x16_q6_high(b, 32 * g + 8 * (2 * h + k / 2) + 4 * (k & 1) + a) << (2 * k));
                        t[X16_Q6_K_HIGH + 128 * g + 64 * h + 4 * r + a] = byte;
                    }
            }
            break;
    }
}

static inline void x16_take(int type, const uint8_t *t, int r, uint8_t *b) {
    uint8_t w[32];
    switch (type) {
        case 2:
            memcpy(b, t + 2 * r, 2);
            x16_take_nibbles32(t + X16_SMALL_NIBBLES, r, w);
            x16_join_q4(w, b + 2);
            break;
        case 3:
            memcpy(b, t + 2 * r, 2);
            memcpy(b + 2, t + 32 + 2 * r, 2);
            x16_take_nibbles32(t + X16_Q4_1_NIBBLES, r, w);
            x16_join_q4(w, b + 4);
            break;
        case 8:
            memcpy(b, t + 2 * r, 2);
            for (int v = 0; v < 8; v++)
                for (int a = 0; a < 4; a++) b[2 + 4 * v + a] = t[X16_SMALL_NIBBLES + 64 * v + 4 * r + a] ^ 0x80;
            break;
        case 12:
        case 13: {
            memcpy(b, t + 2 * r, 2);
            memcpy(b + 2, t + 32 + 2 * r, 2);
            for (int i = 0; i < 12; i++) b[4 + i] = t[X16_K_SCALES + 16 * i + r];
            uint8_t *qs = b + (type == 12 ? 16 : 48);
            memset(qs, 0, 128);
            if (type == 13) memset(b + 16, 0, 32);
            for (int j = 0; j < 8; j++) {
                x16_take_nibbles32(t + (type == 12 ? X16_Q4_K_NIBBLES : X16_Q5_K_NIBBLES) + 256 * j, r, w);
                for (int l = 0; l < 32; l++) qs[32 * (j >> 1) + l] |= (uint8_t)(w[l] << (4 * (j & 1)));
                if (type == 13)
                    for (int a = 0; a < 4; a++) {
                        const uint8_t byte = t[X16_Q5_K_HIGH + 64 * j + 4 * r + a];
                        for (int v = 0; v < 4; v++) {
                            b[16 + 8 * v + a] |= (uint8_t)(((byte >> (2 * v)) & 1) << j);
                            b[16 + 8 * v + 4 + a] |= (uint8_t)(((byte >> (2 * v + 1)) & 1) << j);
                        }
                    }
            }
            break;
        }
        case 14:
            memset(b, 0, 192);
            memcpy(b + 208, t + 2 * r, 2);
            for (int p = 0; p < 8; p++) memcpy(b + 192 + 2 * p, t + X16_Q6_K_SCALES + 32 * p + 2 * r, 2);
            for (int g = 0; g < 8; g++) {
                x16_take_nibbles32(t + X16_Q6_K_NIBBLES + 256 * g, r, w);
                for (int l = 0; l < 32; l++) {
                    const int weight = 32 * g + l, n = weight >> 7, s = (weight >> 5) & 3, i = weight & 31;
                    b[64 * n + 32 * (s & 1) + i] |= (uint8_t)(w[l] << (4 * (s >> 1)));
                }
                for (int h = 0; h < 2; h++)
                    for (int a = 0; a < 4; a++) {
                        const uint8_t byte = t[X16_Q6_K_HIGH + 128 * g + 64 * h + 4 * r + a];
                        for (int k = 0; k < 4; k++) {
                            const int weight = 32 * g + 8 * (2 * h + k / 2) + 4 * (k & 1) + a;
                            const int n = weight >> 7, s = (weight >> 5) & 3, i = weight & 31;
                            b[128 + 32 * n + i] |= (uint8_t)(((byte >> (2 * k)) & 3) << (2 * s));
                        }
                    }
            }
            break;
    }
}

#endif
