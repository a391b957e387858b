/* Weight-only matmuls from a GGUF file's own blocks, at every step size, on float32 activations.
 *
 * Why: a batch-1 decode step streams every weight once, so its time is its bytes. The int8
 * row kernel (decode_ops.c) reads one byte a weight and requantizes the file's values; a
 * GGUF's Q4_1 matrices hold 5 bits a weight (16 bytes of nibbles and two float16 numbers per
 * 32 weights), and served in that form a step reads 0.625 of the int8 bytes. Its Q8_0 ones
 * (32 int8 and a float16 d per 32 weights) read about as much as int8 but are not rounded
 * again. The K-quants (Q4_K, Q5_K, Q6_K: 4.5, 5.5 and 6.56 bits a weight) are what most
 * downloaded files hold; they are read in the file's own bytes too, and no float copy of a
 * matrix is needed for any step size: larger steps dequantize a panel of rows into a
 * per-thread scratch and reuse it for every token (about torch's float GEMM speed from 64
 * tokens up, bench/kernels.py --cpu-blocks). The activations stay float32, so the product is
 * the file's own weights times x, to float32 rounding.
 *
 * Formats (api.h's BLOCK_* codes; the Python side is runtime/loading/quantization.py for the
 * first two, runtime/loading/kquant_weights.py for the K-quants):
 *   BLOCK_Q4:   qs [N, K/32, 16] bytes, byte j holding input j in its low nibble and input j + 16
 *               in its high one (the GGUF order), float16 d, m [N, K/32]; w = q * d + m, q in
 *               0..15 (`Int4Weight`: Q4_1 blocks, and Q4_0 ones as m = -8 d);
 *   BLOCK_Q8:   qs [N, K/32, 32] int8, float16 d [N, K/32]; w = q * d (`Int8BlockWeight`);
 *   BLOCK_Q4_K: the file's super-blocks [N, K/256, 144]: float16 d, dmin, 12 bytes of 6-bit
 *               scales and mins (eight each, scale_mins below), 128 bytes of nibbles; slice j
 *               (inputs 32j..32j+31) is the low nibbles of bytes 32(j/2).. for even j, the high
 *               ones for odd j; w = (d * sc_j) * q - (dmin * m_j);
 *   BLOCK_Q5_K: [N, K/256, 176]: d, dmin, scales[12] as Q4_K, qh[32], qs[128] as Q4_K's; input
 *               i of slice j adds bit j of qh[i] as its fifth bit (q in 0..31), same formula;
 *   BLOCK_Q6_K: [N, K/256, 210]: ql[128], qh[64], int8 scales[16], float16 d; slice j of half
 *               h = j/4 (r = j%4) takes nibble r/2 of ql[64h + 32(r%2) + i] and bits 2r, 2r+1
 *               of qh[32h + i] as bits 4, 5; w = (d * scales[2j + i/16]) * (q - 32).
 * The K-quant formulas are ggml's (and the `gguf` package's gguf.quants), with the same float32
 * roundings: the scales' products once per slice, then a product and a difference per weight,
 * never fused (built with -ffp-contract=off), so `is_block_dequantize` equals gguf's
 * dequantization bit for bit and the products are the file's exact weights times x.
 *
 * Structure, shared by every format: a format supplies its row size, its per-slice scales
 * (`row_scales`, once per row and call) and `unpack`, one 32-input slice of a row as float
 * vectors in registers; the rest is common. Small steps: each slice is unpacked once and
 * multiplied into every token of a tile (four rows by up to four tokens), the next row
 * group's bytes fetched a group ahead (like int8_rows_for). Above small_tokens() tokens the
 * weights are unpacked once per call, not once per four tokens: STEP_INPUTS inputs at a time,
 * a panel of rows into a per-thread scratch (PANEL_ROWS x STEP_INPUTS floats), transposed so
 * that a float GEMM micro-tile (chunk_tiles) reads it without horizontal sums, against the
 * step's tokens packed alike (T x STEP_INPUTS floats). Threads split the weight rows in groups
 * of four (small steps) or in panels (many tokens).
 * Built for AVX-512 where the CPU has it, else AVX2 + FMA + F16C.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_ops.h"
#include "simd.h"

#ifdef __AVX512F__
typedef __m512 vf;
#define VW 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
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
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vset1(f) _mm256_set1_ps(f)
#define vhsum(v) hsum(v)
#endif
#define SLICE 32           /* inputs unpacked at once: a Q4/Q8 block, an eighth of a K-quant's */
#define SUPER 256          /* inputs of a K-quant super-block */
#define NV (SLICE / VW)    /* vectors per slice */
#define ROWS 4             /* weight rows per group */
#define TOKENS 4           /* tokens per tile */
/* rows a many-token step dequantizes at once: the step's inputs stream through the cache
 * once a panel, and only a chunk of the panel (KC inputs) need stay in L1 at a time, so the
 * panel is as large as the threads' share of rows allows. Measured on the 2-core VM (the
 * float GEMM alone, 384 tokens): at K = 8192, 32 rows ran at 130 GFLOP/s, 64 and 128 at 150;
 * at K = 1024, 64 at 160-170, 128 at 155-160. A thread's scratch is 64 x K floats (2 MB at
 * K = 8192). */
