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
#include <pthread.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__x86_64__) || defined(__i386__)
#define SE_X86 1
#include <immintrin.h>
#else
#define SE_X86 0
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

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
static int head_logits_avx512(const uint16_t *m, int64_t rows, int64_t H, int64_t d,
                               int kind, const float *q, int64_t nq, int64_t Hq,
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
static int head_logits_avx2(const uint16_t *m, int64_t rows, int64_t H, int64_t d,
                             int kind, const float *q, int64_t nq, int64_t Hq, float *out)
{
    /* as head_logits_avx512, with 8-lane accumulators */
    int64_t G = Hq / H, dv = d & ~(int64_t)7, P = nq * G, nblk = (P + 7) / 8;
    int64_t *slot = head_slots(H, G, Hq, P, nblk);
    if (!slot)
        return -ENOMEM;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = m + r * H * d;
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
static int head_logits_by_gemv(int path, const uint16_t *m, int64_t rows, int64_t H, int64_t d,
                               int kind, const float *q, int64_t nq, int64_t Hq, float *out)
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
        gemv_dispatch(path, m + g * d, rows, d, H * d, kind, qg, nq * G, tmp);
        for (int64_t b = 0; b < nq; b++)
            for (int64_t j = 0; j < G; j++)
                memcpy(out + (b * Hq + g * G + j) * rows, tmp + (b * G + j) * rows,
                       sizeof(float) * (size_t)rows);
    }
    free(tmp);
    free(qg);
    return 0;
}

int se_head_logits(const uint16_t *m, int64_t rows, int64_t H, int64_t d, int kind,
                   const float *q, int64_t nq, int64_t Hq, float *out)
{
    if (!m || !q || !out || rows < 0 || H <= 0 || d <= 0 || nq <= 0 || Hq <= 0 ||
        Hq % H || (kind != 1 && kind != 2))
        return -EINVAL;
    int path = se_kernel_path();
#if SE_X86
    if (path == SE_PATH_AVX512)
        return head_logits_avx512(m, rows, H, d, kind, q, nq, Hq, out);
    if (path == SE_PATH_AVX2)
        return head_logits_avx2(m, rows, H, d, kind, q, nq, Hq, out);
#endif
    return head_logits_by_gemv(path, m, rows, H, d, kind, q, nq, Hq, out);
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

/* ---- cluster choice (SWARM 5.2, eq. 8) ------------------------------------------- */

/* A key whose ascending order is descending score (NaN lowest, -0 == +0). */
static inline uint32_t desc_key(float s)
{
    if (s != s)
        s = -INFINITY;
    if (s == 0.0f)
        s = 0.0f;
    uint32_t u;
    memcpy(&u, &s, 4);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}

/* k-th smallest (0-based) of a[0..n) by quickselect; a is reordered. */
static uint32_t nth_u32(uint32_t *a, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        uint32_t x = a[lo + (hi - lo) / 2], y = a[lo], z = a[hi], p;
        p = (x < y) ? ((y < z) ? y : (x < z ? z : x)) : ((x < z) ? x : (y < z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < p)
                i++;
            while (a[j] > p)
                j--;
            if (i <= j) {
                uint32_t t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return a[k];
    }
    return a[k];
}

/* A key t such that at least k (1 <= k <= n) of keys[0..n) are <= t, and at
 * most k - 1 plus those sharing t's upper 22 bits: two counting passes over
 * the upper 11 and the next 11 bits (no comparisons to mispredict, unlike a
 * quickselect).  cnt: scratch of >= 2049 uint32. */
static uint32_t key_threshold(const uint32_t *keys, int64_t n, int64_t k, uint32_t *cnt)
{
    memset(cnt, 0, sizeof(uint32_t) * 2049);
    for (int64_t i = 0; i < n; i++)
        cnt[keys[i] >> 21]++;
    int64_t below = 0;
    uint32_t b = 0;
    for (; b < 2047 && below + (int64_t)cnt[b] < k; b++)
        below += cnt[b];
    memset(cnt, 0, sizeof(uint32_t) * 2049);
    for (int64_t i = 0; i < n; i++)          /* keys outside bucket b count in slot 2048 */
        cnt[(keys[i] >> 21) == b ? (keys[i] >> 10) & 2047 : 2048]++;
    uint32_t sb = 0;
    for (; sb < 2047 && below + (int64_t)cnt[sb] < k; sb++)
        below += cnt[sb];
    return (b << 21) | (sb << 10) | 1023u;
}

/* Stable LSD radix sort of (key << 32 | id) by the upper 32 bits, 3 passes of
 * 11 bits; ids come in ascending order, so ties stay in id order. */
static void radix_sort_keys(uint64_t *a, uint64_t *tmp, int64_t n)
{
    size_t cnt[2048];
    for (int pass = 0; pass < 3; pass++) {
        int shift = 32 + 11 * pass;
        memset(cnt, 0, sizeof cnt);
        for (int64_t i = 0; i < n; i++)
            cnt[(a[i] >> shift) & 2047]++;
        size_t sum = 0;
        for (int b = 0; b < 2048; b++) {
            size_t c = cnt[b];
            cnt[b] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++)
            tmp[cnt[(a[i] >> shift) & 2047]++] = a[i];
        memcpy(a, tmp, sizeof(uint64_t) * (size_t)n);
    }
}

int64_t se_choose_clusters(const float *scores, int64_t C, const int64_t *ptr,
                           const int32_t *members, int64_t S, int64_t budget, int64_t w,
                           int64_t *out, int64_t *entries)
{
    if (!scores || !ptr || !members || !out || !entries || C < 0 || S < 0 || budget < 0 ||
        w < 0 || C >= ((int64_t)1 << 32))
        return -EINVAL;
    if (budget > S)
        budget = S;
    if (w > S)
        w = S;
    int64_t have = w, nout = 0;
    if (have >= budget || C == 0) {
        *entries = have;
        return 0;
    }
    uint64_t *seen = calloc((size_t)(S + 63) / 64 + 1, 8);
    uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)C);
    uint32_t *sel = malloc(sizeof(uint32_t) * (size_t)(C > 2049 ? C : 2049));  /* counts */
    uint64_t *cand = malloc(sizeof(uint64_t) * (size_t)C);
    uint64_t *tmp = malloc(sizeof(uint64_t) * (size_t)C);
    if (!seen || !keys || !sel || !cand || !tmp) {
        free(seen); free(keys); free(sel); free(cand); free(tmp);
        return -ENOMEM;
    }
    for (int64_t t = S - w; t < S; t++)
        seen[t >> 6] |= (uint64_t)1 << (t & 63);
    for (int64_t c = 0; c < C; c++)
        keys[c] = desc_key(scores[c]);
    double mean = (double)ptr[C] / (double)C;
    if (mean < 1.0)
        mean = 1.0;
    int64_t k = (int64_t)((double)(budget - have) / mean * 1.5) + 16, done = 0;
    for (;;) {
        if (k > C)
            k = C;
        /* the first k of the order are the clusters whose key is <= the k-th
         * smallest key (with every tie of it): collect them in id order */
        int64_t m = 0;
        if (k < C) {
            uint32_t t = key_threshold(keys, C, k, sel);
            for (int64_t c = 0; c < C; c++) {          /* branch-free */
                cand[m] = ((uint64_t)keys[c] << 32) | (uint64_t)c;
                m += keys[c] <= t;
            }
        } else {
            for (int64_t c = 0; c < C; c++)
                cand[m++] = ((uint64_t)keys[c] << 32) | (uint64_t)c;
        }
        radix_sort_keys(cand, tmp, m);
        for (int64_t j = done; j < m; j++) {
            int64_t c = (int64_t)(cand[j] & 0xffffffffu);
            for (int64_t i = ptr[c]; i < ptr[c + 1]; i++) {
                int64_t t = members[i];
                uint64_t bit = (uint64_t)1 << (t & 63);
                if (!(seen[t >> 6] & bit)) {
                    seen[t >> 6] |= bit;
                    have++;
                }
            }
            out[nout++] = c;
            if (have >= budget)
                goto finish;
        }
        done = m;
        if (m >= C)
            break;
        k = 2 * k > m + 1 ? 2 * k : m + 1;
    }
finish:
    free(seen); free(keys); free(sel); free(cand); free(tmp);
    *entries = have;
    return nout;
}

