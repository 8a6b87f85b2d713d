/*
 * swarmfs cluster choice (SWARM 5.2, eq. 8): clusters in descending score
 * until the window and the chosen clusters hold the budget, alone or after
 * the fp16/bf16 scoring (se_select_fused), the int8 scoring (se_select_i8) or
 * the two-level int8 scoring (se_select_i8x2).
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

int64_t se_choose_clusters(const float *scores, int64_t C, se_choice *ch)
{
    if (!scores || !ch || !ch->ptr || !ch->members || !ch->out || C < 0 || ch->S < 0 ||
        ch->budget < 0 || ch->w < 0 || C >= ((int64_t)1 << 32))
        return -EINVAL;
    const int64_t *ptr = ch->ptr;
    const int32_t *members = ch->members;
    int64_t S = ch->S, budget = ch->budget < S ? ch->budget : S, w = ch->w < S ? ch->w : S;
    int64_t have = w, nout = 0;
    if (have >= budget || C == 0) {
        ch->entries = have;
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
        /* ids come in ascending order and the sort is stable: ties stay in
         * id order */
        const uint64_t *sorted = radix_sort_hi32(cand, tmp, m, 32);
        for (int64_t j = done; j < m; j++) {
            int64_t c = (int64_t)(sorted[j] & 0xffffffffu);
            for (int64_t i = ptr[c]; i < ptr[c + 1]; i++) {
                int64_t t = members[i];
                uint64_t bit = (uint64_t)1 << (t & 63);
                if (!(seen[t >> 6] & bit)) {
                    seen[t >> 6] |= bit;
                    have++;
                }
            }
            ch->out[nout++] = c;
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
    ch->entries = have;
    return nout;
}

int64_t se_select_fused(const se_half_index *ix, const se_query *q, int score, float *work,
                        se_choice *ch)
{
    if (!ix || !q || !ix->m || !q->q || !work || ix->C < 0 || q->H <= 0 || q->d <= 0 ||
        q->Hq <= 0 || q->Hq % q->H || (ix->kind != 1 && ix->kind != 2) || !(q->scale > 0) ||
        (score != 0 && score != 1))
        return -EINVAL;
    int rc = half_scores(se_kernel_path(), ix, q, score, work);
    if (rc < 0)
        return rc;
    return se_choose_clusters(work, ix->C, ch);
}

/* ---- int8 selection -------------------------------------------------------------- */

/* The scores of KV heads [g0, g1): per head its G heads' logits [G, C] (in
 * L2, at work + C), then their softmax added into work[0, C) (the first head
 * of the range initialises it).  One part of se_select_i8, run by one thread. */
struct i8_part {
    const se_i8_index *ix;
    const i8_query *t;
    int64_t H, g0, g1;
    float scale;
    int path;
    float *work;
};

static void *i8_part_run(void *arg)
{
    const struct i8_part *p = arg;
    int64_t C = p->ix->rows, G = p->t->Hq / p->H;
    for (int64_t g = p->g0; g < p->g1; g++) {
        i8_logits(p->path, p->ix, p->H, p->t, g, g + 1, p->work + C, C);
        softmax_acc(p->path, p->work + C, G, C, p->scale, p->work, g == p->g0);
    }
    return NULL;
}

/* The scores [C] in work: per KV head its G heads' logits [G, C] (in L2),
 * then their softmax added into the scores; the same floats as
 * se_head_logits_i8 + se_softmax_sum.  nthreads 2 (and H >= 2): a second
 * thread, started for this call and joined before it returns, scores the KV
 * heads [H/2, H) into its own area, whose scores are then added to the first
 * half's: the same floats up to the order of one addition per score.  No
 * state is shared between calls. */
static int i8_scores(int path, const se_i8_index *ix, const se_query *q, int nthreads,
                     float *work)
{
    int64_t C = ix->rows, H = q->H, G = q->Hq / H;
    i8_query t;
    if (i8_query_make(path, q->q, q->Hq, q->d, &t) < 0)
        return -ENOMEM;
    struct i8_part a = {ix, &t, H, 0, H, q->scale, path, work};
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
    return 0;
}

