/*
 * swarmfs native engine: batched block I/O over several disks.
 *
 * One call (se_execute) carries out a whole plan: arrays of
 * (disk, byte offset, length, destination offset) against one buffer.
 * Two back ends share this interface:
 *   SE_KIND_URING    io_uring through liburing: one ring per calling thread
 *                    (created lazily, torn down on thread exit and se_close),
 *                    SQE batching, CQE batch reaping
 *   SE_KIND_THREADS  pthreads issuing pread/pwrite (fallback)
 *
 * Concurrency: se_execute, se_register_buffer, se_unregister_buffer and
 * se_get_counters may run at the same time from any number of threads; no
 * lock is held while requests are in flight (each thread submits to and reaps
 * from its own ring), and se_get_counters never waits for I/O (counters are
 * atomics).  se_close must not run concurrently with any other call on the
 * same engine (the Python wrapper waits for in-flight calls).
 *
 * Plus small data kernels used by the planner and the store (gather/scatter of
 * rows, XXH3 checksums, entry-bucket assignment), so that no Python code runs
 * per request or per KV entry.
 *
 * Every function that can fail returns 0 (or a count) on success and -errno on
 * failure; per-request results go to a status array (bytes done, or -errno).
 */
#ifndef SWARMFS_ENGINE_H
#define SWARMFS_ENGINE_H

#include <stdint.h>

#define SE_KIND_URING   1
#define SE_KIND_THREADS 2

#define SE_OP_READ  0
#define SE_OP_WRITE 1

#define SE_MAX_DISKS 256
#define SE_MAX_BUFFERS 64

/* Transient failures (io_uring_enter failing with EINTR/EAGAIN/EBUSY/EIO, or a
 * request/pread ending with -EAGAIN/-EINTR) are retried with exponential
 * backoff (1 us doubling, capped at 1 ms) at most this many times in a row
 * without progress; then the requests fail with that error. */
#define SE_DEFAULT_RETRY_LIMIT 200

/* io_uring setup flags that took (se_ring_flags). */
#define SE_RING_SINGLE_ISSUER 1
#define SE_RING_DEFER_TASKRUN 2
#define SE_RING_COOP_TASKRUN  4
#define SE_RING_SUBMIT_ALL    8

typedef struct se_engine se_engine;

/* Cumulative counters, all monotonic since se_*_open unless noted. */
typedef struct {
    uint64_t executes;        /* se_execute calls                              */
    uint64_t requests;        /* requests completed (ok or failed)             */
    uint64_t bytes;           /* bytes transferred                             */
    uint64_t submit_calls;    /* io_uring_enter calls (uring) / thread batches */
    uint64_t sqes;            /* SQEs submitted, incl. resubmissions           */
    uint64_t cqes;            /* CQEs reaped                                   */
    uint64_t retries;         /* -EAGAIN/-EINTR resubmissions and failed
                                 io_uring_enter calls that were retried        */
    uint64_t short_resubmits; /* resubmissions of the rest of a short transfer */
    uint64_t errors;          /* requests that ended with -errno               */
    uint64_t fixed_requests;  /* requests issued with a registered buffer      */
    uint64_t enter_errors;    /* io_uring_enter calls that failed              */
    uint64_t gave_up;         /* executes that stopped retrying a transient error */
    uint64_t fallback_executes; /* uring executes run with pread because this
                                   thread's ring could not be set up           */
    uint64_t long_waits;      /* submit-and-wait calls that took a second or
                                 more (each io_uring_enter waits at most one):
                                 a slow disk, or a late wake-up                */
    uint64_t rings_created;   /* rings set up (one per thread that executed)   */
    uint64_t rings_closed;    /* rings torn down (thread exit, close, broken)  */
    uint64_t thread_requests; /* requests of a uring engine run with pread/pwrite
                                 on the engine's threads: those to disks that
                                 cannot read without blocking (se_blocking_disks) */
    uint64_t in_flight;       /* gauge: se_execute calls running now           */
    uint64_t buffers;         /* gauge: buffers in the engine's fixed-buffer table */
    uint64_t buffer_register_errors; /* per-ring fixed-buffer registrations that
                                        failed (e.g. RLIMIT_MEMLOCK)           */
    int64_t  last_buffer_errno; /* errno of the last such failure (0: none)    */
    int64_t  last_ring_errno;   /* errno of the last failed ring setup (0: none) */
} se_counters;

