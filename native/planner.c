/*
 * swarmfs read planner (SWARM 6.1, eq. 8): candidate copies to one copy
 * per token, balanced over the disk buckets, coalesced into block-aligned
 * requests laid out back to back in a staging buffer.
 */
#include "kernels_int.h"

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
