/* Decode attention over the paged KV cache for bfloat16 caches (see paged_decode.h). */
#include "paged_decode.h"

DEFINE_SEQUENCE(bf16, uint16_t, load_bf16, float_to_bf16)
DEFINE_ENTRY(triode_paged_decode_bf16, bf16, uint16_t)
