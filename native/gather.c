/*
 * swarmfs assembly: entries straight from the staging buffer into K and V
 * [H, n_total, d] (non-temporal stores for large gathers, a second thread
 * for large calls), and the inverse (se_kv_rows).
 */
#include "kernels_int.h"

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
