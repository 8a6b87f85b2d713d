/*
 * swarmfs read planner (SWARM 6.1, eq. 8): candidate copies to one copy
 * per token, balanced over the disk buckets, coalesced into block-aligned
 * requests laid out back to back in a staging buffer.
 *
 * plan_body runs the steps in order, each a function of its own over the
 * call's state (struct plan): 0 the spans of the arguments (which choose
 * the ways through the rest), then the scratch; 1-2 dedup and the bucket
 * choice (a token bitmap, or a token sort); 3 the entries in (disk, offset)
 * order (a key bitmap, or a key sort); 4 coalescing into requests (a run
 * at a time, or an entry at a time); 5 the requests laid out round robin
 * over the disks; 6 each entry's place in the staging buffer.  The steps
 * are inlined into plan_body, which is compiled twice (with and without
 * BMI2), so they cost no calls.
 */
#include "kernels_int.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

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

/* One word of the token bitmaps: 64 tokens seen, seen twice, and how many
 * tokens (seen, seen twice) lie below the word; together, so that a rank
 * costs one cache line. */
typedef struct {
    uint64_t seen, dup;
    uint32_t below, dbelow;
} tword;

/* ---- step 0: the spans of the arguments, and the scratch ------------------------- */

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

/* One planner call: its arguments, the spans that choose its ways (step 0),
 * its scratch (plan_scratch), and what each step hands to the next.  The
 * steps copy what their loops read into locals, since the compiler cannot
 * assume that a store through an output array leaves this struct alone. */
struct plan {
    const se_plan_in *in;
    se_plan_out *out;
    uint64_t tmax, omin, ozor;         /* step 0's token and offset spans */
    int tz, ob;                        /* key: disk << ob | (offset - omin) >> tz */
    size_t words;                      /* token bitmap words (0: the token sort) */
    int64_t kwords;                    /* key bitmap words (0: the key sort) */
    int64_t *load, *first, *nreq_d;    /* per disk: entries, first request, requests */
    uint64_t *key, *tmp;
    uint32_t *ustart;                  /* token sort: token u's candidates in mc */
    int64_t *order;                    /* key sort: the entries in (disk, offset) order */
    uint64_t *go;                      /* offset of entry i's copy */
    kv_rec *recs, *rtmp;
    uint64_t *rs, *re, *qdst;          /* per request: start, end, staging offset */
    eplace *at;                        /* an entry's place in its request */
    uint64_t *pk;                      /* entry u: key << 32 | candidate */
    int32_t *rd, *ed;                  /* disk of request q, of entry i */
    uint32_t *mcnt, *mstart;           /* token bitmap: multi-copy token v's */
    uint32_t *mc;                      /* candidates in mc; token sort: all, by token */
    tword *tw;                         /* token bitmaps */
    uint64_t *kb;                      /* key bitmap */
    uint32_t *kp;                      /* keys (requests) below word w */
    uint64_t *qb;                      /* requests' first keys */
    uint64_t coll;                     /* two chosen entries at one key */
    int keyed;                         /* kb holds every chosen entry */
    int64_t n;                         /* entries */
};

/* Step 0: the arguments' ranges, and the spans that choose the ways: the
 * token bitmap with dedup and token ids below 64 per candidate, the key
 * bitmap when the keys fit 32 bits and stay below 16 per candidate + 2**16.
 * 0, or -EDOM (a token outside [0, 2**31)), -ERANGE (a disk outside [0,
 * ndisks)), -EOVERFLOW (an offset at or beyond 2**52). */
