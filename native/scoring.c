/*
 * swarmfs medoid scoring (SWARM 5.2): fp16/bf16 GEMV and per-head logits
 * (AVX-512 / AVX2+F16C / NEON with a scalar fallback, chosen at run time),
 * the packed index of the "prob" score, vectorised softmax sums, the
 * scores of se_select_fused (half_scores), and the run-time choice of
 * kernel path.
 */
#include "kernels_int.h"

static void gemv_scalar(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld,
                        int kind, const float *q, int64_t nq, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * ld;
        for (int64_t b = 0; b < nq; b++) {
            float acc = 0.f;
            for (int64_t c = 0; c < cols; c++)
                acc += half_to_float(row[c], kind) * q[b * cols + c];
            out[b * rows + r] = acc;
        }
    }
}

#if SE_X86
__attribute__((target("avx2,fma,f16c")))
static void gemv_avx2(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld,
                      int kind, const float *q, int64_t nq, float *out)
{
    int64_t cv = cols & ~(int64_t)7;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * ld;
        for (int64_t b = 0; b < nq; b++) {
            const float *qb = q + b * cols;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t c = 0; c < cv; c += 8) {
                __m128i h = _mm_loadu_si128((const __m128i *)(row + c));
                __m256 x = kind == 2
                    ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                    : _mm256_cvtph_ps(h);
                acc = _mm256_fmadd_ps(x, _mm256_loadu_ps(qb + c), acc);
            }
            __m128 lo = _mm256_castps256_ps128(acc), hi = _mm256_extractf128_ps(acc, 1);
            lo = _mm_add_ps(lo, hi);
            lo = _mm_hadd_ps(lo, lo);
            lo = _mm_hadd_ps(lo, lo);
            float s = _mm_cvtss_f32(lo);
            for (int64_t c = cv; c < cols; c++)
                s += half_to_float(row[c], kind) * qb[c];
            out[b * rows + r] = s;
        }
    }
}

#define LOAD16(kind, p)                                                             \
    ((kind) == 2 ? _mm512_castsi512_ps(_mm512_slli_epi32(                            \
                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), \
                       16))                                                          \
                 : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))))

__attribute__((target("avx512f")))
static void gemv_avx512_1(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld,
                          int kind, const float *qb, float *out)
{
    /* one query: four independent accumulators hide the FMA latency */
    int64_t c4 = cols & ~(int64_t)63, cv = cols & ~(int64_t)15;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * ld;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c < c4; c += 64) {
            a0 = _mm512_fmadd_ps(LOAD16(kind, row + c), _mm512_loadu_ps(qb + c), a0);
            a1 = _mm512_fmadd_ps(LOAD16(kind, row + c + 16), _mm512_loadu_ps(qb + c + 16), a1);
            a2 = _mm512_fmadd_ps(LOAD16(kind, row + c + 32), _mm512_loadu_ps(qb + c + 32), a2);
            a3 = _mm512_fmadd_ps(LOAD16(kind, row + c + 48), _mm512_loadu_ps(qb + c + 48), a3);
        }
        for (; c < cv; c += 16)
            a0 = _mm512_fmadd_ps(LOAD16(kind, row + c), _mm512_loadu_ps(qb + c), a0);
        float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1),
                                                     _mm512_add_ps(a2, a3)));
        for (; c < cols; c++)
            s += half_to_float(row[c], kind) * qb[c];
        out[r] = s;
    }
}

#define QBLK 8

__attribute__((target("avx512f")))
static void gemv_avx512_n(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld,
                          int kind, const float *q, int64_t nq, float *out)
{
    /* several queries: convert each 16-element chunk of a row once and
     * multiply it into up to QBLK accumulators (one per query) */
    int64_t cv = cols & ~(int64_t)15;
    for (int64_t b0 = 0; b0 < nq; b0 += QBLK) {
        int64_t nb = nq - b0 < QBLK ? nq - b0 : QBLK;
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *row = m + r * ld;
            __m512 acc[QBLK];
            for (int b = 0; b < QBLK; b++)
                acc[b] = _mm512_setzero_ps();
            int64_t c = 0;
            for (; c < cv; c += 16) {
                __m512 x = LOAD16(kind, row + c);
#pragma GCC unroll 8
                for (int b = 0; b < QBLK; b++)
                    if (b < nb)
                        acc[b] = _mm512_fmadd_ps(x, _mm512_loadu_ps(q + (b0 + b) * cols + c),
                                                 acc[b]);
            }
            for (int b = 0; b < nb; b++) {
                float s = _mm512_reduce_add_ps(acc[b]);
                for (int64_t cc = c; cc < cols; cc++)
                    s += half_to_float(row[cc], kind) * q[(b0 + b) * cols + cc];
                out[(b0 + b) * rows + r] = s;
            }
        }
    }
}

