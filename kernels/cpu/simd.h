/* Vector helpers shared by the CPU decode ops (AVX2 + FMA). */
#ifndef INFERSTACK_SIMD_H
#define INFERSTACK_SIMD_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

/* eight int8 weights as floats */
INLINE __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* exp on eight floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
 * (relative error about 2e-7, the accuracy of expf); clamped where expf over/underflows */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    float s = hsum(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* a KV cache's element type (the kind the ops are passed): a float16 cache reads half the
 * bytes of a float32 one, and at 64 decoding sequences those bytes are what decode attention
 * waits for */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };

/* An int8 cache row (per token and KV head): D int8 values q, then the row's float32 scale
 * d = absmax / 127 in the next 4 bytes, value i = q[i] * d (kernels/kv_int8.py writes the
 * same bytes). One scale a row, not one a block of 32 as GGUF's Q8_0: attention folds it into
 * the row's score (keys) or softmax weight (values), once a row, so the inner loops are the
 * float16 cache's with a byte load, where a scale per 32 values costs a multiply a block.
 * The cache is an int8 tensor [slots, KVH, D + KV_I8_SCALE]: its strides count bytes. */
#define KV_I8_SCALE 4

INLINE int64_t kv_size(int kind) { return kind == KV_F32 ? 4 : kind == KV_I8 ? 1 : 2; }

/* the scale of the int8 row at `row` (D values) */
INLINE float kv_row_scale(const void *row, int64_t D) {
    float d;
    memcpy(&d, (const char *)row + D, sizeof d);
    return d;
}

/* n floats as an int8 row with its scale at dst: q = round-to-even(x * (127 / absmax)), the
 * products and rounding torch's quantize_rows makes, so both write the same bytes */
INLINE void put_i8(void *dst, const float *src, int64_t n) {
    __m256 m = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(src + d), magnitude));
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    for (; d < n; d++) amax = fabsf(src[d]) > amax ? fabsf(src[d]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, scale = amax / 127.0f;
    int8_t *q = dst;
    for (d = 0; d < n; d++) q[d] = (int8_t)nearbyintf(src[d] * inv);
    memcpy(q + n, &scale, sizeof scale);
}

/* n floats into a cache row at dst, rounded to nearest even as torch's casts round (an int8
 * row: quantized, its scale after it) */
INLINE void put_kv(void *dst, const float *src, int64_t n, int kind) {
    if (kind == KV_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    if (kind == KV_I8) {
        put_i8(dst, src, n);
        return;
    }
    uint16_t *h = dst;
    int64_t d = 0;
    if (kind == KV_F16) {
        for (; d + 8 <= n; d += 8)
            _mm_storeu_si128((__m128i *)(h + d),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
        for (; d < n; d++) h[d] = _cvtss_sh(src[d], _MM_FROUND_TO_NEAREST_INT);
        return;
    }
    for (; d < n; d++) { /* bfloat16: the float's top half, rounded; NaN stays a quiet NaN */
        uint32_t bits;
        memcpy(&bits, src + d, sizeof bits);
        h[d] = (bits & 0x7fffffffu) > 0x7f800000u
                   ? (uint16_t)((bits >> 16) | 0x40u)
                   : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
}

#endif