#define PANEL_ROWS 64

/* bytes of one weight row of K inputs (the split formats' d and m are held apart) */
INLINE int64_t row_bytes(int fmt, int64_t K) {
    switch (fmt) {
    case BLOCK_Q4: return K / 2;
    case BLOCK_Q8: return K;
    case BLOCK_Q4_K: return K / SUPER * 144;
    case BLOCK_Q5_K: return K / SUPER * 176;
    default: return K / SUPER * 210;
    }
}

/* float16 -> float32 for n values */
static void halves(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
}

INLINE float half_at(const uint8_t *p) { /* K-quant fields are not 2-byte aligned (Q6_K) */
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* a super-block's eight (d * scale) and eight (dmin * min) from a Q4_K/Q5_K's 12 bytes of
 * 6-bit fields, unpacked as ggml's get_scale_min_k4 reads them (slice j < 4: the low six bits
 * of bytes j and j + 4; j >= 4: a nibble of byte j + 4 and the top two bits of bytes j - 4
 * and j), all eight at once with ggml's word masks (its AVX2 dot product's): the scalar
 * unpacking cost as much as the slices' own at one token */
INLINE void scale_mins(const uint8_t *q, float d, float dmin, float *mul, float *off) {
    uint32_t u[4];
    memcpy(u, q, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3fu; /* bytes 0-7: the scales, 8-15: the mins */
    __m128i v = _mm_loadu_si128((const __m128i *)u);
    _mm256_storeu_ps(mul, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                                        _mm256_set1_ps(d)));
    _mm256_storeu_ps(off, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                            _mm_srli_si128(v, 8))),
                                        _mm256_set1_ps(dmin)));
}

/* a Q6_K super-block's sixteen d * scale: the even ones (each slice's first 16 inputs) to
 * mul, the odd ones to off */
INLINE void scales6(const uint8_t *q, float d, float *mul, float *off) {
    __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)q),
                                 _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13,
                                               15));
    _mm256_storeu_ps(mul, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                                        _mm256_set1_ps(d)));
    _mm256_storeu_ps(off, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            _mm_srli_si128(v, 8))),
                                        _mm256_set1_ps(d)));
}

/* one row's per-slice scales, sc[2 * kb]: the kb multipliers, then the kb offsets (Q4: m,
 * Q4_K/Q5_K: dmin * min, subtracted) or, for Q6_K, the second half-slice's multipliers */
INLINE void row_scales(int fmt, const uint8_t *row, const uint16_t *d16, const uint16_t *m16,
                       int64_t kb, float *sc) {
    if (fmt == BLOCK_Q4 || fmt == BLOCK_Q8) {
        halves(d16, sc, kb);
        if (m16)
            halves(m16, sc + kb, kb);
        else
            for (int64_t b = 0; b < kb; b++) sc[kb + b] = 0.0f;
        return;
    }
    for (int64_t s = 0; s < kb / 8; s++) {
        float *mul = sc + 8 * s, *off = sc + kb + 8 * s;
        if (fmt == BLOCK_Q6_K) {
            const uint8_t *blk = row + s * 210;
            scales6(blk + 192, half_at(blk + 208), mul, off);
        } else {
            const uint8_t *blk = row + s * (fmt == BLOCK_Q4_K ? 144 : 176);
            scale_mins(blk + 4, half_at(blk), half_at(blk + 2), mul, off);
        }
    }
}

