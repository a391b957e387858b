/* The CPU decode step's hot ops, for float32 activations on AVX2 + FMA machines.
 *
 * Why C: a batch-1 decode step on the 2-core VMs spent 21 ms in torch's int8 weight-only
 * GEMV (about 6.5 GB/s of the 25 GB/s the machine reads) and another 11 ms in small ops that
 * each cost 20-70 us of dispatch for a few hundred floats (docs/perf.md). These functions do
 * the same arithmetic in one pass each, parallel over torch's own OpenMP pool (the library
 * is linked against torch's libgomp with an rpath to it: kernels/cpu_build.py says why).
 *
 * Numerics: every reduction is float32 like torch's, in a different order, so results agree
 * with the references to float32 rounding, not bit for bit (tests/kernels/test_cpu_ops.py).
 * Layouts follow kernels/__init__.py: a tensor is passed as its data pointer and its strides
 * in elements; the innermost dimension is always contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_ops.h"
#include "simd.h"

/* ---- weight-only int8 matmul: y[t, n] = scale[n] * sum_k w[n, k] x[t, k] + bias[n] ----
 *
 * A tile is NR weight rows by TR activation rows; each weight vector is converted once and
 * multiplied into every activation row of the tile, so the conversion's cost falls as the
 * step grows. Threads split the weight rows, and each thread walks its rows in groups of four
 * with every token tile inside: the group's 4 x K bytes stay in L1 while the activations
 * (T x K floats) stay in L2. Batch 1 splits K into two accumulators per row so four rows keep
 * eight FMA chains in flight, enough to cover the FMA latency at memory speed. */
INLINE void tile(const float *x, int64_t ldx, const int8_t *w, int64_t K, int nr, int tr,
                 int split, float out[4][4]) {
    __m256 acc[4][4][2];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++)
            acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    int64_t k = 0;
    if (split) {
        for (; k + 16 <= K; k += 16)
            for (int h = 0; h < 2; h++) {
                __m256 wv[4];
                for (int i = 0; i < nr; i++) wv[i] = load_i8(w + i * K + k + 8 * h);
                for (int j = 0; j < tr; j++) {
                    __m256 xv = _mm256_loadu_ps(x + j * ldx + k + 8 * h);
                    for (int i = 0; i < nr; i++)
                        acc[i][j][h] = _mm256_fmadd_ps(wv[i], xv, acc[i][j][h]);
                }
            }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int i = 0; i < nr; i++) wv[i] = load_i8(w + i * K + k);
        for (int j = 0; j < tr; j++) {
            __m256 xv = _mm256_loadu_ps(x + j * ldx + k);
            for (int i = 0; i < nr; i++) acc[i][j][0] = _mm256_fmadd_ps(wv[i], xv, acc[i][j][0]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++) {
            float s = hsum(_mm256_add_ps(acc[i][j][0], acc[i][j][1]));
            for (int64_t kk = k; kk < K; kk++) s += (float)w[i * K + kk] * x[j * ldx + kk];
            out[i][j] = s;
        }
}

INLINE void store(float out[4][4], int nr, int tr, int64_t n, int64_t t, const float *scale,
                  const float *bias, float *y, int64_t ldy) {
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++)
            y[(t + j) * ldy + n + i] = out[i][j] * scale[n + i] + (bias ? bias[n + i] : 0.0f);
}

/* rows n..n+nr (nr <= 4) against every token: tiles sized so their accumulators fit in the
 * 16 vector registers */