ALWAYS_INLINE
int plan_spans(struct plan *p)
{
    const se_plan_in *in = p->in;
    plan_ranges rg = {0, ~(uint64_t)0, 0, 0, 0};
#if SE_X86
    if (se_kernel_path() == SE_PATH_AVX512)
        rg = ranges_avx512(in->m, in->tok, in->cdisk, in->coff, rg);
    else
#endif
        rg = ranges_scalar(in->m, in->tok, in->cdisk, in->coff, 0, rg);
    if (rg.tmax >= ((uint64_t)1 << 31))
        return -EDOM;
    if (rg.dmax >= (uint32_t)in->ndisks)
        return -ERANGE;
    if (rg.omax >= ((uint64_t)1 << 52))
        return -EOVERFLOW;
    int tz = rg.ozor ? __builtin_ctzll(rg.ozor) : 0;   /* o - omin: multiples of 2**tz */
    int ob = bit_length((rg.omax - rg.omin) >> tz);
    int64_t twords = (int64_t)(rg.tmax >> 6) + 1;
    p->tmax = rg.tmax;
    p->omin = rg.omin;
    p->ozor = rg.ozor;
    p->tz = tz;
    p->ob = ob;
    p->words = in->dedup && twords <= in->m ? (size_t)twords : 0;     /* token bitmap */
    p->kwords = 0;
    if (ob + bit_length(rg.dmax) <= 32) {
        uint64_t kmax = ((uint64_t)rg.dmax << ob) | ((rg.omax - rg.omin) >> tz);
        if (kmax < 16 * (uint64_t)in->m + 65536)
            p->kwords = (int64_t)(kmax >> 6) + 1;                      /* key bitmap */
    }
    return 0;
}

/* The call's scratch, in the planner's own per-thread area (scratch_get):
 * 0 or -ENOMEM.  The buckets, the per-disk counts and the key bitmap start
 * at zero. */
ALWAYS_INLINE
int plan_scratch(struct plan *p)
{
    static __thread struct scratch sc;
    const int64_t m = p->in->m, kwords = p->kwords;
    const int ndisks = p->in->ndisks;
    char *sp = scratch_get(&sc, (size_t)m * (8 * 15 + 4 * 5) + 32 + (size_t)ndisks * 24 +
                                    p->words * 24 + (size_t)kwords * 20 + 256);
    if (!sp)
        return -ENOMEM;
#define TAKE(T, cnt) ((T *)(void *)(sp += ((sizeof(T) * (size_t)(cnt) + 7) & ~(size_t)7), \
                                    sp - ((sizeof(T) * (size_t)(cnt) + 7) & ~(size_t)7)))
    p->load = TAKE(int64_t, ndisks);
    p->first = TAKE(int64_t, ndisks + 1);
    p->nreq_d = TAKE(int64_t, ndisks);
    memset(p->load, 0, sizeof(int64_t) * (size_t)(3 * ndisks + 1));
    p->key = TAKE(uint64_t, m);
    p->tmp = TAKE(uint64_t, m);
    p->ustart = TAKE(uint32_t, m + 1);
    p->order = TAKE(int64_t, m);
    p->go = TAKE(uint64_t, m);
    p->recs = TAKE(kv_rec, m);
    p->rtmp = TAKE(kv_rec, m);
    p->rs = TAKE(uint64_t, m);                  /* per request (at most m) */
    p->re = TAKE(uint64_t, m);
    p->qdst = TAKE(uint64_t, m);
    p->at = TAKE(eplace, m);
    p->pk = TAKE(uint64_t, m);
    p->rd = TAKE(int32_t, m);
    p->ed = TAKE(int32_t, m);
    p->mcnt = TAKE(uint32_t, m + 1);
    p->mstart = TAKE(uint32_t, m + 1);
    p->mc = TAKE(uint32_t, m);
    p->tw = TAKE(tword, p->words);
    p->kb = TAKE(uint64_t, kwords);
    p->kp = TAKE(uint32_t, kwords);
    p->qb = TAKE(uint64_t, kwords);
#undef TAKE
    if (kwords)
        memset(p->kb, 0, sizeof(uint64_t) * (size_t)kwords);
    return 0;
}

/* ---- steps 1-2: dedup (eq. 8) and the entry buckets (6.1) ----------------------- */