int64_t se_select_fused(const uint16_t *m, const uint16_t *packed, int64_t C, int64_t H,
                        int64_t d, int kind, const float *q, int64_t Hq, float scale, int score,
                        const int64_t *ptr, const int32_t *members, int64_t S,
                        int64_t budget, int64_t w, float *work, int64_t *out,
                        int64_t *entries)
{
    if (!m || !q || !work || C < 0 || H <= 0 || d <= 0 || Hq <= 0 || Hq % H ||
        (kind != 1 && kind != 2) || !(scale > 0) || (score != 0 && score != 1))
        return -EINVAL;
    int path = se_kernel_path();
    float *sc = work;                         /* [C] scores */
    if (C > 0) {
        if (score == 1) {
            /* logit: GQA-summed, scaled query [H * d] against each row */
            float *qg = malloc(sizeof(float) * (size_t)(H * d));
            if (!qg)
                return -ENOMEM;
            int64_t G = Hq / H;
            for (int64_t g = 0; g < H; g++)
                for (int64_t j = 0; j < d; j++) {
                    float s = 0.f;
                    for (int64_t i = 0; i < G; i++)
                        s += q[(g * G + i) * d + j];
                    qg[g * d + j] = s * scale;
                }
            gemv_dispatch(path, m, C, H * d, H * d, kind, qg, 1, sc);
            free(qg);
        } else {
            /* prob: per-head logits [Hq, C] in work + C, softmax-summed over heads */
            float *lg = work + C;
            int rc = 0;
#if SE_X86
            if (packed && path == SE_PATH_AVX512)
                packed_logits_avx512(packed, C, H, d, kind, q, Hq, lg);
            else if (packed && path == SE_PATH_AVX2)
                packed_logits_avx2(packed, C, H, d, kind, q, Hq, lg);
            else if (path == SE_PATH_AVX512)
                rc = head_logits_avx512(m, C, H, d, kind, q, 1, Hq, lg);
            else if (path == SE_PATH_AVX2)
                rc = head_logits_avx2(m, C, H, d, kind, q, 1, Hq, lg);
            else
#endif
                rc = head_logits_by_gemv(path, m, C, H, d, kind, q, 1, Hq, lg);
            if (rc < 0)
                return rc;
            softmax_sum_dispatch(path, lg, Hq, C, scale, sc);
        }
    }
    return se_choose_clusters(sc, C, ptr, members, S, budget, w, out, entries);
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

static void softmax_acc(int path, float *x, int64_t nh, int64_t n, float scale, float *out,
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

/* ---- int8 medoid index: per-row scales, exact integer dots ----------------------
 * Layout: per KV head g, blocks of 16 medoids, groups of 4 dimensions: byte
 * ((g * nblk + b) * d/4 + j4) * 64 + i * 4 + t holds medoid b*16+i, dimension
 * 4*j4+t, quantised to round(x * 127 / max|row|) in [-127, 127].  scales [H, Cp]
 * (Cp = 16 * nblk; max|row| / 127, 0 past C) and sums [H, Cp] (the row's int8
 * sum, for the unsigned-query correction of vpdpbusd).  Every path computes
 * the same integer dot products, so their logits are bit-identical. */

void se_pack_medoids_i8(const uint16_t *m, int64_t C, int64_t H, int64_t d, int kind,
                        int8_t *out, float *scales, int32_t *sums)
{
    int64_t nblk = (C + 15) / 16, Cp = nblk * 16, D4 = d / 4;
    for (int64_t g = 0; g < H; g++)
        for (int64_t r = 0; r < Cp; r++) {
            int64_t b = r / 16, i = r % 16;
            int8_t *o = out + (g * nblk + b) * D4 * 64 + i * 4;
            float mx = 0.f;
            if (r < C)
                for (int64_t j = 0; j < d; j++) {
                    float x = fabsf(half_to_float(m[r * H * d + g * d + j], kind));
                    mx = x > mx ? x : mx;          /* NaN never wins */
                }
            float inv = mx > 0.f && isfinite(mx) ? 127.f / mx : 0.f;
            int32_t s = 0;
            for (int64_t j = 0; j < d; j++) {
                int v = 0;
                if (r < C && inv > 0.f) {
                    float x = half_to_float(m[r * H * d + g * d + j], kind) * inv;
                    v = x != x ? 0 : x >= 127.f ? 127 : x <= -127.f ? -127 : (int)lrintf(x);
                }
                o[(j / 4) * 64 + (j % 4)] = (int8_t)v;
                s += v;
            }
            scales[g * Cp + r] = inv > 0.f ? mx / 127.f : 0.f;
            sums[g * Cp + r] = s;
        }
}

/* One query's Hq heads quantised per head: q8 [Hq, d] in [-127, 127], sq [Hq]. */
static void quant_query(const float *q, int64_t Hq, int64_t d, int8_t *q8, float *sq)
{
    for (int64_t h = 0; h < Hq; h++) {
        float mx = 0.f;
        for (int64_t j = 0; j < d; j++) {
            float x = fabsf(q[h * d + j]);
            mx = x > mx ? x : mx;
        }
        float inv = mx > 0.f && isfinite(mx) ? 127.f / mx : 0.f;
        for (int64_t j = 0; j < d; j++) {
            float x = q[h * d + j] * inv;
            q8[h * d + j] = (int8_t)(x != x ? 0 : x >= 127.f ? 127 : x <= -127.f ? -127
                                                                           : (int)lrintf(x));
        }
        sq[h] = inv > 0.f ? mx / 127.f : 0.f;
    }
}

static void i8_logits_scalar(const int8_t *P, const float *sm, int64_t C, int64_t H,
                             int64_t d, const int8_t *q8, const float *sq, int64_t Hq,
                             int64_t g0, int64_t g1, float *lg, int64_t ldc)
{
    int64_t G = Hq / H, nblk = (C + 15) / 16, Cp = nblk * 16, D4 = d / 4;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t r = 0; r < C; r++) {
            const int8_t *p = P + (g * nblk + r / 16) * D4 * 64 + (r % 16) * 4;
            for (int64_t k = 0; k < G; k++) {
                int64_t h = g * G + k;
                int32_t dot = 0;
                for (int64_t j = 0; j < d; j++)
                    dot += (int32_t)p[(j / 4) * 64 + (j % 4)] * q8[h * d + j];
                lg[(h - g0 * G) * ldc + r] = (float)dot * (sm[g * Cp + r] * sq[h]);
            }
        }
}

#if SE_X86
/* The query's 4-byte dimension groups as words: qw[h * D4 + j4]; with bias
 * 128 (unsigned bytes, for vpdpbusd) or as is (signed). */
static void query_words(const int8_t *q8, int64_t Hq, int64_t d, int bias, uint32_t *qw)
{
    for (int64_t h = 0; h < Hq; h++)
        for (int64_t j4 = 0; j4 < d / 4; j4++) {
            uint32_t w = 0;
            for (int t = 0; t < 4; t++)
                w |= (uint32_t)(uint8_t)(q8[h * d + j4 * 4 + t] + (bias ? 128 : 0)) << (8 * t);
            qw[h * (d / 4) + j4] = w;
        }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void i8_logits_vnni(const int8_t *P, const float *sm, const int32_t *ms, int64_t C,
                           int64_t H, int64_t d, const uint32_t *qw, const float *sq,
                           int64_t Hq, int64_t g0, int64_t g1, float *lg, int64_t ldc)
{
    int64_t G = Hq / H, nblk = (C + 15) / 16, Cp = nblk * 16, D4 = d / 4;
    if (G == 1) {
        /* one query head per KV head (no GQA): one accumulator per block would
         * make each block a chain of dependent vpdpbusd (latency-bound), so
         * four blocks run side by side */
        for (int64_t g = g0; g < g1; g++) {
            const uint32_t *qh = qw + g * D4;
            const __m512 fq = _mm512_set1_ps(sq[g]);
            for (int64_t b = 0; b < nblk; b += 4) {
                int64_t nb = nblk - b < 4 ? nblk - b : 4;
                __m512i acc[4];
                for (int64_t u = 0; u < 4; u++)
                    acc[u] = u < nb ? _mm512_sub_epi32(_mm512_setzero_si512(),
                        _mm512_slli_epi32(_mm512_loadu_si512(ms + g * Cp + (b + u) * 16), 7))
                                    : _mm512_setzero_si512();
                const int8_t *p = P + (g * nblk + b) * D4 * 64;
                if (nb == 4) {
                    for (int64_t j4 = 0; j4 < D4; j4++) {
                        __m512i qv = _mm512_set1_epi32((int)qh[j4]);
#pragma GCC unroll 4
                        for (int u = 0; u < 4; u++)
                            acc[u] = _mm512_dpbusd_epi32(
                                acc[u], qv, _mm512_loadu_si512(p + (u * D4 + j4) * 64));
                    }
                } else {
                    for (int64_t j4 = 0; j4 < D4; j4++) {
                        __m512i qv = _mm512_set1_epi32((int)qh[j4]);
                        for (int64_t u = 0; u < nb; u++)
                            acc[u] = _mm512_dpbusd_epi32(
                                acc[u], qv, _mm512_loadu_si512(p + (u * D4 + j4) * 64));
                    }
                }
                for (int64_t u = 0; u < nb; u++) {
                    int64_t r0 = (b + u) * 16, nr = C - r0 < 16 ? C - r0 : 16;
                    __mmask16 mk = (__mmask16)((1u << nr) - 1);
                    __m512 f = _mm512_loadu_ps(sm + g * Cp + r0);
                    _mm512_mask_storeu_ps(lg + (g - g0) * ldc + r0, mk,
                        _mm512_mul_ps(_mm512_cvtepi32_ps(acc[u]), _mm512_mul_ps(f, fq)));
                }
            }
        }
        return;
    }
    for (int64_t g = g0; g < g1; g++)
        for (int64_t h0 = 0; h0 < G; h0 += 8) {
            int64_t nh = G - h0 < 8 ? G - h0 : 8, hb = g * G + h0;
            for (int64_t b = 0; b < nblk; b++) {
                const int8_t *p = P + (g * nblk + b) * D4 * 64;
                /* sum (q + 128) m = q.m + 128 sum m: start at -128 sum m */
                __m512i base = _mm512_sub_epi32(_mm512_setzero_si512(),
                    _mm512_slli_epi32(_mm512_loadu_si512(ms + g * Cp + b * 16), 7));
                __m512i acc[8];
                for (int k = 0; k < 8; k++)
                    acc[k] = base;
                for (int64_t j4 = 0; j4 < D4; j4++) {
                    __m512i x = _mm512_loadu_si512(p + j4 * 64);
#pragma GCC unroll 8
                    for (int k = 0; k < 8; k++)
                        if (k < nh)
                            acc[k] = _mm512_dpbusd_epi32(
                                acc[k], _mm512_set1_epi32((int)qw[(hb + k) * D4 + j4]), x);
                }
                __m512 f = _mm512_loadu_ps(sm + g * Cp + b * 16);
                int64_t r0 = b * 16, nr = C - r0 < 16 ? C - r0 : 16;
                __mmask16 mk = (__mmask16)((1u << nr) - 1);
                for (int k = 0; k < nh; k++)
                    _mm512_mask_storeu_ps(lg + (hb - g0 * G + k) * ldc + r0, mk,
                        _mm512_mul_ps(_mm512_cvtepi32_ps(acc[k]),
                                      _mm512_mul_ps(f, _mm512_set1_ps(sq[hb + k]))));
            }
        }
}

/* AVX2: |q| (unsigned) times sign(m, q) with vpmaddubsw (pairs <= 2 * 127^2,
 * no saturation), pairs summed by vpmaddwd. */
__attribute__((target("avx2")))
static void i8_logits_avx2(const int8_t *P, const float *sm, int64_t C, int64_t H, int64_t d,
                           const uint32_t *qw, const float *sq, int64_t Hq, int64_t g0,
                           int64_t g1, float *lg, int64_t ldc)
{
    int64_t G = Hq / H, nblk = (C + 15) / 16, Cp = nblk * 16, D4 = d / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = g0; g < g1; g++)
        for (int64_t h0 = 0; h0 < G; h0 += 8) {
            int64_t nh = G - h0 < 8 ? G - h0 : 8, hb = g * G + h0;
            for (int64_t b = 0; b < nblk; b++)
                for (int half = 0; half < 2; half++) {
                    int64_t r0 = b * 16 + half * 8, nr = C - r0 < 8 ? C - r0 : 8;
                    if (nr <= 0)
                        continue;
                    const int8_t *p = P + (g * nblk + b) * D4 * 64 + half * 32;
                    __m256i acc[8];
                    for (int k = 0; k < 8; k++)
                        acc[k] = _mm256_setzero_si256();
                    for (int64_t j4 = 0; j4 < D4; j4++) {
                        __m256i x = _mm256_loadu_si256((const __m256i *)(p + j4 * 64));
#pragma GCC unroll 8
                        for (int k = 0; k < 8; k++)
                            if (k < nh) {
                                __m256i qv = _mm256_set1_epi32((int)qw[(hb + k) * D4 + j4]);
                                __m256i t = _mm256_maddubs_epi16(_mm256_abs_epi8(qv),
                                                                 _mm256_sign_epi8(x, qv));
                                acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(t, ones));
                            }
                    }
                    __m256 f = _mm256_loadu_ps(sm + g * Cp + r0);
                    for (int k = 0; k < nh; k++) {
                        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[k]),
                                                 _mm256_mul_ps(f, _mm256_set1_ps(sq[hb + k])));
                        float t[8];
                        _mm256_storeu_ps(t, v);
                        memcpy(lg + (hb - g0 * G + k) * ldc + r0, t, sizeof(float) * (size_t)nr);
                    }
                }
        }
}
#endif /* SE_X86 */