/* 32 bytes of 0..255 (or -128..127, `sign`) as NV float vectors */
INLINE void widen(__m256i q, int sign, vf w[NV]) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
#ifdef __AVX512F__
    w[0] = _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo));
    w[1] = _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi));
#else
    __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++)
        w[v] = _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(part[v])
                                       : _mm256_cvtepu8_epi32(part[v]));
#endif
}

/* 32 bytes from p, each shifted right by `shift` bits and masked to `mask`: by an immediate
 * (the shift counts repeat slice after slice, so the branches are predicted), since a shift
 * by a register count takes a shuffle-port uop, the port a one-token step is bound by */
INLINE __m256i bits_of(const uint8_t *p, int shift, int mask) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    switch (shift) {
    case 0: break;
    case 1: v = _mm256_srli_epi16(v, 1); break;
    case 2: v = _mm256_srli_epi16(v, 2); break;
    case 3: v = _mm256_srli_epi16(v, 3); break;
    case 4: v = _mm256_srli_epi16(v, 4); break;
    case 5: v = _mm256_srli_epi16(v, 5); break;
    case 6: v = _mm256_srli_epi16(v, 6); break;
    default: v = _mm256_srli_epi16(v, 7);
    }
    return _mm256_and_si256(v, _mm256_set1_epi8((char)mask));
}

/* slice b (inputs 32b..32b+31) of one row as NV float vectors, in input order; j = b % 8, its
 * place in a K-quant super-block; sc: the row's scales (row_scales). fmt is a constant
 * wherever this is inlined, so the switch folds, and so is j in the small steps' tiles (their
 * loop over a super-block's slices is unrolled), so the bit fields' shifts are immediates. */
INLINE void unpack(int fmt, const uint8_t *row, int64_t b, int j, const float *sc, int64_t kb,
                   vf w[NV]) {
    const float d = sc[b], m = sc[kb + b];
    switch (fmt) {
    case BLOCK_Q8: { /* q * d, one rounding, as the file's own dequantization */
        const int8_t *q8 = (const int8_t *)(row + b * SLICE);
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
    case BLOCK_Q4: {
        const uint8_t *qs = row + b * 16;
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
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                               dv, mv);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
                               dv, mv);
#endif
        return;
    }
    case BLOCK_Q4_K: {
        const uint8_t *qs = row + (b >> 3) * 144 + 16 + (j >> 1) * 32;
#ifdef __AVX512F__
        /* as Q4's table, its entries rounded as ggml's (d * q, then - m); the odd slices'
         * high nibbles shifted down, the bits above them ignored by vpermps. Widened straight
         * from memory and shifted as words: the shuffle port, which the widening and the
         * permutes already share, bounds a one-token step */
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 table = _mm512_sub_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
        if (j & 1) {
            v0 = _mm512_srli_epi32(v0, 4);
            v1 = _mm512_srli_epi32(v1, 4);
        }
        w[0] = _mm512_permutexvar_ps(v0, table);
        w[1] = _mm512_permutexvar_ps(v1, table);
#else
        widen(bits_of(qs, (j & 1) * 4, 15), 0, w);
        for (int v = 0; v < NV; v++) w[v] = vsub(vmul(w[v], vset1(d)), vset1(m));
#endif
        return;
    }
    case BLOCK_Q5_K: {
        const uint8_t *blk = row + (b >> 3) * 176;
        __m256i q = _mm256_or_si256(bits_of(blk + 48 + (j >> 1) * 32, (j & 1) * 4, 15),
                                    _mm256_slli_epi16(bits_of(blk + 16, j, 1), 4));
        widen(q, 0, w);
        for (int v = 0; v < NV; v++) w[v] = vsub(vmul(w[v], vset1(d)), vset1(m));
        return;
    }
    default: { /* BLOCK_Q6_K: m is the second half-slice's multiplier */
        const uint8_t *blk = row + (b >> 3) * 210;
        const int h = j >> 2, r = j & 3;
        __m256i q = _mm256_or_si256(bits_of(blk + 64 * h + 32 * (r & 1), (r >> 1) * 4, 15),
                                    _mm256_slli_epi16(bits_of(blk + 128 + 32 * h, 2 * r, 3), 4));
        widen(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), 1, w);
        for (int v = 0; v < NV; v++) w[v] = vmul(w[v], vset1(v < NV / 2 ? d : m));
        return;
    }
    }
}