int64_t se_select_i8(const se_i8_index *ix, const se_query *q, int nthreads, float *work,
                     se_choice *ch)
{
    if (i8_args_bad(ix, q) || !work || !(q->scale > 0) || nthreads < 1)
        return -EINVAL;
    if (ix->rows > 0) {
        int rc = i8_scores(se_kernel_path(), ix, q, nthreads, work);
        if (rc < 0)
            return rc;
    }
    return se_choose_clusters(work, ix->rows, ch);
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
 * Python); each group's rows lie in whole blocks of the reordered index
 * ix->fine (standard int8 layout, Crows rows per head; rowmed [H, Crows]
 * names the medoid of each row, -1 for padding), and its centroid is row k
 * of ix->coarse (K rows per head).  Per head: the G heads' logits against
 * the K centroids; groups ranked by max over heads of scale * (logit - max)
 * + log(members) (glogn); the best ngroups scored exactly; the others stand
 * in the softmax as one column of weight members * exp(scale * centroid
 * logit), so each head's normaliser counts every medoid, and each of the
 * group's medoids gets that column's share divided by the members.  With
 * ngroups = K this is se_select_i8's score up to summation order. */

/* One se_select_i8x2 call: its arguments, the quantised query and the
 * scratch of one KV head at a time. */
struct x2_call {
    const se_i8x2_index *ix;
    const se_query *q;
    int path;
    int64_t K, G, ngroups;
    i8_query t;
    float *Lc;              /* [G, K] the head's logits against the centroids */
    float *rowbuf;          /* [G, ncols] the softmax's columns */
    float *share;           /* [K] a skipped group's share, per medoid */
    float *acc;             /* [ncols] the columns' softmax, summed over heads */
    int32_t *colsrc;        /* [ncols] a column's row, or -(k + 1) for group k */
    uint32_t *keys, *sel;   /* [K] the groups' ranks (desc_key), a copy */
    float *score;           /* [C] */
};

/* The call's scratch (a per-thread area, kept between calls) and quantised
 * query.  0 or -ENOMEM. */
static int x2_setup(struct x2_call *x)
{
    static __thread struct scratch sc;
    int64_t G = x->G, K = x->K, Kp = (K + 15) / 16 * 16;
    size_t ncmax = (size_t)(x->ix->fine.rows + K);
    char *scratch = scratch_get(&sc, sizeof(float) * ((size_t)G * ncmax * 2 + ncmax +
                                                      (size_t)G * Kp + 64) +
                                         sizeof(int32_t) * (ncmax + 2 * (size_t)K) + 256);
    if (!scratch)
        return -ENOMEM;
    x->Lc = (float *)(void *)scratch;                    /* [G, K] */
    x->rowbuf = x->Lc + G * Kp;                          /* [G, ncols] */
    x->share = x->rowbuf + G * ncmax;                    /* [G, group rows] */
    x->acc = x->share + G * ncmax;                       /* [ncols] */
    x->colsrc = (int32_t *)(void *)(x->acc + ncmax + 16);
    x->keys = (uint32_t *)(x->colsrc + ncmax);
    x->sel = x->keys + K;
    const se_query *q = x->q;
    return i8_query_make(x->path, q->q, q->Hq, q->d, &x->t) < 0 ? -ENOMEM : 0;
}

/* KV head g's groups ranked: the G heads' logits against the K centroids,
 * then per group the key of max over heads of scale * (logit - the head's
 * max) + log(members) (over blocks of 64 heads, the smallest key). */
static void x2_rank_groups(struct x2_call *x, int64_t g)
{
    const int64_t K = x->K, G = x->G;
    const float *Lc = x->Lc, *glogn = x->ix->glogn;
    uint32_t *keys = x->keys;
    float mx[64];
    i8_logits(x->path, &x->ix->coarse, x->q->H, &x->t, g, g + 1, x->Lc, K);
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
            uint32_t kk = desc_key(b * x->q->scale + glogn[g * K + k]);
            if (h0 == 0 || kk < keys[k])
                keys[k] = kk;
        }
    }
}

/* The key of the ngroups-th best group (groups whose key is at most it are
 * scored exactly). */
static uint32_t x2_threshold(struct x2_call *x)
{
    if (x->ngroups >= x->K)
        return 0xffffffffu;
    memcpy(x->sel, x->keys, sizeof(uint32_t) * (size_t)x->K);
    return nth_u32(x->sel, x->K, x->ngroups - 1);
}

/* Group k of head g scored exactly: its rows' logits into columns [col,
 * col + rows) of rowbuf (nc columns); padding rows at -1e30.  Returns the
 * rows. */
