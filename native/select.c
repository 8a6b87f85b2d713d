/*
 * swarmfs cluster choice (SWARM 5.2, eq. 8): clusters in descending score
 * until the window and the chosen clusters hold the budget, alone or after
 * the int8 scoring (se_select_i8) or the two-level int8 scoring
 * (se_select_i8x2).
 */
#include "kernels_int.h"

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
