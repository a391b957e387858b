/* Attention over the paged KV cache on the CPU, float32 queries against a float32, float16,
 * bfloat16 or int8 cache (each body compiled once per element type, so its loads carry no
 * branch; an int8 row's scale, simd.h, multiplies its score or its softmax weight):
 * decodes (one new token a sequence) and prefill/extend chunks (many new tokens a sequence,
 * causal), one kernel for both.
 *
 * Why: at 64 decoding sequences of a few hundred tokens, a step reads about 1 GB of K/V,
 * as long as its matmuls take. The first decode kernel (a task per sequence and KV head, all
 * scores, then all values) read DRAM at 15 GB/s where the machine reads 37, and prefill went
 * through torch's SDPA per sequence after gathering each context out of its pages. Here a
 * task walks its sequence's context once, in chunks of 16 positions, the rows AHEAD chunks on
 * fetched a few at a time through this one's arithmetic (fetch_rows): the chunk's scores for
 * every query vector of the task, an online softmax (flash attention's running max and sum), the chunk's values added in.
 * A decode task takes whole sequences' KV heads (a page of all heads is one run of memory);
 * a prefill task takes a tile of query rows of one KV head, so each chunk of keys stays in
 * L1 across the tile's rows x G query vectors.
 *
 * Layout: q and out [T, H, D] with row and head strides; caches [slots, KVH, D] (slot and
 * head strides in elements, unit inner stride); position p of a sequence lives in slot
 * table[p / page] * page + p % page. Query row r of a task sits at position first + r and
 * sees positions 0..first + r, or with a sliding window W (Gemma 3's local layers, Mistral's)
 * first + r - W + 1..first + r: a task starts at the chunk holding its first row's earliest
 * visible position, and masks the lanes before each vector's own. KV head h serves query
 * heads h * G .. h * G + G - 1.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_ops.h"
#include "simd.h"

#define CHUNK 16     /* positions scored together */
#define TILE_ROWS 16 /* query rows of a prefill task */
#define QG 3         /* query vectors of one KV head scored together */
#define AHEAD 2      /* chunks between the one computed and the one fetched */
#define PF_HINT _MM_HINT_T0 /* toward L1; L2 (T2) measured alike */

/* cache values from element `at` of base as floats: 16, 8 or one (an int8 cache's unscaled:
 * its row scale is applied once a row, to the score or the softmax weight) */
#ifdef __AVX512F__
INLINE __m512 kv16(const void *base, int64_t at, int kind) {
    if (kind == KV_F32) return _mm512_loadu_ps((const float *)base + at);
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + at))));
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (kind == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
INLINE __m256 kv8(const void *base, int64_t at, int kind) {
    if (kind == KV_F32) return _mm256_loadu_ps((const float *)base + at);
    if (kind == KV_I8) return load_i8((const int8_t *)base + at);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    if (kind == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
INLINE float kv1(const void *base, int64_t at, int kind) {
    if (kind == KV_F32) return ((const float *)base)[at];
    if (kind == KV_I8) return (float)((const int8_t *)base)[at];
    uint16_t h = ((const uint16_t *)base)[at];
    if (kind == KV_F16) return _cvtsh_ss(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* the cache rows at base + ahead[i] (D values each) fetched toward L1, rows [i0, i1) of na:
 * spread through a chunk's arithmetic, so the loads of later chunks overlap it (a burst of
 * them at the chunk's start stalls the core until its miss buffers drain) */
INLINE void fetch_rows(const void *base, const int64_t *ahead, int i0, int i1, int na,
                       int64_t D, int kind) {
    const int64_t size = kv_size(kind);
    for (int i = i0; i < i1 && i < na; i++) {
        for (int64_t d = 0; d < D; d += 64 / size)
            _mm_prefetch((const char *)base + (ahead[i] + d) * size, PF_HINT);
        if (kind == KV_I8) /* the scale's line, where the row ends past its last fetched one */
            _mm_prefetch((const char *)base + ahead[i] + D + KV_I8_SCALE - 1, PF_HINT);
    }
}

/* q . the cache row at element `at`, D values */
INLINE float dot_kv(const float *q, const void *base, int64_t at, int64_t D, int kind) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv8(base, at + d, kind), acc);
    float s = hsum(acc);
    for (; d < D; d++) s += q[d] * kv1(base, at + d, kind);
    return s;
}

#ifdef __AVX512F__
/* lanes i and j of a 4 x 4 index transposed: the reduction tree below leaves position
 * 4q + j's sum in lane 4j + q, so accumulators are filed under their transposed lane */
#define TRANSPOSED(i) ((((i)&3) << 2) | ((i) >> 2))

/* the 16 horizontal sums of acc[0..16) as one vector, lane i = sum of acc[TRANSPOSED(i)]:
 * halves, then quarters, then pairs inside 128-bit lanes (45 shuffles and adds, where 16
 * separate reductions take about 130) */
INLINE __m512 sums16(__m512 a[CHUNK]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: a[2i] folded in half; lanes 8-15: a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter k: a[4i + k] folded to four lanes */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]),
                             _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]));
    return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}
