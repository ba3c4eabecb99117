/* Every decoder layer of a Llama-shaped model for one decode step, in one call from Python.
 *
 * With its weights in quantized blocks, a batch-of-one step of the default model is about 200
 * kernel calls of tens of microseconds each; from Python each call costs 10-25 us more in
 * dispatch and argument checks, a fifth of the step. Here the same kernels run in the same
 * order on the same buffers (quant_linear*.c, elementwise.c, paged_decode.h), so the result
 * is bit for bit the Python path's; only the dispatch is gone. kernels.decode_stack checks
 * the step's metadata once and describes the layers (decode_stack.h).
 *
 * Per layer, hidden [rows, hidden] in and out, residual [rows, hidden] carried:
 *   normed = rms_norm(hidden + residual) (layer 0: residual = hidden)
 *   qkv = normed @ Wqkv; rotary on q, k; k, v into the cache; attn = decode attention
 *   hidden = attn @ Wo; normed = rms_norm(hidden + residual)
 *   hidden = silu_and_mul(normed @ Wgate_up) @ Wdown
 * The caller applies the final norm.
 *
 * A step whose rows carry LoRA adapters (lora_slots, a slot per row, -1 for none) adds each
 * adapted matrix's delta (lora.c): in the matrix's op, the threads shrink its input into h
 * (x @ A, 16 rows a claim) before they claim its columns; the op after it, which reads the
 * output row by row (rotary, a norm), first adds a row's delta (h @ B); gate and up, read by
 * column, get theirs after a barrier of their own, before SiLU.
 *
 * One OpenMP team runs the whole step (team.h). Each op is cut into chunks (a row of a norm,
 * up to 256 KiB of a matrix's weights, a unit of the attention) that the threads claim, and
 * consecutive ops are separated by a barrier that spins, then yields: with a parallel region
 * per kernel call, as the Python path has, a step paid up to two thread wake-ups an op, tens
 * of microseconds each on these VMs (docs/benchmarks.md has the measurements). The serial
 * forms of the kernels open no OpenMP construct (quant_blocks.h's RUN_SHARES): at thousands
 * of calls a step, one empty `if (0)` region each cost more than the team saved.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "decode_stack.h"
#include "exports.h"
#include "quant_x16.h"
#include "team.h"

#define OUT_OF_MEMORY -5
#define CHUNK_BYTES (256 << 10) /* of weights, per claimed chunk of a matrix */
#define MIN_CHUNKS_PER_THREAD 4
#define OPS_PER_LAYER 16 /* 8, and with adapters a shrink for each of the 4 matrices and gate_up's expand */
#define LORA_ROWS 16      /* rows per shrink claim */
#define EXPAND_CHUNK 64   /* gate and up columns per expand claim */

/* What the team shares for a step. */
typedef struct {
    const decode_model *m;
    const decode_layer *layers;
    int64_t rows;
    float *hidden, *residual, *normed, *qkv, *attention, *gate_up, *activation;
    const int64_t *positions, *slots;
    const int32_t *tables, *seq_lens;
    const int32_t *lora_slots; /* a row's adapter slot (-1: none), or NULL: no adapters this step */
    float *lora_h;             /* rows x the widest adapter's parts * rank */
    int64_t table_stride;
    int attention_split;
    counter *claims;     /* counters_per_op for each op of each layer, from 0 */
    int counters_per_op; /* one per thread */
    team_barrier barrier;
} step_state;

/* A thread's own: the current matrix's input quantized for each block type of its parts
 * (q8_type[i] < 0: not yet), since the activations' scales follow the weights' blocks. */
typedef struct {
    void *q8[MAX_PARTS];
    int q8_type[MAX_PARTS];
    int me, threads;
} thread_state;

static void new_input(thread_state *own) {
    for (int i = 0; i < MAX_PARTS; i++) own->q8_type[i] = -1;
}

/* The thread's buffer holding x quantized for `type`, quantized on first use. */
static void *quantized_input(const step_state *st, thread_state *own, int type, const float *x, int in) {
    int i = 0;
    while (i < MAX_PARTS - 1 && own->q8_type[i] != type && own->q8_type[i] >= 0) i++;
    if (own->q8_type[i] != type) {
        triode_q8_quantize_rows(type, st->m->activations == ACTIVATIONS_WIDE, x, in, st->rows, in, own->q8[i], 0,
                                st->rows);
        own->q8_type[i] = type;
    }
    return own->q8[i];
}

/* Whether a part runs on float32 activations: all of them when the step's are, and with wide
 * ones the parts kept in GGUF's layout (the wide kernels read interleaved ones only). */