__attribute__((target("avx512f")))
static void gemv_avx512(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld,
                        int kind, const float *q, int64_t nq, float *out)
{
    if (nq == 1)
        gemv_avx512_1(m, rows, cols, ld, kind, q, out);
    else
        gemv_avx512_n(m, rows, cols, ld, kind, q, nq, out);
}

/* The 8 horizontal sums of a0..a7 (16 lanes each), as one 8-lane vector. */
__attribute__((target("avx512f,avx512dq")))
static inline __m256 hsum8x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 a4,
                              __m512 a5, __m512 a6, __m512 a7)
{
#define HALVES(a) _mm256_add_ps(_mm512_castps512_ps256(a), \
                                _mm512_extractf32x8_ps(a, 1))
    __m256 s0 = HALVES(a0), s1 = HALVES(a1), s2 = HALVES(a2), s3 = HALVES(a3);
    __m256 s4 = HALVES(a4), s5 = HALVES(a5), s6 = HALVES(a6), s7 = HALVES(a7);
#undef HALVES
    __m256 b0 = _mm256_hadd_ps(s0, s1), b1 = _mm256_hadd_ps(s2, s3);
    __m256 b2 = _mm256_hadd_ps(s4, s5), b3 = _mm256_hadd_ps(s6, s7);
    __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
    __m128 r0 = _mm_add_ps(_mm256_castps256_ps128(c0), _mm256_extractf128_ps(c0, 1));
    __m128 r1 = _mm_add_ps(_mm256_castps256_ps128(c1), _mm256_extractf128_ps(c1, 1));
    return _mm256_set_m128(r1, r0);
}

/* (query, query head) index of each accumulator slot of the fused head-logits
 * kernels, per KV head, in blocks of 8 (unused slots of the last block repeat
 * its first pair; their sums are discarded).  NULL when out of memory. */
static int64_t *head_slots(int64_t H, int64_t G, int64_t Hq, int64_t P, int64_t nblk)
{
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)(H * nblk * 8));
    if (!slot)
        return NULL;
    for (int64_t g = 0; g < H; g++)
        for (int64_t k = 0; k < nblk * 8; k++) {
            int64_t pk = k < P ? k : (k / 8) * 8;
            slot[g * nblk * 8 + k] = (pk / G) * Hq + g * G + pk % G;
        }
    return slot;
}

__attribute__((target("avx512f,avx512dq")))
static int head_logits_avx512(const uint16_t *m, int64_t rows, int64_t ld, int64_t H,
                               int64_t d, int kind, const float *q, int64_t nq, int64_t Hq,
                               float *out)
{
    /* For each row and KV head, the (query, query head) pairs that read that
     * head go in blocks of 8 with one accumulator each (unused slots repeat a
     * valid query and are discarded), so each 16-element chunk is converted
     * once and feeds 8 FMAs. */
    int64_t G = Hq / H, dv = d & ~(int64_t)15, P = nq * G, nblk = (P + 7) / 8;
    int64_t *slot = head_slots(H, G, Hq, P, nblk);
    if (!slot)
        return -ENOMEM;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * ld;
        for (int64_t g = 0; g < H; g++) {
            const uint16_t *seg = row + g * d;
            for (int64_t p0 = 0; p0 < P; p0 += 8) {
                const int64_t *sl = slot + g * nblk * 8 + p0;
                const float *qp[8];
                for (int k = 0; k < 8; k++)
                    qp[k] = q + sl[k] * d;
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
                __m512 a4 = _mm512_setzero_ps(), a5 = _mm512_setzero_ps();
                __m512 a6 = _mm512_setzero_ps(), a7 = _mm512_setzero_ps();
                int64_t c = 0;
                for (; c < dv; c += 16) {
                    __m512 x = LOAD16(kind, seg + c);
                    a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[0] + c), a0);
                    a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[1] + c), a1);
                    a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[2] + c), a2);
                    a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[3] + c), a3);
                    a4 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[4] + c), a4);
                    a5 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[5] + c), a5);
                    a6 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[6] + c), a6);
                    a7 = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp[7] + c), a7);
                }
                float sum[8];
                _mm256_storeu_ps(sum, hsum8x16(a0, a1, a2, a3, a4, a5, a6, a7));
                int64_t np_ = P - p0 < 8 ? P - p0 : 8;
                for (int k = 0; k < np_; k++) {
                    for (int64_t cc = c; cc < d; cc++)
                        sum[k] += half_to_float(seg[cc], kind) * qp[k][cc];
                    out[sl[k] * rows + r] = sum[k];
                }
            }
        }
    }
    free(slot);
    return 0;
}