/* Step 1 of the token-bitmap path: the tokens seen, and seen twice, and the
 * counts below each word.  *M: the multi-copy tokens; returns the tokens. */
ALWAYS_INLINE
uint32_t tokens_seen(struct plan *p, uint32_t *M)
{
    const int64_t m = p->in->m, *tok = p->in->tok;
    const size_t words = p->words;
    tword *tw = p->tw;
    memset(tw, 0, sizeof(tword) * words);
    for (int64_t i = 0; i < m; i++) {
        uint64_t t = (uint64_t)tok[i], b = (uint64_t)1 << (t & 63);
        tw[t >> 6].dup |= tw[t >> 6].seen & b;
        tw[t >> 6].seen |= b;
    }
    uint32_t U = 0, Mc = 0;
    for (size_t w = 0; w < words; w++) {
        tw[w].below = U;
        tw[w].dbelow = Mc;
        U += (uint32_t)__builtin_popcountll(tw[w].seen);
        Mc += (uint32_t)__builtin_popcountll(tw[w].dup);
    }
    *M = Mc;
    return U;
}

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
ALWAYS_INLINE
int64_t rank_pass(struct plan *p, uint64_t *mlist, int keyed)
{
    const int64_t m = p->in->m, *tok = p->in->tok;
    const int32_t *cdisk = p->in->cdisk;
    const uint64_t *coff = p->in->coff, omin = p->omin;
    const tword *tw = p->tw;
    const int ob = p->ob, tz = p->tz;
    uint64_t *pk = p->pk, *kb = p->kb;
    int64_t *load = p->load;
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
    p->coll |= cl;
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

/* Step 2 of the token-bitmap path: the candidates of multi-copy token v as
 * mc[mstart[v], mstart[v + 1]), in candidate order (a counting sort of the
 * list by v); *minc, *maxc: the fewest and the most copies. */
ALWAYS_INLINE
void group_multi(struct plan *p, const uint64_t *mlist, int64_t nm, uint32_t M,
                 uint32_t *minc, uint32_t *maxc)
{
    uint32_t *mcnt = p->mcnt, *mstart = p->mstart, *mc = p->mc;
    memset(mcnt, 0, sizeof(uint32_t) * ((size_t)M + 1));
    for (int64_t k = 0; k < nm; k++)
        mcnt[mlist[k] >> 32]++;
    uint32_t sum = 0, lo = ~0u, hi = 0;
    for (uint32_t v = 0; v < M; v++) {
        uint32_t c = mcnt[v];
        lo = c < lo ? c : lo;
        hi = c > hi ? c : hi;
        mstart[v] = mcnt[v] = sum;
        sum += c;
    }
    mstart[M] = sum;
    for (int64_t k = 0; k < nm; k++)
        mc[mcnt[mlist[k] >> 32]++] = (uint32_t)mlist[k];
    *minc = lo;
    *maxc = hi;
}

/* The items u < N of more than one copy (start[u + 1] - start[u] > 1) in
 * ascending copy count, stable (a counting sort), into byc; maxc: the most
 * copies.  0 or -ENOMEM. */
static int copies_by_count(const uint32_t *start, uint32_t N, uint32_t maxc, uint32_t *byc)
{
    uint32_t *cc = calloc((size_t)maxc + 2, sizeof(uint32_t));
    if (!cc)
        return -ENOMEM;
    for (uint32_t u = 0; u < N; u++) {
        uint32_t c = start[u + 1] - start[u];
        if (c > 1)
            cc[c + 1]++;
    }
    for (uint64_t c = 1; c <= (uint64_t)maxc + 1; c++)
        cc[c] += cc[c - 1];
    for (uint32_t u = 0; u < N; u++) {
        uint32_t c = start[u + 1] - start[u];
        if (c > 1)
            byc[cc[c]++] = u;
    }
    free(cc);
    return 0;
}

/* The bucket choice of SWARM 6.1: of the candidates cand[lo, hi), the one
 * whose disk's bucket holds the fewest entries, the first on a tie. */
ALWAYS_INLINE
int64_t least_loaded(const uint32_t *cand, uint32_t lo, uint32_t hi, const int64_t *load,
                     const int32_t *cdisk)
{
    int64_t best = cand[lo], bl = load[cdisk[best]];
    for (uint32_t j = lo + 1; j < hi; j++) {
        int64_t c = cand[j];
        if (load[cdisk[c]] < bl) {
            bl = load[cdisk[c]];
            best = c;
        }
    }
    return best;
}

/* Step 2 of the token-bitmap path: the multi-copy tokens in the order byc
 * (NULL: their own), each to the smallest bucket among its copies (or,
 * policy "first", to its first copy); its entry (its token's rank) gets
 * pk = key << 32 | copy, and with the key bitmap the key's bit. */
ALWAYS_INLINE
void choose_multi_bitmap(struct plan *p, const uint32_t *byc, uint32_t M)
{
    const int64_t *tok = p->in->tok;
    const int32_t *cdisk = p->in->cdisk;
    const uint64_t *coff = p->in->coff, omin = p->omin;
    const uint32_t *mstart = p->mstart, *mc = p->mc;
    const tword *tw = p->tw;
    const int balanced = p->in->balanced, keyed = p->kwords != 0, ob = p->ob, tz = p->tz;
    int64_t *load = p->load;
    uint64_t *pk = p->pk, *kb = p->kb, coll = 0;
    for (uint32_t k = 0; k < M; k++) {
        uint32_t v = byc ? byc[k] : k;
        int64_t best = mc[mstart[v]];
        uint64_t t = (uint64_t)tok[best], w = t >> 6;
        uint64_t below = ((uint64_t)1 << (t & 63)) - 1;
        uint32_t u = tw[w].below + (uint32_t)__builtin_popcountll(tw[w].seen & below);
        if (balanced)
            best = least_loaded(mc, mstart[v], mstart[v + 1], load, cdisk);
        load[cdisk[best]]++;                 /* (policy "first": a count only) */
        uint64_t kk = 0;
        if (keyed) {
            kk = ((uint64_t)cdisk[best] << ob) | ((coff[best] - omin) >> tz);
            coll |= key_set(kb, kk);
        }
        pk[u] = (kk << 32) | (uint64_t)best;
    }
    p->coll |= coll;
}

/* Steps 1-2 with the token bitmap: a token's entry is its rank, the tokens
 * below it (prefix popcounts), so single-copy tokens take their copy in one
 * pass over the candidates in their order; only multi-copy tokens are
 * grouped for the bucket choice.  0 or -ENOMEM. */
ALWAYS_INLINE
int dedup_bitmap(struct plan *p)
{
    const se_plan_in *in = p->in;
    uint32_t M, U = tokens_seen(p, &M), minc, maxc;
    uint64_t *mlist = p->tmp;
    int64_t nm = p->kwords ? rank_pass(p, mlist, 1) : rank_pass(p, mlist, 0);
    group_multi(p, mlist, nm, M, &minc, &maxc);
    uint32_t *byc = NULL;                    /* ascending copy count (stable) */
    if (in->balanced && M && minc != maxc) {
        byc = (uint32_t *)(void *)p->key;
        if (copies_by_count(p->mstart, M, maxc, byc) < 0)
            return -ENOMEM;
    }
    choose_multi_bitmap(p, byc, M);
    for (int d = 0; d < in->ndisks; d++)
        p->out->disk_entries[d] = p->load[d];
    if (!p->kwords || p->coll) {
        int64_t *chosen = p->out->chosen;
        const uint64_t *pk = p->pk;
        for (uint32_t u = 0; u < U; u++)
            chosen[u] = (int64_t)(pk[u] & 0xffffffffu);
    }
    p->n = U;
    p->keyed = p->kwords != 0;
    return 0;
}

/* Step 2 of the token-sort path: the tokens' runs in the sorted candidates
 * sk: token u's candidates mc[ustart[u], ustart[u + 1]), its first copy
 * chosen, a single copy's bucket counted.  *multi, *maxc: the multi-copy
 * tokens, the most copies.  Returns the tokens. */
ALWAYS_INLINE
uint32_t token_runs(struct plan *p, const uint64_t *sk, uint32_t *multi, uint32_t *maxc)
{
    const int64_t m = p->in->m;
    const int32_t *cdisk = p->in->cdisk;
    uint32_t *ustart = p->ustart, *mc = p->mc;
    int64_t *chosen = p->out->chosen, *load = p->load;
    uint32_t U = 0, nmulti = 0, most = 1, start = 0;
    uint64_t prev = sk[0] >> 32;
    for (int64_t i = 0; i <= m; i++) {
        uint64_t t = i < m ? sk[i] >> 32 : ~(uint64_t)0;
        if (i < m)
            mc[i] = (uint32_t)sk[i];
        if (i > 0 && t == prev)
            continue;
        if (i > 0) {                     /* token prev: candidates [start, i) */
            uint32_t c = (uint32_t)i - start;
            ustart[U] = start;
            chosen[U] = mc[start];
            if (c == 1) {
                load[cdisk[mc[start]]]++;
            } else {
                nmulti++;
                most = c > most ? c : most;
            }
            U++;
        }
        start = (uint32_t)i;
        prev = t;
    }
    ustart[U] = (uint32_t)m;
    *multi = nmulti;
    *maxc = most;
    return U;
}

/* Steps 1-2 without the token bitmap: the candidates by token (a radix sort
 * of token << 32 | candidate on the token's bits, stable: candidate order
 * within a token); without dedup each candidate is an entry, with it each
 * token's first copy, or (balanced) the multi-copy tokens in ascending copy
 * count each to the smallest bucket among their copies.  0 or -ENOMEM. */
ALWAYS_INLINE
int dedup_sorted(struct plan *p)
{
    const se_plan_in *in = p->in;
    const int64_t m = in->m;
    int64_t *chosen = p->out->chosen;
    uint64_t *key = p->key;
    for (int64_t i = 0; i < m; i++)
        key[i] = ((uint64_t)in->tok[i] << 32) | (uint64_t)i;
    const uint64_t *sk = radix_sort_hi32(key, p->tmp, m, bit_length(p->tmax));
    if (!in->dedup) {
        for (int64_t i = 0; i < m; i++)
            chosen[i] = (int64_t)(sk[i] & 0xffffffffu);
        p->n = m;
        return 0;
    }
    uint32_t multi, maxc, U = token_runs(p, sk, &multi, &maxc);
    p->n = U;
    if (!in->balanced || !multi)
        return 0;
    uint32_t *byc = (uint32_t *)(void *)p->tmp;
    if (copies_by_count(p->ustart, U, maxc, byc) < 0)
        return -ENOMEM;
    for (uint32_t k = 0; k < multi; k++) {
        uint32_t u = byc[k];
        int64_t best = least_loaded(p->mc, p->ustart[u], p->ustart[u + 1], p->load, in->cdisk);
        p->load[in->cdisk[best]]++;
        chosen[u] = best;
    }
    return 0;
}

/* ---- step 3: the entries in (disk, offset) order ---------------------------------- */

/* Step 3 with the key bitmap (filled in step 2 on the token-bitmap path):
 * each chosen entry's key and bit. */
ALWAYS_INLINE
void key_entries(struct plan *p)
{
    const int32_t *cdisk = p->in->cdisk;
    const uint64_t *coff = p->in->coff, omin = p->omin;
    const int64_t n = p->n, *chosen = p->out->chosen;
    const int ob = p->ob, tz = p->tz;
    int64_t *disk_entries = p->out->disk_entries;
    uint64_t *kb = p->kb, *pk = p->pk, coll = 0;
    for (int64_t u = 0; u < n; u++) {
        int64_t c = chosen[u];
        uint64_t k = ((uint64_t)cdisk[c] << ob) | ((coff[c] - omin) >> tz);
        coll |= key_set(kb, k);
        disk_entries[cdisk[c]]++;
        pk[u] = (k << 32) | (uint64_t)c;
    }
    p->coll |= coll;
    p->keyed = 1;
}

/* Step 3 without it: a radix sort of the chosen entries, their offsets
 * relative to the smallest, without their common trailing zero bits, below
 * the disk bits, as one 32-bit key when they fit; else 64-bit (disk << 52 |
 * offset) records.  Then order[j] is the j-th entry, key[j] its disk << 52
 * | offset. */
ALWAYS_INLINE
void sort_entries(struct plan *p)
{
    const int32_t *cdisk = p->in->cdisk;
    const uint64_t *coff = p->in->coff;
    const int64_t n = p->n, *chosen = p->out->chosen;
    const int ndisks = p->in->ndisks;
    int64_t *disk_entries = p->out->disk_entries, *order = p->order;
    int32_t *ed = p->ed;
    uint64_t *go = p->go, *key = p->key;
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
            key[i] = ((((uint64_t)ed[i] << cb) | ((go[i] - cmin) >> ctz)) << 32) | (uint64_t)i;
        uint64_t *s3 = radix_sort_hi32(key, p->tmp, n, cb + db);
        for (int64_t j = 0; j < n; j++) {
            uint64_t v = s3[j], k = v >> 32;
            order[j] = (int64_t)(v & 0xffffffffu);
            key[j] = ((k >> cb) << 52) | (cmin + ((k & ((((uint64_t)1) << cb) - 1)) << ctz));
        }
        return;
    }
    kv_rec *recs = p->recs;
    for (int64_t i = 0; i < n; i++) {
        recs[i].key = ((uint64_t)ed[i] << 52) | go[i];
        recs[i].idx = i;
    }
    kv_rec *sr = radix_sort_rec(recs, p->rtmp, n, 66);
    for (int64_t i = 0; i < n; i++) {
        order[i] = sr[i].idx;
        key[i] = sr[i].key;
    }
}