static void int8_row_group(const float *x, int64_t T, int64_t ldx, const int8_t *w,
                           int64_t K, int64_t n, int nr, const float *scale,
                           const float *bias, float *y, int64_t ldy) {
    const int8_t *wn = w + n * K;
    /* the next group's rows, fetched while this one computes: with four rows read side by
     * side the hardware prefetcher alone streamed 9.5 GB/s from memory, this 17-21 */
    for (int64_t off = 0; off < 4 * K; off += 64)
        _mm_prefetch((const char *)(wn + 4 * K + off), _MM_HINT_T0);
    float out[4][4];
    int64_t t = 0;
    for (; t + 4 <= T; t += 4)
        for (int i = 0; i < nr; i += 2) {
            int r = nr - i < 2 ? 1 : 2;
            if (r == 2) tile(x + t * ldx, ldx, wn + i * K, K, 2, 4, 0, out);
            else tile(x + t * ldx, ldx, wn + i * K, K, 1, 4, 1, out);
            store(out, r, 4, n + i, t, scale, bias, y, ldy);
        }
    int rest = (int)(T - t);
    if (rest == 0) return;
    if (nr == 4) {
        if (rest == 1) tile(x + t * ldx, ldx, wn, K, 4, 1, 1, out);
        else if (rest == 2) tile(x + t * ldx, ldx, wn, K, 4, 2, 0, out);
        else {
            tile(x + t * ldx, ldx, wn, K, 2, 3, 0, out);
            store(out, 2, 3, n, t, scale, bias, y, ldy);
            tile(x + t * ldx, ldx, wn + 2 * K, K, 2, 3, 0, out);
            store(out, 2, 3, n + 2, t, scale, bias, y, ldy);
            return;
        }
        store(out, 4, rest, n, t, scale, bias, y, ldy);
        return;
    }
    for (int i = 0; i < nr; i++) {
        if (rest == 1) tile(x + t * ldx, ldx, wn + i * K, K, 1, 1, 1, out);
        else if (rest == 2) tile(x + t * ldx, ldx, wn + i * K, K, 1, 2, 1, out);
        else tile(x + t * ldx, ldx, wn + i * K, K, 1, 3, 1, out);
        store(out, 1, rest, n + i, t, scale, bias, y, ldy);
    }
}

/* the whole matmul, its row groups shared out among the threads of the enclosing parallel
 * region (called from inside one) */
void int8_rows_for(const float *x, int64_t T, int64_t ldx, const int8_t *w, const float *scale,
                   const float *bias, int64_t N, int64_t K, float *y, int64_t ldy) {
    int64_t groups = (N + 3) / 4;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n = g * 4;
        int nr = N - n < 4 ? (int)(N - n) : 4;
        int8_row_group(x, T, ldx, w, K, n, nr, scale, bias, y, ldy);
    }
}

void is_int8_linear(const float *x, int64_t T, int64_t ldx, const int8_t *w,
                    const float *scale, const float *bias, int64_t N, int64_t K, float *y,
                    int64_t ldy, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    int8_rows_for(x, T, ldx, w, scale, bias, N, K, y, ldy);
}

/* ---- the same matmul from a panel layout, for steps of several rows ----
 *
 * With more than a few rows the dot-product tiles above spend their time converting each
 * weight again for every token tile and summing vectors horizontally. Here the weight is
 * packed in panels of 16 output rows stored input-major (panel[k][16]: see
 * runtime/quantization.py), so a tile of up to 6 tokens by 16 outputs accumulates in 12
 * vector registers: per input k, one 16-byte load and two conversions feed 12 FMAs, each
 * token's x[t, k] broadcast from memory, and no horizontal sum at all. */
#define PANEL 16
#define PANEL_TOKENS 6

/* a tile of tr tokens by 16 outputs from an int8 panel (wp) or from its float32 conversion
 * (wf, [K][16]: then per input two loads and 12 FMAs, nothing else on the FMA pipes); the
 * accumulators are local and stored once at the end, so they stay in registers */