/* nr rows (from `rows`, rb bytes apart, their scales sc [nr][2 kb]) by tr tokens; with one
 * token the vectors of a slice alternate between two accumulators so more FMA chains overlap */
INLINE void tile(int fmt, const float *x, int64_t ldx, const uint8_t *rows, int64_t rb,
                 const float *sc, int64_t kb, int nr, int tr, float out[ROWS][TOKENS]) {
    vf acc[ROWS][TOKENS][2];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++) acc[i][j][0] = acc[i][j][1] = vzero();
    /* a K-quant's super-block at a time, its eight slices unrolled (a constant place each) */
    const int unit = fmt == BLOCK_Q4 || fmt == BLOCK_Q8 ? 1 : 8;
    for (int64_t b0 = 0; b0 < kb; b0 += unit) {
#pragma GCC unroll 8
        for (int u = 0; u < unit; u++) {
            const int64_t b = b0 + u;
            for (int i = 0; i < nr; i++) {
                vf w[NV];
                unpack(fmt, rows + i * rb, b, u, sc + i * 2 * kb, kb, w);
                for (int j = 0; j < tr; j++) {
                    const float *xb = x + j * ldx + b * SLICE;
                    for (int v = 0; v < NV; v++) {
                        int a = tr == 1 ? v & 1 : 0;
                        acc[i][j][a] = vfma(w[v], vload(xb + v * VW), acc[i][j][a]);
                    }
                }
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < tr; j++)
            out[i][j] = vhsum(tr == 1 ? vadd(acc[i][j][0], acc[i][j][1]) : acc[i][j][0]);
}

/* rows n .. n + nr (nr <= ROWS) against every token, in tiles of up to TOKENS tokens */
INLINE void row_group(int fmt, const float *x, int64_t T, int64_t ldx, const uint8_t *qs,
                      const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t n,
                      int nr, int64_t N, int64_t K, float *y, int64_t ldy) {
    const int64_t kb = K / SLICE, rb = row_bytes(fmt, K);
    const uint8_t *q = qs + n * rb;
    /* the next group's bytes (and split scales), fetched while this one computes (as in
     * int8_row_group) */
    if (n + ROWS < N) {
        for (int64_t off = 0; off < ROWS * rb; off += 64)
            _mm_prefetch((const char *)(q + ROWS * rb + off), _MM_HINT_T0);
        if (d16)
            for (int64_t off = 0; off < ROWS * kb * 2; off += 64) {
                _mm_prefetch((const char *)(d16 + (n + ROWS) * kb) + off, _MM_HINT_T0);
                if (m16) _mm_prefetch((const char *)(m16 + (n + ROWS) * kb) + off, _MM_HINT_T0);
            }
    }
    float sc[ROWS * 2 * kb];
    for (int i = 0; i < nr; i++)
        row_scales(fmt, q + i * rb, d16 ? d16 + (n + i) * kb : NULL,
                   m16 ? m16 + (n + i) * kb : NULL, kb, sc + i * 2 * kb);
    float out[ROWS][TOKENS];
    for (int64_t t = 0; t < T; t += TOKENS) {
        int tr = T - t < TOKENS ? (int)(T - t) : TOKENS;
        const float *xt = x + t * ldx;
        /* constant tile shapes, so the accumulators stay in registers */
#define TILE(R, C) tile(fmt, xt, ldx, q + r * rb, rb, sc + r * 2 * kb, kb, R, C, out)
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

/* rows n .. n + nr as floats, row i at w + i * ldw */
INLINE void dequant_rows(int fmt, const uint8_t *qs, const uint16_t *d16, const uint16_t *m16,
                         int64_t n, int64_t nr, int64_t K, float *w, int64_t ldw) {
    const int64_t kb = K / SLICE, rb = row_bytes(fmt, K);
    float sc[2 * kb];
    for (int64_t i = 0; i < nr; i++) {
        const uint8_t *row = qs + (n + i) * rb;
        row_scales(fmt, row, d16 ? d16 + (n + i) * kb : NULL, m16 ? m16 + (n + i) * kb : NULL,
                   kb, sc);
        for (int64_t b = 0; b < kb; b++) {
            vf v[NV];
            unpack(fmt, row, b, (int)(b & 7), sc, kb, v);
            for (int j = 0; j < NV; j++) vstore(w + i * ldw + b * SLICE + j * VW, v[j]);
        }
    }
}

/* ---- many tokens: a panel of rows dequantized once, input-major, and a float GEMM on it ----
 *
 * The panel is packed as micro-panels of PR rows, each [K][PR]: one input's PR weights are
 * two vectors, so a micro-tile of MR tokens by PR rows broadcasts each token's input and
 * FMAs it into the two vectors, MR x 2 accumulators in registers, no horizontal sums, and
 * its outputs are rows of y. Measured on the 2-core VM against torch's float GEMM on the same
 * weights (bench/kernels.py --cpu-blocks): the row-major panel with dot-product tiles this
 * replaces took 1.4-2x torch's time at 256-512 tokens (its four-row tiles ended in 24
 * horizontal sums each and, at K = 8192, their six tokens' inputs no longer fitted in L1);
 * this one takes 1.0-1.2x at 256-512 tokens, 0.85-1.1x at 64, less below (the micro-tile
 * alone runs at 160-190 GFLOP/s a core, about the FMA ports' peak; the AVX2 build at about
 * 1.1x torch's own AVX2 GEMM). */
#define PR (2 * VW) /* rows of a micro-panel */
#ifdef __AVX512F__
#define MR 12 /* tokens of a micro-tile: 24 accumulators, 2 weights and a broadcast of 32 */
#else
#define MR 6 /* 12 accumulators, 2 weights and a broadcast of 16 */
#endif
#define CHUNK (8 * SLICE) /* inputs dequantized before a transpose: one K-quant super-block */

/* an 8 x 8 block of floats transposed: dst[j][i] = src[i][j] */
INLINE void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

#ifdef __AVX512F__
/* a 16 x 16 block transposed: dst[j][i] = src[i][j], in 64 shuffles (the 8 x 8 blocks of
 * transpose8 take 96 for as many floats; the shuffle port bounds the panel's packing) */
INLINE void transpose16(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: a0 b0 a1 b1, a2 b2 a3 b3 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[4g + c]: rows 4g.. at columns c, c+4, c+8, c+12 */
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; c++) { /* rows 0-7 and 8-15 of columns c, c+8 (and c+4, c+12) */
        t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
        t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    }
    for (int c = 0; c < 4; c++) {
        _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88));
        _mm512_storeu_ps(dst + (c + 8) * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd));
        _mm512_storeu_ps(dst + (c + 4) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88));
        _mm512_storeu_ps(dst + (c + 12) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd));
    }
}
#define transpose_block transpose16
#else
#define transpose_block transpose8
#endif

