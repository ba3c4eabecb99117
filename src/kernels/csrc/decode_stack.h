/* The decode step's description, as kernels.decode_stack fills it (its ctypes structures
 * mirror these field for field): the model's shape and, per layer, the weights, norms and
 * cache the step reads. decode_stack.c runs it. */
#ifndef TRIODE_DECODE_STACK_H
#define TRIODE_DECODE_STACK_H

#include <stdint.h>

#include "lora.h"

#define MAX_PARTS 3  /* q, k and v kept as three block types */

/* One quantized part of a matrix: `out` consecutive output features. */
typedef struct {
    int32_t type;
    int64_t out;
    int64_t row_bytes;
    const uint8_t *data;
    const float *bias; /* its share of the bias, or NULL */
} quant_part;

typedef struct {
    quant_part parts[MAX_PARTS];
    int32_t count;
} quant_matrix;

/* The layer's four matrices in this order, for their LoRA adapters. */
enum { MATRIX_QKV = 0, MATRIX_O = 1, MATRIX_GATE_UP = 2, MATRIX_DOWN = 3 };

typedef struct {
    const float *input_norm, *post_attention_norm;
    quant_matrix qkv, o, gate_up, down;
    float *k_cache, *v_cache;
    int32_t window; /* the keys a query sees, itself included; 0: all */
    const lora_matrix *lora[4]; /* each matrix's adapters (MATRIX_*), or NULL */
} decode_layer;

/* What the quantized matrices multiply (decode_model.activations). */
enum { ACTIVATIONS_FLOAT32 = 0, ACTIVATIONS_INT8 = 1, ACTIVATIONS_WIDE = 2 };

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, activations;
    float eps, scale;
    int64_t num_slots, max_positions;
    const float *cos_sin;
    int32_t invariant; /* float32 activations in tiles that keep each row's sums in one order */
} decode_model;

/* The op a failure came from (*failed_op), for the caller's message (kernels.decode_stack). */
enum { OP_LINEAR = 1, OP_ROTARY = 3, OP_WRITE_KV = 4, OP_ATTENTION = 5 };

#endif