static int have_vnni(void)
{
#if SE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* The quantised query of i8_logits: q8 [Hq, d], sq [Hq], qw [Hq, d/4]. */
typedef struct {
    int8_t *q8;
    float *sq;
    uint32_t *qw;
} i8_query;

static void i8_query_free(i8_query *t)
{
    free(t->q8); free(t->sq); free(t->qw);
}

static int i8_query_make(int path, const float *q, int64_t Hq, int64_t d, i8_query *t)
{
    t->q8 = malloc((size_t)(Hq * d));
    t->sq = malloc(sizeof(float) * (size_t)Hq);
    t->qw = malloc(sizeof(uint32_t) * (size_t)(Hq * (d / 4)));
    if (!t->q8 || !t->sq || !t->qw) {
        i8_query_free(t);
        return -ENOMEM;
    }
    quant_query(q, Hq, d, t->q8, t->sq);
#if SE_X86
    if (path == SE_PATH_AVX512 || path == SE_PATH_AVX2)
        query_words(t->q8, Hq, d, path == SE_PATH_AVX512 && have_vnni(), t->qw);
#endif
    (void)path;
    return 0;
}

/* Logits of the query heads of KV heads [g0, g1) against the int8 index:
 * lg [(g1 - g0) * Hq / H rows of stride ldc >= C], on the given path (AVX-512:
 * VNNI where the CPU has it, else the AVX2 kernel). */
static void i8_logits(int path, const int8_t *P, const float *sm, const int32_t *ms, int64_t C,
                      int64_t H, int64_t d, const i8_query *t, int64_t Hq, int64_t g0,
                      int64_t g1, float *lg, int64_t ldc)
{
#if SE_X86
    if (path == SE_PATH_AVX512 && have_vnni()) {
        i8_logits_vnni(P, sm, ms, C, H, d, t->qw, t->sq, Hq, g0, g1, lg, ldc);
        return;
    }
    if (path == SE_PATH_AVX512 || path == SE_PATH_AVX2) {
        i8_logits_avx2(P, sm, C, H, d, t->qw, t->sq, Hq, g0, g1, lg, ldc);
        return;
    }
#endif
    (void)ms;
    i8_logits_scalar(P, sm, C, H, d, t->q8, t->sq, Hq, g0, g1, lg, ldc);
}

int se_head_logits_i8(const int8_t *P, const float *sm, const int32_t *ms, int64_t C,
                      int64_t H, int64_t d, const float *q, int64_t Hq, float *lg)
{
    if (!P || !sm || !ms || !q || !lg || C < 0 || H <= 0 || d <= 0 || d % 4 || Hq <= 0 ||
        Hq % H)
        return -EINVAL;
    int path = se_kernel_path();
    i8_query t;
    if (i8_query_make(path, q, Hq, d, &t) < 0)
        return -ENOMEM;
    i8_logits(path, P, sm, ms, C, H, d, &t, Hq, 0, H, lg, C);
    i8_query_free(&t);
    return 0;
}

/* A per-thread scratch area that only grows, kept between calls (a fresh
 * malloc of these sizes is an mmap whose page faults cost more than the
 * work).  Each caller keeps its own (static __thread), so callers may nest.
 * Returns NULL when the area cannot grow. */
struct scratch {
    char *buf;
    size_t cap;
};

static char *scratch_get(struct scratch *sc, size_t need)
{
    if (need > sc->cap) {
        free(sc->buf);
        sc->buf = malloc(need);
        sc->cap = sc->buf ? need : 0;
    }
    return sc->buf;
}

/* The scores of KV heads [g0, g1): per head its G heads' logits [G, C] (in
 * L2, at work + C), then their softmax added into work[0, C) (the first head
 * of the range initialises it).  One part of se_select_i8, run by one thread. */
struct i8_part {
    const int8_t *P;
    const float *sm;
    const int32_t *ms;
    const i8_query *t;
    int64_t C, H, d, Hq, g0, g1;
    float scale;
    int path;
    float *work;
};

static void *i8_part_run(void *arg)
{
    const struct i8_part *p = arg;
    int64_t G = p->Hq / p->H;
    for (int64_t g = p->g0; g < p->g1; g++) {
        i8_logits(p->path, p->P, p->sm, p->ms, p->C, p->H, p->d, p->t, p->Hq, g, g + 1,
                  p->work + p->C, p->C);
        softmax_acc(p->path, p->work + p->C, G, p->C, p->scale, p->work, g == p->g0);
    }
    return NULL;
}

/* Per KV head: its G heads' logits [G, C] (in L2), then their softmax added
 * into the scores; the same floats as se_head_logits_i8 + se_softmax_sum.
 * nthreads 2 (and H >= 2): a second thread, started for this call and joined
 * before it returns, scores the KV heads [H/2, H) into its own area, whose
 * scores are then added to the first half's: the same floats up to the
 * order of one addition per score.  No state is shared between calls. */
int64_t se_select_i8(const int8_t *P, const float *sm, const int32_t *ms, int64_t C,
                     int64_t H, int64_t d, const float *q, int64_t Hq, float scale,
                     const int64_t *ptr, const int32_t *members, int64_t S, int64_t budget,
                     int64_t w, int nthreads, float *work, int64_t *out, int64_t *entries)
{
    if (!P || !sm || !ms || !q || !work || C < 0 || H <= 0 || d <= 0 || d % 4 || Hq <= 0 ||
        Hq % H || !(scale > 0) || nthreads < 1)
        return -EINVAL;
    int path = se_kernel_path();
    if (C > 0) {
        i8_query t;
        if (i8_query_make(path, q, Hq, d, &t) < 0)
            return -ENOMEM;
        struct i8_part a = {P, sm, ms, &t, C, H, d, Hq, 0, H, scale, path, work};
        int64_t G = Hq / H;
        struct i8_part b = a;
        float *second = NULL;
        pthread_t th;
        int started = 0;
        if (nthreads >= 2 && H >= 2) {
            static __thread struct scratch sc;      /* the second half's scores and logits */
            second = (float *)scratch_get(&sc, sizeof(float) * (size_t)(C * (G + 1)));
            if (second) {
                a.g1 = b.g0 = H / 2;
                b.work = second;
                started = pthread_create(&th, NULL, i8_part_run, &b) == 0;
                if (!started)
                    a.g1 = H;                       /* no thread: this one does all */
            }
        }
        i8_part_run(&a);
        if (started) {
            pthread_join(th, NULL);
            for (int64_t i = 0; i < C; i++)
                work[i] += second[i];
        }
        i8_query_free(&t);
    }
    return se_choose_clusters(work, C, ptr, members, S, budget, w, out, entries);
}

/* score[c] += share[grp[c]] for c < C: a gather (vpgatherdd on the vector paths). */
#if SE_X86
__attribute__((target("avx512f")))
static void add_shares_avx512(float *score, const float *share, const int32_t *grp, int64_t C)
{
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m512 v = _mm512_i32gather_ps(_mm512_loadu_si512(grp + c), share, 4);
        _mm512_storeu_ps(score + c, _mm512_add_ps(_mm512_loadu_ps(score + c), v));
    }
    for (; c < C; c++)
        score[c] += share[grp[c]];
}

__attribute__((target("avx2")))
static void add_shares_avx2(float *score, const float *share, const int32_t *grp, int64_t C)
{
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
        __m256 v = _mm256_i32gather_ps(share, _mm256_loadu_si256((const __m256i *)(grp + c)), 4);
        _mm256_storeu_ps(score + c, _mm256_add_ps(_mm256_loadu_ps(score + c), v));
    }
    for (; c < C; c++)
        score[c] += share[grp[c]];
}
#endif

static void add_shares(int path, float *score, const float *share, const int32_t *grp,
                       int64_t C)
{
#if SE_X86
    if (path == SE_PATH_AVX512) {
        add_shares_avx512(score, share, grp, C);
        return;
    }
    if (path == SE_PATH_AVX2) {
        add_shares_avx2(score, share, grp, C);
        return;
    }
#endif
    for (int64_t c = 0; c < C; c++)
        score[c] += share[grp[c]];
}

/* ---- two-level int8 selection: super-centroids, then the best groups exactly ----
 * Per KV head g the medoids are grouped (k-means over that head's keys, in
 * Python); each group's rows lie in whole blocks of the reordered index P
 * (standard int8 layout, Crows rows per head; rowmed [H, Crows] names the
 * medoid of each row, -1 for padding), and its centroid is row k of the
 * super index Ps (K rows per head).  Per head: the G heads' logits against
 * the K centroids; groups ranked by max over heads of scale * (logit - max)
 * + log(members) (glogn); the best ngroups scored exactly; the others stand
 * in the softmax as one column of weight members * exp(scale * centroid
 * logit), so each head's normaliser counts every medoid, and each of the
 * group's medoids gets that column's share divided by the members.  With ngroups = K this is
 * se_select_i8's score up to summation order. */
