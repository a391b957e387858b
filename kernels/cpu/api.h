/* The library's exported API: every function Python binds (kernels/cpu_api.py) and the structs
 * it passes, declared once here. tests/kernels/test_bindings.py parses this file and fails on
 * any difference from the ctypes table, field by field and argument by argument, and compiles
 * the sources with -Werror=missing-prototypes so each definition must match its line here.
 * The library is built with -fvisibility=hidden: only IS_API functions are exported, so the
 * export list, this header and the table are the same set of names.
 *
 * Tensors are a data pointer and strides in elements; the innermost dimension is contiguous.
 */
#ifndef INFERSTACK_API_H
#define INFERSTACK_API_H
#include <stdint.h>

#define IS_API __attribute__((visibility("default")))

/* the weight formats of the block kernels (block_ops.c describes each layout): the split
 * forms the runtime builds from a file's Q4_0/Q4_1 and Q8_0 blocks (qs, with float16 d and m
 * apart; the codes are their old `bits`), and a file's K-quant super-blocks as its own bytes
 * (the codes are ggml's type numbers). kernels/cpu_api.py mirrors them (BLOCK_FORMATS). */
enum { BLOCK_Q4 = 4, BLOCK_Q8 = 8, BLOCK_Q4_K = 12, BLOCK_Q5_K = 13, BLOCK_Q6_K = 14 };

/* one projection in the forms it has: int8 (q, panels, scale; NULL: none), the file's own
 * blocks (qs, d16, m16 in a BLOCK_* format; block_ops.c) for steps of up to small_rows rows,
 * and the float weight; a block weight without a float copy (dense NULL) runs its blocks at
 * every step size. A projection whose rows a file holds in two or more block formats (a
 * fused q/k/v of a Q4_K_M file: q and k in Q4_K, v in Q6_K) is a chain: this Matrix's n rows
 * in its format, then `next`'s rows in theirs (its bias the following rows' own), all into
 * one output; the int8 fields, small_rows and dense (of every row, with the whole bias) are
 * read from the first only. */
typedef struct Matrix {
    const int8_t *q;
    const int8_t *panels; /* the int8 weight in panels (decode_ops.c); NULL: rows only */
    const float *scale;
    const float *bias; /* NULL: none */
    int64_t n, k;
    const uint8_t *qs;
    const uint16_t *d16, *m16; /* NULL for the K-quants, whose scales are in their blocks */
    int64_t format, small_rows;
    const float *dense; /* [rows, k] or NULL: read only by a block weight's larger steps */
    const struct Matrix *next; /* the following rows in another block format; NULL: none */
} Matrix;

/* one decoder layer's shapes and weights (decode_layer.c) */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, attn_scale;
    const float *input_norm, *post_norm;
    Matrix qkv, o_proj, gate_up, down;
} LayerWeights;

/* what a decode step's layers share: rotary tables, the caches and where each token goes */
typedef struct {
    const float *cos, *sin; /* [B, head_dim] */
    void *k_cache, *v_cache;
    int64_t cache_slot, cache_head; /* strides in elements */
    const int64_t *slots, *tables, *lens;
    int64_t table_stride, page;
    int64_t kind; /* the caches' element type (simd.h) */
} StepCache;

/* attention's operands (attention.c): q and out [rows, H, D] by row and head strides (a row
 * is a sequence for decodes, a token for prefill), caches [slots, KVH, D] of element type
 * `kind` (simd.h) by slot and head strides, one page table a row of `tables` */
typedef struct {
    const float *q;
    int64_t q_row, q_head;
    const void *k_cache, *v_cache;
    int64_t cache_slot, cache_head, kind;
    const int64_t *tables;
    int64_t table_stride, page;
    int64_t heads, kv_heads, head_dim;
    float scale;
    float *out;
    int64_t out_row, out_head;
    int64_t window; /* 0: every earlier position; else a query sees the last `window` ones */
} AttentionArgs;

/* new K/V rows [T, KVH, D] by row and head strides, and the caches they go into */
typedef struct {
    const float *k, *v;
    int64_t k_row, k_head, v_row, v_head;
    void *k_cache, *v_cache;
    int64_t cache_slot, cache_head, kind;
} StoreKVArgs;

/* decode_ops.c: y [T, N] = x [T, K] w^T * scale + bias, from int8 rows or their panels */
IS_API void is_int8_linear(const float *x, int64_t T, int64_t ldx, const int8_t *w,
                           const float *scale, const float *bias, int64_t N, int64_t K, float *y,
                           int64_t ldy, int threads);
IS_API void is_int8_linear_panels(const float *x, int64_t T, int64_t ldx, const int8_t *panels,
                                  const float *scale, const float *bias, int64_t N, int64_t K,
                                  float *y, int64_t ldy, int threads);
/* block_ops.c: the same from a GGUF's blocks in a BLOCK_* format (d16, m16: the split forms'
 * scales, else NULL); and the weight itself, w [N, K] (row stride ldw) as float32, exactly */
IS_API void is_block_linear(const float *x, int64_t T, int64_t ldx, const uint8_t *qs,
                            int format, const uint16_t *d16, const uint16_t *m16,
                            const float *bias, int64_t N, int64_t K, float *y, int64_t ldy,
                            int threads);
IS_API void is_block_dequantize(const uint8_t *qs, int format, const uint16_t *d16,
                                const uint16_t *m16, int64_t N, int64_t K, float *w,
                                int64_t ldw, int threads);
/* f32_ops.c: from float32 rows */
IS_API void is_f32_linear(const float *x, int64_t T, int64_t ldx, const float *w,
                          const float *bias, int64_t N, int64_t K, float *y, int64_t ldy,
                          int threads);
/* decode_ops.c: the small ops */
IS_API void is_rms_norm(const float *x, int64_t ldx, const float *res, int64_t ldr,
                        const float *w, float *out, float *res_out, int64_t T, int64_t D,
                        float eps, int threads);
IS_API void is_silu_and_mul(const float *gu, int64_t ldg, float *out, int64_t T, int64_t I,
                            int threads);
IS_API void is_rotary(float *x, int64_t T, int64_t H, int64_t D, int64_t stride_t,
                      int64_t stride_h, const float *cos, const float *sin);
IS_API void is_store_kv(const StoreKVArgs *a, const int64_t *slots, int64_t T, int64_t KVH,
                        int64_t D);
/* attention.c: nonzero when a task could not allocate its state */
IS_API int is_decode_attention(const AttentionArgs *a, const int64_t *lens, int64_t B,
                               int threads);
IS_API int is_prefill_attention(const AttentionArgs *a, const int64_t *starts,
                                const int64_t *prefix, int64_t C, int threads);
/* decode_layer.c: one layer of a decode-only step; -1 when attention ran out of memory */
IS_API int is_decode_layer(const LayerWeights *L, float *x, float *residual, int first,
                           const StepCache *c, int64_t B, float *scratch, int threads);
#endif
