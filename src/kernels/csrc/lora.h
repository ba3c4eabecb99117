/* One linear layer's LoRA adapters, slot by slot, as kernels.lora describes them (its ctypes
 * structure mirrors this one): a [slots][in][width] holds A transposed, width = parts * rank
 * (the parts' A side by side: q, k and v of a fused projection); b [slots][rank][out] holds B
 * transposed, scaled, the columns of part p multiplying h's p-th run of `rank` values. */
#ifndef TRIODE_LORA_H
#define TRIODE_LORA_H

#include <stdint.h>

#define MAX_LORA_PARTS 3

typedef struct {
    const void *a, *b;
    int32_t bf16; /* weights in bfloat16; else float32 */
    int32_t rank, parts;
    int64_t in, out, slots;
    int64_t slices[MAX_LORA_PARTS]; /* output columns of each part, in order */
} lora_matrix;

#endif
