/*
 * swarmfs native data kernels: internal definitions shared by the kernel
 * files (the cffi interface is engine.h).  One file per job:
 *
 *   data.c      gather/scatter of entry rows, XXH3-64 checksums, the
 *               entry-bucket assignment of SWARM 6.1
 *   scoring.c   medoid scoring: fp16/bf16 GEMV, per-head logits and softmax
 *               sums (AVX-512 / AVX2+F16C / NEON with a scalar fallback), and
 *               the run-time choice of kernel path
 *   index_i8.c  the int8 medoid index: packing, quantised queries, logits
 *   select.c    the cluster choice (SWARM 5.2, eq. 8), alone or after scoring
 *   planner.c   the read planner (SWARM 6.1, eq. 8)
 *   gather.c    assembly: entries straight into K and V
 */
#ifndef SWARMFS_KERNELS_INT_H
#define SWARMFS_KERNELS_INT_H

#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define SE_X86 1
#include <immintrin.h>
#else
#define SE_X86 0
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

/* fp16 (kind 1) or bf16 (kind 2) bits to fp32. */
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

/* A per-thread scratch area that only grows, kept between calls (a fresh
 * malloc of these sizes is an mmap whose page faults cost more than the
 * work).  Each caller keeps its own (static __thread), so callers may nest.
 * Returns NULL when the area cannot grow. */
struct scratch {
    char *buf;
    size_t cap;
};

static inline char *scratch_get(struct scratch *sc, size_t need)
{
    if (need > sc->cap) {
        free(sc->buf);
        sc->buf = malloc(need);
        sc->cap = sc->buf ? need : 0;
    }
    return sc->buf;
}

/* data.c */
/* Stable LSD radix sort of 64-bit values by their bits [32, 32 + nbits)
 * (nbits <= 32; the low 32 bits ride along); n < 2**32.  Returns the buffer
 * that holds the result (a or tmp). */
uint64_t *radix_sort_hi32(uint64_t *a, uint64_t *tmp, int64_t n, int nbits);

/* scoring.c */
/* softmax_sum on a writable x, one exp per element, adding into out (init:
 * the first head overwrites it). */
void softmax_acc(int path, float *x, int64_t nh, int64_t n, float scale, float *out,
                 int init);
/* se_select_fused's scores: work [C * (Hq + 1)], the scores in its first C.
 * 0 or -ENOMEM. */
int half_scores(int path, const se_half_index *ix, const se_query *q, int score, float *work);

/* index_i8.c */
/* The quantised query of i8_logits: q8 [Hq, d], sq [Hq], qw [Hq, d/4]. */
typedef struct {
    int8_t *q8;
    float *sq;
    uint32_t *qw;
    int64_t Hq, d;
} i8_query;

void i8_query_free(i8_query *t);
/* q [Hq, d] quantised per head (and as words for the vector paths). */
int i8_query_make(int path, const float *q, int64_t Hq, int64_t d, i8_query *t);
/* Logits of the query heads of t (Hq / H per KV head) of KV heads [g0, g1)
 * against ix (H KV heads): lg [(g1 - g0) * Hq / H rows of stride ldc]. */
void i8_logits(int path, const se_i8_index *ix, int64_t H, const i8_query *t, int64_t g0,
               int64_t g1, float *lg, int64_t ldc);
/* Nonzero when an int8 index and a query cannot go together (-EINVAL). */
int i8_args_bad(const se_i8_index *ix, const se_query *q);

#endif