#endif /* SE_X86 */

#if SE_X86
/* exp(x) for x <= 0 (or any x > -87), AVX-512: 2^(x log2 e) split into an
 * integer power (scalef) and a degree-6 polynomial of the fraction; relative
 * error ~2e-7, which is below fp32 softmax noise. */
__attribute__((target("avx512f")))
static inline __m512 exp512(__m512 x)
{
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, log2e);
    __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, i);                        /* f in [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6184503e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503339e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, i);
}

__attribute__((target("avx512f")))
static void softmax_sum_avx512(const float *x, int64_t nh, int64_t n, float scale, float *out)
{
    int64_t nv = n & ~(int64_t)15;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t h = 0; h < nh; h++) {
        const float *row = x + h * n;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int64_t c = 0;
        for (; c < nv; c += 16)
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + c));
        float m = _mm512_reduce_max_ps(mx);
        for (; c < n; c++)
            m = row[c] > m ? row[c] : m;
        m *= scale;
        const __m512 mv = _mm512_set1_ps(m);
        __m512 acc = _mm512_setzero_ps();
        for (c = 0; c < nv; c += 16)
            acc = _mm512_add_ps(acc, exp512(_mm512_fmsub_ps(_mm512_loadu_ps(row + c), sc, mv)));
        float sum = _mm512_reduce_add_ps(acc);
        for (c = nv; c < n; c++)
            sum += expf(row[c] * scale - m);
        const __m512 inv = _mm512_set1_ps(1.0f / sum);
        for (c = 0; c < nv; c += 16) {
            __m512 e = exp512(_mm512_fmsub_ps(_mm512_loadu_ps(row + c), sc, mv));
            __m512 o = h ? _mm512_loadu_ps(out + c) : _mm512_setzero_ps();
            _mm512_storeu_ps(out + c, _mm512_fmadd_ps(e, inv, o));
        }
        for (c = nv; c < n; c++)
            out[c] = (h ? out[c] : 0.0f) + expf(row[c] * scale - m) / sum;
    }
}

#endif /* SE_X86 */

static void softmax_sum_scalar(const float *x, int64_t nh, int64_t n, float scale, float *out)
{
    for (int64_t h = 0; h < nh; h++) {
        const float *row = x + h * n;
        float m = -INFINITY, sum = 0.f;
        for (int64_t c = 0; c < n; c++)
            m = row[c] > m ? row[c] : m;
        m *= scale;
        for (int64_t c = 0; c < n; c++)
            sum += expf(row[c] * scale - m);
        for (int64_t c = 0; c < n; c++)
            out[c] = (h ? out[c] : 0.0f) + expf(row[c] * scale - m) / sum;
    }
}


/* ---- AVX2 + FMA + F16C: per-head logits and softmax sums -------------------- */
#if SE_X86
#define LOAD8(kind, p)                                                               \
    ((kind) == 2 ? _mm256_castsi256_ps(_mm256_slli_epi32(                             \
                       _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16)) \
                 : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))

/* The 8 horizontal sums of a0..a7 (8 lanes each), as one 8-lane vector. */
__attribute__((target("avx2,fma,f16c")))
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                             __m256 a5, __m256 a6, __m256 a7)
{
    __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    __m256 b2 = _mm256_hadd_ps(a4, a5), b3 = _mm256_hadd_ps(a6, a7);
    __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
    /* c0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] halves of a0..a3, c1 likewise */
    __m256 lo = _mm256_permute2f128_ps(c0, c1, 0x20), hi = _mm256_permute2f128_ps(c0, c1, 0x31);
    return _mm256_add_ps(lo, hi);
}