INLINE void panel_tile(const float *x, int64_t ldx, const int8_t *wp, const float *wf,
                       int64_t K, int tr, float out[PANEL_TOKENS][PANEL]) {
    __m256 acc[PANEL_TOKENS][2];
    for (int j = 0; j < tr; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1;
        if (wf) {
            w0 = _mm256_loadu_ps(wf + k * PANEL);
            w1 = _mm256_loadu_ps(wf + k * PANEL + 8);
        } else {
            __m128i raw = _mm_loadu_si128((const __m128i *)(wp + k * PANEL));
            w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
            w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
        }
        for (int j = 0; j < tr; j++) {
            __m256 xb = _mm256_broadcast_ss(x + j * ldx + k);
            acc[j][0] = _mm256_fmadd_ps(xb, w0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(xb, w1, acc[j][1]);
        }
    }
    for (int j = 0; j < tr; j++) {
        _mm256_storeu_ps(out[j], acc[j][0]);
        _mm256_storeu_ps(out[j] + 8, acc[j][1]);
    }
}

/* the tile with its height and weight kind made constants, one specialization each */
#define PANEL_TILE(xt, ldx, wp, wf, K, tr, out)                                                \
    (wf ? panel_tile(xt, ldx, NULL, wf, K, tr, out) : panel_tile(xt, ldx, wp, NULL, K, tr, out))

/* one token: two inputs per step into four accumulators, so the FMA chains overlap (with
 * two, each step would wait out the previous FMA's latency: half the memory's speed) */
INLINE void panel_row(const float *x, const int8_t *wp, int64_t K, float out[PANEL]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(wp + k * PANEL));
        __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
        __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
        a0 = _mm256_fmadd_ps(xa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a0);
        a1 = _mm256_fmadd_ps(xa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                             a1);
        b0 = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), b0);
        b1 = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
                             b1);
    }
    for (; k < K; k++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(wp + k * PANEL));
        __m256 xa = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), a0);
        a1 = _mm256_fmadd_ps(xa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))),
                             a1);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(a0, b0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(a1, b1));
}

/* from this many token tiles (25 rows) a panel is converted to float32 once and every tile
 * reads that: the conversion then costs a tile's share, not a third of every tile's FP work
 * (measured 1.05-1.36x at 32-64 rows, not faster at 16) */
#define PANEL_F32_TILES 5

static void int8_panel(const float *x, int64_t T, int64_t ldx, const int8_t *wp, int64_t K,
                       int64_t n0, int64_t N, const float *scale, const float *bias, float *y,
                       int64_t ldy) {
    float out[PANEL_TOKENS][PANEL];
    int valid = N - n0 < PANEL ? (int)(N - n0) : PANEL;
    /* balanced tile heights: 8 rows run as 4 + 4, not 6 + a poor 2 */
    int64_t tiles = (T + PANEL_TOKENS - 1) / PANEL_TOKENS;
    int64_t height = (T + tiles - 1) / tiles;
    float *wf = tiles >= PANEL_F32_TILES ? malloc(sizeof(float) * (size_t)(K * PANEL)) : NULL;
    if (wf)
        for (int64_t k = 0; k < K * PANEL; k += 8)
            _mm256_storeu_ps(wf + k, load_i8(wp + k));
    for (int64_t t = 0; t < T; t += height) {
        int tr = T - t < height ? (int)(T - t) : (int)height;
        const float *xt = x + t * ldx;
        switch (tr) { /* constant tile heights, so the accumulators stay in registers */
        case 6: PANEL_TILE(xt, ldx, wp, wf, K, 6, out); break;
        case 5: PANEL_TILE(xt, ldx, wp, wf, K, 5, out); break;
        case 4: PANEL_TILE(xt, ldx, wp, wf, K, 4, out); break;
        case 3: PANEL_TILE(xt, ldx, wp, wf, K, 3, out); break;
        case 2: PANEL_TILE(xt, ldx, wp, wf, K, 2, out); break;
        default:
            if (wf) panel_tile(xt, ldx, NULL, wf, K, 1, out);
            else panel_row(xt, wp, K, out[0]);
        }
        for (int j = 0; j < tr; j++) {
            float *dst = y + (t + j) * ldy + n0;
            for (int i = 0; i < valid; i++)
                dst[i] = out[j][i] * scale[n0 + i] + (bias ? bias[n0 + i] : 0.0f);
        }
    }
    free(wf);
}

/* the whole matmul from panels, shared out like int8_rows_for */
void int8_panels_for(const float *x, int64_t T, int64_t ldx, const int8_t *panels,
                     const float *scale, const float *bias, int64_t N, int64_t K, float *y,
                     int64_t ldy) {
    int64_t count = (N + PANEL - 1) / PANEL;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < count; p++)
        int8_panel(x, T, ldx, panels + p * PANEL * K, K, p * PANEL, N, scale, bias, y, ldy);
}

