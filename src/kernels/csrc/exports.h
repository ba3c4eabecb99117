/* The kernels one unit calls in another (decode_stack.c calls the ops' serial forms), declared
 * once: the defining units include this too, so the compiler holds both sides to it. */
#ifndef TRIODE_EXPORTS_H
#define TRIODE_EXPORTS_H

#include <stdint.h>

#include "lora.h"

int triode_quant_linear_serial(int type, const float *x, int64_t x_stride, const uint8_t *w,
                               int64_t row_bytes, const float *bias, float *y, int64_t y_stride,
                               int64_t rows, int in, int64_t out, int invariant);
int triode_quant_x16_linear(int type, int wide, const float *x, int64_t x_stride, const uint8_t *w,
                            int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t rows, int in,
                            int64_t out);
int triode_quant_x16_linear_q8(int type, int wide, void *buffer, int64_t rows, int in, const uint8_t *w,
                               int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t first,
                               int64_t last);
void triode_quant_x16_row(int type, const uint8_t *w, int64_t row_bytes, int block, int64_t row, uint8_t *out);
int64_t triode_q8_bytes(int64_t rows, int in);
int triode_q8_quantize(int type, const float *x, int64_t x_stride, int64_t rows, int in, void *buffer);
int64_t triode_q8_wide_bytes(int64_t rows, int in);
int triode_q8_quantize_rows(int type, int wide, const float *x, int64_t x_stride, int64_t rows, int in,
                            void *buffer, int64_t first, int64_t last);
int triode_quant_linear_q8(int type, void *buffer, int64_t rows, int in, const uint8_t *w,
                           int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t first,
                           int64_t out);
int triode_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                        const float *weight, float *out, float *residual_out, int64_t rows, int hidden,
                        float eps);
int triode_silu_mul_columns_f32(const float *gate, const float *up, int64_t x_stride, float *out,
                                int64_t out_stride, int64_t rows, int n);
int triode_rotary_f32(const int64_t *positions, int64_t tokens, float *query, int64_t query_stride,
                      int query_heads, float *key, int64_t key_stride, int key_heads, const float *cos_sin,
                      int64_t max_positions, int dim);
int triode_write_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                        float *k_cache, float *v_cache, const int64_t *slots, int64_t tokens,
                        int64_t num_slots, int row);
int triode_paged_decode_f32_units(const float *query, int64_t q_stride, const float *k_cache,
                                  const float *v_cache, const int32_t *tables, int64_t table_stride,
                                  const int32_t *seq_lens, float *out, int64_t out_stride, int heads,
                                  int kv_heads, int dim, int block_size, float scale, int window,
                                  float softcap, int split, int first, int count);

/* How many units decode attention cuts a sequence into: each KV head its own while there are
 * fewer sequences than twice the threads (or one thread would take a whole batch of one). */
static inline int attention_units_per_sequence(int num_seqs, int kv_heads, int threads) {
    return num_seqs < 2 * threads ? kv_heads : 1;
}

void triode_lora_shrink(const lora_matrix *w, const float *x, int64_t x_stride, const int32_t *slots,
                        int64_t rows, float *h);
void triode_lora_expand(const lora_matrix *w, const float *h, const int32_t *slots, int64_t rows, float *y,
                        int64_t y_stride, int64_t first, int64_t last);

#endif