__attribute__((target("avx2,fma,f16c")))
static int head_logits_avx2(const uint16_t *m, int64_t rows, int64_t ld, int64_t H,
                             int64_t d, int kind, const float *q, int64_t nq, int64_t Hq,
                             float *out)
{
    /* as head_logits_avx512, with 8-lane accumulators */
    int64_t G = Hq / H, dv = d & ~(int64_t)7, P = nq * G, nblk = (P + 7) / 8;
    int64_t *slot = head_slots(H, G, Hq, P, nblk);
    if (!slot)
        return -ENOMEM;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * ld;
        for (int64_t g = 0; g < H; g++) {
            const uint16_t *seg = row + g * d;
            for (int64_t p0 = 0; p0 < P; p0 += 8) {
                const int64_t *sl = slot + g * nblk * 8 + p0;
                const float *qp[8];
                for (int k = 0; k < 8; k++)
                    qp[k] = q + sl[k] * d;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
                __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps();
                __m256 a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
                int64_t c = 0;
                for (; c < dv; c += 8) {
                    __m256 x = LOAD8(kind, seg + c);
                    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[0] + c), a0);
                    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[1] + c), a1);
                    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[2] + c), a2);
                    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[3] + c), a3);
                    a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[4] + c), a4);
                    a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[5] + c), a5);
                    a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[6] + c), a6);
                    a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(qp[7] + c), a7);
                }
                float sum[8];
                _mm256_storeu_ps(sum, hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7));
                int64_t np_ = P - p0 < 8 ? P - p0 : 8;
                for (int k = 0; k < np_; k++) {
                    for (int64_t cc = c; cc < d; cc++)
                        sum[k] += half_to_float(seg[cc], kind) * qp[k][cc];
                    out[sl[k] * rows + r] = sum[k];
                }
            }
        }
    }
    free(slot);
    return 0;
}

/* exp(x) for x > -87, AVX2: as exp512, with 2^i built in the exponent bits */
__attribute__((target("avx2,fma,f16c")))
static inline __m256 exp256(__m256 x)
{
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 t = _mm256_mul_ps(x, log2e);
    __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, i);
    __m256 p = _mm256_set1_ps(1.5353362e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6184503e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503339e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma,f16c")))
static void softmax_sum_avx2(const float *x, int64_t nh, int64_t n, float scale, float *out)
{
    int64_t nv = n & ~(int64_t)7;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t h = 0; h < nh; h++) {
        const float *row = x + h * n;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int64_t c = 0;
        for (; c < nv; c += 8)
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + c));
        float mm[8];
        _mm256_storeu_ps(mm, mx);
        float m = -INFINITY;
        for (int k = 0; k < 8; k++)
            m = mm[k] > m ? mm[k] : m;
        for (; c < n; c++)
            m = row[c] > m ? row[c] : m;
        m *= scale;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 acc = _mm256_setzero_ps();
        for (c = 0; c < nv; c += 8)
            acc = _mm256_add_ps(acc, exp256(_mm256_fmsub_ps(_mm256_loadu_ps(row + c), sc, mv)));
        float aa[8], sum = 0.f;
        _mm256_storeu_ps(aa, acc);
        for (int k = 0; k < 8; k++)
            sum += aa[k];
        for (c = nv; c < n; c++)
            sum += expf(row[c] * scale - m);
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (c = 0; c < nv; c += 8) {
            __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(row + c), sc, mv));
            __m256 o = h ? _mm256_loadu_ps(out + c) : _mm256_setzero_ps();
            _mm256_storeu_ps(out + c, _mm256_fmadd_ps(e, inv, o));
        }
        for (c = nv; c < n; c++)
            out[c] = (h ? out[c] : 0.0f) + expf(row[c] * scale - m) / sum;
    }
}
#endif /* SE_X86 */

/* ---- packed medoid index: per KV head, blocks of 16 rows, dimension-major ------ */

