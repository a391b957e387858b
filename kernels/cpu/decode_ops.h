/* What the fused decode layer (decode_layer.c) shares with the single ops (decode_ops.c):
 * internal, hidden by the build's -fvisibility=hidden (the exported API is api.h's). */
#ifndef INFERSTACK_DECODE_OPS_H
#define INFERSTACK_DECODE_OPS_H
#include <stdint.h>

#include "api.h"

/* an int8 matmul y = x w^T * scale + bias, work-shared among the threads of the enclosing
 * parallel region: from row-major weights, or from their panels (16 rows, input-major) */
void int8_rows_for(const float *x, int64_t T, int64_t ldx, const int8_t *w, const float *scale,
                   const float *bias, int64_t N, int64_t K, float *y, int64_t ldy);
void int8_panels_for(const float *x, int64_t T, int64_t ldx, const int8_t *panels,
                     const float *scale, const float *bias, int64_t N, int64_t K, float *y,
                     int64_t ldy);
/* a matmul y = x w^T + bias from a GGUF's blocks in a BLOCK_* format (api.h; block_ops.c has
 * the layouts), work-shared like the int8 ones */
void block_rows_for(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int fmt,
                    const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t N,
                    int64_t K, float *y, int64_t ldy);
/* a float32 matmul y = x w^T + bias from row-major weights (f32_ops.c), work-shared alike */
void f32_rows_for(const float *x, int64_t T, int64_t ldx, const float *w, const float *bias,
                  int64_t N, int64_t K, float *y, int64_t ldy);
/* out = norm(x + res) * w, res_out = x + res (res NULL: norm(x) * w) */
void norm_row(const float *x, const float *res, const float *w, float *out, float *res_out,
              int64_t D, float eps);
/* o = silu(g) * u over I values */
void silu_row(const float *g, const float *u, float *o, int64_t I);
/* rotary on one token's H heads (head stride stride_h) with its cos, signed sin [D] */
void rotate_token(float *x, int64_t H, int64_t D, int64_t stride_h, const float *c,
                  const float *s);
/* decode attention (attention.c), work-shared among the threads of the enclosing parallel
 * region: a's q [B, H, D] against its paged cache, sequence b's new token at position
 * lens[b] - 1; returns nonzero on this thread if a task could not allocate its state */
int decode_attention_for(const AttentionArgs *a, const int64_t *lens, int64_t B, int threads);
#endif