typedef struct {
    uint64_t requests;
    uint64_t bytes;
    uint64_t busy_ns;  /* per execute: first submission to last completion on this disk */
} se_disk_counters;

/* What one se_execute call ran into (optional out-parameter). */
typedef struct {
    int32_t enter_errno;     /* last io_uring_enter error seen (0: none)        */
    uint32_t enter_failures; /* io_uring_enter calls that failed in this call   */
    int32_t gave_up;         /* 1: a transient error was retried too often      */
    int32_t fallback;        /* 1: ran with pread (no ring for this thread)     */
    int32_t ring_errno;      /* why the ring could not be set up (fallback)     */
    int32_t fixed;           /* 1: requests used the registered buffer          */
    uint64_t abandoned;      /* requests still in the kernel when the call gave
                                up: the buffer may still be written to         */
} se_exec_info;

/* Open an io_uring engine over nfds already-open file descriptors (the
 * engine duplicates them and closes its duplicates in se_close).
 * queue_depth: SQ entries (the CQ gets twice as many).  The calling thread's
 * ring is set up now; when the kernel refuses for lack of locked memory
 * (-ENOMEM, RLIMIT_MEMLOCK) the depth is halved down to 8 before giving up
 * (se_queue_depth gives the depth in use).
 * Returns 0, or -errno if io_uring cannot be set up (ENOSYS, EPERM, ENOMEM...). */
int se_uring_open(se_engine **out, const int *fds, int nfds, unsigned queue_depth);

/* Open the thread-pool engine: up to nthreads workers per se_execute call. */
int se_threads_open(se_engine **out, const int *fds, int nfds, unsigned nthreads);

int se_kind(const se_engine *e);
unsigned se_queue_depth(const se_engine *e);
int se_files_registered(const se_engine *e);
int se_ring_flags(const se_engine *e);
/* Disks whose files cannot read without blocking (RWF_NOWAIT: EOPNOTSUPP, e.g.
 * tmpfs).  io_uring would hand every request of theirs to its io-wq workers;
 * a uring engine runs them on its own threads with pread/pwrite instead
 * (SE_BLOCKING_THREADS, the default: 2.2-2.4x io-wq's rate on tmpfs at 4 KiB),
 * or submits them with IOSQE_ASYNC (SE_BLOCKING_IOWQ), which lets io-wq run
 * them concurrently. */
#define SE_BLOCKING_THREADS 0
#define SE_BLOCKING_IOWQ    1
int se_blocking_disks(const se_engine *e);
void se_set_blocking_mode(se_engine *e, int mode);
/* 1 if requests to disk d run with pread/pwrite on threads (a threads
 * engine, or a blocking disk of a uring engine in SE_BLOCKING_THREADS). */
int se_disk_on_threads(const se_engine *e, int d);
void se_set_retry_limit(se_engine *e, unsigned limit);

/* Register [addr, addr+len) as a fixed buffer.  The buffer enters the engine's
 * table and is registered in the calling thread's ring now, in other threads'
 * rings on their next se_execute.  Returns the slot (>= 0) or -errno (e.g.
 * -ENOMEM when RLIMIT_MEMLOCK is too small, -EOPNOTSUPP for the thread engine).
 * The memory must stay mapped until se_unregister_buffer or se_close. */
int se_register_buffer(se_engine *e, void *addr, uint64_t len);
int se_unregister_buffer(se_engine *e, int slot);

/* The requests of one se_execute call: request i moves len[i] bytes
 * between disk[i] at byte offset off[i] and buf + dst[i]. */
typedef struct {
    int op;                  /* SE_OP_READ or SE_OP_WRITE */
    int64_t n;
    const int32_t *disk;
    const uint64_t *off;
    const uint32_t *len;
    const uint64_t *dst;
    char *buf;
    uint64_t buflen;
    int buf_slot;            /* a registered buffer slot that contains buf, or -1 */
} se_requests;

/* Execute the requests rq.  status[i] receives len[i] on success or -errno
 * (-ENODATA when a read hit the end of the disk early).  info (may be NULL)
 * receives what the call ran into.  Returns the number of failed requests
 * (>= 0), or -errno if nothing could be attempted (-EINVAL for a bad
 * argument). */
int64_t se_execute(se_engine *e, const se_requests *rq, int32_t *status, se_exec_info *info);

