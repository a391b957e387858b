/* Weight-only matmuls from a GGUF file's own blocks, for small steps, on float32 activations.
 *
 * Why: a batch-1 decode step streams every weight once, so its time is its bytes. The int8
 * row kernel (decode_ops.c) reads one byte a weight and requantizes the file's values; a
 * GGUF's Q4_1 matrices hold 5 bits a weight (16 bytes of nibbles and two float16 numbers per
 * 32 weights), and served in that form a step reads 0.625 of the int8 bytes. Its Q8_0 ones
 * (32 int8 and a float16 d per 32 weights) read about as much as int8 but are not rounded
 * again. The activations stay float32, so the product is the file's own weights times x, to
 * float32 rounding.
 *
 * Layouts (runtime/quantization.py builds them): per weight row, blocks of 32 inputs, with
 * float16 d [N, K/32] (and m for 4 bits):
 *   4 bits: qs [N, K/32, 16] bytes, byte j holding input j in its low nibble and input j + 16
 *           in its high one (the GGUF order); w = q * d + m, q in 0..15 (`Int4Weight`);
 *   8 bits: qs [N, K/32, 32] int8; w = q * d (`Int8BlockWeight`).
 *
 * Each block is dequantized once into float vectors and multiplied into every token of the
 * tile; above DEQUANT_TOKENS tokens a panel of rows is dequantized once into L2 and the float
 * tiles of f32_ops.c take over. Threads split the weight rows in groups of four (small steps,
 * each group's bytes fetched a group ahead, like int8_rows_for) or in panels (many tokens).
 * Built for AVX-512 where the CPU has it, else AVX2 + FMA + F16C.
 */
#include <immintrin.h>
#include <stdint.h>

#include "decode_ops.h"
#include "simd.h"

#ifdef __AVX512F__
typedef __m512 vf;
#define VW 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vset1(f) _mm512_set1_ps(f)
#define vhsum(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vf;
#define VW 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vset1(f) _mm256_set1_ps(f)
#define vhsum(v) hsum(v)
#endif
#define Q4_BLOCK 32
#define NV (Q4_BLOCK / VW) /* vectors per block */
#define ROWS 4             /* weight rows per group */
#define TOKENS 4           /* tokens per tile */
/* above this many tokens a panel is dequantized once and multiplied by float tiles: each
 * weight is then unpacked once per call, not once per four tokens */
#define DEQUANT_TOKENS 8
#define PANEL_ROWS 32          /* rows a many-token step dequantizes at once */
#define PANEL_FLOATS (1 << 16) /* 256 KB: a panel stays in L2 */

/* one block of one row as NV float vectors, in input order */
INLINE void dequant(const uint8_t *qs, int bits, float d, float m, vf w[NV]) {
    if (bits == 8) { /* q * d, one rounding, as the file's own dequantization */
        const int8_t *q8 = (const int8_t *)qs;
        for (int v = 0; v < NV; v++)
#ifdef __AVX512F__
            w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                     _mm_loadu_si128((const __m128i *)(q8 + v * VW)))),
                                 vset1(d));
#else
            w[v] = _mm256_mul_ps(load_i8(q8 + v * VW), vset1(d));
#endif
        return;
    }
#ifdef __AVX512F__
    /* the block's 16 possible weights, q * d + m for q = 0..15, then each nibble picks its
     * own: vpermps reads only the low four bits of each index, so the low nibbles need no
     * mask and nothing is converted (a table FMA and two permutes per block, where
     * converting costs two conversions and two FMAs) */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    w[0] = _mm512_permutexvar_ps(v, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
#else
    vf dv = vset1(d), mv = vset1(m);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv,
                           mv);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv,
                           mv);
#endif
}

/* nr rows (from qs, their float scales ds/ms [nr][kb]) by tr tokens; with one token the
 * vectors of a block alternate between two accumulators so more FMA chains overlap */
