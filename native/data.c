/*
 * swarmfs native data kernels: the per-entry loops of the store and the
 * planner (kernels_int.h lists the kernel files; engine.h is the interface):
 * gather/scatter of entry rows, XXH3-64 checksums (xxHash, inlined) and the
 * entry-bucket assignment of SWARM 6.1.
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