/* ---- step 4: coalescing into requests ----------------------------------------------- */

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

/* Step 4 an entry at a time, reading the key bitmap in bit order: at[p] by
 * the entry's place p in that order (kp: the keys below each word). */
ALWAYS_INLINE
void coalesce_keyed(struct plan *p, coalescer *cs, int simple)
{
    const int64_t kwords = p->kwords;
    const uint64_t *kb = p->kb, omin = p->omin, omask = ((uint64_t)1 << p->ob) - 1;
    const int ob = p->ob, tz = p->tz;
    uint32_t *kp = p->kp;
    eplace *at = p->at;
    int64_t j = 0;
    for (int64_t w = 0; w < kwords; w++) {
        kp[w] = (uint32_t)j;
        for (uint64_t b = kb[w]; b; b &= b - 1) {
            uint64_t k = ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(b);
            coalesce_add(cs, k >> ob, omin + ((k & omask) << tz), j++, at, simple);
        }
    }
}

/* Step 4 an entry at a time in the sorted order: at[u] by entry. */
ALWAYS_INLINE
void coalesce_sorted(struct plan *p, coalescer *cs)
{
    const int64_t n = p->n, *order = p->order;
    const uint64_t *key = p->key;
    eplace *at = p->at;
    for (int64_t j = 0; j < n; j++)
        coalesce_add(cs, key[j] >> 52, key[j] & (((uint64_t)1 << 52) - 1), order[j], at, 0);
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
ALWAYS_INLINE
void run_request(const struct plan *p, uint64_t s, uint64_t e, uint64_t chunk, int64_t *q)
{
    /* entries s + j, j < L, at offsets o(s) + (j << tz); entry j in chunk
     * (j << tz) / chunk (a division only for a run that needs it) */
    const int ob = p->ob, tz = p->tz;
    const uint64_t omin = p->omin, E = p->in->E;
    uint64_t *qb = p->qb, *rs = p->rs, *re = p->re;
    int32_t *rd = p->rd;
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

ALWAYS_INLINE
int64_t coalesce_runs(const struct plan *p, uint64_t chunk, int adjacent)
{
    const int ob = p->ob;
    const int64_t kwords = p->kwords;
    const uint64_t *kb = p->kb;
    uint64_t *qb = p->qb;
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
            run_request(p, s0, ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(en), chunk, &q);
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
            run_request(p, s, ((uint64_t)w << 6) | (uint64_t)__builtin_ctzll(en), chunk, &q);
            en &= en - 1;
        }
    }
    return q;
}