/* Snapshot of the counters; never waits for I/O in flight. */
void se_get_counters(se_engine *e, se_counters *c, se_disk_counters *per_disk);
/* Tear down every ring and free the engine.  No other call may be running. */
void se_close(se_engine *e);

/* ---- data kernels ---------------------------------------------------- */

/* dst[i*row : (i+1)*row] = src[src_off[i] : src_off[i]+row] */
void se_gather_rows(char *dst, const char *src, const uint64_t *src_off,
                    int64_t n, uint64_t row);
/* dst[dst_off[i] : +row] = src[src_row[i]*row : +row] */
void se_scatter_rows(char *dst, const uint64_t *dst_off, const char *src,
                     const int64_t *src_row, int64_t n, uint64_t row);
/* out[i] = XXH3_64(buf + off[i], len[i]) */
void se_xxh3_ranges(const char *buf, const uint64_t *off, const uint64_t *len,
                    int64_t n, uint64_t *out);
/* out[i] = XXH3_64(buf + i*row, row) */
void se_xxh3_rows(const char *buf, int64_t n, uint64_t row, uint64_t *out);
/* Checks XXH3_64(buf + off[i], row) == expected[i]; writes the indices of the
 * failing rows to bad (at most max_bad) and returns how many failed. */
int64_t se_verify_rows(const char *buf, const uint64_t *off, int64_t n,
                       uint64_t row, const uint64_t *expected,
                       int64_t *bad, int64_t max_bad);

/* Entry-bucket scheduling (SWARM 6.1).  Entries are given in the order to
 * process (ascending copy count); entry i may be read from copies
 * [ptr[i], ptr[i+1]) whose disks are cdisk[...].  Each entry goes to the copy
 * whose disk bucket currently holds the fewest entries (first such copy on a
 * tie); load[] (ndisks) is updated; choice[i] receives the copy index. */
void se_assign_buckets(int64_t n, const int64_t *ptr, const int32_t *cdisk,
                       int64_t *load, int ndisks, int64_t *choice);

/* Medoid scoring GEMV: out[b * rows + r] = sum_c M[r * ld + c] * q[b * cols + c]
 * for nq queries, M in fp16 (kind 1) or bf16 (kind 2) bits with row stride ld
 * (elements), q and out float32.  One thread; AVX-512 / AVX2+F16C paths chosen
 * at run time, scalar otherwise.  Returns the path used: 3 avx512, 2 avx2,
 * 1 scalar, or -EINVAL. */
int se_gemv_half(const uint16_t *m, int64_t rows, int64_t cols, int64_t ld, int kind,
                 const float *q, int64_t nq, float *out);

/* Per-query-head logits against rows of H_kv heads, one pass over m:
 * m [rows, H_kv * d] (fp16 kind 1 / bf16 kind 2) whose rows start ld
 * elements apart (ld >= H_kv * d: e.g. the K half of stored entry rows, ld =
 * 2 H_kv d), q float32 [nq, H_q, d], out float32 [nq, H_q, rows]; query head
 * h uses KV head h / (H_q / H_kv).  Returns 0 or -EINVAL. */
int se_head_logits(const uint16_t *m, int64_t rows, int64_t ld, int64_t num_kv_heads,
                   int64_t d, int kind, const float *q, int64_t nq, int64_t num_q_heads,
                   float *out);

/* Softmax of each of nh rows of x [nh, n] (after multiplying by scale),
 * summed over the rows into out [n] (out is overwritten).  Vectorised exp on
 * AVX-512.  Returns 0 or -EINVAL. */
int se_softmax_sum(const float *x, int64_t nh, int64_t n, float scale, float *out);

/* The read planner's input: m candidate copies, copy i of token tok[i] at
 * byte offset coff[i] of disk cdisk[i]. */
typedef struct {
    int64_t m;
    const int64_t *tok;
    const int32_t *cdisk;
    const uint64_t *coff;
    int ndisks;
    uint64_t E;              /* entry bytes */
    uint64_t bs;             /* block size (a power of two) */
    uint64_t max_gap;        /* bytes between entries read through */
    uint64_t max_request;    /* bytes per request from a run's start (0: no limit) */
    int balanced;            /* 1: the bucket choice; 0: each token's first copy */
    int dedup;               /* 1: one entry per token */
} se_plan_in;

/* The plan: arrays of capacity m (per entry, per request) and ndisks (per
 * disk) that the caller provides; n_entries and staging are written. */