void se_pack_medoids(const uint16_t *m, int64_t C, int64_t H, int64_t d, uint16_t *out)
{
    int64_t nblk = (C + 15) / 16;
    for (int64_t g = 0; g < H; g++)
        for (int64_t b = 0; b < nblk; b++) {
            uint16_t *o = out + ((g * nblk + b) * d) * 16;
            for (int64_t j = 0; j < d; j++)
                for (int64_t i = 0; i < 16; i++) {
                    int64_t r = b * 16 + i;
                    o[j * 16 + i] = r < C ? m[r * H * d + g * d + j] : 0;
                }
        }
}

#if SE_X86
/* Logits of one query's Hq heads against the packed index: lg [Hq, C].  Each
 * 16-row block of KV head g is converted once per dimension and feeds the G
 * query heads of g (no horizontal sums, contiguous stores). */
__attribute__((target("avx512f")))
static void packed_logits_avx512(const uint16_t *P, int64_t C, int64_t H, int64_t d, int kind,
                                 const float *q, int64_t Hq, float *lg)
{
    int64_t G = Hq / H, nblk = (C + 15) / 16;
    for (int64_t g = 0; g < H; g++)
        for (int64_t h0 = 0; h0 < G; h0 += 8) {
            int64_t nh = G - h0 < 8 ? G - h0 : 8;
            const float *qh = q + (g * G + h0) * d;
            for (int64_t b = 0; b < nblk; b++) {
                const uint16_t *p = P + ((g * nblk + b) * d) * 16;
                __m512 acc[8];
                for (int k = 0; k < 8; k++)
                    acc[k] = _mm512_setzero_ps();
                for (int64_t j = 0; j < d; j++) {
                    __m512 x = LOAD16(kind, p + j * 16);
#pragma GCC unroll 8
                    for (int k = 0; k < 8; k++)
                        if (k < nh)
                            acc[k] = _mm512_fmadd_ps(x, _mm512_set1_ps(qh[k * d + j]), acc[k]);
                }
                int64_t r0 = b * 16, nr = C - r0 < 16 ? C - r0 : 16;
                __mmask16 mk = (__mmask16)((1u << nr) - 1);
                for (int k = 0; k < nh; k++)
                    _mm512_mask_storeu_ps(lg + (g * G + h0 + k) * C + r0, mk, acc[k]);
            }
        }
}

__attribute__((target("avx2,fma,f16c")))
static void packed_logits_avx2(const uint16_t *P, int64_t C, int64_t H, int64_t d, int kind,
                               const float *q, int64_t Hq, float *lg)
{
    int64_t G = Hq / H, nblk = (C + 15) / 16;
    for (int64_t g = 0; g < H; g++)
        for (int64_t h0 = 0; h0 < G; h0 += 8) {
            int64_t nh = G - h0 < 8 ? G - h0 : 8;
            const float *qh = q + (g * G + h0) * d;
            for (int64_t b = 0; b < nblk; b++)
                for (int half = 0; half < 2; half++) {
                    const uint16_t *p = P + ((g * nblk + b) * d) * 16 + half * 8;
                    __m256 acc[8];
                    for (int k = 0; k < 8; k++)
                        acc[k] = _mm256_setzero_ps();
                    for (int64_t j = 0; j < d; j++) {
                        __m256 x = LOAD8(kind, p + j * 16);
#pragma GCC unroll 8
                        for (int k = 0; k < 8; k++)
                            if (k < nh)
                                acc[k] = _mm256_fmadd_ps(x, _mm256_set1_ps(qh[k * d + j]),
                                                         acc[k]);
                    }
                    int64_t r0 = b * 16 + half * 8, nr = C - r0 < 8 ? C - r0 : 8;
                    if (nr <= 0)
                        continue;
                    for (int k = 0; k < nh; k++) {
                        if (nr == 8) {
                            _mm256_storeu_ps(lg + (g * G + h0 + k) * C + r0, acc[k]);
                        } else {
                            float t[8];
                            _mm256_storeu_ps(t, acc[k]);
                            memcpy(lg + (g * G + h0 + k) * C + r0, t, sizeof(float) * (size_t)nr);
                        }
                    }
                }
        }
}
#endif /* SE_X86 */