int64_t se_select_i8x2(const int8_t *P, const float *sm, const int32_t *ms, int64_t Crows,
                       const int32_t *rowmed, const int8_t *Ps, const float *sms,
                       const int32_t *mss, int64_t K, const int32_t *gblk, const float *glogn,
                       const int32_t *mgrp, int64_t ngroups, int64_t C, int64_t H, int64_t d,
                       const float *q, int64_t Hq, float scale, const int64_t *ptr,
                       const int32_t *members, int64_t S, int64_t budget, int64_t w,
                       float *score, int64_t *out, int64_t *entries)
{
    if (!P || !sm || !ms || !rowmed || !Ps || !sms || !mss || !gblk || !glogn || !mgrp || !q ||
        !score || C < 0 || K <= 0 || Crows < 0 || Crows % 16 || H <= 0 || d <= 0 || d % 4 ||
        Hq <= 0 || Hq % H || !(scale > 0) || ngroups < 1)
        return -EINVAL;
    if (ngroups > K)
        ngroups = K;
    int path = se_kernel_path();
    int64_t G = Hq / H, D4 = d / 4, nblk = Crows / 16, Kp = (K + 15) / 16 * 16;
    for (int64_t c = 0; c < C; c++)
        score[c] = 0.f;
    if (C > 0) {
        static __thread struct scratch sc;
        size_t ncmax = (size_t)(Crows + K);
        char *scratch = scratch_get(&sc, sizeof(float) * ((size_t)G * ncmax * 2 + ncmax +
                                                          (size_t)G * Kp + 64) +
                                             sizeof(int32_t) * (ncmax + 2 * (size_t)K) + 256);
        if (!scratch)
            return -ENOMEM;
        float *Lc = (float *)(void *)scratch;               /* [G, K] */
        float *rowbuf = Lc + G * Kp;                         /* [G, ncols] */
        float *tmp = rowbuf + G * ncmax;                     /* [G, group rows] */
        float *acc = tmp + G * ncmax;                        /* [ncols] */
        int32_t *colsrc = (int32_t *)(void *)(acc + ncmax + 16);  /* row, or -(k + 1) */
        uint32_t *keys = (uint32_t *)(colsrc + ncmax);
        uint32_t *sel = keys + K;
        i8_query t;
        if (i8_query_make(path, q, Hq, d, &t) < 0)
            return -ENOMEM;
        float mx[64];
        for (int64_t g = 0; g < H; g++) {
            i8_logits(path, Ps, sms, mss, K, H, d, &t, Hq, g, g + 1, Lc, K);
            for (int64_t k = 0; k < K; k++)
                keys[k] = 0;
            for (int64_t h0 = 0; h0 < G; h0 += 64) {
                int64_t nh = G - h0 < 64 ? G - h0 : 64;
                for (int64_t h = 0; h < nh; h++) {
                    float m = -INFINITY;
                    for (int64_t k = 0; k < K; k++)
                        m = Lc[(h0 + h) * K + k] > m ? Lc[(h0 + h) * K + k] : m;
                    mx[h] = m;
                }
                for (int64_t k = 0; k < K; k++) {
                    float b = -INFINITY;
                    for (int64_t h = 0; h < nh; h++) {
                        float v = Lc[(h0 + h) * K + k] - mx[h];
                        b = v > b ? v : b;
                    }
                    uint32_t kk = desc_key(b * scale + glogn[g * K + k]);
                    if (h0 == 0 || kk < keys[k])
                        keys[k] = kk;
                }
            }
            uint32_t th = 0xffffffffu;
            if (ngroups < K) {
                memcpy(sel, keys, sizeof(uint32_t) * (size_t)K);
                th = nth_u32(sel, K, ngroups - 1);
            }
            /* columns: the chosen groups' rows, then one per other group */
            int64_t nc = 0;
            for (int64_t k = 0; k < K; k++)
                if (keys[k] <= th)
                    nc += (int64_t)(gblk[g * (K + 1) + k + 1] - gblk[g * (K + 1) + k]) * 16;
                else
                    nc++;
            int64_t col = 0;
            i8_query tg = {t.q8 + g * G * d, t.sq + g * G, t.qw + g * G * D4};
            for (int64_t k = 0; k < K; k++) {
                int64_t b0 = gblk[g * (K + 1) + k], b1 = gblk[g * (K + 1) + k + 1];
                if (keys[k] <= th) {
                    int64_t nr = (b1 - b0) * 16;
                    if (nr == 0)
                        continue;
                    const int64_t base = g * nblk + b0;
                    i8_logits(path, P + base * D4 * 64, sm + g * Crows + b0 * 16,
                              ms + g * Crows + b0 * 16, nr, 1, d, &tg, G, 0, 1, rowbuf + col,
                              nc);
                    for (int64_t r = 0; r < nr; r++) {
                        int32_t rr = (int32_t)(b0 * 16 + r);
                        colsrc[col + r] = rr;
                        if (rowmed[g * Crows + rr] < 0)
                            for (int64_t h = 0; h < G; h++)
                                rowbuf[h * nc + col + r] = -1e30f;
                    }
                    col += nr;
                } else {
                    for (int64_t h = 0; h < G; h++)
                        rowbuf[h * nc + col] = Lc[h * K + k] + glogn[g * K + k] / scale;
                    colsrc[col] = -(int32_t)(k + 1);
                    col++;
                }
            }
            softmax_acc(path, rowbuf, G, nc, scale, acc, 1);
            float *share = tmp;                      /* [K] a skipped group's share, per medoid */
            for (int64_t k = 0; k < K; k++)
                share[k] = 0.f;
            for (int64_t c = 0; c < nc; c++) {
                int32_t s = colsrc[c];
                if (s >= 0) {
                    int32_t md = rowmed[g * Crows + s];
                    if (md >= 0)
                        score[md] += acc[c];
                } else {
                    int64_t k = -(int64_t)s - 1;
                    share[k] = acc[c] * expf(-glogn[g * K + k]);
                }
            }
            add_shares(path, score, share, mgrp + g * C, C);
        }
        i8_query_free(&t);
    }
    if (!ptr)
        return 0;                      /* scores only */
    return se_choose_clusters(score, C, ptr, members, S, budget, w, out, entries);
}

/* ---- the read planner (SWARM 6.1, eq. 8) ------------------------------------------ */

typedef struct {
    uint64_t key;
    int64_t idx;
} kv_rec;

/* Stable LSD radix sort of records by key, 11-bit digits up to `bits`
 * bits, skipping digits that are equal in every key; tmp: scratch of n.
 * Used only when a (disk, offset) key does not fit 32 bits. */
static kv_rec *radix_sort_rec(kv_rec *a, kv_rec *tmp, int64_t n, int bits)
{
    size_t cnt[2048];
    for (int shift = 0; shift < bits; shift += 11) {
        memset(cnt, 0, sizeof cnt);
        for (int64_t i = 0; i < n; i++)
            cnt[(a[i].key >> shift) & 2047]++;
        if (n && cnt[(a[0].key >> shift) & 2047] == (size_t)n)
            continue;
        size_t sum = 0;
        for (int b = 0; b < 2048; b++) {
            size_t c = cnt[b];
            cnt[b] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++)
            tmp[cnt[(a[i].key >> shift) & 2047]++] = a[i];
        kv_rec *t = a;
        a = tmp;
        tmp = t;
    }
    return a;
}

static inline int bit_length(uint64_t x)
{
    return x ? 64 - __builtin_clzll(x) : 0;
}

/* Stable LSD radix sort of 64-bit values by their bits [32, 32 + nbits)
 * (nbits <= 32; the low 32 bits ride along), in as few equal digits of at
 * most 11 bits as cover nbits, all digit histograms counted in one pass and
 * digits equal in every value skipped.  n < 2**32.  Returns the buffer that
 * holds the result (a or tmp). */
static uint64_t *radix_sort_hi32(uint64_t *a, uint64_t *tmp, int64_t n, int nbits)
{
    if (n < 2 || nbits <= 0)
        return a;
    int p = (nbits + 10) / 11, w = (nbits + p - 1) / p;
    uint32_t mask = (1u << w) - 1;
    uint32_t cnt[3][2048];
    memset(cnt, 0, sizeof(cnt[0]) * (size_t)p);
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)(a[i] >> 32);
        for (int k = 0; k < p; k++)
            cnt[k][(v >> (k * w)) & mask]++;
    }
    for (int k = 0; k < p; k++) {
        int sh = 32 + k * w;
        uint32_t *c = cnt[k];
        if (c[(a[0] >> sh) & mask] == (uint32_t)n)
            continue;
        uint32_t sum = 0;
        for (uint32_t b = 0; b <= mask; b++) {
            uint32_t x = c[b];
            c[b] = sum;
            sum += x;
        }
        for (int64_t i = 0; i < n; i++)
            tmp[c[(a[i] >> sh) & mask]++] = a[i];
        uint64_t *t = a;
        a = tmp;
        tmp = t;
    }
    return a;
}

/* The coalescing state (coalesce_add) and an entry's place in its request. */
typedef struct {
    uint64_t E, reach, chunk, bmask;      /* reach: E + max_gap; chunk: max_request */
    int64_t q;                            /* the last request (-1: none yet) */
    uint64_t pd, po;                      /* the previous entry */
    uint64_t run_base, chunk_hi;          /* its run, the end of its chunk */
    uint64_t cs, ce, cd;                  /* the last request's start, end, disk */
    int32_t *rd;                          /* per request: disk, */
    uint64_t *rs, *re;                    /* aligned start and end */
} coalescer;

typedef struct {
    uint64_t rel, q;                      /* offset in the request, request */
} eplace;

/* Step 4 of the planner, one entry at a time in (disk, offset) order: runs
 * of entries whose gap is at most max_gap, split at max_request from the
 * run's start, aligned to blocks, merged where aligned ranges overlap.  The
 * entry's offset within its request and the request go to at[j] (j: the
 * entry's place in the sorted order, or its index in the plan); the
 * request's staging offset is added once all are known.  `simple`: no
 * aligned ranges can overlap (entries and E block aligned, no two entries
 * within E of each other; plan_body checks), so no merges and no alignment.
 * Whether an entry starts a request follows the data, which no branch
 * predictor learns: the state is updated through masks, without branches
 * but for leaving a max_request chunk (rare).  Offsets ascend within a run,
 * so an entry leaves its chunk iff o >= chunk_hi. */