#endif

/* s[j][i] = scale * q_j . k_i for QG query vectors and the keys at kc + offs[i], i < n (an
 * offs past n repeats offs[0], a real row; the softmax masks those lanes). Each key row is
 * loaded once for the QG vectors: three FMAs a load, where one vector at a time is load-bound */
INLINE void chunk_scores(const float *const q[QG], const void *kc, const int64_t *offs, int n,
                         int64_t D, float scale, float s[QG][CHUNK], int kind,
                         const int64_t *ahead, int na) {
    float row_scale[CHUNK]; /* an int8 cache's key scales times `scale`, a lane a position */
    if (kind == KV_I8)
        for (int i = 0; i < CHUNK; i++)
            row_scale[i] = scale * kv_row_scale((const int8_t *)kc + offs[i], D);
#ifdef __AVX512F__
    if (D % 16 == 0) {
        __m512 part[QG][CHUNK];
        if (n < CHUNK)
            for (int j = 0; j < QG; j++)
                for (int i = 0; i < CHUNK; i++) part[j][i] = _mm512_setzero_ps();
        for (int i0 = 0; i0 < n; i0 += 4) {
            fetch_rows(kc, ahead, i0, i0 + (i0 + 4 < n ? 4 : CHUNK), na, D, kind);
            __m512 acc[QG][4];
            for (int j = 0; j < QG; j++)
                for (int p = 0; p < 4; p++) acc[j][p] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                __m512 qv[QG];
                for (int j = 0; j < QG; j++) qv[j] = _mm512_loadu_ps(q[j] + d);
                for (int p = 0; p < 4; p++) {
                    __m512 kv = kv16(kc, offs[i0 + p] + d, kind);
                    for (int j = 0; j < QG; j++)
                        acc[j][p] = _mm512_fmadd_ps(qv[j], kv, acc[j][p]);
                }
            }
            for (int j = 0; j < QG; j++)
                for (int p = 0; p < 4; p++) part[j][TRANSPOSED(i0 + p)] = acc[j][p];
        }
        const __m512 by = kind == KV_I8 ? _mm512_loadu_ps(row_scale) : _mm512_set1_ps(scale);
        for (int j = 0; j < QG; j++) _mm512_storeu_ps(s[j], _mm512_mul_ps(sums16(part[j]), by));
        return;
    }
#endif
    for (int i = 0; i < n; i++) {
        fetch_rows(kc, ahead, i, i + 1 < n ? i + 1 : CHUNK, na, D, kind);
        const float by = kind == KV_I8 ? row_scale[i] : scale;
        for (int j = 0; j < QG; j++) s[j][i] = dot_kv(q[j], kc, offs[i], D, kind) * by;
    }
}

/* acc_j[0..D) = acc_j * corr[j] + sum_i w[j][i] * v_i for the QG vectors: each value row
 * loaded once for all of them */