/* Step 4: the requests (rd, rs, re), a run of the key bitmap at a time
 * (*runs) when no aligned ranges can overlap (entries and E in whole
 * blocks, and entries, at distinct keys at least 2**tz apart, at least E
 * apart) and two entries share a run iff their keys are adjacent, or never;
 * else an entry at a time in (disk, offset) order, from the key bitmap or
 * after the key sort (step 3).  Returns the number of requests. */
ALWAYS_INLINE
int64_t coalesce(struct plan *p, int *runs)
{
    const se_plan_in *in = p->in;
    const uint64_t E = in->E, bs = in->bs, max_request = in->max_request;
    /* (no max_request: one chunk of 2**62 bytes, past every offset) */
    uint64_t chunk = max_request == 0 ? (uint64_t)1 << 62 : max_request > E ? max_request : E;
    uint64_t g = (E + in->max_gap) >> p->tz;
    int simple = !((p->omin | p->ozor | E) & (bs - 1)) && (!p->ozor || E <= (uint64_t)1 << p->tz);
    *runs = p->keyed && simple && g <= 1;
    if (*runs)
        return coalesce_runs(p, chunk, g == 1);
    coalescer cs = {E, E + in->max_gap, chunk, ~(bs - 1), -1, ~(uint64_t)0, 0, 0, 0, 0, 0,
                    ~(uint64_t)0, p->rd, p->rs, p->re};
    if (p->keyed && simple)
        coalesce_keyed(p, &cs, 1);
    else if (p->keyed)
        coalesce_keyed(p, &cs, 0);
    else
        coalesce_sorted(p, &cs);
    return cs.q + 1;
}

