/* What the fused decode layer (decode_layer.c) shares with the single ops (decode_ops.c). */
#ifndef INFERSTACK_DECODE_OPS_H
#define INFERSTACK_DECODE_OPS_H
#include <stdint.h>

/* weight rows n..n+nr (nr <= 4) of an int8 matmul against T activation rows */
void int8_row_group(const float *x, int64_t T, int64_t ldx, const int8_t *w, int64_t K,
                    int64_t n, int nr, const float *scale, const float *bias, float *y,
                    int64_t ldy);
/* the panel (16 rows from n0, input-major) of an int8 matmul against T activation rows */
void int8_panel(const float *x, int64_t T, int64_t ldx, const int8_t *wp, int64_t K,
                int64_t n0, int64_t N, const float *scale, const float *bias, float *y,
                int64_t ldy);
/* out = norm(x + res) * w, res_out = x + res (res NULL: norm(x) * w) */
void norm_row(const float *x, const float *res, const float *w, float *out, float *res_out,
              int64_t D, float eps);
/* o = silu(g) * u over I values */
void silu_row(const float *g, const float *u, float *o, int64_t I);
/* rotary on one token's H heads (head stride stride_h) with its cos, signed sin [D] */
void rotate_token(float *x, int64_t H, int64_t D, int64_t stride_h, const float *c,
                  const float *s);
/* one sequence's G query heads against one KV head of the paged cache; -1: out of memory */
int attend_one(const float *q, int64_t q_head, const float *kc, const float *vc,
               int64_t cache_slot, int64_t kvh_off, const int64_t *table, int64_t len,
               int64_t page, int64_t G, int64_t D, float scale, float *out, int64_t out_head);
#endif