INLINE void add_values(float *const acc[QG], const float corr[QG], float w[QG][CHUNK],
                       const void *vc, const int64_t *offs, int n, int64_t D, int kind,
                       const int64_t *ahead, int na) {
    int64_t d = 0;
#ifdef __AVX512F__
    for (; d + 64 <= D; d += 64) {
        __m512 a[QG][4];
        for (int j = 0; j < QG; j++)
            for (int c = 0; c < 4; c++)
                a[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[j] + d + 16 * c),
                                        _mm512_set1_ps(corr[j]));
        for (int i = 0; i < n; i++) {
            if (d == 0) fetch_rows(vc, ahead, i, i + 1 < n ? i + 1 : CHUNK, na, D, kind);
            __m512 v[4];
            for (int c = 0; c < 4; c++) v[c] = kv16(vc, offs[i] + d + 16 * c, kind);
            for (int j = 0; j < QG; j++) {
                __m512 wv = _mm512_set1_ps(w[j][i]);
                for (int c = 0; c < 4; c++) a[j][c] = _mm512_fmadd_ps(wv, v[c], a[j][c]);
            }
        }
        for (int j = 0; j < QG; j++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc[j] + d + 16 * c, a[j][c]);
    }
#endif
    const int fetched = d > 0; /* the 64-wide loop above fetched the rows ahead */
    for (int j = 0; j < QG; j++) {
        int64_t e = d;
        for (; e + 8 <= D; e += 8) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc[j] + e), _mm256_set1_ps(corr[j]));
            for (int i = 0; i < n; i++) {
                if (!fetched && j == 0 && e == d)
                    fetch_rows(vc, ahead, i, i + 1 < n ? i + 1 : CHUNK, na, D, kind);
                a = _mm256_fmadd_ps(_mm256_set1_ps(w[j][i]), kv8(vc, offs[i] + e, kind), a);
            }
            _mm256_storeu_ps(acc[j] + e, a);
        }
        for (; e < D; e++) {
            float a = acc[j][e] * corr[j];
            for (int i = 0; i < n; i++) a += w[j][i] * kv1(vc, offs[i] + e, kind);
            acc[j][e] = a;
        }
    }
}

/* one query vector's online softmax step over a chunk of scores s, of which lanes lo..n
 * (0 <= lo < n) are positions it sees (a window hides those before lo): s becomes the weights
 * exp(s - new max) (0 outside), its running max m and sum l move on; returns the factor its
 * output so far is scaled by */
INLINE float chunk_weights(float *s, int lo, int n, float *m, float *l) {
    for (int i = 0; i < lo; i++) s[i] = -INFINITY; /* out of the max */
    float mx = s[0];
    if (n == CHUNK) { /* the common case, without a chain of scalar compares */
        __m256 v = _mm256_max_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
        v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
        v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
        v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
        mx = _mm_cvtss_f32(_mm256_castps256_ps128(v));
    } else
        for (int i = 1; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    float mnew = mx > *m ? mx : *m, corr = expf(*m - mnew); /* m = -inf at first: corr 0 */
    __m256 mv = _mm256_set1_ps(mnew), total = _mm256_setzero_ps();
    for (int i = 0; i < CHUNK; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        if (i + 8 > n) /* lanes past n are not positions this vector sees */
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                     _mm256_set1_epi32(n - i), lane)));
        if (lo > i) /* nor those before its window (exp clamps -inf to a tiny weight) */
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                     lane, _mm256_set1_epi32(lo - i - 1))));
        _mm256_storeu_ps(s + i, e);
        total = _mm256_add_ps(total, e);
    }
    *l = *l * corr + hsum(total);
    *m = mnew;
    return corr;
}

/* the cache one layer reads */
typedef struct {
    const void *k, *v;
    int64_t slot, head, page; /* strides in elements; positions a page */
    int kind;                 /* KV_F32, KV_F16, KV_BF16 or KV_I8 */
    int64_t window;           /* 0: no window */
} Cache;

INLINE int64_t slot_of(const int64_t *table, int64_t page, int64_t p) {
    return table[p / page] * page + p % page;
}

/* rows [0, rows) of one sequence's queries at positions first.., against its context, for
 * KV heads [h0, h1), the cache's elements of type `kind` (a constant in each copy); -1 when
 * its state could not be allocated */