/* ---- steps 5-6: the requests laid out, the entries placed ------------------------- */

/* Step 5: the submission order, round robin over the disks, request r of
 * each in turn, laid out back to back in staging (qdst: request q's
 * staging offset). */
ALWAYS_INLINE
void lay_out(struct plan *p, int64_t R)
{
    se_plan_out *out = p->out;
    const int ndisks = p->in->ndisks;
    const int32_t *rd = p->rd;
    const uint64_t *rs = p->rs, *re = p->re;
    int64_t *nreq_d = p->nreq_d, *first = p->first, *disk_bytes = out->disk_bytes;
    int32_t *rdisk = out->rdisk;
    uint64_t *roff = out->roff, *rdst = out->rdst, *qdst = p->qdst;
    uint32_t *rlen = out->rlen;
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
    out->staging = dst;
}

/* Step 6, per entry in the plan: its token, and where it lands in the
 * staging buffer.  After a run at a time: its request is the last that
 * starts at or below its key (qb's rank). */
ALWAYS_INLINE
void place_by_runs(struct plan *p)
{
    const int64_t n = p->n, kwords = p->kwords, *tok = p->in->tok;
    const uint64_t *pk = p->pk, *qb = p->qb, *qdst = p->qdst, *rs = p->rs, omin = p->omin;
    const uint64_t omask = ((uint64_t)1 << p->ob) - 1;
    const int tz = p->tz;
    uint32_t *kp = p->kp;
    int64_t *chosen = p->out->chosen, *utok = p->out->utok;
    uint64_t *src = p->out->src;
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
}