static int64_t x2_exact_group(struct x2_call *x, int64_t g, int64_t k, int64_t col,
                              int64_t nc)
{
    const se_i8x2_index *ix = x->ix;
    const int64_t K = x->K, G = x->G, d = x->q->d, D4 = d / 4, Crows = ix->fine.rows;
    int64_t b0 = ix->gblk[g * (K + 1) + k], b1 = ix->gblk[g * (K + 1) + k + 1];
    int64_t nr = (b1 - b0) * 16;
    if (nr == 0)
        return 0;
    const int64_t base = g * (Crows / 16) + b0;
    se_i8_index rows = {ix->fine.data + base * D4 * 64, ix->fine.scales + g * Crows + b0 * 16,
                        ix->fine.sums + g * Crows + b0 * 16, nr};
    i8_query tg = {x->t.q8 + g * G * d, x->t.sq + g * G, x->t.qw + g * G * D4, G, d};
    i8_logits(x->path, &rows, 1, &tg, 0, 1, x->rowbuf + col, nc);
    for (int64_t r = 0; r < nr; r++) {
        int32_t rr = (int32_t)(b0 * 16 + r);
        x->colsrc[col + r] = rr;
        if (ix->rowmed[g * Crows + rr] < 0)
            for (int64_t h = 0; h < G; h++)
                x->rowbuf[h * nc + col + r] = -1e30f;
    }
    return nr;
}

/* The softmax's columns of head g: the rows of the groups whose key is at
 * most th, then one per other group (its centroid's logit + log(members) /
 * scale).  Returns the number of columns. */
static int64_t x2_columns(struct x2_call *x, int64_t g, uint32_t th)
{
    const int64_t K = x->K, G = x->G;
    const int32_t *gblk = x->ix->gblk;
    const float *glogn = x->ix->glogn;
    int64_t nc = 0;
    for (int64_t k = 0; k < K; k++)
        if (x->keys[k] <= th)
            nc += (int64_t)(gblk[g * (K + 1) + k + 1] - gblk[g * (K + 1) + k]) * 16;
        else
            nc++;
    int64_t col = 0;
    for (int64_t k = 0; k < K; k++) {
        if (x->keys[k] <= th) {
            col += x2_exact_group(x, g, k, col, nc);
            continue;
        }
        for (int64_t h = 0; h < G; h++)
            x->rowbuf[h * nc + col] = x->Lc[h * K + k] + glogn[g * K + k] / x->q->scale;
        x->colsrc[col] = -(int32_t)(k + 1);
        col++;
    }
    return nc;
}

/* The softmax of head g's nc columns added into the scores: a row's to its
 * medoid, a skipped group's share to each of its medoids. */
static void x2_spread(struct x2_call *x, int64_t g, int64_t nc)
{
    const se_i8x2_index *ix = x->ix;
    const int64_t K = x->K, C = ix->C, Crows = ix->fine.rows;
    softmax_acc(x->path, x->rowbuf, x->G, nc, x->q->scale, x->acc, 1);
    for (int64_t k = 0; k < K; k++)
        x->share[k] = 0.f;
    for (int64_t c = 0; c < nc; c++) {
        int32_t s = x->colsrc[c];
        if (s >= 0) {
            int32_t md = ix->rowmed[g * Crows + s];
            if (md >= 0)
                x->score[md] += x->acc[c];
        } else {
            int64_t k = -(int64_t)s - 1;
            x->share[k] = x->acc[c] * expf(-ix->glogn[g * K + k]);
        }
    }
    add_shares(x->path, x->score, x->share, ix->mgrp + g * C, C);
}

static int x2_args_bad(const se_i8x2_index *ix, const se_query *q, int64_t ngroups,
                       const float *score)
{
    if (!ix || i8_args_bad(&ix->fine, q) || i8_args_bad(&ix->coarse, q))
        return 1;
    return !ix->rowmed || !ix->gblk || !ix->glogn || !ix->mgrp || !score || ix->C < 0 ||
           ix->coarse.rows <= 0 || ix->fine.rows % 16 || !(q->scale > 0) || ngroups < 1;
}

int64_t se_select_i8x2(const se_i8x2_index *ix, const se_query *q, int64_t ngroups,
                       float *score, se_choice *ch)
{
    if (x2_args_bad(ix, q, ngroups, score))
        return -EINVAL;
    struct x2_call x = {.ix = ix, .q = q, .path = se_kernel_path(), .K = ix->coarse.rows,
                        .G = q->Hq / q->H, .score = score};
    x.ngroups = ngroups < x.K ? ngroups : x.K;
    for (int64_t c = 0; c < ix->C; c++)
        score[c] = 0.f;
    if (ix->C > 0) {
        int rc = x2_setup(&x);
        if (rc < 0)
            return rc;
        for (int64_t g = 0; g < q->H; g++) {
            x2_rank_groups(&x, g);
            x2_spread(&x, g, x2_columns(&x, g, x2_threshold(&x)));
        }
        i8_query_free(&x.t);
    }
    if (!ch)
        return 0;                      /* scores only */
    return se_choose_clusters(score, ix->C, ch);
}