/* ---- NEON (aarch64): fp16/bf16 GEMV -------------------------------------------- */
#if defined(__aarch64__)
static void gemv_neon(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld,
                      int kind, const float *q, int64_t nq, float *out)
{
    int64_t cv = cols & ~(int64_t)3;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * ld;
        for (int64_t b = 0; b < nq; b++) {
            const float *qb = q + b * cols;
            float32x4_t acc = vdupq_n_f32(0.f);
            for (int64_t c = 0; c < cv; c += 4) {
                uint16x4_t h = vld1_u16(row + c);
                float32x4_t x = kind == 2
                    ? vreinterpretq_f32_u32(vshll_n_u16(h, 16))
                    : vcvt_f32_f16(vreinterpret_f16_u16(h));
                acc = vfmaq_f32(acc, x, vld1q_f32(qb + c));
            }
            float s = vaddvq_f32(acc);
            for (int64_t c = cv; c < cols; c++)
                s += half_to_float(row[c], kind) * qb[c];
            out[b * rows + r] = s;
        }
    }
}
#endif

/* ---- run-time dispatch ---------------------------------------------------------- */

static int g_forced = SE_PATH_AUTO;

static int path_supported(int path)
{
    switch (path) {
    case SE_PATH_SCALAR:
        return 1;
#if SE_X86
    case SE_PATH_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case SE_PATH_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#endif
#if defined(__aarch64__)
    case SE_PATH_NEON:
        return 1;
#endif
    default:
        return 0;
    }
}

int se_kernel_path_supported(int path)
{
    return path_supported(path);
}

int se_kernel_path(void)
{
    int forced = __atomic_load_n(&g_forced, __ATOMIC_RELAXED);
    if (forced != SE_PATH_AUTO)
        return forced;
    if (path_supported(SE_PATH_AVX512))
        return SE_PATH_AVX512;
    if (path_supported(SE_PATH_AVX2))
        return SE_PATH_AVX2;
    if (path_supported(SE_PATH_NEON))
        return SE_PATH_NEON;
    return SE_PATH_SCALAR;
}

int se_set_kernel_path(int path)
{
    if (path != SE_PATH_AUTO && !path_supported(path))
        return -ENOTSUP;
    __atomic_store_n(&g_forced, path, __ATOMIC_RELAXED);
    return se_kernel_path();
}

static void gemv_dispatch(int path, const uint16_t *m, int64_t rows, int64_t cols, int64_t ld,
                          int kind, const float *q, int64_t nq, float *out)
{
    switch (path) {
#if SE_X86
    case SE_PATH_AVX512:
        gemv_avx512(m, rows, cols, ld, kind, q, nq, out);
        return;
    case SE_PATH_AVX2:
        gemv_avx2(m, rows, cols, ld, kind, q, nq, out);
        return;
#endif
#if defined(__aarch64__)
    case SE_PATH_NEON:
        gemv_neon(m, rows, cols, ld, kind, q, nq, out);
        return;
#endif
    default:
        gemv_scalar(m, rows, cols, ld, kind, q, nq, out);
    }
}

int se_gemv_half(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld, int kind,
                 const float *q, int64_t nq, float *out)
{
    if (!m || !q || !out || rows < 0 || cols <= 0 || ld < cols || nq <= 0 ||
        (kind != 1 && kind != 2))
        return -EINVAL;
    int path = se_kernel_path();
    gemv_dispatch(path, m, rows, cols, ld, kind, q, nq, out);
    return path;
}

/* per KV head, one strided GEMV of its query heads (paths without a fused kernel) */
static int head_logits_by_gemv(int path, const uint16_t *m, int64_t rows, int64_t ld,
                               int64_t H, int64_t d, int kind, const float *q, int64_t nq,
                               int64_t Hq, float *out)
{
    int64_t G = Hq / H;
    float *tmp = malloc(sizeof(float) * (size_t)(nq * G * rows + 1));
    float *qg = malloc(sizeof(float) * (size_t)(nq * G * d + 1));
    if (!tmp || !qg) {
        free(tmp);
        free(qg);
        return -ENOMEM;
    }
    for (int64_t g = 0; g < H; g++) {
        for (int64_t b = 0; b < nq; b++)
            memcpy(qg + b * G * d, q + (b * Hq + g * G) * d, sizeof(float) * (size_t)(G * d));
        gemv_dispatch(path, m + g * d, rows, d, ld, kind, qg, nq * G, tmp);
        for (int64_t b = 0; b < nq; b++)
            for (int64_t j = 0; j < G; j++)
                memcpy(out + (b * Hq + g * G + j) * rows, tmp + (b * G + j) * rows,
                       sizeof(float) * (size_t)rows);
    }
    free(tmp);
    free(qg);
    return 0;
}

