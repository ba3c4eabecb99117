/* bfloat16 <-> float32 for triode's C kernels: bfloat16 is the upper half of a float32. */
#ifndef TRIODE_BF16_H
#define TRIODE_BF16_H

#include <stdint.h>

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)bits << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float value) {
    union { uint32_t u; float f; } v;
    v.f = value;
    v.u += 0x7FFFu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

#endif