INLINE int attend_body(const float *q, int64_t q_row, int64_t q_head, int64_t rows,
                       int64_t first, const Cache *c, const int64_t *table, int64_t h0,
                       int64_t h1, int64_t G, int64_t D, float scale, float *out,
                       int64_t out_row, int64_t out_head, int kind) {
    const int64_t size = kv_size(kind); /* bytes an element */
    const int64_t heads = (h1 - h0) * G, vectors = rows * heads, end = first + rows;
    float *state = malloc(sizeof(float) * (size_t)((vectors + 1) * (D + 2)));
    if (!state) return -1;
    float *m = state, *l = m + vectors, *acc = l + vectors, *spare = acc + vectors * D;
    float *spare_acc = spare + 2; /* where a padding vector's state goes */
    for (int64_t i = 0; i < vectors; i++) m[i] = -INFINITY, l[i] = 0.0f;
    for (int64_t i = 0; i < vectors * D; i++) acc[i] = 0.0f;
    int64_t offs[CHUNK];
    float s[QG][CHUNK];
    int64_t lo = c->window ? first - c->window + 1 : 0; /* the task's earliest visible */
    lo = lo > 0 ? lo : 0;
    for (int64_t p0 = lo / CHUNK * CHUNK; p0 < end; p0 += CHUNK) {
        int n = end - p0 < CHUNK ? (int)(end - p0) : CHUNK;
        /* a lane before the task's window reads its first visible row instead (masked all
         * the same): what lies outside every window is never read */
        for (int i = 0; i < n; i++)
            offs[i] = slot_of(table, c->page, p0 + i < lo ? lo : p0 + i) * c->slot;
        /* the rows AHEAD chunks on, fetched while this one computes, each KV head's while
         * that head's scores and values run (the first query group's calls: later groups of
         * a prefill tile find them fetched). Measured over 30 layers' caches (not one layer
         * again, which stays in L3): issued as one burst at the chunk's start they left
         * float16 decodes at 15 GB/s, spread 23-29 GB/s; 1, 2 or 4 chunks ahead alike */
        int64_t ahead[CHUNK], na = 0;
        for (int64_t p = p0 + AHEAD * CHUNK; p < p0 + (AHEAD + 1) * CHUNK && p < end; p++)
            ahead[na++] = slot_of(table, c->page, p) * c->slot;
        for (int i = n; i < CHUNK; i++) offs[i] = offs[0];
        for (int64_t h = h0; h < h1; h++) {
            const char *kh = (const char *)c->k + h * c->head * size;
            const char *vh = (const char *)c->v + h * c->head * size;
            /* the KV head's query vectors, row by row, QG at a time (the last group padded
             * with a scratch vector); rows that see none of the chunk take no part */
            for (int64_t f = 0; f < rows * G; f += QG) {
                const float *qp[QG];
                float *accs[QG], *ms[QG], *ls[QG], corr[QG];
                int seen[QG], before[QG], most = 0;
                for (int j = 0; j < QG; j++) {
                    int64_t r = (f + j) / G, g = (f + j) % G, visible = first + r + 1 - p0;
                    int64_t vec = r * heads + (h - h0) * G + g;
                    /* lanes before the vector's window (its earliest visible position) */
                    int64_t early = c->window ? first + r - c->window + 1 - p0 : 0;
                    before[j] = early > 0 ? (int)(early < CHUNK ? early : CHUNK) : 0;
                    if (f + j >= rows * G || visible <= 0 || before[j] >= visible ||
                        before[j] >= n) { /* the chunk holds none of its positions */
                        qp[j] = q, accs[j] = spare_acc, ms[j] = spare, ls[j] = spare + 1;
                        seen[j] = 1, before[j] = 0; /* nothing of its own to do */
                        continue;
                    }
                    qp[j] = q + r * q_row + (h * G + g) * q_head;
                    accs[j] = acc + vec * D, ms[j] = m + vec, ls[j] = l + vec;
                    seen[j] = visible < n ? (int)visible : n;
                    most = seen[j] > most ? seen[j] : most;
                }
                if (!most) continue;
                chunk_scores(qp, kh, offs, most, D, scale, s, kind, ahead, f ? 0 : (int)na);
                spare[0] = -INFINITY, spare[1] = 0.0f;
                for (int j = 0; j < QG; j++)
                    corr[j] = chunk_weights(s[j], before[j], seen[j] < most ? seen[j] : most,
                                            ms[j], ls[j]);
                if (kind == KV_I8) /* each value row's scale, into its weight (l has it not) */
                    for (int i = 0; i < most; i++) {
                        const float d = kv_row_scale((const int8_t *)vh + offs[i], D);
                        for (int j = 0; j < QG; j++) s[j][i] *= d;
                    }
                add_values(accs, corr, s, vh, offs, most, D, kind, ahead, f ? 0 : (int)na);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < heads; j++) {
            int64_t vec = r * heads + j;
            float inv = 1.0f / l[vec], *o = out + r * out_row + (h0 * G + j) * out_head;
            for (int64_t d = 0; d < D; d++) o[d] = acc[vec * D + d] * inv;
        }
    free(state);
    return 0;
}

static int attend_task(const float *q, int64_t q_row, int64_t q_head, int64_t rows,
                       int64_t first, const Cache *c, const int64_t *table, int64_t h0,
                       int64_t h1, int64_t G, int64_t D, float scale, float *out,
                       int64_t out_row, int64_t out_head) {
#define ATTEND(kind)                                                                       \
    attend_body(q, q_row, q_head, rows, first, c, table, h0, h1, G, D, scale, out, out_row, \
                out_head, kind)
    return c->kind == KV_F16    ? ATTEND(KV_F16)
           : c->kind == KV_BF16 ? ATTEND(KV_BF16)
           : c->kind == KV_I8   ? ATTEND(KV_I8)
                                : ATTEND(KV_F32);
#undef ATTEND
}

/* the cache a's strides describe, as attend_task reads it */
static Cache cache_of(const AttentionArgs *a) {
    const Cache c = {a->k_cache, a->v_cache, a->cache_slot, a->cache_head, a->page,
                     (int)a->kind, a->window};
    return c;
}

int decode_attention_for(const AttentionArgs *a, const int64_t *lens, int64_t B, int threads) {
    const Cache c = cache_of(a);
    const int64_t KVH = a->kv_heads, G = a->heads / KVH;
    /* whole sequences where there are enough to share out, else one KV head a task */
    const int64_t per = B >= 2 * threads ? KVH : 1, per_seq = KVH / per;
    int failed = 0; /* this thread's tasks; the enclosing region's reduction joins them */
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < B * per_seq; t++) {
        int64_t b = t / per_seq, h0 = t % per_seq * per;
        failed |= attend_task(a->q + b * a->q_row, 0, a->q_head, 1, lens[b] - 1, &c,
                              a->tables + b * a->table_stride, h0, h0 + per, G, a->head_dim,
                              a->scale, a->out + b * a->out_row, 0, a->out_head);
    }
    return failed;
}

int is_decode_attention(const AttentionArgs *a, const int64_t *lens, int64_t B, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    failed |= decode_attention_for(a, lens, B, threads);
    return failed;
}

/* Chunk i owns q's rows starts[i] .. starts[i + 1] at positions prefix[i].. of its sequence
 * (table row i); every row's K/V is already in the cache. Rows outside the chunks are left
 * alone. Tasks are TILE_ROWS rows of one KV head, the latest (longest) tiles handed out
 * first. */
int is_prefill_attention(const AttentionArgs *a, const int64_t *starts, const int64_t *prefix,
                         int64_t C, int threads) {
    const Cache c = cache_of(a);
    const int64_t KVH = a->kv_heads, G = a->heads / KVH;
    int64_t *first_tile = malloc(sizeof(int64_t) * (size_t)(C + 1));
    if (!first_tile) return -1;
    first_tile[0] = 0;
    for (int64_t i = 0; i < C; i++)
        first_tile[i + 1] = first_tile[i] + (starts[i + 1] - starts[i] + TILE_ROWS - 1) /
                                                TILE_ROWS;
    const int64_t tasks = first_tile[C] * KVH;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1) \
    reduction(| : failed)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t tile = first_tile[C] - 1 - t / KVH, h = t % KVH, i = 0;
        while (first_tile[i + 1] <= tile) i++;
        int64_t r0 = starts[i] + (tile - first_tile[i]) * TILE_ROWS;
        int64_t rows = starts[i + 1] - r0 < TILE_ROWS ? starts[i + 1] - r0 : TILE_ROWS;
        failed |= attend_task(a->q + r0 * a->q_row, a->q_row, a->q_head, rows,
                              prefix[i] + r0 - starts[i], &c, a->tables + i * a->table_stride,
                              h, h + 1, G, a->head_dim, a->scale, a->out + r0 * a->out_row,
                              a->out_row, a->out_head);
    }
    free(first_tile);
    return failed;
}