int se_head_logits(const uint16_t *m, int64_t rows, int64_t ld, int64_t H, int64_t d,
                   int kind, const float *q, int64_t nq, int64_t Hq, float *out)
{
    if (!m || !q || !out || rows < 0 || H <= 0 || d <= 0 || ld < H * d || nq <= 0 ||
        Hq <= 0 || Hq % H || (kind != 1 && kind != 2))
        return -EINVAL;
    int path = se_kernel_path();
#if SE_X86
    if (path == SE_PATH_AVX512)
        return head_logits_avx512(m, rows, ld, H, d, kind, q, nq, Hq, out);
    if (path == SE_PATH_AVX2)
        return head_logits_avx2(m, rows, ld, H, d, kind, q, nq, Hq, out);
#endif
    return head_logits_by_gemv(path, m, rows, ld, H, d, kind, q, nq, Hq, out);
}

static void softmax_sum_dispatch(int path, const float *x, int64_t nh, int64_t n, float scale,
                                 float *out)
{
#if SE_X86
    if (path == SE_PATH_AVX512) {
        softmax_sum_avx512(x, nh, n, scale, out);
        return;
    }
    if (path == SE_PATH_AVX2) {
        softmax_sum_avx2(x, nh, n, scale, out);
        return;
    }
#endif
    softmax_sum_scalar(x, nh, n, scale, out);
}

int se_softmax_sum(const float *x, int64_t nh, int64_t n, float scale, float *out)
{
    if (!x || !out || nh <= 0 || n <= 0 || !(scale > 0))
        return -EINVAL;
    softmax_sum_dispatch(se_kernel_path(), x, nh, n, scale, out);
    return 0;
}

/* The "logit" score: the GQA-summed, scaled query [H * d] against each row. */
static int logit_scores(int path, const se_half_index *ix, const se_query *q, float *sc)
{
    int64_t H = q->H, d = q->d, G = q->Hq / H;
    float *qg = malloc(sizeof(float) * (size_t)(H * d));
    if (!qg)
        return -ENOMEM;
    for (int64_t g = 0; g < H; g++)
        for (int64_t j = 0; j < d; j++) {
            float s = 0.f;
            for (int64_t i = 0; i < G; i++)
                s += q->q[(g * G + i) * d + j];
            qg[g * d + j] = s * q->scale;
        }
    gemv_dispatch(path, ix->m, ix->C, H * d, H * d, ix->kind, qg, 1, sc);
    free(qg);
    return 0;
}

/* The "prob" score: per-head logits [Hq, C] in lg, softmax-summed over heads
 * into sc. */
static int prob_scores(int path, const se_half_index *ix, const se_query *q, float *sc,
                       float *lg)
{
    const uint16_t *m = ix->m, *packed = ix->packed;
    int64_t C = ix->C, H = q->H, d = q->d, Hq = q->Hq;
    int kind = ix->kind, rc = 0;
#if SE_X86
    if (packed && path == SE_PATH_AVX512)
        packed_logits_avx512(packed, C, H, d, kind, q->q, Hq, lg);
    else if (packed && path == SE_PATH_AVX2)
        packed_logits_avx2(packed, C, H, d, kind, q->q, Hq, lg);
    else if (path == SE_PATH_AVX512)
        rc = head_logits_avx512(m, C, H * d, H, d, kind, q->q, 1, Hq, lg);
    else if (path == SE_PATH_AVX2)
        rc = head_logits_avx2(m, C, H * d, H, d, kind, q->q, 1, Hq, lg);
    else
#endif
        rc = head_logits_by_gemv(path, m, C, H * d, H, d, kind, q->q, 1, Hq, lg);
    (void)packed;
    if (rc < 0)
        return rc;
    softmax_sum_dispatch(path, lg, Hq, C, q->scale, sc);
    return 0;
}

int half_scores(int path, const se_half_index *ix, const se_query *q, int score, float *work)
{
    if (ix->C == 0)
        return 0;
    if (score == 1)
        return logit_scores(path, ix, q, work);
    return prob_scores(path, ix, q, work, work + ix->C);
}

