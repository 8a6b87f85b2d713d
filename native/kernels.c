/*
 * swarmfs native data kernels: the per-entry and per-medoid loops of the
 * planner, the store and retrieval, so that no Python runs per entry or per
 * request.  See engine.h for the interface.
 *
 *   gather/scatter of entry rows, XXH3-64 checksums (xxHash, inlined),
 *   the entry-bucket assignment of SWARM 6.1, and medoid scoring: fp16/bf16
 *   GEMV and per-head logits (AVX-512 / AVX2+F16C with a scalar fallback,
 *   chosen at run time) and a vectorised softmax-sum.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* ---- data kernels -------------------------------------------------------- */

void se_gather_rows(char *dst, const char *src, const uint64_t *src_off,
                    int64_t n, uint64_t row)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + (uint64_t)i * row, src + src_off[i], row);
}

void se_scatter_rows(char *dst, const uint64_t *dst_off, const char *src,
                     const int64_t *src_row, int64_t n, uint64_t row)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + dst_off[i], src + (uint64_t)src_row[i] * row, row);
}

void se_xxh3_ranges(const char *buf, const uint64_t *off, const uint64_t *len,
                    int64_t n, uint64_t *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = XXH3_64bits(buf + off[i], len[i]);
}

void se_xxh3_rows(const char *buf, int64_t n, uint64_t row, uint64_t *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = XXH3_64bits(buf + (uint64_t)i * row, row);
}

int64_t se_verify_rows(const char *buf, const uint64_t *off, int64_t n,
                       uint64_t row, const uint64_t *expected,
                       int64_t *bad, int64_t max_bad)
{
    int64_t nbad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (XXH3_64bits(buf + off[i], row) != expected[i]) {
            if (nbad < max_bad)
                bad[nbad] = i;
            nbad++;
        }
    }
    return nbad;
}

void se_assign_buckets(int64_t n, const int64_t *ptr, const int32_t *cdisk,
                       int64_t *load, int ndisks, int64_t *choice)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t best = -1;
        int64_t best_load = INT64_MAX;
        for (int64_t k = ptr[i]; k < ptr[i + 1]; k++) {
            int d = cdisk[k];
            if (d < 0 || d >= ndisks)
                continue;
            if (load[d] < best_load) {
                best_load = load[d];
                best = k;
            }
        }
        choice[i] = best;
        if (best >= 0)
            load[cdisk[best]]++;
    }
}

/* ---- medoid scoring ---------------------------------------------------- */

static inline float half_to_float(uint16_t h, int kind)
{
    if (kind == 2) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    /* IEEE fp16 -> fp32 */
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) {
            u = s;
        } else {
            e = 127 - 15 + 1;
            while (!(m & 0x400)) {
                m <<= 1;
                e--;
            }
            u = s | (e << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) {
        u = s | 0x7f800000 | (m << 13);
    } else {
        u = s | ((e + 127 - 15) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

__attribute__((target("avx512f,avx512dq")))
static void head_logits_avx512(const uint16_t *m, int64_t rows, int64_t H, int64_t d,
                               int kind, const float *q, int64_t nq, int64_t Hq,
                               float *out)
{
    /* For each row and KV head, the (query, query head) pairs that read that
     * head go in blocks of 8 with one accumulator each (unused slots repeat a
     * valid query and are discarded), so each 16-element chunk is converted
     * once and feeds 8 FMAs. */
    int64_t G = Hq / H, dv = d & ~(int64_t)15, P = nq * G, nblk = (P + 7) / 8;
    /* (query, head) index of each accumulator slot, per KV head: computed once */
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)(H * nblk * 8));
    if (!slot)
        return;
    for (int64_t g = 0; g < H; g++)
        for (int64_t k = 0; k < nblk * 8; k++) {
            int64_t pk = k < P ? k : (k / 8) * 8;
            slot[g * nblk * 8 + k] = (pk / G) * Hq + g * G + pk % G;
        }
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * H * d;
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
}

int se_head_logits(const uint16_t *m, int64_t rows, int64_t H, int64_t d, int kind,
                   const float *q, int64_t nq, int64_t Hq, float *out)
{
    if (!m || !q || !out || rows < 0 || H <= 0 || d <= 0 || nq <= 0 || Hq <= 0 ||
        Hq % H || (kind != 1 && kind != 2))
        return -EINVAL;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
        head_logits_avx512(m, rows, H, d, kind, q, nq, Hq, out);
        return 0;
    }
    /* other CPUs: one strided GEMV per KV head */
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
        se_gemv_half(m + g * d, rows, d, H * d, kind, qg, nq * G, tmp);
        for (int64_t b = 0; b < nq; b++)
            for (int64_t j = 0; j < G; j++)
                memcpy(out + (b * Hq + g * G + j) * rows, tmp + (b * G + j) * rows,
                       sizeof(float) * (size_t)rows);
    }
    free(tmp);
    free(qg);
    return 0;
}

int se_gemv_half(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld, int kind,
                 const float *q, int64_t nq, float *out)
{
    if (!m || !q || !out || rows < 0 || cols <= 0 || ld < cols || nq <= 0 ||
        (kind != 1 && kind != 2))
        return -EINVAL;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        gemv_avx512(m, rows, cols, ld, kind, q, nq, out);
        return 3;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        gemv_avx2(m, rows, cols, ld, kind, q, nq, out);
        return 2;
    }
    gemv_scalar(m, rows, cols, ld, kind, q, nq, out);
    return 1;
}

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

int se_softmax_sum(const float *x, int64_t nh, int64_t n, float scale, float *out)
{
    if (!x || !out || nh <= 0 || n <= 0 || !(scale > 0))
        return -EINVAL;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        softmax_sum_avx512(x, nh, n, scale, out);
    else
        softmax_sum_scalar(x, nh, n, scale, out);
    return 0;
}