/* Step 6 after the key bitmap an entry at a time: its place in the bitmap's
 * order is its key's rank. */
ALWAYS_INLINE
void place_by_keys(struct plan *p)
{
    const int64_t n = p->n, *tok = p->in->tok;
    const uint64_t *pk = p->pk, *kb = p->kb, *qdst = p->qdst;
    const uint32_t *kp = p->kp;
    const eplace *at = p->at;
    int64_t *chosen = p->out->chosen, *utok = p->out->utok;
    uint64_t *src = p->out->src;
    uint64_t below_all = ~(uint64_t)0;
    for (int64_t u = 0; u < n; u++) {
        uint64_t c = pk[u] & 0xffffffffu, k = pk[u] >> 32;
        chosen[u] = (int64_t)c;
        utok[u] = tok[c];
        uint64_t w = k >> 6, below = ~(below_all << (k & 63));
        uint32_t j = kp[w] + (uint32_t)__builtin_popcountll(kb[w] & below);
        src[u] = qdst[at[j].q] + at[j].rel;
    }
}

/* Step 6 after the key sort: at[u] by entry. */
ALWAYS_INLINE
void place_by_entries(struct plan *p)
{
    const int64_t n = p->n, *tok = p->in->tok, *chosen = p->out->chosen;
    const uint64_t *qdst = p->qdst;
    const eplace *at = p->at;
    int64_t *utok = p->out->utok;
    uint64_t *src = p->out->src;
    for (int64_t u = 0; u < n; u++) {
        utok[u] = tok[chosen[u]];
        src[u] = qdst[at[u].q] + at[u].rel;
    }
}