/* softmax_sum on a writable x, one exp per element (kept in x between the
 * sum and the output pass; the same floats as softmax_sum), adding into out
 * (init: the first head overwrites it). */
#if SE_X86
__attribute__((target("avx512f")))
static void softmax_acc_avx512(float *x, int64_t nh, int64_t n, float scale, float *out,
                               int init)
{
    int64_t nv = n & ~(int64_t)15;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t h = 0; h < nh; h++) {
        float *row = x + h * n;
        int first = init && h == 0;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int64_t c = 0;
        for (; c < nv; c += 16)
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + c));
        float m = _mm512_reduce_max_ps(mx);
        for (; c < n; c++)
            m = row[c] > m ? row[c] : m;
        m *= scale;
        const __m512 mv = _mm512_set1_ps(m);
        __m512 acc = _mm512_setzero_ps();
        for (c = 0; c < nv; c += 16) {
            __m512 e = exp512(_mm512_fmsub_ps(_mm512_loadu_ps(row + c), sc, mv));
            _mm512_storeu_ps(row + c, e);
            acc = _mm512_add_ps(acc, e);
        }
        float sum = _mm512_reduce_add_ps(acc);
        for (c = nv; c < n; c++) {
            row[c] = expf(row[c] * scale - m);
            sum += row[c];
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sum);
        for (c = 0; c < nv; c += 16) {
            __m512 o = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + c);
            _mm512_storeu_ps(out + c, _mm512_fmadd_ps(_mm512_loadu_ps(row + c), inv, o));
        }
        for (c = nv; c < n; c++)
            out[c] = (first ? 0.0f : out[c]) + row[c] / sum;
    }
}

__attribute__((target("avx2,fma,f16c")))
static void softmax_acc_avx2(float *x, int64_t nh, int64_t n, float scale, float *out,
                             int init)
{
    int64_t nv = n & ~(int64_t)7;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t h = 0; h < nh; h++) {
        float *row = x + h * n;
        int first = init && h == 0;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int64_t c = 0;
        for (; c < nv; c += 8)
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + c));
        float mm[8];
        _mm256_storeu_ps(mm, mx);
        float m = -INFINITY;
        for (int k = 0; k < 8; k++)
            m = mm[k] > m ? mm[k] : m;
        for (; c < n; c++)
            m = row[c] > m ? row[c] : m;
        m *= scale;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 acc = _mm256_setzero_ps();
        for (c = 0; c < nv; c += 8) {
            __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(row + c), sc, mv));
            _mm256_storeu_ps(row + c, e);
            acc = _mm256_add_ps(acc, e);
        }
        float aa[8], sum = 0.f;
        _mm256_storeu_ps(aa, acc);
        for (int k = 0; k < 8; k++)
            sum += aa[k];
        for (c = nv; c < n; c++) {
            row[c] = expf(row[c] * scale - m);
            sum += row[c];
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (c = 0; c < nv; c += 8) {
            __m256 o = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + c);
            _mm256_storeu_ps(out + c, _mm256_fmadd_ps(_mm256_loadu_ps(row + c), inv, o));
        }
        for (c = nv; c < n; c++)
            out[c] = (first ? 0.0f : out[c]) + row[c] / sum;
    }
}
#endif

void softmax_acc(int path, float *x, int64_t nh, int64_t n, float scale, float *out,
                 int init)
{
#if SE_X86
    if (path == SE_PATH_AVX512) {
        softmax_acc_avx512(x, nh, n, scale, out, init);
        return;
    }
    if (path == SE_PATH_AVX2) {
        softmax_acc_avx2(x, nh, n, scale, out, init);
        return;
    }
#endif
    for (int64_t h = 0; h < nh; h++) {
        float *row = x + h * n;
        int first = init && h == 0;
        float m = -INFINITY, sum = 0.f;
        for (int64_t c = 0; c < n; c++)
            m = row[c] > m ? row[c] : m;
        m *= scale;
        for (int64_t c = 0; c < n; c++)
            sum += expf(row[c] * scale - m);
        for (int64_t c = 0; c < n; c++)
            out[c] = (first ? 0.0f : out[c]) + expf(row[c] * scale - m) / sum;
    }
}