INLINE void tile(const float *x, int64_t ldx, const uint8_t *qs, int bits, const float *ds,
                 const float *ms, int64_t kb, int nr, int tr, float out[ROWS][TOKENS]) {
    const int64_t bb = bits * 4; /* bytes a block */
    vf acc[ROWS][TOKENS][2];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++) acc[i][j][0] = acc[i][j][1] = vzero();
    for (int64_t b = 0; b < kb; b++) {
        for (int i = 0; i < nr; i++) {
            vf w[NV];
            dequant(qs + (i * kb + b) * bb, bits, ds[i * kb + b], ms[i * kb + b], w);
            for (int j = 0; j < tr; j++) {
                const float *xb = x + j * ldx + b * Q4_BLOCK;
                for (int v = 0; v < NV; v++) {
                    int a = tr == 1 ? v & 1 : 0;
                    acc[i][j][a] = vfma(w[v], vload(xb + v * VW), acc[i][j][a]);
                }
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++)
            out[i][j] = vhsum(tr == 1 ? vadd(acc[i][j][0], acc[i][j][1]) : acc[i][j][0]);
}

/* float16 -> float32 for n values */
static void halves(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
}

INLINE void row_group(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int bits,
                      const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t n,
                      int nr, int64_t N, int64_t K, float *y, int64_t ldy) {
    const int64_t kb = K / Q4_BLOCK, bytes = kb * bits * 4;
    const uint8_t *q = qs + n * bytes;
    /* the next group's nibbles and scales, fetched while this one computes (as in
     * int8_row_group) */
    if (n + ROWS < N) {
        for (int64_t off = 0; off < ROWS * bytes; off += 64)
            _mm_prefetch((const char *)(q + ROWS * bytes + off), _MM_HINT_T0);
        for (int64_t off = 0; off < ROWS * kb * 2; off += 64) {
            _mm_prefetch((const char *)(d16 + (n + ROWS) * kb) + off, _MM_HINT_T0);
            if (m16) _mm_prefetch((const char *)(m16 + (n + ROWS) * kb) + off, _MM_HINT_T0);
        }
    }
    float ds[ROWS * kb], ms[ROWS * kb];
    halves(d16 + n * kb, ds, nr * kb);
    if (m16)
        halves(m16 + n * kb, ms, nr * kb);
    else
        for (int64_t i = 0; i < nr * kb; i++) ms[i] = 0.0f;
    float out[ROWS][TOKENS];
    for (int64_t t = 0; t < T; t += TOKENS) {
        int tr = T - t < TOKENS ? (int)(T - t) : TOKENS;
        const float *xt = x + t * ldx;
        /* constant tile shapes, so the accumulators stay in registers */
#define TILE(R, C) tile(xt, ldx, q + r * bytes, bits, ds + r * kb, ms + r * kb, kb, R, C, out)
        for (int r = 0; r < nr; r += (nr == ROWS ? ROWS : 1)) {
            int rows = nr == ROWS ? ROWS : 1;
            if (rows == ROWS) {
                switch (tr) {
                case 1: TILE(ROWS, 1); break;
                case 2: TILE(ROWS, 2); break;
                case 3: TILE(ROWS, 3); break;
                default: TILE(ROWS, 4);
                }
            } else {
                switch (tr) {
                case 1: TILE(1, 1); break;
                case 2: TILE(1, 2); break;
                case 3: TILE(1, 3); break;
                default: TILE(1, 4);
                }
            }
#undef TILE
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < tr; j++)
                    y[(t + j) * ldy + n + r + i] = out[i][j] + (bias ? bias[n + r + i] : 0.0f);
        }
    }
}

/* the two formats' groups, each with its block width a constant */
static void group4(const float *x, int64_t T, int64_t ldx, const uint8_t *qs,
                   const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t n,
                   int nr, int64_t N, int64_t K, float *y, int64_t ldy) {
    row_group(x, T, ldx, qs, 4, d16, m16, bias, n, nr, N, K, y, ldy);
}

static void group8(const float *x, int64_t T, int64_t ldx, const uint8_t *qs,
                   const uint16_t *d16, const float *bias, int64_t n, int nr, int64_t N,
                   int64_t K, float *y, int64_t ldy) {
    row_group(x, T, ldx, qs, 8, d16, NULL, bias, n, nr, N, K, y, ldy);
}

/* rows n .. n + nr of a many-token step: dequantized once into w, then the float tiles, which
 * keep each tile of tokens in L1 across all nr rows (the panel itself stays in L2) */
static void panel(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int bits,
                  const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t n,
                  int64_t nr, int64_t K, float *w, float *y, int64_t ldy) {
    const int64_t kb = K / Q4_BLOCK, bytes = kb * bits * 4;
    for (int64_t i = 0; i < nr; i++) {
        float ds[kb], ms[kb];
        halves(d16 + (n + i) * kb, ds, kb);
        if (m16) halves(m16 + (n + i) * kb, ms, kb);
        for (int64_t b = 0; b < kb; b++) {
            vf v[NV];
            dequant(qs + (n + i) * bytes + b * bits * 4, bits, ds[b], m16 ? ms[b] : 0.0f, v);
            for (int j = 0; j < NV; j++) vstore(w + i * K + b * Q4_BLOCK + j * VW, v[j]);
        }
    }
    f32_group_tiles(x, T, ldx, w, (int)nr, K, bias ? bias + n : NULL, y + n, ldy);
}

void block_rows_for(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int bits,
                    const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t N,
                    int64_t K, float *y, int64_t ldy) {
    if (T > DEQUANT_TOKENS && K <= 8192) {
        /* many tokens: panels of up to PANEL_ROWS rows, at most 256 KB of floats each, so a
         * step's activations are read once a panel instead of once every four rows (at 512
         * tokens they no longer fit in L2, and streaming them per group bound the GEMM) */
        int64_t rows = PANEL_FLOATS / K / ROWS * ROWS;
        rows = rows > PANEL_ROWS ? PANEL_ROWS : rows < ROWS ? ROWS : rows;
        float w[rows * K];
        const int64_t panels = (N + rows - 1) / rows;
#pragma omp for schedule(dynamic) /* a thread held up elsewhere takes fewer panels */
        for (int64_t p = 0; p < panels; p++) {
            int64_t n = p * rows;
            panel(x, T, ldx, qs, bits, d16, m16, bias, n, N - n < rows ? N - n : rows, K, w, y,
                  ldy);
        }
        return;
    }
    int64_t groups = (N + ROWS - 1) / ROWS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n = g * ROWS;
        int nr = N - n < ROWS ? (int)(N - n) : ROWS;
        if (bits == 8)
            group8(x, T, ldx, qs, d16, bias, n, nr, N, K, y, ldy);
        else
            group4(x, T, ldx, qs, d16, m16, bias, n, nr, N, K, y, ldy);
    }
}

void is_block_linear(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int bits,
                     const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t N,
                     int64_t K, float *y, int64_t ldy, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    block_rows_for(x, T, ldx, qs, bits, d16, m16, bias, N, K, y, ldy);
}
