/* float32 matmul y = x w^T + bias for a decode step of many rows, from the row-major float
 * weight the runtime keeps anyway (runtime/linear.py's float copy).
 *
 * Why: an int4 model (block_ops.c) serves its smallest steps from the file's own blocks and,
 * where it keeps a float copy of the same weights, everything larger from that copy, so that
 * no batch size changes the weights a request is multiplied by (the block kernel now serves
 * any step itself, from panels it dequantizes: a weight without the copy never comes here).
 * Inside the fused decode layer (decode_layer.c) the
 * larger steps need a GEMM that is work-shared within its parallel region; torch's would be
 * a region of its own. A tile is ROWS weight rows by up to TOKENS tokens, its accumulators in
 * registers: per input vector, ROWS weight loads and TOKENS activation loads feed
 * ROWS x TOKENS FMAs, and one horizontal sum per output ends the tile. The group's rows (4 x K
 * floats) stay in L1 across the token tiles, the step's activations in L2.
 */
#include <immintrin.h>
#include <stdint.h>

#include "decode_ops.h"
#include "simd.h"

#ifdef __AVX512F__
typedef __m512 vf;
#define VW 16
#define TOKENS 6 /* 24 accumulators of 32 registers */
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vhsum(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vf;
#define VW 8
#define TOKENS 3 /* 12 accumulators of 16 registers */
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vhsum(v) hsum(v)
#endif
#define ROWS 4

INLINE void tile(const float *x, int64_t ldx, const float *w, int64_t K, int nr, int tr,
                 float out[ROWS][TOKENS]) {
    vf acc[ROWS][TOKENS];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++) acc[i][j] = vzero();
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        vf wv[ROWS];
        for (int i = 0; i < nr; i++) wv[i] = vload(w + i * K + k);
        for (int j = 0; j < tr; j++) {
            vf xv = vload(x + j * ldx + k);
            for (int i = 0; i < nr; i++) acc[i][j] = vfma(wv[i], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++) {
            float s = vhsum(acc[i][j]);
            for (int64_t kk = k; kk < K; kk++) s += w[i * K + kk] * x[j * ldx + kk];
            out[i][j] = s;
        }
}

/* rows [0, nr) of w (row-major, K floats each) against every token: y[t][i] (+ bias[i]).
 * Token tiles outside, row groups inside: a tile's activations stay in L1 across all nr rows */
static void f32_group_tiles(const float *x, int64_t T, int64_t ldx, const float *w, int nr,
                            int64_t K, const float *bias, float *y, int64_t ldy) {
    float out[ROWS][TOKENS];
    /* balanced token tiles (8 tokens as 4 + 4, not 6 + 2) */
    int64_t tiles = (T + TOKENS - 1) / TOKENS, height = (T + tiles - 1) / tiles;
    for (int64_t t = 0; t < T; t += height) {
        int tr = T - t < height ? (int)(T - t) : (int)height;
        const float *xt = x + t * ldx;
        for (int r = 0; r < nr; r += (nr - r >= ROWS ? ROWS : 1)) {
            int rows = nr - r >= ROWS ? ROWS : 1;
            /* constant tile shapes, so the accumulators stay in registers */
#define TILE(R)                                                                                \
    switch (tr) {                                                                              \
    case 1: tile(xt, ldx, w + r * K, K, R, 1, out); break;                                     \
    case 2: tile(xt, ldx, w + r * K, K, R, 2, out); break;                                     \
    case 3: tile(xt, ldx, w + r * K, K, R, 3, out); break;                                     \
    TOKEN_CASES(R)                                                                             \
    }
#ifdef __AVX512F__
#define TOKEN_CASES(R)                                                                         \
    case 4: tile(xt, ldx, w + r * K, K, R, 4, out); break;                                     \
    case 5: tile(xt, ldx, w + r * K, K, R, 5, out); break;                                     \
    default: tile(xt, ldx, w + r * K, K, R, 6, out);
#else
#define TOKEN_CASES(R)
#endif
            if (rows == ROWS) {
                TILE(ROWS)
            } else {
                TILE(1)
            }
#undef TILE
#undef TOKEN_CASES
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < tr; j++)
                    y[(t + j) * ldy + r + i] = out[i][j] + (bias ? bias[r + i] : 0.0f);
        }
    }
}

static void f32_row_group(const float *x, int64_t T, int64_t ldx, const float *w,
                          const float *bias, int64_t n, int nr, int64_t N, int64_t K, float *y,
                          int64_t ldy) {
    const float *wn = w + n * K;
    if (n + ROWS < N) /* the next group, fetched while this one computes */
        for (int64_t off = 0; off < ROWS * K; off += 16)
            _mm_prefetch((const char *)(wn + ROWS * K + off), _MM_HINT_T1);
    f32_group_tiles(x, T, ldx, wn, nr, K, bias ? bias + n : NULL, y + n, ldy);
}

void f32_rows_for(const float *x, int64_t T, int64_t ldx, const float *w, const float *bias,
                  int64_t N, int64_t K, float *y, int64_t ldy) {
    int64_t groups = (N + ROWS - 1) / ROWS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n = g * ROWS;
        f32_row_group(x, T, ldx, w, bias, n, N - n < ROWS ? (int)(N - n) : ROWS, N, K, y, ldy);
    }
}

void is_f32_linear(const float *x, int64_t T, int64_t ldx, const float *w, const float *bias,
                   int64_t N, int64_t K, float *y, int64_t ldy, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    f32_rows_for(x, T, ldx, w, bias, N, K, y, ldy);
}