/* rows n .. n + nr (nr <= PR), slices [b0, b0 + cb) (inputs 32 b0 ..), into the micro-panel
 * wp [32 cb][PR], rows past nr zero: CHUNK inputs of every row unpacked into tmp, then
 * transposed in VW x VW blocks */
INLINE void pack_rows(int fmt, const uint8_t *qs, const uint16_t *d16, const uint16_t *m16,
                      int64_t n, int nr, int64_t K, int64_t b0, int64_t cb, float *wp) {
    const int64_t kb = K / SLICE, rb = row_bytes(fmt, K);
    float tmp[PR][CHUNK];
    for (int64_t c0 = 0; c0 < cb; c0 += 8) {
        const int cn = cb - c0 < 8 ? (int)(cb - c0) : 8, at = (int)(b0 + c0);
        for (int r = 0; r < PR; r++) {
            if (r >= nr) {
                memset(tmp[r], 0, sizeof(float) * (size_t)(cn * SLICE));
                continue;
            }
            /* the chunk as a row of cn slices: its bytes, and its scales alone */
            const uint8_t *row = qs + (n + r) * rb + row_bytes(fmt, at * SLICE);
            float sc[16];
            row_scales(fmt, row, d16 ? d16 + (n + r) * kb + at : NULL,
                       m16 ? m16 + (n + r) * kb + at : NULL, cn, sc);
            for (int b = 0; b < cn; b++) {
                vf v[NV];
                unpack(fmt, row, b, b, sc, cn, v);
                for (int j = 0; j < NV; j++) vstore(tmp[r] + b * SLICE + j * VW, v[j]);
            }
        }
        for (int k = 0; k < cn * SLICE; k += VW)
            for (int r = 0; r < PR; r += VW)
                transpose_block(tmp[r] + k, CHUNK, wp + (c0 * SLICE + k) * PR + r, PR);
    }
}

