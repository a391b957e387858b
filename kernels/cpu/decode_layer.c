/* One Llama decoder layer for a step of decodes only (one new token per sequence), in one
 * call and one OpenMP parallel region.
 *
 * Why: called op by op from Python, a batch-1 layer paid ten wrapper calls and ten thread
 * fork/joins (about 30 us each on the 2-core VMs) around 3.5 MB of int8 weights that stream
 * in about 200 us. Here the phases are work-shared loops of one region, parted by its
 * barriers, and the weights of each matmul are fetched a row group ahead (decode_ops.c).
 * The arithmetic is the single ops' own (decode_ops.h), so the fused layer and the op-by-op
 * path agree to float32 rounding (tests/kernels/test_cpu_decode_layer.py).
 *
 * Contract (the Python side, kernels/cpu_layer.py, checks it): float32 activations; each
 * weight int8 with one float32 scale per row, or in a file's own blocks (with its float copy,
 * or without one: then the blocks at every step size);
 * caches [slots, KVH, D] of float32, float16 or bfloat16 (or int8 rows [slots, KVH, D + 4]
 * ending in their scales, simd.h) with unit inner stride, int64
 * slots, tables and lengths, and B sequences each at the token whose K/V goes to slots[b]
 * and whose context is then lens[b] long. Attention is attention.c's, work-shared inside the
 * region.
 */
#include <stdint.h>
#include <string.h>

#include "decode_ops.h"
#include "simd.h"

/* Matrix, LayerWeights and StepCache: api.h (kernels/cpu_api.py mirrors them) */

/* from this many rows the panel kernel runs: on the 2-core VMs the two tied from 8 to 32 rows
 * and the panels won by 1.27x at 64 (docs/perf.md); below, the row kernel, which prefetches
 * and keeps more FMA chains busy for one or two tokens. Python's choice is the same
 * (kernels.cpu_ops.PANEL_MIN_ROWS). */
#define PANEL_MIN_ROWS 32

/* a projection's output width: the rows of every matrix of its chain (api.h) */
static int64_t rows_of(const Matrix *m) {
    int64_t n = 0;
    for (; m; m = m->next) n += m->n;
    return n;
}

static void matmul_for(const Matrix *m, const float *x, int64_t B, float *y) {
    const int64_t ldy = rows_of(m);
    /* a file's blocks up to their crossover, or at every size where no float copy is kept
     * (the K-quants: block_rows_for dequantizes panels for larger steps itself); a chain's
     * matrices each into their own columns */
    if (m->qs && (B <= m->small_rows || !m->dense))
        for (int64_t at = 0; m; at += m->n, m = m->next)
            block_rows_for(x, B, m->k, m->qs, (int)m->format, m->d16, m->m16, m->bias, m->n,
                           m->k, y + at, ldy);
    else if (!m->q) /* a file's block weight above its crossover: the same weights in float */
        f32_rows_for(x, B, m->k, m->dense, m->bias, ldy, m->k, y, ldy);
    else if (m->panels && B >= PANEL_MIN_ROWS)
        int8_panels_for(x, B, m->k, m->panels, m->scale, m->bias, m->n, m->k, y, m->n);
    else
        int8_rows_for(x, B, m->k, m->q, m->scale, m->bias, m->n, m->k, y, m->n);
}

/* x [B, hidden]: the previous layer's output (or the embeddings: first != 0) in, this
 * layer's output out; residual [B, hidden] carried across layers; scratch holds
 * B * (qkv + attention + gate_up + act) floats. Returns -1 if attention ran out of memory. */
int is_decode_layer(const LayerWeights *L, float *x, float *residual, int first,
                    const StepCache *c, int64_t B, float *scratch, int threads) {
    const int64_t H = L->hidden, D = L->head_dim, nq = L->heads * D, nk = L->kv_heads * D;
    const int64_t nqkv = rows_of(&L->qkv), size = kv_size((int)c->kind);
    float *qkv = scratch, *attn = qkv + B * nqkv, *gu = attn + B * nq, *act = gu + B * 2 * L->inter;
    float *h = act + B * L->inter; /* the normed input of each matmul */
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            if (first) memcpy(residual + b * H, x + b * H, sizeof(float) * (size_t)H);
            norm_row(first ? residual + b * H : x + b * H, first ? NULL : residual + b * H,
                     L->input_norm, h + b * H, residual + b * H, H, L->eps);
        }
        matmul_for(&L->qkv, h, B, qkv);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * nqkv;
            rotate_token(row, L->heads + L->kv_heads, D, D, c->cos + b * D, c->sin + b * D);
            for (int64_t kh = 0; kh < L->kv_heads; kh++) {
                int64_t at = (c->slots[b] * c->cache_slot + kh * c->cache_head) * size;
                put_kv((char *)c->k_cache + at, row + nq + kh * D, D, (int)c->kind);
                put_kv((char *)c->v_cache + at, row + nq + nk + kh * D, D, (int)c->kind);
            }
        }
        const AttentionArgs att = {
            .q = qkv, .q_row = nqkv, .q_head = D, .k_cache = c->k_cache, .v_cache = c->v_cache,
            .cache_slot = c->cache_slot, .cache_head = c->cache_head, .kind = c->kind,
            .tables = c->tables, .table_stride = c->table_stride, .page = c->page,
            .heads = L->heads, .kv_heads = L->kv_heads, .head_dim = D, .scale = L->attn_scale,
            .out = attn, .out_row = nq, .out_head = D};
        failed |= decode_attention_for(&att, c->lens, B, threads);
        matmul_for(&L->o_proj, attn, B, x);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            norm_row(x + b * H, residual + b * H, L->post_norm, h + b * H, residual + b * H, H,
                     L->eps);
        matmul_for(&L->gate_up, h, B, gu);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            silu_row(gu + b * 2 * L->inter, gu + b * 2 * L->inter + L->inter,
                     act + b * L->inter, L->inter);
        matmul_for(&L->down, act, B, x);
    }
    return failed ? -1 : 0;
}