static inline __attribute__((always_inline))
void coalesce_add(coalescer *c, uint64_t d, uint64_t o, int64_t j, eplace *at, int simple)
{
    uint64_t newrun = (d != c->pd) | (o > c->po + c->reach);
    uint64_t m = -newrun;                /* all ones on a new run */
    c->run_base = (o & m) | (c->run_base & ~m);  /* chunk 0 of a run: [o, o + chunk) */
    c->chunk_hi = ((o + c->chunk) & m) | (c->chunk_hi & ~m);
    uint64_t newreq = newrun;
    if (__builtin_expect(o >= c->chunk_hi, 0)) {
        uint64_t ch = (o - c->run_base) / c->chunk;
        c->chunk_hi = c->run_base + (ch + 1) * c->chunk;
        newreq = 1;
    }
    uint64_t a0 = o, a1 = o + c->E;
    if (!simple) {
        a0 = o & c->bmask;
        a1 = (o + c->E + ~c->bmask) & c->bmask;
        /* aligned ranges overlap: one request */
        newreq &= ~((uint64_t)(c->cd == d) & (uint64_t)(a0 < c->ce));
    }
    uint64_t mq = -newreq;
    c->cs = (a0 & mq) | (c->cs & ~mq);
    if (simple) {
        c->ce = a1;
    } else {
        uint64_t ce = c->ce & ~mq;
        c->ce = a1 > ce ? a1 : ce;
        c->cd = d;
    }
    int64_t q = c->q + (int64_t)newreq;
    c->q = q;
    c->rs[q] = c->cs;
    c->re[q] = c->ce;
    c->rd[q] = (int32_t)d;
    c->pd = d;
    c->po = o;
    at[j].rel = o - c->cs;
    at[j].q = (uint64_t)q;
}

/* Step 0 of the planner: the largest token, disk and offset, the smallest
 * offset, and the OR of every offset XOR the first (its trailing zeros: the
 * offsets' common ones relative to any of them). */
typedef struct {
    uint64_t tmax, omin, omax, ozor;
    uint32_t dmax;
} plan_ranges;

static plan_ranges ranges_scalar(int64_t m, const int64_t *tok, const int32_t *cdisk,
                                 const uint64_t *coff, int64_t i0, plan_ranges r)
{
    uint64_t o0 = coff[0];
    for (int64_t i = i0; i < m; i++) {
        uint64_t t = (uint64_t)tok[i], o = coff[i];
        uint32_t d = (uint32_t)cdisk[i];
        r.tmax = t > r.tmax ? t : r.tmax;
        r.dmax = d > r.dmax ? d : r.dmax;
        r.omin = o < r.omin ? o : r.omin;
        r.omax = o > r.omax ? o : r.omax;
        r.ozor |= o ^ o0;
    }
    return r;
}

#if SE_X86
/* the same, 16 candidates a step (a third of the scalar loop's time) */
__attribute__((target("avx512f")))
static plan_ranges ranges_avx512(int64_t m, const int64_t *tok, const int32_t *cdisk,
                                 const uint64_t *coff, plan_ranges r)
{
    __m512i t = _mm512_setzero_si512(), d = t, omax = t, ozor = t;
    __m512i omin = _mm512_set1_epi64(-1), o0 = _mm512_set1_epi64((long long)coff[0]);
    int64_t i = 0;
    for (; i + 16 <= m; i += 16) {
        __m512i a = _mm512_loadu_si512(coff + i), b = _mm512_loadu_si512(coff + i + 8);
        t = _mm512_max_epu64(t, _mm512_max_epu64(_mm512_loadu_si512(tok + i),
                                                  _mm512_loadu_si512(tok + i + 8)));
        d = _mm512_max_epu32(d, _mm512_loadu_si512(cdisk + i));
        omin = _mm512_min_epu64(omin, _mm512_min_epu64(a, b));
        omax = _mm512_max_epu64(omax, _mm512_max_epu64(a, b));
        ozor = _mm512_or_si512(ozor, _mm512_or_si512(_mm512_xor_si512(a, o0),
                                                     _mm512_xor_si512(b, o0)));
    }
    r.tmax = _mm512_reduce_max_epu64(t);
    r.dmax = _mm512_reduce_max_epu32(d);
    r.omin = _mm512_reduce_min_epu64(omin);
    r.omax = _mm512_reduce_max_epu64(omax);
    r.ozor = (uint64_t)_mm512_reduce_or_epi64(ozor);
    return ranges_scalar(m, tok, cdisk, coff, i, r);
}
#endif

/* One word of the token bitmaps: 64 tokens seen, seen twice, and how many
 * tokens (seen, seen twice) lie below the word; together, so that a rank
 * costs one cache line. */
typedef struct {
    uint64_t seen, dup;
    uint32_t below, dbelow;
} tword;

/* Step 2 of the token-bitmap path (see plan_body), one pass over the
 * candidates in their order.  Entry u of token t is its rank (the tokens
 * below it).  A single-copy token takes its copy, its bucket (load) and,
 * with `keyed`, its bit in the key bitmap kb (key d << ob | (o - omin) >>
 * tz): pk[u] = key << 32 | candidate; multi-copy token v (its rank among
 * those) has its candidates listed as (v << 32 | candidate).  No branch on
 * the kind (the candidates come in no order a predictor learns): what is
 * meant for the other kind adds zero or is overwritten (the list's next
 * slot; pk[u] of a multi-copy token, set again by the bucket choice).  Few
 * stores: one that misses L1 holds up the ones behind it.  A key set twice
 * (two chosen entries at one place) is flagged in *coll.  Returns the
 * list's length. */
static inline __attribute__((always_inline))
int64_t rank_pass(int64_t m, const int64_t *tok, const int32_t *cdisk, const uint64_t *coff,
                  const tword *tw, uint64_t *pk, int64_t *load, uint64_t *mlist, int keyed,
                  uint64_t *kb, int ob, int tz, uint64_t omin, uint64_t *coll)
{
    int64_t nm = 0;
    uint64_t cl = 0;
    for (int64_t i = 0; i < m; i++) {
        uint64_t t = (uint64_t)tok[i], w = t >> 6, below = ((uint64_t)1 << (t & 63)) - 1;
        uint64_t sw = tw[w].seen, dw = tw[w].dup;
        uint32_t u = tw[w].below + (uint32_t)__builtin_popcountll(sw & below);
        uint32_t v = tw[w].dbelow + (uint32_t)__builtin_popcountll(dw & below);
        uint32_t multi = (uint32_t)(dw >> (t & 63)) & 1, single = multi ^ 1;
        mlist[nm] = ((uint64_t)v << 32) | (uint64_t)i;
        nm += multi;
        int32_t d = cdisk[i];
        load[d] += single;
        uint64_t k = 0;
        if (keyed) {
            k = ((uint64_t)d << ob) | ((coff[i] - omin) >> tz);
            uint64_t bit = (uint64_t)single << (k & 63), old = kb[k >> 6];
            kb[k >> 6] = old | bit;
            cl |= old & bit;
        }
        pk[u] = (k << 32) | (uint64_t)i;
    }
    *coll |= cl;
    return nm;
}

/* Key k's bit in the key bitmap (as in rank_pass); nonzero if set already. */
static inline __attribute__((always_inline))
uint64_t key_set(uint64_t *kb, uint64_t k)
{
    uint64_t b = (uint64_t)1 << (k & 63), old = kb[k >> 6];
    kb[k >> 6] = old | b;
    return old & b;
}

/* Step 4 a run at a time, when no aligned ranges can overlap (as
 * `simple` in coalesce_add) and two entries share a run iff their keys are
 * adjacent (`adjacent`: E + max_gap >> tz == 1) or never (== 0).  Per word
 * of the key bitmap, bit operations give the keys that start a run (no set
 * key before them, or the first key of a disk) and those that end one; the
 * starts and ends pair up in order, and each run makes one request [its
 * first offset, its last + E) unless it is longer than a chunk.  Each
 * request's first key is marked in qb, whose rank then names an entry's
 * request.  Returns the number of requests. */
static inline __attribute__((always_inline))
void run_request(uint64_t s, uint64_t e, int ob, int tz, uint64_t omin, uint64_t E,
                 uint64_t chunk, uint64_t *qb, int32_t *rd, uint64_t *rs, uint64_t *re,
                 int64_t *q)
{
    /* entries s + j, j < L, at offsets o(s) + (j << tz); entry j in chunk
     * (j << tz) / chunk (a division only for a run that needs it) */
    uint64_t omask = ((uint64_t)1 << ob) - 1, L = e - s + 1;
    for (uint64_t j = 0, j2; j < L; j = j2) {
        j2 = L;
        if (__builtin_expect(((L - 1) << tz) >= chunk, 0)) {
            uint64_t ch = (j << tz) / chunk;   /* first entry of the next chunk: */
            uint64_t nx = (((ch + 1) * chunk) + ((uint64_t)1 << tz) - 1) >> tz;
            j2 = nx < L ? nx : L;
            qb[(s + j) >> 6] |= (uint64_t)1 << ((s + j) & 63);
        }
        rd[*q] = (int32_t)(s >> ob);
        rs[*q] = omin + (((s + j) & omask) << tz);
        re[*q] = omin + (((s + j2 - 1) & omask) << tz) + E;
        ++*q;
    }
}

static inline __attribute__((always_inline))
int64_t coalesce_runs(const uint64_t *kb, int64_t kwords, int ob, int tz, uint64_t omin,
                      uint64_t E, uint64_t chunk, int adjacent, uint64_t *qb, int32_t *rd,
                      uint64_t *rs, uint64_t *re)
{
    uint64_t omask = ((uint64_t)1 << ob) - 1;
    /* a disk's first and last keys within a word, when disks are < 64 keys */
    uint64_t first = 0;
    for (int j = 0; ob < 6 && j < 64; j += 1 << ob)
        first |= (uint64_t)1 << j;
    uint64_t last = ob < 6 ? first << (((uint64_t)1 << ob) - 1) : 0;
    int64_t q = 0;
    uint64_t open = 0, s0 = 0;             /* a run open from an earlier word */
    memset(qb, 0, sizeof(uint64_t) * (size_t)kwords);
    for (int64_t w = 0; w < kwords; w++) {
        uint64_t b = kb[w], st = b, en = b;
        if (adjacent) {
            uint64_t base = (uint64_t)w << 6, df = first, dl = last;
            if (ob >= 6) {
                df = (base & omask) == 0;                          /* bit 0 */
                dl = ((base | 63) & omask) == omask ? (uint64_t)1 << 63 : 0;
            }
            uint64_t before = (b << 1) | (w > 0 ? kb[w - 1] >> 63 : 0);
            uint64_t after = (b >> 1) | (w + 1 < kwords ? kb[w + 1] << 63 : 0);
            st = (b & ~before) | (b & df);
            en = (b & ~after) | (b & dl);
        }
        qb[w] |= st;
        if (open && en) {                  /* the open run ends here */
            run_request(s0, ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(en), ob, tz, omin,
                        E, chunk, qb, rd, rs, re, &q);
            en &= en - 1;
            open = 0;
        }
        for (; st; st &= st - 1) {
            uint64_t s = ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(st);
            if (!en) {                     /* (the word's last start) */
                open = 1;
                s0 = s;
                break;
            }
            run_request(s, ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(en), ob, tz, omin, E,
                        chunk, qb, rd, rs, re, &q);
            en &= en - 1;
        }
    }
    return q;
}