static int float_part(const decode_model *m, const quant_part *part) {
    return m->activations == ACTIVATIONS_FLOAT32 || (m->activations == ACTIVATIONS_WIDE && !(part->type & TYPE_X16));
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int max_int(int a, int b) { return a > b ? a : b; }

/* y[:, first:last] = x @ w[first:last]^T for a matrix kept as parts side by side. */
static void linear_columns(const step_state *st, thread_state *own, const quant_matrix *w, const float *x,
                           int in, float *y, int64_t y_stride, int64_t first, int64_t last)
{
    int64_t base = 0;
    for (int p = 0; p < w->count && first < last; base += w->parts[p].out, p++) {
        const quant_part *part = &w->parts[p];
        const int64_t from = first > base ? first : base, to = min64(last, base + part->out);
        if (from >= to) continue;
        if (float_part(st->m, part)) {
            const float *bias = part->bias ? part->bias + (from - base) : NULL;
            triode_quant_linear_serial(part->type, x, in, part->data + (from - base) * part->row_bytes,
                                       part->row_bytes, bias, y + from, y_stride, st->rows, in, to - from,
                                       st->m->invariant);
            continue;
        }
        void *input = quantized_input(st, own, part->type & ~TYPE_X16, x, in);
        if (st->m->activations == ACTIVATIONS_WIDE)
            triode_quant_x16_linear_q8(part->type, 1, input, st->rows, in, part->data, part->row_bytes, part->bias,
                                       y + base, y_stride, from - base, to - base);
        else
            triode_quant_linear_q8(part->type, input, st->rows, in, part->data, part->row_bytes, part->bias,
                                   y + base, y_stride, from - base, to - from);
    }
}

static int64_t matrix_width(const quant_matrix *w) {
    int64_t width = 0;
    for (int p = 0; p < w->count; p++) width += w->parts[p].out;
    return width;
}

/* Columns per claimed chunk, a multiple of `align`: CHUNK_BYTES of the matrix's first part,
 * or less where that would leave a thread fewer than MIN_CHUNKS_PER_THREAD of them (the small
 * models' matrices are a few hundred kilobytes). */
static int64_t chunk_columns(const quant_matrix *w, int64_t width, int threads, int64_t align) {
    const int64_t by_bytes = CHUNK_BYTES / w->parts[0].row_bytes;
    const int64_t by_count = width / ((int64_t)threads * MIN_CHUNKS_PER_THREAD);
    const int64_t columns = by_bytes < by_count ? by_bytes : by_count;
    return columns > align ? (columns + align - 1) / align * align : align;
}

static void team_linear(const step_state *st, thread_state *own, counter *counters, const quant_matrix *w,
                        const float *x, int in, float *y)
{
    const int64_t width = matrix_width(w), columns = chunk_columns(w, width, own->threads, 16);
    share_claim shares = {counters, (width + columns - 1) / columns, 0};
    new_input(own);
    for (int64_t c; (c = claim_share(&shares, own->me, own->threads)) >= 0;)
        linear_columns(st, own, w, x, in, y, width, c * columns, min64((c + 1) * columns, width));
}

/* activation = silu(gate) * up; a claim is the same columns of gate and of up. Chunks start
 * at multiples of 32 columns, where triode_silu_mul_f32 would be in step with them. */
static void team_gate_up(const step_state *st, thread_state *own, counter *counters,
                         const quant_matrix *gate_up)
{
    const int64_t inter = st->m->intermediate, columns = chunk_columns(gate_up, inter, own->threads, 32);
    share_claim shares = {counters, (inter + columns - 1) / columns, 0};
    new_input(own);
    for (int64_t c; (c = claim_share(&shares, own->me, own->threads)) >= 0;) {
        const int64_t first = c * columns, last = min64(first + columns, inter);
        linear_columns(st, own, gate_up, st->normed, st->m->hidden, st->gate_up, 2 * inter, first, last);
        linear_columns(st, own, gate_up, st->normed, st->m->hidden, st->gate_up, 2 * inter, inter + first,
                       inter + last);
        triode_silu_mul_columns_f32(st->gate_up + first, st->gate_up + inter + first, 2 * inter,
                                    st->activation + first, inter, st->rows, (int)(last - first));
    }
}

/* A row's share of the adapters' delta of the matrix whose op ran before (its h), added to
 * y's row r: the expand done row by row in the op that reads the row next, so that it needs
 * no barrier of its own. */
static void expand_row(const step_state *st, const lora_matrix *lora, int64_t r, float *y) {
    if (lora) {
        const int64_t width = (int64_t)lora->parts * lora->rank;
        triode_lora_expand(lora, st->lora_h + r * width, st->lora_slots + r, 1, y + r * lora->out, lora->out, 0,
                           lora->out);
    }
}

/* normed = rms_norm(hidden + residual) (residual updated; layer 0: of hidden alone), a row a
 * claim; `lora`: the adapters of the matrix that wrote hidden, whose delta is added first. */
static void team_norm(const step_state *st, counter *rows, const float *weight, int first_layer,
                      const lora_matrix *lora) {
    const int hidden = st->m->hidden;
    for (int64_t r; (r = claim(rows)) < st->rows;) {
        expand_row(st, lora, r, st->hidden);
        float *residual = first_layer ? NULL : st->residual + r * hidden;
        triode_rms_norm_f32(st->hidden + r * hidden, hidden, residual, hidden, weight, st->normed + r * hidden,
                            residual, 1, hidden, st->m->eps);
    }
}

/* Rotary on a row's q and k, then its k and v into the cache, a row a claim (after the qkv
 * adapters' delta, `lora`). */
static void team_rotary(const step_state *st, counter *rows, const decode_layer *layer, const lora_matrix *lora) {
    const decode_model *m = st->m;
    const int q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim, width = q_size + 2 * kv_size;
    for (int64_t r; (r = claim(rows)) < st->rows;) {
        expand_row(st, lora, r, st->qkv);
        float *row = st->qkv + r * width;
        triode_rotary_f32(st->positions + r, 1, row, width, m->heads, row + q_size, width, m->kv_heads,
                          m->cos_sin, m->max_positions, m->head_dim);
        triode_write_kv_f32(row + q_size, width, row + q_size + kv_size, width, layer->k_cache, layer->v_cache,
                            st->slots + r, 1, m->num_slots, kv_size);
    }
}

static void team_attention(const step_state *st, counter *units, const decode_layer *layer) {
    const decode_model *m = st->m;
    const int q_size = m->heads * m->head_dim, width = q_size + 2 * m->kv_heads * m->head_dim;
    for (int64_t u; (u = claim(units)) < st->rows * st->attention_split;)
        triode_paged_decode_f32_units(st->qkv, width, layer->k_cache, layer->v_cache, st->tables, st->table_stride,
                                      st->seq_lens, st->attention, q_size, m->heads, m->kv_heads, m->head_dim,
                                      m->block_size, m->scale, layer->window, 0.0f, st->attention_split,
                                      (int)u, 1);
}

/* The matrix's adapters for this step, or NULL. */
static const lora_matrix *step_lora(const step_state *st, const decode_layer *layer, int matrix) {
    return st->lora_slots ? layer->lora[matrix] : NULL;
}

/* h = x @ A for every adapted row, LORA_ROWS rows a claim (in the matrix's own op, before its
 * columns: both read x only, and a thread that shrinks then joins the columns). */
static void team_lora_shrink(const step_state *st, counter *chunks, const lora_matrix *lora, const float *x,
                             int64_t x_stride)
{
    const int64_t width = (int64_t)lora->parts * lora->rank, blocks = (st->rows + LORA_ROWS - 1) / LORA_ROWS;
    for (int64_t c; (c = claim(chunks)) < blocks;) {
        const int64_t row = c * LORA_ROWS;
        triode_lora_shrink(lora, x + row * x_stride, x_stride, st->lora_slots + row, min64(LORA_ROWS, st->rows - row),
                           st->lora_h + row * width);
    }
}

/* y = x @ W, and with adapters h = x @ A in the same op (the next op adds h @ B, row by row:
 * expand_row). `op` advances past the counters it used. */
static void team_adapted_linear(step_state *st, thread_state *own, counter **op, const quant_matrix *w,
                                const lora_matrix *lora, const float *x, int in, float *y)
{
    if (lora) team_lora_shrink(st, *op + st->counters_per_op, lora, x, in);
    team_linear(st, own, *op, w, x, in, y);
    if (lora) *op += st->counters_per_op;
}

/* The gate_up op with adapters: gate and up columns and h, then after a barrier their deltas
 * and SiLU-and-multiply, claim by claim of the same columns of gate and of up. */
static void team_adapted_gate_up(step_state *st, thread_state *own, counter **op, const decode_layer *layer,
                                 const lora_matrix *lora, int threads)
{
    const int next = st->counters_per_op;
    const int64_t inter = st->m->intermediate, columns = chunk_columns(&layer->gate_up, inter, own->threads, 32);
    share_claim shares = {*op, (inter + columns - 1) / columns, 0};
    team_lora_shrink(st, *op += next, lora, st->normed, st->m->hidden);
    new_input(own);
    for (int64_t c; (c = claim_share(&shares, own->me, own->threads)) >= 0;) {
        const int64_t first = c * columns, last = min64(first + columns, inter);
        linear_columns(st, own, &layer->gate_up, st->normed, st->m->hidden, st->gate_up, 2 * inter, first, last);
        linear_columns(st, own, &layer->gate_up, st->normed, st->m->hidden, st->gate_up, 2 * inter, inter + first,
                       inter + last);
    }
    team_wait(&st->barrier, threads);
    counter *chunks = *op += next;
    const int64_t count = (inter + EXPAND_CHUNK - 1) / EXPAND_CHUNK;
    for (int64_t c; (c = claim(chunks)) < count;) {
        const int64_t first = c * EXPAND_CHUNK, last = min64(first + EXPAND_CHUNK, inter);
        triode_lora_expand(lora, st->lora_h, st->lora_slots, st->rows, st->gate_up, 2 * inter, first, last);
        triode_lora_expand(lora, st->lora_h, st->lora_slots, st->rows, st->gate_up, 2 * inter, inter + first,
                           inter + last);
        triode_silu_mul_columns_f32(st->gate_up + first, st->gate_up + inter + first, 2 * inter,
                                    st->activation + first, inter, st->rows, (int)(last - first));
    }
}

static void run_layers(step_state *st, thread_state *own, int threads) {
    const decode_model *m = st->m;
    for (int l = 0; l < m->layers; l++) {
        const decode_layer *layer = &st->layers[l];
        counter *op = st->claims + (int64_t)l * OPS_PER_LAYER * st->counters_per_op;
        const int next = st->counters_per_op;
        team_norm(st, op, layer->input_norm, l == 0, l ? step_lora(st, &st->layers[l - 1], MATRIX_DOWN) : NULL);
        team_wait(&st->barrier, threads);
        op += next;
        const lora_matrix *qkv_lora = step_lora(st, layer, MATRIX_QKV), *o_lora = step_lora(st, layer, MATRIX_O);
        team_adapted_linear(st, own, &op, &layer->qkv, qkv_lora, st->normed, m->hidden, st->qkv);
        team_wait(&st->barrier, threads);
        team_rotary(st, op += next, layer, qkv_lora);
        team_wait(&st->barrier, threads);
        team_attention(st, op += next, layer);
        team_wait(&st->barrier, threads);
        op += next;
        team_adapted_linear(st, own, &op, &layer->o, o_lora, st->attention, m->heads * m->head_dim, st->hidden);
        team_wait(&st->barrier, threads);
        team_norm(st, op += next, layer->post_attention_norm, 0, o_lora);
        team_wait(&st->barrier, threads);
        op += next;
        const lora_matrix *gate_up_lora = step_lora(st, layer, MATRIX_GATE_UP);
        if (gate_up_lora) team_adapted_gate_up(st, own, &op, layer, gate_up_lora, threads);
        else team_gate_up(st, own, op, &layer->gate_up);
        team_wait(&st->barrier, threads);
        op += next;
        team_adapted_linear(st, own, &op, &layer->down, step_lora(st, layer, MATRIX_DOWN), st->activation,
                            m->intermediate, st->hidden);
        team_wait(&st->barrier, threads);
    }
    /* The last layer's down adapters, which no next norm adds. */
    const lora_matrix *last = step_lora(st, &st->layers[m->layers - 1], MATRIX_DOWN);
    counter *rows = st->claims + (int64_t)m->layers * OPS_PER_LAYER * st->counters_per_op;
    if (last) {
        for (int64_t r; (r = claim(rows)) < st->rows;) expand_row(st, last, r, st->hidden);
        team_wait(&st->barrier, threads);
    }
}

/* Every check a kernel would make, before the team starts (a failure inside it could not stop
 * the other threads). Returns 0 or the failing kernel's status, the op in *failed_op. */
static int check_step(const decode_model *m, const decode_layer *layers, int64_t rows, const int64_t *positions,
                      const int64_t *slots, int *failed_op)
{
    for (int64_t r = 0; r < rows; r++) {
        if (positions[r] < 0 || positions[r] >= m->max_positions) return *failed_op = OP_ROTARY, -1;
        if (slots[r] < 0 || slots[r] >= m->num_slots) return *failed_op = OP_WRITE_KV, -1;
    }
    const int q_size = m->heads * m->head_dim;
    int status = triode_paged_decode_f32_units(NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, 0, m->heads, m->kv_heads,
                                               m->head_dim, m->block_size, m->scale, 0, 0.0f, 1, 0, 0);
    if (status) return *failed_op = OP_ATTENTION, status;
    for (int l = 0; l < m->layers; l++) {
        const quant_matrix *matrices[] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        const int inputs[] = {m->hidden, q_size, m->hidden, m->intermediate};
        for (int i = 0; i < 4; i++)
            for (int p = 0; p < matrices[i]->count; p++) {
                const quant_part *part = &matrices[i]->parts[p];
                status = float_part(m, part)
                    ? triode_quant_linear_serial(part->type, NULL, 0, part->data, part->row_bytes, NULL, NULL,
                                                 0, rows, inputs[i], 0, m->invariant)
                    : triode_quant_linear_q8(part->type, NULL, rows, inputs[i], part->data, part->row_bytes, NULL,
                                             NULL, 0, 0, 0);
                if (status) return *failed_op = OP_LINEAR, status;
            }
    }
    return 0;
}

/* hidden [rows, hidden] in and out; residual [rows, hidden] out (hidden + residual is the
 * final norm's input). Returns 0, or the failed op's status with the op in *failed_op
 * (OUT_OF_MEMORY with 0 when the scratch buffers cannot be allocated). */
int triode_decode_stack(const decode_model *m, const decode_layer *layers, float *hidden, float *residual,
                        int64_t rows, const int64_t *positions, const int64_t *slots,
                        const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                        const int32_t *lora_slots, int *failed_op)
{
    *failed_op = 0;
    int status = check_step(m, layers, rows, positions, slots, failed_op);
    if (status) return status;
    const int q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    const int qkv_width = q_size + 2 * kv_size, max_threads = omp_get_max_threads();
    const int widest_input = max_int(max_int(m->hidden, q_size), m->intermediate);
    int64_t lora_width = 0;
    for (int l = 0; lora_slots && l < m->layers; l++)
        for (int i = 0; i < 4; i++)
            if (layers[l].lora[i] && layers[l].lora[i]->parts * (int64_t)layers[l].lora[i]->rank > lora_width)
                lora_width = layers[l].lora[i]->parts * (int64_t)layers[l].lora[i]->rank;
    const size_t floats = (size_t)rows * ((size_t)m->hidden + qkv_width + q_size + 3 * (size_t)m->intermediate
                                          + (size_t)lora_width);
    const int64_t input_bytes = m->activations == ACTIVATIONS_WIDE ? triode_q8_wide_bytes(rows, widest_input)
                                : m->activations == ACTIVATIONS_INT8 ? triode_q8_bytes(rows, widest_input) : 0;
    const size_t q8_bytes = ((size_t)input_bytes + 63) / 64 * 64;
    const size_t counters = ((size_t)m->layers * OPS_PER_LAYER + 1) * (size_t)max_threads; /* +1: the last expand */
    float *normed = malloc(floats * sizeof(float));
    counter *claims = aligned_alloc(sizeof(counter), counters * sizeof(counter));
    char *q8 = q8_bytes ? malloc(q8_bytes * MAX_PARTS * (size_t)max_threads) : NULL;
    if (!normed || !claims || (q8_bytes && !q8)) {
        status = OUT_OF_MEMORY;
        goto done;
    }
    step_state st = {
        .m = m, .layers = layers, .rows = rows, .hidden = hidden, .residual = residual, .normed = normed,
        .positions = positions, .slots = slots, .tables = tables, .seq_lens = seq_lens,
        .table_stride = table_stride, .claims = claims, .counters_per_op = max_threads,
        .lora_slots = lora_slots,
    };
    for (size_t i = 0; i < counters; i++) atomic_init(&claims[i].value, 0);
    st.qkv = normed + rows * m->hidden;
    st.attention = st.qkv + rows * qkv_width;
    st.gate_up = st.attention + rows * q_size;
    st.activation = st.gate_up + rows * 2 * m->intermediate;
    st.lora_h = st.activation + rows * m->intermediate;
    atomic_init(&st.barrier.arrived, 0);
    atomic_init(&st.barrier.generation, 0);
    memcpy(residual, hidden, sizeof(float) * rows * m->hidden);
    #pragma omp parallel num_threads(max_threads)
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        #pragma omp single
        st.attention_split = attention_units_per_sequence((int)rows, m->kv_heads, threads);
        thread_state own = {.me = me, .threads = threads};
        for (int i = 0; i < MAX_PARTS; i++) own.q8[i] = q8 ? q8 + q8_bytes * (MAX_PARTS * me + i) : NULL;
        run_layers(&st, &own, threads);
    }
done:
    free(q8);
    free(claims);
    free(normed);
    return status;
}