/* the packed tokens xt [kc][mr] (a token tile, input-major) by the PR rows of micro-panel wp
 * [kc][PR], into y's first nr (<= PR) columns: y = sum + bias, or y += sum where `add` (a
 * later chunk of inputs) */
INLINE void micro(const float *xt, const float *wp, int64_t kc, int mr, int nr,
                  const float *bias, int add, float *y, int64_t ldy) {
    vf acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = vzero();
    for (int64_t k = 0; k < kc; k++) {
        vf w0 = vload(wp + k * PR), w1 = vload(wp + k * PR + VW);
        for (int i = 0; i < mr; i++) {
            vf xv = vset1(xt[k * mr + i]);
            acc[i][0] = vfma(w0, xv, acc[i][0]);
            acc[i][1] = vfma(w1, xv, acc[i][1]);
        }
    }
    float b[PR];
    for (int r = 0; r < PR; r++) b[r] = bias && !add && r < nr ? bias[r] : 0.0f;
    vf b0 = vload(b), b1 = vload(b + VW);
    for (int i = 0; i < mr; i++) {
        float *yi = y + i * ldy;
        if (nr == PR) {
            vstore(yi, vadd(acc[i][0], add ? vload(yi) : b0));
            vstore(yi + VW, vadd(acc[i][1], add ? vload(yi + VW) : b1));
        } else {
            float o[PR];
            vstore(o, vadd(acc[i][0], b0));
            vstore(o + VW, vadd(acc[i][1], b1));
            for (int r = 0; r < nr; r++) yi[r] = add ? yi[r] + o[r] : o[r];
        }
    }
}

/* the token tiles' height: balanced (13 tokens as 7 + 6, not 12 + 1) */
INLINE int64_t tile_height(int64_t T) {
    const int64_t tiles = (T + MR - 1) / MR;
    return (T + tiles - 1) / tiles;
}

/* inputs [k0, k0 + kc) of every token, packed tile by tile: tile t.. (tile_height tokens) at
 * xp + t kc, input-major ([kc][mr]), so a micro-tile's broadcasts read one cache line per
 * input instead of one per token (rows of x are K floats apart: at 512 tokens, streaming
 * them per micro-tile from L3 held the GEMM to about 0.75x torch's) */
static void pack_tokens(const float *x, int64_t T, int64_t ldx, int64_t k0, int64_t kc,
                        float *xp) {
    const int64_t height = tile_height(T);
    for (int64_t t = 0; t < T; t += height) {
        const int64_t mr = T - t < height ? T - t : height;
        float *dst = xp + t * kc;
        for (int64_t i = 0; i < mr; i++) {
            const float *src = x + (t + i) * ldx + k0;
            for (int64_t k = 0; k < kc; k++) dst[k * mr + i] = src[k];
        }
    }
}

/* every token (packed by pack_tokens) by the nr rows packed in wp (micro-panels of PR rows,
 * kc x PR floats each), in sub-chunks of KC inputs: a sub-chunk of the panel (KC x PR floats
 * a micro-panel) stays in L1 across all the step's tokens, a micro-tile's inputs across the
 * panel's micro-panels; and each output sums at most KC products in one register before the
 * sub-chunks' sums are added, which keeps its rounding near that of a lane-split dot product
 * (one chain over all K inputs rounded about 4x further at K = 1536) */
