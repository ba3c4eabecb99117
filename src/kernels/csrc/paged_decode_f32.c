/* Decode attention over the paged KV cache for float32 caches (see paged_decode.h). */
#include "exports.h"
#include "paged_decode.h"

#define STORE_F32(x) (x)
DEFINE_SEQUENCE(f32, float, load_f32, STORE_F32)
DEFINE_ENTRY(triode_paged_decode_f32, f32, float)
