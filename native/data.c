/*
 * swarmfs native data kernels: the per-entry loops of the store and the
 * planner (kernels_int.h lists the kernel files; engine.h is the interface):
 * gather/scatter of entry rows, XXH3-64 checksums (xxHash, inlined), the
 * entry-bucket assignment of SWARM 6.1, and the radix sort that orders the
 * planner's candidates and the cluster choice's clusters.
 */
#include "kernels_int.h"

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

/* Stable LSD radix sort of 64-bit values by their bits [32, 32 + nbits)
 * (nbits <= 32; the low 32 bits ride along), in as few equal digits of at
 * most 11 bits as cover nbits, all digit histograms counted in one pass and
 * digits equal in every value skipped.  n < 2**32.  Returns the buffer that
 * holds the result (a or tmp). */
uint64_t *radix_sort_hi32(uint64_t *a, uint64_t *tmp, int64_t n, int nbits)
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