typedef struct {
    int64_t *utok;           /* per entry (ascending token): its token, */
    int64_t *chosen;         /* the candidate read, */
    uint64_t *src;           /* its byte offset in staging */
    int32_t *rdisk;          /* per request: disk, */
    uint64_t *roff;          /* byte offset, */
    uint32_t *rlen;          /* length, */
    uint64_t *rdst;          /* byte offset in staging */
    int64_t *disk_entries;   /* per disk: entries, */
    int64_t *disk_bytes;     /* bytes read */
    int64_t n_entries;       /* out */
    uint64_t staging;        /* out: staging bytes */
} se_plan_out;

/* The read planner (SWARM 6.1, eq. 8) in one call, as swarmfs._planner
 * documents it: m candidate copies -> with dedup, one copy per token
 * (balanced: single-copy entries fill their buckets, the others in
 * ascending copy count go to the smallest bucket among their copies, the
 * first copy on a tie; else the first copy); per disk in offset order, runs
 * of entries with gaps <= max_gap split every max_request bytes from the
 * run's start, block aligned, overlapping ranges merged; requests in
 * round-robin disk order laid out back to back.  Returns the request count
 * or -EINVAL / -ENOMEM, or for an argument out of range -EDOM (a token
 * outside [0, 2**31)), -ERANGE (a disk outside [0, ndisks)), -EOVERFLOW (an
 * offset at or beyond 2**52). */
int64_t se_plan_reads(const se_plan_in *in, se_plan_out *out);

/* Assembly: entry i (K of H heads then V of H heads, dbytes per head, at
 * src + src_off[i]) goes to column dst_idx[i] of k and v [H, n_total, dbytes];
 * nthreads 2 splits a large call over a second thread.  Returns 1 if it did. */
int se_gather_kv(const char *src, const uint64_t *src_off, int64_t n, int64_t H,
                 uint64_t dbytes, const int64_t *dst_idx, int64_t n_total, char *k, char *v,
                 int nthreads);
/* The inverse of se_gather_kv: column idx[i] of K and V [H, *, dbytes] (head
 * strides in bytes) to row i of out [m, 2 * H * dbytes]. */
void se_kv_rows(const char *k, const char *v, int64_t H, uint64_t dbytes, uint64_t kstride,
                uint64_t vstride, const int64_t *idx, int64_t m, char *out);
/* How se_gather_kv will store for these arguments on the current kernel path:
 * 2 = 512-bit non-temporal stores, 1 = 256-bit non-temporal stores, 0 = memcpy
 * (calls writing under 16 MiB, rows not a multiple of 64 bytes, K or V not
 * 64-byte aligned, or a path without them). */
int se_gather_kv_mode(uint64_t dbytes, int64_t n, int64_t H, const char *k, const char *v);

/* Kernel paths of the scoring kernels (gemv, head logits, softmax sums, fused
 * selection), chosen at run time from the CPU's features: */
#define SE_PATH_AUTO 0
#define SE_PATH_SCALAR 1
#define SE_PATH_AVX2 2
#define SE_PATH_AVX512 3
#define SE_PATH_NEON 4
/* The path the kernels use now. */
int se_kernel_path(void);
/* 1 when this CPU (and build) can run the path, else 0. */
int se_kernel_path_supported(int path);
/* Force a path (SE_PATH_AUTO: back to the best the CPU has), for benchmarks
 * and tests; process-wide.  Returns the path now used, or -ENOTSUP when this
 * CPU (or this build) lacks it. */
int se_set_kernel_path(int path);


/* The medoid index m [C, H * d] (2-byte floats) repacked for the "prob" score:
 * per KV head, blocks of 16 rows stored dimension-major, out [H, ceil(C/16), d, 16]
 * (rows past C are zero). */
void se_pack_medoids(const uint16_t *m, int64_t C, int64_t H, int64_t d, uint16_t *out);

/* The int8 medoid index (SWARM §5.2 scoring with int8 keys and fp32 scales):
 * out int8 [H, ceil(C/16), d/4, 16, 4] (per KV head, blocks of 16 rows, groups
 * of 4 dimensions), scales float [H, Cp] (max|row| / 127; Cp = 16 ceil(C/16)),
 * sums int32 [H, Cp] (each row's int8 sum).  d % 4 == 0. */
void se_pack_medoids_i8(const uint16_t *m, int64_t C, int64_t H, int64_t d, int kind,
                        int8_t *out, float *scales, int32_t *sums);