#define KC 128
static void chunk_tiles(const float *xp, int64_t T, const float *wp, int64_t nr, int64_t kc,
                        const float *bias, int add, float *y, int64_t ldy) {
    const int64_t height = tile_height(T);
    for (int64_t k0 = 0; k0 < kc; k0 += KC) {
        const int64_t ks = kc - k0 < KC ? kc - k0 : KC;
        for (int64_t t = 0; t < T; t += height) {
            const int mr = T - t < height ? (int)(T - t) : (int)height;
            const float *xt = xp + t * kc + k0 * mr;
            for (int64_t r = 0; r < nr; r += PR) {
                const int rows = nr - r < PR ? (int)(nr - r) : PR;
                const float *b = bias ? bias + r : NULL;
                /* constant tile heights, so the accumulators stay in registers */
#define MICRO(M)                                                                               \
    micro(xt, wp + r * kc + k0 * PR, ks, M, rows, b, add || k0 > 0, y + t * ldy + r, ldy)
                switch (mr) {
                case 1: MICRO(1); break;
                case 2: MICRO(2); break;
                case 3: MICRO(3); break;
                case 4: MICRO(4); break;
                case 5: MICRO(5); break;
#ifdef __AVX512F__
                case 6: MICRO(6); break;
                case 7: MICRO(7); break;
                case 8: MICRO(8); break;
                case 9: MICRO(9); break;
                case 10: MICRO(10); break;
                case 11: MICRO(11); break;
#endif
                default: MICRO(MR);
                }
#undef MICRO
            }
        }
    }
}

/* each format's group, row dequantization and panel packing, with its format a constant */
typedef void group_fn(const float *x, int64_t T, int64_t ldx, const uint8_t *qs,
                      const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t n,
                      int nr, int64_t N, int64_t K, float *y, int64_t ldy);
typedef void dequant_fn(const uint8_t *qs, const uint16_t *d16, const uint16_t *m16, int64_t n,
                        int64_t nr, int64_t K, float *w, int64_t ldw);
typedef void pack_fn(const uint8_t *qs, const uint16_t *d16, const uint16_t *m16, int64_t n,
                     int nr, int64_t K, int64_t b0, int64_t cb, float *wp);
#define FORMAT(F)                                                                              \
    static void group_##F(const float *x, int64_t T, int64_t ldx, const uint8_t *qs,          \
                          const uint16_t *d16, const uint16_t *m16, const float *bias,         \
                          int64_t n, int nr, int64_t N, int64_t K, float *y, int64_t ldy) {    \
        row_group(BLOCK_##F, x, T, ldx, qs, d16, m16, bias, n, nr, N, K, y, ldy);              \
    }                                                                                          \
    static void dequant_##F(const uint8_t *qs, const uint16_t *d16, const uint16_t *m16,       \
                            int64_t n, int64_t nr, int64_t K, float *w, int64_t ldw) {         \
        dequant_rows(BLOCK_##F, qs, d16, m16, n, nr, K, w, ldw);                               \
    }                                                                                          \
    static void pack_##F(const uint8_t *qs, const uint16_t *d16, const uint16_t *m16,          \
                         int64_t n, int nr, int64_t K, int64_t b0, int64_t cb, float *wp) {    \
        pack_rows(BLOCK_##F, qs, d16, m16, n, nr, K, b0, cb, wp);                              \
    }
FORMAT(Q4)
FORMAT(Q8)
FORMAT(Q4_K)
FORMAT(Q5_K)
FORMAT(Q6_K)
#undef FORMAT

#define PICK(F)                                                                                \
    switch (fmt) {                                                                             \
    case BLOCK_Q4: return F##_Q4;                                                              \
    case BLOCK_Q8: return F##_Q8;                                                              \
    case BLOCK_Q4_K: return F##_Q4_K;                                                          \
    case BLOCK_Q5_K: return F##_Q5_K;                                                          \
    default: return F##_Q6_K;                                                                  \
    }
static group_fn *group_for(int fmt) { PICK(group) }
static dequant_fn *dequant_for(int fmt) { PICK(dequant) }
static pack_fn *pack_for(int fmt) { PICK(pack) }
#undef PICK

/* the row groups: every weight unpacked once per tile of TOKENS tokens, nothing stored */
static void rows_small(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int fmt,
                       const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t N,
                       int64_t K, float *y, int64_t ldy) {
    group_fn *group = group_for(fmt);
    const int64_t groups = (N + ROWS - 1) / ROWS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n = g * ROWS;
        group(x, T, ldx, qs, d16, m16, bias, n, N - n < ROWS ? (int)(N - n) : ROWS, N, K, y,
              ldy);
    }
}

/* the panels: PANEL_ROWS (or PR) rows at a time, in chunks of STEP_INPUTS inputs. For each
 * chunk, every thread packs the step's tokens (pack_tokens: T x STEP_INPUTS floats, which stay
 * in L2 across its panels), then dequantizes each of its panels' chunk once into its scratch
 * and multiplies it into every token, adding to the earlier chunks' sums. The tokens are read
 * from memory once a call, the weights dequantized once; the outputs are read and written
 * once a chunk. A thread's panels are the same in every chunk (a static schedule), so each
 * output is only ever summed by one thread. */