void is_int8_linear_panels(const float *x, int64_t T, int64_t ldx, const int8_t *panels,
                           const float *scale, const float *bias, int64_t N, int64_t K,
                           float *y, int64_t ldy, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    int8_panels_for(x, T, ldx, panels, scale, bias, N, K, y, ldy);
}

/* ---- RMSNorm, with the residual add fused: v = x + res; res_out = v; out = norm(v) * w ---- */
void norm_row(const float *x, const float *res, const float *w, float *out,
                     float *res_out, int64_t D, float eps) {
    __m256 ss = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 v = _mm256_loadu_ps(x + d);
        if (res) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(res + d));
            _mm256_storeu_ps(res_out + d, v);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    float s = hsum(ss);
    for (int64_t e = d; e < D; e++) {
        float v = x[e] + (res ? res[e] : 0.0f);
        if (res) res_out[e] = v;
        s += v * v;
    }
    const float *src = res ? res_out : x;
    float r = 1.0f / sqrtf(s / (float)D + eps);
    __m256 rv = _mm256_set1_ps(r);
    for (d = 0; d + 8 <= D; d += 8)
        _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + d), rv),
                                                _mm256_loadu_ps(w + d)));
    for (; d < D; d++) out[d] = src[d] * r * w[d];
}

void is_rms_norm(const float *x, int64_t ldx, const float *res, int64_t ldr, const float *w,
                 float *out, float *res_out, int64_t T, int64_t D, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= 16)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * ldx, res ? res + t * ldr : NULL, w, out + t * D,
                 res_out ? res_out + t * D : NULL, D, eps);
}

/* ---- SiLU(gate) * up over [T, 2I] -> [T, I] ---- */

void silu_row(const float *g, const float *u, float *o, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f),
                                   exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void is_silu_and_mul(const float *gu, int64_t ldg, float *out, int64_t T, int64_t I,
                     int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= 8)
    for (int64_t t = 0; t < T; t++) silu_row(gu + t * ldg, gu + t * ldg + I, out + t * I, I);
}

/* ---- rotary, in place: x [T, H, D] with cos, signed sin [T, D] (kernels.rotary_cos_sin) ----
 * out = x * cos + roll(x, D/2) * sin */
void rotate_token(float *x, int64_t H, int64_t D, int64_t stride_h, const float *c,
                  const float *s) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < H; h++) {
        float *p = x + h * stride_h;
        int64_t j = 0;
        for (; j + 8 <= half; j += 8) {
            __m256 x1 = _mm256_loadu_ps(p + j), x2 = _mm256_loadu_ps(p + half + j);
            _mm256_storeu_ps(p + j, _mm256_fmadd_ps(x2, _mm256_loadu_ps(s + j),
                                                    _mm256_mul_ps(x1, _mm256_loadu_ps(c + j))));
            _mm256_storeu_ps(p + half + j,
                             _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + half + j),
                                             _mm256_mul_ps(x2, _mm256_loadu_ps(c + half + j))));
        }
        for (; j < half; j++) {
            float x1 = p[j], x2 = p[half + j];
            p[j] = x1 * c[j] + x2 * s[j];
            p[half + j] = x2 * c[half + j] + x1 * s[half + j];
        }
    }
}

void is_rotary(float *x, int64_t T, int64_t H, int64_t D, int64_t stride_t, int64_t stride_h,
               const float *cos, const float *sin) {
    for (int64_t t = 0; t < T; t++)
        rotate_token(x + t * stride_t, H, D, stride_h, cos + t * D, sin + t * D);
}

/* ---- store the step's new K/V rows: cache[slot[t], h, :] = new[t, h, :], converted to the
 * cache's element type `kind` (simd.h); a negative slot stores nothing ---- */
void is_store_kv(const StoreKVArgs *a, const int64_t *slots, int64_t T, int64_t KVH,
                 int64_t D) {
    const int kind = (int)a->kind;
    const int64_t size = kv_size(kind);
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < KVH; h++) {
            int64_t at = (slots[t] * a->cache_slot + h * a->cache_head) * size;
            put_kv((char *)a->k_cache + at, a->k + t * a->k_row + h * a->k_head, D, kind);
            put_kv((char *)a->v_cache + at, a->v + t * a->v_row + h * a->v_head, D, kind);
        }
    }
}