/* The planner (se_plan_reads, after its argument checks).  Two ways through
 * each of its two orderings, chosen by the spans of the values:
 *
 *   Dedup with token ids below 64 per candidate: a bitmap of the tokens seen
 *   (and seen twice) instead of a token sort; a token's entry is its rank,
 *   the tokens below it (prefix popcounts), so single-copy tokens take their
 *   copy in one pass over the candidates in their order; only multi-copy
 *   tokens are grouped (a counting sort by their rank among those) for the
 *   bucket choice.  Else a radix sort of (token, candidate).
 *
 *   (disk, offset) keys (offsets relative to the candidates' smallest,
 *   without their common trailing zero bits, below the disk bits) below 16
 *   per candidate + 2**16: a bitmap with one bit per key, set as entries are
 *   chosen and read in bit order to coalesce; an entry finds its place in
 *   that order by its key's rank.  Else (or if two entries share a key) a
 *   radix sort of the chosen entries' keys.
 *
 * The random-access writes are few: chosen[u] (once per candidate), and
 * the small bitmaps; the rest is written in order.  Same results every way
 * (tests/test_planner.py checks each path against the numpy specification). */
/* The planner's parameters and arguments, shared by its body and the
 * builds that wrap it (engine.h: se_plan_reads). */
#define PLAN_PARAMS                                                                       \
    int64_t m, const int64_t *tok, const int32_t *cdisk, const uint64_t *coff, int ndisks, \
    uint64_t E, uint64_t bs, uint64_t max_gap, uint64_t max_request, int balanced,          \
    int dedup, int64_t *utok, int64_t *chosen, uint64_t *src, int64_t *n_entries,          \
    int32_t *rdisk, uint64_t *roff, uint32_t *rlen, uint64_t *rdst, uint64_t *staging,      \
    int64_t *disk_entries, int64_t *disk_bytes
#define PLAN_ARGS                                                                         \
    m, tok, cdisk, coff, ndisks, E, bs, max_gap, max_request, balanced, dedup, utok,      \
    chosen, src, n_entries, rdisk, roff, rlen, rdst, staging, disk_entries, disk_bytes

static inline __attribute__((always_inline))
int64_t plan_body(PLAN_PARAMS)
{
    /* 0. the arguments' ranges, and the spans that choose the paths */
    plan_ranges rg = {0, ~(uint64_t)0, 0, 0, 0};
#if SE_X86
    if (se_kernel_path() == SE_PATH_AVX512)
        rg = ranges_avx512(m, tok, cdisk, coff, rg);
    else
#endif
        rg = ranges_scalar(m, tok, cdisk, coff, 0, rg);
    uint64_t tmax = rg.tmax, omin = rg.omin, omax = rg.omax, ozor = rg.ozor;
    uint32_t dmax = rg.dmax;              /* o - omin: multiples of 2**ctz(ozor) */
    if (tmax >= ((uint64_t)1 << 31))
        return -EDOM;                         /* a token outside [0, 2**31) */
    if (dmax >= (uint32_t)ndisks)
        return -ERANGE;                       /* a disk outside [0, ndisks) */
    if (omax >= ((uint64_t)1 << 52))
        return -EOVERFLOW;                    /* an offset at or beyond 2**52 */
    int tz = ozor ? __builtin_ctzll(ozor) : 0;
    int ob = bit_length((omax - omin) >> tz);
    int64_t twords = (int64_t)(tmax >> 6) + 1, kwords = 0;
    size_t words = dedup && twords <= m ? (size_t)twords : 0;    /* token bitmap path */
    if (ob + bit_length(dmax) <= 32) {
        uint64_t kmax = ((uint64_t)dmax << ob) | ((omax - omin) >> tz);
        if (kmax < 16 * (uint64_t)m + 65536)
            kwords = (int64_t)(kmax >> 6) + 1;                   /* key bitmap path */
    }

    static __thread struct scratch sc;     /* the planner's own (scratch_get) */
    char *scratch = scratch_get(&sc, (size_t)m * (8 * 15 + 4 * 5) + 32 + (size_t)ndisks * 24 +
                                         words * 24 + (size_t)kwords * 20 + 256);
    if (!scratch)
        return -ENOMEM;
    char *sp = scratch;
#define TAKE(T, cnt) ((T *)(void *)(sp += ((sizeof(T) * (size_t)(cnt) + 7) & ~(size_t)7), \
                                    sp - ((sizeof(T) * (size_t)(cnt) + 7) & ~(size_t)7)))
    int64_t *load = TAKE(int64_t, ndisks);
    int64_t *first = TAKE(int64_t, ndisks + 1);
    int64_t *nreq_d = TAKE(int64_t, ndisks);
    memset(load, 0, sizeof(int64_t) * (size_t)(3 * ndisks + 1));
    uint64_t *key = TAKE(uint64_t, m);
    uint64_t *tmp = TAKE(uint64_t, m);
    int64_t *ustart = TAKE(int64_t, m + 1);
    int64_t *order = TAKE(int64_t, m);
    uint64_t *go = TAKE(uint64_t, m);                 /* offset of entry i's copy */
    kv_rec *recs = TAKE(kv_rec, m);
    kv_rec *rtmp = TAKE(kv_rec, m);
    uint64_t *rs = TAKE(uint64_t, m);                 /* per request (at most n) */
    uint64_t *re = TAKE(uint64_t, m);
    uint64_t *qdst = TAKE(uint64_t, m);               /* staging offset of request q */
    eplace *at = TAKE(eplace, m);                     /* an entry's place in its request */
    uint64_t *pk = TAKE(uint64_t, m);                 /* entry u: key << 32 | candidate */
    int32_t *rd = TAKE(int32_t, m);
    int32_t *ed = TAKE(int32_t, m);                   /* disk of entry i */
    uint32_t *mcnt = TAKE(uint32_t, m + 1);           /* multi-copy tokens */
    uint32_t *mstart = TAKE(uint32_t, m + 1);
    uint32_t *mc = TAKE(uint32_t, m);
    tword *tw = TAKE(tword, words);                   /* token bitmaps */
    uint64_t *kb = TAKE(uint64_t, kwords);            /* key bitmap */
    uint32_t *kp = TAKE(uint32_t, kwords);            /* keys (requests) below word w */
    uint64_t *qb = TAKE(uint64_t, kwords);            /* requests' first keys */