#define STEP_INPUTS (2 * CHUNK)
static void rows_panels(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int fmt,
                        const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t N,
                        int64_t K, float *y, int64_t ldy) {
    /* at least eight panels a thread, else a thread finishing its last while the other
     * still has one idles for a larger share (576 rows: 18 of 32 rows, not 9 of 64) */
    const int64_t rows = N >= 8 * omp_get_num_threads() * PANEL_ROWS ? PANEL_ROWS : PR;
    const int64_t step = K < STEP_INPUTS ? K : STEP_INPUTS, panels = (N + rows - 1) / rows;
    float *wp = aligned_alloc(64, sizeof(float) * (size_t)(rows * step));
    float *xp = aligned_alloc(64, sizeof(float) * (size_t)((T * step + 15) / 16 * 16));
    const int ok = wp && xp;
    pack_fn *pack = pack_for(fmt);
    group_fn *group = group_for(fmt);
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t kc = K - k0 < step ? K - k0 : step;
        if (ok) pack_tokens(x, T, ldx, k0, kc, xp);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n = p * rows, nr = N - n < rows ? N - n : rows;
            if (!ok) { /* no scratch for this thread: its panels by row groups, whole, slower */
                for (int64_t g = n; g < n + nr && k0 == 0; g += ROWS)
                    group(x, T, ldx, qs, d16, m16, bias, g,
                          n + nr - g < ROWS ? (int)(n + nr - g) : ROWS, N, K, y, ldy);
                continue;
            }
            for (int64_t r = 0; r < nr; r += PR)
                pack(qs, d16, m16, n + r, nr - r < PR ? (int)(nr - r) : PR, K, k0 / SLICE,
                     kc / SLICE, wp + r * kc);
            chunk_tiles(xp, T, wp, nr, kc, bias ? bias + n : NULL, k0 > 0, y + n, ldy);
        }
    }
    free(wp);
    free(xp);
}

/* up to how many tokens the row groups beat a panel: above, each weight is unpacked once per
 * call instead of once per four tokens, which pays for packing the panel (about 0.2 ns a
 * weight, half of it the transposes) from here. Measured on the 2-core VM, one thread, from
 * 8 to 32 tokens at 3072x1024 and 576x1536: the 16-lane tiles unpack Q4 and Q8 cheaply (a
 * table permute, a conversion) and tie near 20 tokens, Q4_K (the same table, from 32 bytes)
 * near 15, Q5_K and Q6_K (two bit fields and a conversion) near 10; the 8-lane tiles tie
 * near 8 tokens in every format. */
INLINE int64_t small_tokens(int fmt) {
#ifdef __AVX512F__
    return fmt == BLOCK_Q4 || fmt == BLOCK_Q8 ? 20 : fmt == BLOCK_Q4_K ? 14 : 10;
#else
    (void)fmt;
    return 8;
#endif
}

void block_rows_for(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int fmt,
                    const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t N,
                    int64_t K, float *y, int64_t ldy) {
    if (T > small_tokens(fmt))
        rows_panels(x, T, ldx, qs, fmt, d16, m16, bias, N, K, y, ldy);
    else
        rows_small(x, T, ldx, qs, fmt, d16, m16, bias, N, K, y, ldy);
}

void is_block_linear(const float *x, int64_t T, int64_t ldx, const uint8_t *qs, int format,
                     const uint16_t *d16, const uint16_t *m16, const float *bias, int64_t N,
                     int64_t K, float *y, int64_t ldy, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    block_rows_for(x, T, ldx, qs, format, d16, m16, bias, N, K, y, ldy);
}

void is_block_dequantize(const uint8_t *qs, int format, const uint16_t *d16,
                         const uint16_t *m16, int64_t N, int64_t K, float *w, int64_t ldw,
                         int threads) {
    dequant_fn *dequant = dequant_for(format);
    const int64_t groups = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n = g * ROWS;
        dequant(qs, d16, m16, n, N - n < ROWS ? N - n : ROWS, K, w + n * ldw, ldw);
    }
}
