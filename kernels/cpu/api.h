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

/* one projection in the forms it has: int8 (q, panels, scale; NULL: none), the file's own
 * blocks (qs, d16, m16, bits; block_ops.c) for steps of up to small_rows rows, and the float
 * weight */
typedef struct {
    const int8_t *q;
    const int8_t *panels; /* the int8 weight in panels (decode_ops.c); NULL: rows only */
    const float *scale;
    const float *bias; /* NULL: none */
    int64_t n, k;
    const uint8_t *qs;
    const uint16_t *d16, *m16;
    int64_t bits, small_rows;
    const float *dense; /* [n, k]: read only by a 4-bit weight's larger steps */
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
/* block_ops.c: the same from a GGUF's blocks of 32 inputs */
IS_API void is_block_linear(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int bits,
                            const uint16_t *d16, const uint16_t *m16, const float *bias,
                            int64_t N, int64_t K, float *y, int64_t ldy, int threads);
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