/* ---- scoring and cluster choice (SWARM 5.2, eq. 8) ------------------------
 * Their arguments travel in small structs: the query, the index scored, and
 * the cluster choice that follows the scores. */

/* One query: q float32 [Hq, d]; query head h reads KV head h / (Hq / H).
 * scale: the softmax scale (> 0). */
typedef struct {
    const float *q;
    int64_t Hq;
    int64_t H;
    int64_t d;
    float scale;
} se_query;

/* The cluster choice: clusters in descending score (ties: lower id; NaN
 * lowest) until the union of the window (the last w of S tokens) and the
 * chosen clusters' members (CSR ptr [C+1], members) holds budget distinct
 * entries (capped at S).  out [C] receives the chosen ids in order, entries
 * the distinct entries they hold. */
typedef struct {
    const int64_t *ptr;
    const int32_t *members;
    int64_t S;
    int64_t budget;
    int64_t w;
    int64_t *out;
    int64_t entries;         /* out */
} se_choice;

/* The fp16/bf16 medoid index: m [C, H * d] (kind 1 fp16, 2 bf16), and
 * optionally its se_pack_medoids form (NULL: none; used by the AVX-512 and
 * AVX2 "prob" paths). */
typedef struct {
    const uint16_t *m;
    const uint16_t *packed;
    int64_t C;
    int kind;
} se_half_index;

/* The int8 medoid index of se_pack_medoids_i8, rows medoids per KV head. */
typedef struct {
    const int8_t *data;
    const float *scales;
    const int32_t *sums;
    int64_t rows;
} se_i8_index;

/* The two-level int8 index (select.c documents it): per KV head the medoids
 * in K groups, each group's rows in whole blocks of 16 of the fine index. */
typedef struct {
    se_i8_index fine;        /* the medoids reordered by group: Crows rows a head */
    const int32_t *rowmed;   /* [H, Crows]: each row's medoid, -1 for padding */
    se_i8_index coarse;      /* the groups' centroids: K rows a head */
    const int32_t *gblk;     /* [H, K + 1]: group k's blocks [gblk[k], gblk[k+1]) */
    const float *glogn;      /* [H, K]: log of each group's members */
    const int32_t *mgrp;     /* [H, C]: each medoid's group */
    int64_t C;               /* medoids */
} se_i8x2_index;

/* Cluster choice alone, from scores [C].  Partial: a key threshold (two
 * counting passes) and a radix sort of the clusters above it, a bitmap of
 * seen tokens, no full sort.  Returns how many were chosen (ch->out,
 * ch->entries), or -EINVAL / -ENOMEM. */
int64_t se_choose_clusters(const float *scores, int64_t C, se_choice *ch);

/* Medoid scoring and cluster choice in one call: one query against ix (H KV
 * heads of d); score 0 = "prob" (per-head softmax of scale * logits, summed
 * over heads), 1 = "logit" (GQA-summed query, scaled).  work: float32
 * [C * (Hq + 1)] scratch (scores in its first C).  Then the choice ch.
 * Returns as se_choose_clusters. */
int64_t se_select_fused(const se_half_index *ix, const se_query *q, int score, float *work,
                        se_choice *ch);

/* Per-head logits lg float [Hq, rows] (unscaled) of the query (quantised per
 * head to int8) against the int8 index; exact integer dots, so every path
 * returns the same floats.  0 or -EINVAL / -ENOMEM. */
int se_head_logits_i8(const se_i8_index *ix, const se_query *q, float *lg);

/* se_select_fused's "prob" score from the int8 index, per KV head (logits of its
 * Hq / H query heads, then their softmax added into the scores); work float
 * [C * (Hq / H + 1)] scratch (scores in its first C).  nthreads 2: a second
 * thread for this call scores half the KV heads (joined before returning).
 * Then the choice ch.  Returns as se_choose_clusters. */
int64_t se_select_i8(const se_i8_index *ix, const se_query *q, int nthreads, float *work,
                     se_choice *ch);

/* Two-level int8 selection: per KV head the G heads' logits against the K
 * group centroids, the best ngroups groups' medoids scored exactly, the
 * others through their centroid; scores [C] written; with ch NULL only the
 * scores, else the choice ch.  Returns the clusters chosen (0 with ch NULL),
 * or -EINVAL / -ENOMEM. */
int64_t se_select_i8x2(const se_i8x2_index *ix, const se_query *q, int64_t ngroups,
                       float *score, se_choice *ch);

#endif