#undef TAKE
    if (kwords)
        memset(kb, 0, sizeof(uint64_t) * (size_t)kwords);
    uint64_t coll = 0;                     /* two chosen entries at one key */
    int keyed = 0;                         /* kb holds every chosen entry */

    int64_t n = 0;
    if (words) {
        /* 1. dedup (eq. 8): the tokens seen, and seen twice */
        memset(tw, 0, sizeof(tword) * words);
        for (int64_t i = 0; i < m; i++) {
            uint64_t t = (uint64_t)tok[i], b = (uint64_t)1 << (t & 63);
            tw[t >> 6].dup |= tw[t >> 6].seen & b;
            tw[t >> 6].seen |= b;
        }
        uint32_t U = 0, M = 0;
        for (size_t w = 0; w < words; w++) {
            tw[w].below = U;
            tw[w].dbelow = M;
            U += (uint32_t)__builtin_popcountll(tw[w].seen);
            M += (uint32_t)__builtin_popcountll(tw[w].dup);
        }
        /* 2. single-copy tokens: their copy and bucket (6.1); multi-copy
         * tokens listed */
        memset(mcnt, 0, sizeof(uint32_t) * ((size_t)M + 1));
        uint64_t *mlist = tmp;
        int64_t nm = kwords ? rank_pass(m, tok, cdisk, coff, tw, pk, load, mlist, 1, kb, ob, tz,
                                        omin, &coll)
                            : rank_pass(m, tok, cdisk, coff, tw, pk, load, mlist, 0, NULL, 0, 0,
                                        0, &coll);
        for (int64_t k = 0; k < nm; k++)
            mcnt[mlist[k] >> 32]++;
        /* candidates of multi-copy token v: mc[mstart[v], mstart[v + 1]),
         * in candidate order */
        uint32_t sum = 0, minc = ~0u, maxc = 0;
        for (uint32_t v = 0; v < M; v++) {
            uint32_t c = mcnt[v];
            minc = c < minc ? c : minc;
            maxc = c > maxc ? c : maxc;
            mstart[v] = mcnt[v] = sum;
            sum += c;
        }
        mstart[M] = sum;
        for (int64_t k = 0; k < nm; k++)
            mc[mcnt[mlist[k] >> 32]++] = (uint32_t)mlist[k];
        /* multi-copy tokens in ascending copy count (stable), each to the
         * smallest bucket among its copies, the first copy on a tie; or
         * (policy "first") to its first copy */
        uint32_t *byc = NULL;
        if (balanced && M && minc != maxc) {
            uint32_t *cc = calloc((size_t)maxc + 2, sizeof(uint32_t));
            if (!cc)
                return -ENOMEM;
            byc = (uint32_t *)(void *)key;
            for (uint32_t v = 0; v < M; v++)
                cc[mstart[v + 1] - mstart[v] + 1]++;
            for (uint32_t c = 1; c <= maxc + 1; c++)
                cc[c] += cc[c - 1];
            for (uint32_t v = 0; v < M; v++)
                byc[cc[mstart[v + 1] - mstart[v]]++] = v;
            free(cc);
        }
        for (uint32_t k = 0; k < M; k++) {
            uint32_t v = byc ? byc[k] : k;
            int64_t best = mc[mstart[v]];
            uint64_t t = (uint64_t)tok[best], w = t >> 6;
            uint64_t below = ((uint64_t)1 << (t & 63)) - 1;
            uint32_t u = tw[w].below + (uint32_t)__builtin_popcountll(tw[w].seen & below);
            if (balanced) {
                int64_t bl = load[cdisk[best]];
                for (uint32_t j = mstart[v] + 1; j < mstart[v + 1]; j++) {
                    int64_t c = mc[j];
                    if (load[cdisk[c]] < bl) {
                        bl = load[cdisk[c]];
                        best = c;
                    }
                }
            }
            load[cdisk[best]]++;                 /* (policy "first": a count only) */
            uint64_t kk = 0;
            if (kwords) {
                kk = ((uint64_t)cdisk[best] << ob) | ((coff[best] - omin) >> tz);
                coll |= key_set(kb, kk);
            }
            pk[u] = (kk << 32) | (uint64_t)best;
        }
        for (int d = 0; d < ndisks; d++)
            disk_entries[d] = load[d];
        if (!kwords || coll)
            for (uint32_t u = 0; u < U; u++)
                chosen[u] = (int64_t)(pk[u] & 0xffffffffu);
        n = U;
        keyed = kwords != 0;
    } else {
        /* 1. candidates by token (stable: candidate order within a token), as
         * (token << 32 | candidate) values sorted on the token's bits only */
        for (int64_t i = 0; i < m; i++)
            key[i] = ((uint64_t)tok[i] << 32) | (uint64_t)i;
        uint64_t *sk = radix_sort_hi32(key, tmp, m, bit_length(tmax));
        if (!dedup) {
            for (int64_t i = 0; i < m; i++)
                chosen[i] = (int64_t)(sk[i] & 0xffffffffu);
            n = m;
        } else {
            /* 2. dedup (eq. 8) and entry buckets (6.1) */
            int64_t U = 0, multi = 0, maxc = 1;
            uint64_t prev = sk[0] >> 32;
            int64_t start = 0;
            for (int64_t i = 0; i <= m; i++) {
                uint64_t t = i < m ? sk[i] >> 32 : ~(uint64_t)0;
                if (i < m)
                    order[i] = (int64_t)(sk[i] & 0xffffffffu);
                if (i > 0 && t == prev)
                    continue;
                if (i > 0) {                     /* token prev: candidates [start, i) */
                    int64_t c = i - start;
                    ustart[U] = start;
                    chosen[U] = order[start];
                    if (c == 1)
                        load[cdisk[order[start]]]++;
                    else {
                        multi++;
                        if (c > maxc)
                            maxc = c;
                    }
                    U++;
                }
                start = i;
                prev = t;
            }
            ustart[U] = m;
            if (balanced && multi) {
                /* multi-copy entries in ascending copy count (stable), each to the
                 * smallest bucket among its copies, the first copy on a tie */
                int64_t *cc = calloc((size_t)maxc + 2, sizeof(int64_t));
                if (!cc)
                    return -ENOMEM;
                int64_t *byc = (int64_t *)(void *)tmp;
                for (int64_t u = 0; u < U; u++) {
                    int64_t c = ustart[u + 1] - ustart[u];
                    if (c > 1)
                        cc[c + 1]++;
                }
                for (int64_t c = 1; c <= maxc + 1; c++)
                    cc[c] += cc[c - 1];
                for (int64_t u = 0; u < U; u++) {
                    int64_t c = ustart[u + 1] - ustart[u];
                    if (c > 1)
                        byc[cc[c]++] = u;
                }
                free(cc);
                for (int64_t k = 0; k < multi; k++) {
                    int64_t u = byc[k], best = order[ustart[u]];
                    int64_t bl = load[cdisk[best]];
                    for (int64_t i = ustart[u] + 1; i < ustart[u + 1]; i++) {
                        int64_t c = order[i];
                        if (load[cdisk[c]] < bl) {
                            bl = load[cdisk[c]];
                            best = c;
                        }
                    }
                    load[cdisk[best]]++;
                    chosen[u] = best;
                }
            }
            n = U;
        }
    }
    *n_entries = n;

    /* 3. the entries in (disk, offset) order: the key bitmap when the keys
     * fit it (filled above on the token-bitmap path) */
    if (kwords && !keyed) {
        for (int64_t u = 0; u < n; u++) {
            int64_t c = chosen[u];
            uint64_t k = ((uint64_t)cdisk[c] << ob) | ((coff[c] - omin) >> tz);
            coll |= key_set(kb, k);
            disk_entries[cdisk[c]]++;
            pk[u] = (k << 32) | (uint64_t)c;
        }
        keyed = 1;
    }
    keyed = keyed && !coll;
    /* (no max_request: one chunk of 2**62 bytes, past every offset) */
    uint64_t chunk = max_request == 0 ? (uint64_t)1 << 62 : max_request > E ? max_request : E;
    coalescer cs = {E, E + max_gap, chunk, ~(bs - 1), -1, ~(uint64_t)0, 0, 0, 0, 0, 0,
                    ~(uint64_t)0, rd, rs, re};
    /* no aligned ranges overlap: entries and E in whole blocks, and entries
     * (distinct keys: at least 2**tz apart) at least E apart; and two
     * entries share a run iff their keys are adjacent, or never */
    uint64_t omask = ((uint64_t)1 << ob) - 1, g = (E + max_gap) >> tz;
    int simple = !((omin | ozor | E) & (bs - 1)) && (!ozor || E <= (uint64_t)1 << tz);
    int runs = keyed && simple && g <= 1;
    int64_t R = 0;
    if (runs) {
        /* 4. requests, a run of the key bitmap at a time */
        R = coalesce_runs(kb, kwords, ob, tz, omin, E, chunk, g == 1, qb, rd, rs, re);
    } else if (keyed) {
        /* 4. requests, reading the key bitmap in bit order: at[p] by the
         * entry's place p in that order (kp: the keys below each word) */
        int64_t p = 0;
        if (simple)
            for (int64_t w = 0; w < kwords; w++) {
                kp[w] = (uint32_t)p;
                for (uint64_t b = kb[w]; b; b &= b - 1) {
                    uint64_t k = ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(b);
                    coalesce_add(&cs, k >> ob, omin + ((k & omask) << tz), p++, at, 1);
                }
            }
        else
            for (int64_t w = 0; w < kwords; w++) {
                kp[w] = (uint32_t)p;
                for (uint64_t b = kb[w]; b; b &= b - 1) {
                    uint64_t k = ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(b);
                    coalesce_add(&cs, k >> ob, omin + ((k & omask) << tz), p++, at, 0);
                }
            }
    } else {
        /* else a radix sort: the chosen offsets relative to the smallest,
         * without their common trailing zero bits, below the disk bits, as
         * one 32-bit key when they fit; else 64-bit (disk << 52 | offset)
         * records */
        for (int d = 0; d < ndisks; d++)
            disk_entries[d] = 0;
        uint64_t cmin = ~(uint64_t)0, cmax = 0, czor = 0, c0 = coff[chosen[0]];
        for (int64_t i = 0; i < n; i++) {
            int64_t c = chosen[i];
            uint64_t o = coff[c];
            int32_t d = cdisk[c];
            ed[i] = d;
            go[i] = o;
            disk_entries[d]++;
            cmin = o < cmin ? o : cmin;
            cmax = o > cmax ? o : cmax;
            czor |= o ^ c0;
        }
        int ctz = czor ? __builtin_ctzll(czor) : 0;
        int cb = bit_length((cmax - cmin) >> ctz), db = bit_length((uint64_t)(ndisks - 1));
        if (cb + db <= 32) {
            for (int64_t i = 0; i < n; i++)
                key[i] = ((((uint64_t)ed[i] << cb) | ((go[i] - cmin) >> ctz)) << 32) |
                         (uint64_t)i;
            uint64_t *s3 = radix_sort_hi32(key, tmp, n, cb + db);
            for (int64_t j = 0; j < n; j++) {
                uint64_t v = s3[j], k = v >> 32;
                order[j] = (int64_t)(v & 0xffffffffu);
                key[j] = ((k >> cb) << 52) | (cmin + ((k & ((((uint64_t)1) << cb) - 1)) << ctz));
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                recs[i].key = ((uint64_t)ed[i] << 52) | go[i];
                recs[i].idx = i;
            }
            kv_rec *sr = radix_sort_rec(recs, rtmp, n, 66);
            for (int64_t i = 0; i < n; i++) {
                order[i] = sr[i].idx;
                key[i] = sr[i].key;
            }
        }
        /* 4. requests, in the sorted order: at[u] by entry */
        for (int64_t j = 0; j < n; j++)
            coalesce_add(&cs, key[j] >> 52, key[j] & (((uint64_t)1 << 52) - 1), order[j], at, 0);
    }
    if (!runs)
        R = cs.q + 1;

    /* 5. submission order: round robin over the disks, request r of each in turn */
    for (int64_t r = 0; r < R; r++)
        nreq_d[rd[r]]++;
    int64_t maxr = 0;
    for (int d = 0; d < ndisks; d++) {
        first[d + 1] = first[d] + nreq_d[d];
        if (nreq_d[d] > maxr)
            maxr = nreq_d[d];
    }
    int64_t kq = 0;
    uint64_t dst = 0;
    for (int64_t r = 0; r < maxr; r++)
        for (int d = 0; d < ndisks; d++)
            if (r < nreq_d[d]) {
                int64_t q = first[d] + r;
                uint64_t len = re[q] - rs[q];
                qdst[q] = dst;
                rdisk[kq] = rd[q];
                roff[kq] = rs[q];
                rlen[kq] = (uint32_t)len;
                rdst[kq] = dst;
                dst += len;
                disk_bytes[d] += (int64_t)len;
                kq++;
            }
    *staging = dst;

    /* 6. per entry in the plan: its token, and where it lands in the
     * staging buffer */
    if (runs) {
        /* an entry's request: the request starts at or below its key */
        uint32_t acc = 0;
        for (int64_t w = 0; w < kwords; w++) {
            kp[w] = acc;
            acc += (uint32_t)__builtin_popcountll(qb[w]);
        }
        for (int64_t u = 0; u < n; u++) {
            uint64_t c = pk[u] & 0xffffffffu, k = pk[u] >> 32, w = k >> 6;
            chosen[u] = (int64_t)c;
            utok[u] = tok[c];
            uint64_t upto = ~(uint64_t)0 >> (63 - (k & 63));    /* keys <= k */
            uint32_t q = kp[w] + (uint32_t)__builtin_popcountll(qb[w] & upto) - 1;
            src[u] = qdst[q] + (omin + ((k & omask) << tz) - rs[q]);
        }
    } else if (keyed) {
        uint64_t below_all = ~(uint64_t)0;
        for (int64_t u = 0; u < n; u++) {
            uint64_t c = pk[u] & 0xffffffffu, k = pk[u] >> 32;
            chosen[u] = (int64_t)c;
            utok[u] = tok[c];
            uint64_t w = k >> 6, below = ~(below_all << (k & 63));
            uint32_t p = kp[w] + (uint32_t)__builtin_popcountll(kb[w] & below);
            src[u] = qdst[at[p].q] + at[p].rel;
        }
    } else {
        for (int64_t u = 0; u < n; u++) {
            utok[u] = tok[chosen[u]];
            src[u] = qdst[at[u].q] + at[u].rel;
        }
    }
    return R;
}

