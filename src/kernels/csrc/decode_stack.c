/* Every decoder layer of a Llama-shaped model for one decode step, in one call from Python.
 *
 * With its weights in quantized blocks, a batch-of-one step of the default model is about 200
 * kernel calls of tens of microseconds each; from Python each call costs 10-25 us more in
 * dispatch and argument checks, a fifth of the step. Here the same kernels run in the same
 * order on the same buffers (quant_linear*.c, elementwise.c, paged_decode.h), so the result
 * is bit for bit the Python path's; only the dispatch is gone. kernels.decode_stack checks
 * the step's metadata once and describes the layers (decode_model / decode_layer below).
 *
 * Per layer, hidden [rows, hidden] in and out, residual [rows, hidden] carried:
 *   normed = rms_norm(hidden + residual) (layer 0: residual = hidden)
 *   qkv = normed @ Wqkv; rotary on q, k; k, v into the cache; attn = decode attention
 *   hidden = attn @ Wo; normed = rms_norm(hidden + residual)
 *   hidden = silu_and_mul(normed @ Wgate_up) @ Wdown
 * The caller applies the final norm.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PARTS 3  /* q, k and v kept as three block types */
#define OUT_OF_MEMORY -5

int triode_quant_linear(int type, const float *x, int64_t x_stride, const uint8_t *w,
                        int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                        int64_t rows, int in, int64_t out);
int triode_quant_linear_int8(int type, const float *x, int64_t x_stride, const uint8_t *w,
                             int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                             int64_t rows, int in, int64_t out);
int triode_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                        const float *weight, float *out, float *residual_out, int64_t rows, int hidden,
                        float eps);
int triode_silu_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int d);
int triode_rotary_f32(const int64_t *positions, int64_t tokens, float *query, int64_t query_stride,
                      int query_heads, float *key, int64_t key_stride, int key_heads, const float *cos_sin,
                      int64_t max_positions, int dim);
int triode_write_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                        float *k_cache, float *v_cache, const int64_t *slots, int64_t tokens,
                        int64_t num_slots, int row);
int triode_paged_decode_f32(const float *query, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                            float *out, int64_t out_stride, int num_seqs, int heads, int kv_heads,
                            int dim, int block_size, float scale);

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

typedef struct {
    const float *input_norm, *post_attention_norm;
    quant_matrix qkv, o, gate_up, down;
    float *k_cache, *v_cache;
} decode_layer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, int8_activations;
    float eps, scale;
    int64_t num_slots, max_positions;
    const float *cos_sin;
} decode_model;

/* The op a failure came from (*failed_op), for the caller's message. */
enum { OP_LINEAR = 1, OP_NORM, OP_ROTARY, OP_WRITE_KV, OP_ATTENTION, OP_ACTIVATION };

static int linear(const decode_model *m, const quant_matrix *w, const float *x, int in, float *y,
                  int64_t rows)
{
    int64_t width = 0, column = 0;
    for (int p = 0; p < w->count; p++) width += w->parts[p].out;
    for (int p = 0; p < w->count; p++) {
        const quant_part *part = &w->parts[p];
        const int status = (m->int8_activations ? triode_quant_linear_int8 : triode_quant_linear)(
            part->type, x, in, part->data, part->row_bytes, part->bias, y + column, width, rows, in,
            part->out);
        if (status) return status;
        column += part->out;
    }
    return 0;
}

#define TRY(call, op)                                                                           \
    if ((status = (call))) {                                                                    \
        *failed_op = (op);                                                                      \
        goto done;                                                                              \
    }

/* hidden [rows, hidden] in and out; residual [rows, hidden] out (hidden + residual is the
 * final norm's input). Returns 0, or the failed op's status with the op in *failed_op
 * (OUT_OF_MEMORY with 0 when the scratch buffers cannot be allocated). */
int triode_decode_stack(const decode_model *m, const decode_layer *layers, float *hidden, float *residual,
                        int64_t rows, const int64_t *positions, const int64_t *slots,
                        const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                        int *failed_op)
{
    *failed_op = 0;
    const int q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    const int qkv_width = q_size + 2 * kv_size;
    const size_t floats = (size_t)rows * ((size_t)m->hidden + qkv_width + q_size + 3 * (size_t)m->intermediate);
    float *normed = malloc(floats * sizeof(float));
    if (!normed) return OUT_OF_MEMORY;
    float *qkv = normed + rows * m->hidden, *attention = qkv + rows * qkv_width;
    float *gate_up = attention + rows * q_size, *activation = gate_up + rows * 2 * m->intermediate;
    int status = 0;
    memcpy(residual, hidden, sizeof(float) * rows * m->hidden);
    for (int l = 0; l < m->layers; l++) {
        const decode_layer *layer = &layers[l];
        TRY(triode_rms_norm_f32(hidden, m->hidden, l ? residual : NULL, m->hidden, layer->input_norm,
                                normed, l ? residual : NULL, rows, m->hidden, m->eps), OP_NORM);
        TRY(linear(m, &layer->qkv, normed, m->hidden, qkv, rows), OP_LINEAR);
        TRY(triode_rotary_f32(positions, rows, qkv, qkv_width, m->heads, qkv + q_size, qkv_width,
                              m->kv_heads, m->cos_sin, m->max_positions, m->head_dim), OP_ROTARY);
        TRY(triode_write_kv_f32(qkv + q_size, qkv_width, qkv + q_size + kv_size, qkv_width,
                                layer->k_cache, layer->v_cache, slots, rows, m->num_slots, kv_size),
            OP_WRITE_KV);
        TRY(triode_paged_decode_f32(qkv, qkv_width, layer->k_cache, layer->v_cache, tables, table_stride,
                                    seq_lens, attention, q_size, (int)rows, m->heads, m->kv_heads,
                                    m->head_dim, m->block_size, m->scale), OP_ATTENTION);
        TRY(linear(m, &layer->o, attention, q_size, hidden, rows), OP_LINEAR);
        TRY(triode_rms_norm_f32(hidden, m->hidden, residual, m->hidden, layer->post_attention_norm,
                                normed, residual, rows, m->hidden, m->eps), OP_NORM);
        TRY(linear(m, &layer->gate_up, normed, m->hidden, gate_up, rows), OP_LINEAR);
        TRY(triode_silu_mul_f32(gate_up, 2 * m->intermediate, activation, rows, m->intermediate),
            OP_ACTIVATION);
        TRY(linear(m, &layer->down, activation, m->intermediate, hidden, rows), OP_LINEAR);
    }
done:
    free(normed);
    return status;
}
