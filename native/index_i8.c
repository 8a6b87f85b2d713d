/*
 * swarmfs int8 medoid index (SWARM 5.2 scoring with int8 keys and fp32
 * scales): packing, quantised queries, and exact integer logits on the
 * AVX-512 VNNI, AVX2 and scalar paths.
 */
#include "kernels_int.h"

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

static void i8_logits_scalar(const se_i8_index *ix, int64_t H, const i8_query *t,
                             int64_t g0, int64_t g1, float *lg, int64_t ldc)
{
    const int8_t *P = ix->data, *q8 = t->q8;
    const float *sm = ix->scales, *sq = t->sq;
    int64_t C = ix->rows, d = t->d, Hq = t->Hq, G = Hq / H;
    int64_t nblk = (C + 15) / 16, Cp = nblk * 16, D4 = d / 4;
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
static void i8_logits_vnni(const se_i8_index *ix, int64_t H, const i8_query *t,
                           int64_t g0, int64_t g1, float *lg, int64_t ldc)
{
    const int8_t *P = ix->data;
    const float *sm = ix->scales, *sq = t->sq;
    const int32_t *ms = ix->sums;
    const uint32_t *qw = t->qw;
    int64_t C = ix->rows, d = t->d, G = t->Hq / H;
    int64_t nblk = (C + 15) / 16, Cp = nblk * 16, D4 = d / 4;
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
static void i8_logits_avx2(const se_i8_index *ix, int64_t H, const i8_query *t,
                           int64_t g0, int64_t g1, float *lg, int64_t ldc)
{
    const int8_t *P = ix->data;
    const uint32_t *qw = t->qw;
    const float *sm = ix->scales, *sq = t->sq;
    int64_t C = ix->rows, d = t->d, G = t->Hq / H;
    int64_t nblk = (C + 15) / 16, Cp = nblk * 16, D4 = d / 4;
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

void i8_query_free(i8_query *t)
{
    free(t->q8); free(t->sq); free(t->qw);
}

int i8_query_make(int path, const float *q, int64_t Hq, int64_t d, i8_query *t)
{
    t->Hq = Hq;
    t->d = d;
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
void i8_logits(int path, const se_i8_index *ix, int64_t H, const i8_query *t, int64_t g0,
               int64_t g1, float *lg, int64_t ldc)
{
#if SE_X86
    if (path == SE_PATH_AVX512 && have_vnni()) {
        i8_logits_vnni(ix, H, t, g0, g1, lg, ldc);
        return;
    }
    if (path == SE_PATH_AVX512 || path == SE_PATH_AVX2) {
        i8_logits_avx2(ix, H, t, g0, g1, lg, ldc);
        return;
    }
#endif
    i8_logits_scalar(ix, H, t, g0, g1, lg, ldc);
}

int i8_args_bad(const se_i8_index *ix, const se_query *q)
{
    return !ix || !q || !ix->data || !ix->scales || !ix->sums || !q->q || ix->rows < 0 ||
           q->H <= 0 || q->d <= 0 || q->d % 4 || q->Hq <= 0 || q->Hq % q->H;
}

int se_head_logits_i8(const se_i8_index *ix, const se_query *q, float *lg)
{
    if (i8_args_bad(ix, q) || !lg)
        return -EINVAL;
    int path = se_kernel_path();
    i8_query t;
    if (i8_query_make(path, q->q, q->Hq, q->d, &t) < 0)
        return -ENOMEM;
    i8_logits(path, ix, q->H, &t, 0, q->H, lg, ix->rows);
    i8_query_free(&t);
    return 0;
}