#if SE_X86
/* the same planner compiled with popcnt (the rank passes) and BMI2's
 * one-uop variable shifts (the key arithmetic) */
__attribute__((target("popcnt,bmi,bmi2")))
static int64_t plan_bmi2(PLAN_PARAMS)
{
    return plan_body(PLAN_ARGS);
}
#endif

int64_t se_plan_reads(PLAN_PARAMS)
{
    if (m < 0 || m >= ((int64_t)1 << 32) || ndisks <= 0 || E == 0 || bs == 0 || (bs & (bs - 1)))
        return -EINVAL;
    for (int d = 0; d < ndisks; d++)
        disk_entries[d] = disk_bytes[d] = 0;
    *n_entries = 0;
    *staging = 0;
    if (m == 0)
        return 0;
#if SE_X86
    if (__builtin_cpu_supports("popcnt") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2"))
        return plan_bmi2(PLAN_ARGS);
#endif
    return plan_body(PLAN_ARGS);
}
#undef PLAN_PARAMS
#undef PLAN_ARGS

/* ---- assembly: entries straight into K and V [H, n_total, d] ------------------
 * Entry i (its H K rows, then its H V rows, dbytes each) goes to column
 * dst_idx[i] of every head of K and V.  A large gather (at least
 * SE_GATHER_STREAM_BYTES written) uses non-temporal stores of whole 64-byte
 * lines where the path, the row size and the output alignment allow: the
 * output is far larger than L2, so storing around the cache saves the
 * read-for-ownership of every destination line.  Measured with the read
 * that consumes K and V (docs/benchmarks.md section 9): at 54 MB the gather
 * takes 0.6x the time and gather + read 0.84x; at 13.5 MB the gather gains
 * what the read then loses (the output no longer sits in L3), hence the
 * threshold.  The bytes written are the same on every path. */
#define SE_GATHER_STREAM_BYTES ((uint64_t)16 << 20)

static void gather_kv_copy(const char *src, const uint64_t *src_off, int64_t n, int64_t H,
                           uint64_t dbytes, const int64_t *dst_idx, uint64_t hstride, char *k,
                           char *v)
{
    for (int64_t i = 0; i < n; i++) {
        const char *row = src + src_off[i];
        uint64_t at = (uint64_t)dst_idx[i] * dbytes;
        for (int64_t h = 0; h < H; h++) {
            memcpy(k + (uint64_t)h * hstride + at, row + (uint64_t)h * dbytes, dbytes);
            memcpy(v + (uint64_t)h * hstride + at, row + (uint64_t)(H + h) * dbytes, dbytes);
        }
    }
}

#if SE_X86
/* One streaming gather per vector width: LINE(d, s) stores the 64-byte line
 * at s to d around the cache (the rows are whole lines: gather_kv_mode). */
#define GATHER_KV_STREAM(name, isa, LINE)                                                     \
    __attribute__((target(isa)))                                                              \
    static void name(const char *src, const uint64_t *src_off, int64_t n, int64_t H,          \
                     uint64_t dbytes, const int64_t *dst_idx, uint64_t hstride, char *k,      \
                     char *v)                                                                 \
    {                                                                                         \
        for (int64_t i = 0; i < n; i++) {                                                     \
            const char *row = src + src_off[i];                                               \
            uint64_t at = (uint64_t)dst_idx[i] * dbytes;                                      \
            for (int64_t h = 0; h < 2 * H; h++) {                                             \
                char *d = (h < H ? k + (uint64_t)h * hstride                                  \
                                 : v + (uint64_t)(h - H) * hstride) + at;                     \
                const char *s = row + (uint64_t)h * dbytes;                                   \
                for (uint64_t j = 0; j < dbytes; j += 64)                                     \
                    LINE(d + j, s + j);                                                       \
            }                                                                                 \
        }                                                                                     \
        _mm_sfence();                                                                         \
    }

#define LINE512(d, s) _mm512_stream_si512((void *)(d), _mm512_loadu_si512(s))
#define LINE256(d, s)                                                                         \
    do {                                                                                      \
        _mm256_stream_si256((__m256i *)(void *)(d),                                           \
                            _mm256_loadu_si256((const __m256i *)(const void *)(s)));          \
        _mm256_stream_si256((__m256i *)(void *)((d) + 32),                                    \
                            _mm256_loadu_si256((const __m256i *)(const void *)((s) + 32)));   \
    } while (0)

GATHER_KV_STREAM(gather_kv_stream512, "avx512f", LINE512)
GATHER_KV_STREAM(gather_kv_stream256, "avx2", LINE256)
#undef LINE512
#undef LINE256
#undef GATHER_KV_STREAM
#endif

/* The inverse of the gather: column idx[i] of every head of K and V (head
 * strides kstride and vstride bytes, dbytes per row) to row i of out
 * [m, 2 * H * dbytes], K heads then V heads, as the entry is stored. */
void se_kv_rows(const char *k, const char *v, int64_t H, uint64_t dbytes, uint64_t kstride,
                uint64_t vstride, const int64_t *idx, int64_t m, char *out)
{
    uint64_t eb = 2 * (uint64_t)H * dbytes;
    for (int64_t i = 0; i < m; i++) {
        char *row = out + (uint64_t)i * eb;
        uint64_t at = (uint64_t)idx[i] * dbytes;
        for (int64_t h = 0; h < H; h++) {
            memcpy(row + (uint64_t)h * dbytes, k + (uint64_t)h * kstride + at, dbytes);
            memcpy(row + (uint64_t)(H + h) * dbytes, v + (uint64_t)h * vstride + at, dbytes);
        }
    }
}

/* The gather's strategy (engine.h): 2 = 512-bit streaming stores, 1 = 256-bit
 * streaming stores, 0 = memcpy.  Streaming needs whole 64-byte lines: rows of
 * a multiple of 64 bytes and 64-byte aligned K and V. */
int se_gather_kv_mode(uint64_t dbytes, int64_t n, int64_t H, const char *k, const char *v)
{
    uint64_t written = (uint64_t)n * 2 * (uint64_t)H * dbytes;
    if (written < SE_GATHER_STREAM_BYTES || dbytes % 64 || ((uintptr_t)k | (uintptr_t)v) % 64)
        return 0;
    int path = se_kernel_path();
    return path == SE_PATH_AVX512 ? 2 : path == SE_PATH_AVX2 ? 1 : 0;
}

/* One part of a gather, run by one thread, in the strategy chosen for the
 * whole call (so a split call streams exactly when an unsplit one would). */
struct gather_part {
    const char *src;
    const uint64_t *src_off;
    int64_t n, H;
    uint64_t dbytes;
    const int64_t *dst_idx;
    uint64_t hstride;
    char *k, *v;
    int mode;
};

static void *gather_part_run(void *arg)
{
    const struct gather_part *p = arg;
    switch (p->mode) {
#if SE_X86
    case 2:
        gather_kv_stream512(p->src, p->src_off, p->n, p->H, p->dbytes, p->dst_idx, p->hstride,
                            p->k, p->v);
        break;
    case 1:
        gather_kv_stream256(p->src, p->src_off, p->n, p->H, p->dbytes, p->dst_idx, p->hstride,
                            p->k, p->v);
        break;
#endif
    default:
        gather_kv_copy(p->src, p->src_off, p->n, p->H, p->dbytes, p->dst_idx, p->hstride, p->k,
                       p->v);
    }
    return NULL;
}

/* nthreads 2 and at least SE_GATHER_SPLIT_BYTES written: a second thread,
 * started for this call and joined before it returns, places the second half
 * of the entries (both cores for one step's assembly; the bytes written are
 * the same).  Measured on a 2-core VM: 0.7-0.8x the one-thread time at
 * 4 MiB, 0.6-0.7x at 8-51 MiB, 0.9x at 2 MiB and 1.5x at 1 MiB, where the
 * thread's start (about 0.1 ms) costs more than it saves (docs/benchmarks.md
 * section 9).  A call whose dst_idx repeats a column stays on one thread (the
 * later entry wins, as without threads).  Returns 1 if the call was split. */
#define SE_GATHER_SPLIT_BYTES ((uint64_t)4 << 20)

/* Whether no column repeats in dst_idx [n] (values in [0, n_total)): only
 * then may two threads place the halves, since with a repeat one thread
 * keeps the later entry and two would race for it (a bitmap: n_total bits;
 * 0 when it cannot be had, so the call stays on one thread). */
static int distinct_columns(const int64_t *dst_idx, int64_t n, int64_t n_total)
{
    uint64_t *seen = calloc(((uint64_t)n_total + 63) / 64, sizeof(uint64_t));
    if (!seen)
        return 0;
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++) {
        uint64_t c = (uint64_t)dst_idx[i], bit = (uint64_t)1 << (c % 64);
        ok = !(seen[c / 64] & bit);
        seen[c / 64] |= bit;
    }
    free(seen);
    return ok;
}

int se_gather_kv(const char *src, const uint64_t *src_off, int64_t n, int64_t H,
                 uint64_t dbytes, const int64_t *dst_idx, int64_t n_total, char *k, char *v,
                 int nthreads)
{
    struct gather_part a = {src, src_off, n, H, dbytes, dst_idx, (uint64_t)n_total * dbytes,
                            k, v, se_gather_kv_mode(dbytes, n, H, k, v)};
    uint64_t written = (uint64_t)n * 2 * (uint64_t)H * dbytes;
    int split = 0;
    pthread_t th;
    struct gather_part b = a;
    if (nthreads >= 2 && written >= SE_GATHER_SPLIT_BYTES && n >= 2 &&
        distinct_columns(dst_idx, n, n_total)) {
        a.n = n / 2;
        b.n = n - a.n;
        b.src_off = src_off + a.n;
        b.dst_idx = dst_idx + a.n;
        split = pthread_create(&th, NULL, gather_part_run, &b) == 0;
        if (!split)
            a.n = n;                                /* no thread: this one does all */
    }
    gather_part_run(&a);
    if (split)
        pthread_join(th, NULL);
    return split;
}