/* ---- the planner --------------------------------------------------------------------- */

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
ALWAYS_INLINE
int64_t plan_body(const se_plan_in *in, se_plan_out *out)
{
    struct plan p = {.in = in, .out = out};
    int rc = plan_spans(&p);
    if (rc == 0)
        rc = plan_scratch(&p);
    if (rc == 0)
        rc = p.words ? dedup_bitmap(&p) : dedup_sorted(&p);
    if (rc < 0)
        return rc;
    out->n_entries = p.n;
    if (p.kwords && !p.keyed)
        key_entries(&p);
    p.keyed = p.keyed && !p.coll;
    if (!p.keyed)
        sort_entries(&p);
    int runs;
    int64_t R = coalesce(&p, &runs);
    lay_out(&p, R);
    if (runs)
        place_by_runs(&p);
    else if (p.keyed)
        place_by_keys(&p);
    else
        place_by_entries(&p);
    return R;
}

#if SE_X86
/* the same planner compiled with popcnt (the rank passes) and BMI2's
 * one-uop variable shifts (the key arithmetic) */
__attribute__((target("popcnt,bmi,bmi2")))
static int64_t plan_bmi2(const se_plan_in *in, se_plan_out *out)
{
    return plan_body(in, out);
}
#endif

int64_t se_plan_reads(const se_plan_in *in, se_plan_out *out)
{
    if (!in || !out || in->m < 0 || in->m >= ((int64_t)1 << 32) || in->ndisks <= 0 ||
        in->E == 0 || in->bs == 0 || (in->bs & (in->bs - 1)))
        return -EINVAL;
    for (int d = 0; d < in->ndisks; d++)
        out->disk_entries[d] = out->disk_bytes[d] = 0;
    out->n_entries = 0;
    out->staging = 0;
    if (in->m == 0)
        return 0;
#if SE_X86
    if (__builtin_cpu_supports("popcnt") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2"))
        return plan_bmi2(in, out);
#endif
    return plan_body(in, out);
}
