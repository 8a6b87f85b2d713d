/*
 * swarmfs native engine.  See engine.h for the interface.
 *
 * io_uring back end: one ring per (engine, thread), as liburing's
 * documentation and 3FS USRBIO recommend: a ring is set up the first time a
 * thread executes (or registers a buffer), with IORING_SETUP_SINGLE_ISSUER,
 * DEFER_TASKRUN and COOP_TASKRUN where the kernel has them; the disks are
 * registered files of every ring.  No lock is held while requests are in
 * flight: a thread submits to and reaps from its own ring only.  A ring is
 * torn down when its thread exits (a pthread key destructor), when the engine
 * closes, or when the ring broke (io_uring_enter kept failing).
 *
 * se_execute fills as many SQEs as the ring holds, submits them and waits in
 * one io_uring_enter (io_uring_submit_and_wait), reaps CQEs in batches
 * (io_uring_peek_batch_cqe + one io_uring_cq_advance), and resubmits the rest
 * of short transfers and requests that ended with -EAGAIN/-EINTR.  When the
 * plan fits in the ring, the whole plan costs a single io_uring_enter.
 * Transient failures are retried with backoff a bounded number of times in a
 * row without progress (SE_DEFAULT_RETRY_LIMIT), then the requests fail; a
 * wait never blocks for more than a second at a time, and requests in the
 * kernel without any completion for SE_STALL_NS (60 s) fail with ETIMEDOUT.
 *
 * Fixed buffers (rings.c): a buffer is registered in a ring when that ring's
 * thread first reads into it; a buffer whose registration fails in a ring
 * (e.g. RLIMIT_MEMLOCK) is read with plain READ there; the failure is counted.
 * Files that cannot read without blocking (tmpfs) get IOSQE_ASYNC.
 *
 * Thread back end: up to nthreads pthreads per call pull request indices from
 * an atomic counter and issue pread/pwrite with the same retry rules.  It is
 * also the fallback of a uring engine in a thread whose ring cannot be set up.
 *
 * Counters are atomics, added once per call from per-call tallies, so
 * se_get_counters never waits for I/O.
 *
 * Per-thread rings and fixed-buffer registration are in rings.c; the data
 * kernels (gather/scatter, checksums, scoring, selection, the planner,
 * assembly) are in one file per job, listed in kernels_int.h.
 */
#include "engine_int.h"

#include <time.h>
#include <unistd.h>
#include <sys/uio.h>

/* ---- open / close ------------------------------------------------------ */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void backoff(unsigned fails)
{
    uint64_t ns = 1000ull << (fails < 11 ? fails - 1 : 10);
    if (ns > BACKOFF_MAX_NS)
        ns = BACKOFF_MAX_NS;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ns};
    nanosleep(&ts, NULL);
}

/* Whether io_uring can try a read of fd inline: a file without non-blocking
 * read support (RWF_NOWAIT gives EOPNOTSUPP, e.g. tmpfs) has every read punted
 * to io-wq, and io-wq runs punted work concurrently only when it was submitted
 * with IOSQE_ASYNC (otherwise one worker at a time).  Punting by request size
 * does not pay on tmpfs: without IOSQE_ASYNC 4 KiB reads did 500K IOPS
 * against 554K with it (interleaved, medians of 11), and 128 KiB reads lost
 * about 40%. */
static int supports_nowait(int fd)
{
    void *b = NULL;
    if (posix_memalign(&b, 4096, 4096) != 0)
        return 1;
    struct iovec iov = {.iov_base = b, .iov_len = 4096};
    ssize_t r = preadv2(fd, &iov, 1, 0, RWF_NOWAIT);
    int ok = !(r < 0 && errno == EOPNOTSUPP);
    free(b);
    return ok;
}

static int check_fds(const int *fds, int nfds)
{
    if (nfds <= 0 || nfds > SE_MAX_DISKS)
        return -EINVAL;
    for (int i = 0; i < nfds; i++)
        if (fds[i] < 0)
            return -EBADF;
    return 0;
}

static se_engine *alloc_engine(int kind, const int *fds, int nfds)
{
    se_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return NULL;
    e->kind = kind;
    e->nfds = nfds;
    e->retry_limit = SE_DEFAULT_RETRY_LIMIT;
    e->wait_div = 4;   /* 4 and 8 measured alike; 1 (refill after every CQE) is slower */
    memcpy(e->fds, fds, sizeof(int) * (size_t)nfds);
    pthread_mutex_init(&e->mu, NULL);
    return e;
}

int se_uring_open(se_engine **out, const int *fds, int nfds, unsigned queue_depth)
{
    int ret = check_fds(fds, nfds);
    if (ret)
        return ret;
    if (queue_depth == 0 || queue_depth > 32768)
        return -EINVAL;
    se_engine *e = alloc_engine(SE_KIND_URING, fds, nfds);
    if (!e)
        return -ENOMEM;
    ret = rings_open(e, queue_depth);
    if (ret < 0) {
        pthread_mutex_destroy(&e->mu);
        free(e);
        return ret;
    }
    e->nthreads = e->qd < 32 ? e->qd : 32;
    for (int d = 0; d < nfds; d++) {
        e->punt[d] = !supports_nowait(fds[d]);
        e->npunt += e->punt[d];
    }
    *out = e;
    return 0;
}

int se_threads_open(se_engine **out, const int *fds, int nfds, unsigned nthreads)
{
    int ret = check_fds(fds, nfds);
    if (ret)
        return ret;
    if (nthreads == 0 || nthreads > 1024)
        return -EINVAL;
    se_engine *e = alloc_engine(SE_KIND_THREADS, fds, nfds);
    if (!e)
        return -ENOMEM;
    e->nthreads = nthreads;
    e->qd = nthreads;
    engine_publish(e);
    *out = e;
    return 0;
}

int se_kind(const se_engine *e) { return e->kind; }
unsigned se_queue_depth(const se_engine *e) { return e->qd; }
int se_files_registered(const se_engine *e) { return e->files_registered; }
int se_ring_flags(const se_engine *e) { return e->ring_flags; }
int se_async_disks(const se_engine *e) { return e->npunt; }
void se_set_retry_limit(se_engine *e, unsigned limit) { e->retry_limit = limit; }

void se_close(se_engine *e)
{
    if (!e)
        return;
    rings_close(e);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* ---- execution ---------------------------------------------------------- */

/* Bookkeeping of one se_execute call. */
struct exec_ctx {
    se_engine *e;
    int op;
    int64_t n;
    const int32_t *disk;
    const uint64_t *off;
    const uint32_t *len;
    const uint64_t *dst;
    char *buf;
    int32_t *status;
    se_counters lc;          /* this call's tallies, added to e->c at the end */
    uint64_t first_ns[SE_MAX_DISKS];
    uint64_t last_ns[SE_MAX_DISKS];
    uint64_t dreq[SE_MAX_DISKS];
    uint64_t dbytes[SE_MAX_DISKS];
    uint64_t failed;
    int gave_up;             /* a request stopped retrying a transient error */
};

/* Validates request i; returns 0 or -errno. */
static int check_request(const struct exec_ctx *x, int64_t i, uint64_t buflen)
{
    if (x->disk[i] < 0 || x->disk[i] >= x->e->nfds)
        return -EBADF;
    if (x->len[i] == 0 || x->dst[i] > buflen || x->len[i] > buflen - x->dst[i])
        return -EINVAL;
    if (x->off[i] > (uint64_t)INT64_MAX - x->len[i])
        return -EINVAL;
    return 0;
}

static void finish_counters(struct exec_ctx *x)
{
    se_engine *e = x->e;
    for (int d = 0; d < e->nfds; d++) {
        if (!x->dreq[d])
            continue;
        ADD(e->d[d].requests, x->dreq[d]);
        ADD(e->d[d].bytes, x->dbytes[d]);
        if (x->last_ns[d] > x->first_ns[d])
            ADD(e->d[d].busy_ns, x->last_ns[d] - x->first_ns[d]);
    }
    se_counters *c = &x->lc;
    c->executes++;
    uint64_t *src = (uint64_t *)c, *dst = (uint64_t *)&e->c;
    /* every field up to (not including) in_flight is a plain sum */
    size_t nsum = offsetof(se_counters, in_flight) / sizeof(uint64_t);
    for (size_t k = 0; k < nsum; k++)
        if (src[k])
            ADD(dst[k], src[k]);
}

static int transient_enter_error(int err)
{
    return err == -EINTR || err == -EAGAIN || err == -EBUSY || err == -EIO ||
           err == -ETIME || err == -ENOMEM;
}

/* ---- io_uring ---------------------------------------------------------- */

static void uring_execute(struct exec_ctx *x, struct se_ring *r, int64_t *queue,
                          uint32_t *prog, int64_t nq, int buf_slot, se_exec_info *info)
{
    se_engine *e = x->e;
    struct io_uring *ring = &r->ring;
    se_counters *lc = &x->lc;
    struct io_uring_cqe *cqes[CQE_BATCH];
    const int64_t n = x->n;
    int64_t qh = 0, qt = nq == n ? 0 : nq, qcount = nq;  /* ring buffer of request indices */
    int64_t remaining = nq;
    unsigned inflight = 0;   /* SQEs filled and not reaped (in the SQ or the kernel) */
    unsigned fails = 0;      /* rounds in a row without progress */
    uint64_t t_progress = 0; /* first round without progress (0: made progress) */
    int last_err = 0, give_up = 0;
    const int fixed_file = r->files_registered;
    const unsigned qd = r->qd;

    while (remaining > 0) {
        uint64_t t = 0;
        while (qcount > 0 && inflight < qd) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
            if (!sqe)
                break;
            int64_t i = queue[qh];
            if (++qh == n)
                qh = 0;
            qcount--;
            int d = x->disk[i];
            int fd = fixed_file ? d : e->fds[d];
            char *addr = x->buf + x->dst[i] + prog[i];
            unsigned nbytes = x->len[i] - prog[i];
            uint64_t offset = x->off[i] + prog[i];
            if (buf_slot >= 0) {
                if (x->op == SE_OP_READ)
                    io_uring_prep_read_fixed(sqe, fd, addr, nbytes, offset, buf_slot);
                else
                    io_uring_prep_write_fixed(sqe, fd, addr, nbytes, offset, buf_slot);
                if (prog[i] == 0)
                    lc->fixed_requests++;
            } else if (x->op == SE_OP_READ) {
                io_uring_prep_read(sqe, fd, addr, nbytes, offset);
            } else {
                io_uring_prep_write(sqe, fd, addr, nbytes, offset);
            }
            if (fixed_file)
                sqe->flags |= IOSQE_FIXED_FILE;
            if (e->punt[d])
                sqe->flags |= IOSQE_ASYNC;
            io_uring_sqe_set_data64(sqe, (uint64_t)i);
            inflight++;
            lc->sqes++;
            if (!x->first_ns[d]) {
                if (!t)
                    t = now_ns();
                x->first_ns[d] = t;
            }
        }
        /* Everything queued is in the ring: wait for all of it.  Otherwise
         * wait for a fraction, so that each enter refills a batch. */
        unsigned wait_nr = inflight;
        if (qcount > 0) {
            wait_nr = inflight / e->wait_div;
            if (wait_nr < 1)
                wait_nr = 1;
        }
        /* Never block for ever in one enter: wake up every second to check for
         * a stall (SE_STALL_NS without any completion). */
        struct __kernel_timespec ts = {.tv_sec = 1, .tv_nsec = 0};
        struct io_uring_cqe *first = NULL;
        uint64_t tw = now_ns();   /* long_waits: waits of a second or more */
        int ret = io_uring_submit_and_wait_timeout(ring, &first, wait_nr, &ts, NULL);
        lc->submit_calls++;
        if (now_ns() - tw >= 1000000000ull)
            lc->long_waits++;
        int progress = 0;
        unsigned got;
        do {
            got = io_uring_peek_batch_cqe(ring, cqes, CQE_BATCH);
            if (!got)
                break;
            uint64_t tc = now_ns();
            for (unsigned k = 0; k < got; k++) {
                int64_t i = (int64_t)io_uring_cqe_get_data64(cqes[k]);
                int res = cqes[k]->res;
                int d = x->disk[i];
                inflight--;
                x->last_ns[d] = tc;
                if (res == -EAGAIN || res == -EINTR) {
                    lc->retries++;
                    last_err = res;
                    queue[qt] = i;
                    if (++qt == n)
                        qt = 0;
                    qcount++;
                    continue;
                }
                progress = 1;
                if (res < 0 || (res == 0 && x->len[i] > prog[i])) {
                    x->status[i] = res < 0 ? res : -ENODATA;
                    x->failed++;
                    lc->errors++;
                    lc->requests++;
                    x->dreq[d]++;
                    x->dbytes[d] += prog[i];
                    lc->bytes += prog[i];
                    remaining--;
                    continue;
                }
                prog[i] += (uint32_t)res;
                if (prog[i] < x->len[i]) {
                    lc->short_resubmits++;
                    queue[qt] = i;
                    if (++qt == n)
                        qt = 0;
                    qcount++;
                    continue;
                }
                x->status[i] = (int32_t)x->len[i];
                lc->requests++;
                lc->bytes += x->len[i];
                x->dreq[d]++;
                x->dbytes[d] += x->len[i];
                remaining--;
            }
            lc->cqes += got;
            io_uring_cq_advance(ring, got);
        } while (got == CQE_BATCH);
        /* A wait for requests already in the kernel that timed out (every
         * second) or that a signal interrupted is not a failure; it fails only
         * when nothing completes for SE_STALL_NS. */
        int waiting = (ret == -ETIME || ret == -EINTR || ret >= 0) &&
                      inflight > io_uring_sq_ready(ring);
        if (ret < 0 && ret != -ETIME) {
            lc->enter_errors++;
            lc->retries++;
            info->enter_failures++;
            info->enter_errno = -ret;
            last_err = ret;
            if (!transient_enter_error(ret)) {
                give_up = 1;
                break;
            }
        }
        if (progress) {
            fails = 0;
            t_progress = 0;
        } else if (remaining > 0) {
            uint64_t tn = now_ns();
            if (!t_progress)
                t_progress = tn;
            if (waiting) {
                if (tn - t_progress >= SE_STALL_NS) {
                    last_err = -ETIMEDOUT;
                    give_up = 1;
                    info->gave_up = 1;
                    lc->gave_up++;
                    break;
                }
                if (ret != -ETIME)
                    backoff(1);
                continue;
            }
            if (++fails > e->retry_limit) {
                give_up = 1;
                info->gave_up = 1;
                lc->gave_up++;
                break;
            }
            backoff(fails);
        }
    }
    if (give_up) {
        /* The ring is in an unknown state (SQEs the kernel has not taken,
         * requests it has taken and not completed): fail what is left and
         * retire the ring.  Requests still in the kernel may yet write to the
         * buffer: the caller must not reuse it (info->abandoned). */
        unsigned in_sq = io_uring_sq_ready(ring);
        info->abandoned = inflight > in_sq ? inflight - in_sq : 0;
        int err = last_err ? last_err : -EIO;
        for (int64_t i = 0; i < n; i++) {
            if (x->status[i] == 0) {
                x->status[i] = err;
                x->failed++;
                lc->errors++;
                lc->requests++;
            }
        }
        r->broken = 1;
    }
}

/* ---- threads ----------------------------------------------------------- */

struct thread_arg {
    struct exec_ctx *x;
    const int64_t *queue;
    int64_t nq;
    int64_t *next;
    pthread_mutex_t *mu;
};

static void *thread_main(void *p)
{
    struct thread_arg *a = p;
    struct exec_ctx *x = a->x;
    se_engine *e = x->e;
    for (;;) {
        int64_t k = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
        if (k >= a->nq)
            break;
        int64_t i = a->queue[k];
        int d = x->disk[i];
        int fd = e->fds[d];
        uint64_t t0 = now_ns();
        uint32_t done = 0;
        int32_t st = 0;
        uint64_t retries = 0, shorts = 0;
        unsigned fails = 0;
        while (done < x->len[i]) {
            char *addr = x->buf + x->dst[i] + done;
            size_t nbytes = x->len[i] - done;
            off_t offset = (off_t)(x->off[i] + done);
            ssize_t r = x->op == SE_OP_READ ? pread(fd, addr, nbytes, offset)
                                            : pwrite(fd, addr, nbytes, offset);
            if (r < 0) {
                if (errno == EINTR || errno == EAGAIN) {
                    int err = errno;
                    retries++;
                    if (++fails > e->retry_limit) {
                        st = -err;
                        break;
                    }
                    backoff(fails);
                    continue;
                }
                st = -errno;
                break;
            }
            if (r == 0) {
                st = -ENODATA;
                break;
            }
            fails = 0;
            done += (uint32_t)r;
            if (done < x->len[i])
                shorts++;
        }
        uint64_t t1 = now_ns();
        pthread_mutex_lock(a->mu);
        x->status[i] = st ? st : (int32_t)x->len[i];
        if (!x->first_ns[d] || t0 < x->first_ns[d])
            x->first_ns[d] = t0;
        if (t1 > x->last_ns[d])
            x->last_ns[d] = t1;
        x->dreq[d]++;
        x->dbytes[d] += done;
        x->lc.requests++;
        x->lc.bytes += done;
        x->lc.retries += retries;
        x->lc.short_resubmits += shorts;
        x->lc.sqes++;
        x->lc.cqes++;
        if (st) {
            x->failed++;
            x->lc.errors++;
            if (fails > e->retry_limit)
                x->gave_up = 1;
        }
        pthread_mutex_unlock(a->mu);
    }
    return NULL;
}

static void threads_execute(struct exec_ctx *x, const int64_t *queue, int64_t nq)
{
    se_engine *e = x->e;
    unsigned nt = e->nthreads ? e->nthreads : 1;
    if ((int64_t)nt > nq)
        nt = (unsigned)nq;
    pthread_t tids[1024];
    int64_t next = 0;
    pthread_mutex_t mu;
    pthread_mutex_init(&mu, NULL);
    struct thread_arg a = {.x = x, .queue = queue, .nq = nq, .next = &next, .mu = &mu};
    unsigned started = 0;
    for (unsigned k = 1; k < nt; k++) {
        if (pthread_create(&tids[started], NULL, thread_main, &a) != 0)
            break;
        started++;
    }
    x->lc.submit_calls++;
    thread_main(&a); /* the caller works too; with nt == 1 it works alone */
    for (unsigned k = 0; k < started; k++)
        pthread_join(tids[k], NULL);
    pthread_mutex_destroy(&mu);
    if (x->gave_up)
        x->lc.gave_up++;
}

int64_t se_execute(se_engine *e, int op, int64_t n,
                   const int32_t *disk, const uint64_t *off,
                   const uint32_t *len, const uint64_t *dst,
                   char *buf, uint64_t buflen, int buf_slot,
                   int32_t *status, se_exec_info *info)
{
    se_exec_info dummy;
    if (!info)
        info = &dummy;
    memset(info, 0, sizeof(*info));
    if (!e || n < 0 || (op != SE_OP_READ && op != SE_OP_WRITE))
        return -EINVAL;
    if (n == 0)
        return 0;
    if (!disk || !off || !len || !dst || !buf || !status)
        return -EINVAL;
    struct exec_ctx *x = calloc(1, sizeof(*x));
    int64_t *queue = malloc(sizeof(int64_t) * (size_t)n);
    uint32_t *prog = calloc((size_t)n, sizeof(uint32_t));
    if (!x || !queue || !prog) {
        free(x);
        free(queue);
        free(prog);
        return -ENOMEM;
    }
    ADD(e->c.in_flight, 1);
    x->e = e;
    x->op = op;
    x->n = n;
    x->disk = disk;
    x->off = off;
    x->len = len;
    x->dst = dst;
    x->buf = buf;
    x->status = status;

    int64_t nq = 0;
    for (int64_t i = 0; i < n; i++) {
        int r = check_request(x, i, buflen);
        if (r) {
            status[i] = r;
            x->failed++;
            x->lc.errors++;
            x->lc.requests++;
        } else {
            status[i] = 0;
            queue[nq++] = i;
        }
    }
    if (nq > 0 && e->kind == SE_KIND_URING) {
        int err = 0;
        struct se_ring *r = get_ring(e, &err);
        if (r) {
            ring_sync_buffers(e, r, buf_slot);
            if (buf_slot >= 0) {
                struct slot *s = buf_slot < SE_MAX_BUFFERS ? &r->mirror[buf_slot] : NULL;
                if (!s || !s->id || buf < s->addr || buf + buflen > s->addr + s->len)
                    buf_slot = -1;
            }
            info->fixed = buf_slot >= 0;
            uring_execute(x, r, queue, prog, nq, buf_slot, info);
            if (r->broken)
                ring_destroy_own(e, r);
        } else {
            info->fallback = 1;
            info->ring_errno = -err;
            x->lc.fallback_executes++;
            threads_execute(x, queue, nq);
        }
    } else if (nq > 0) {
        threads_execute(x, queue, nq);
    }
    if (x->gave_up)
        info->gave_up = 1;
    finish_counters(x);
    SUB(e->c.in_flight, 1);
    int64_t failed = (int64_t)x->failed;
    free(x);
    free(queue);
    free(prog);
    return failed;
}

void se_get_counters(se_engine *e, se_counters *c, se_disk_counters *per_disk)
{
    if (c) {
        const uint64_t *src = (const uint64_t *)&e->c;
        uint64_t *dst = (uint64_t *)c;
        for (size_t k = 0; k < sizeof(se_counters) / sizeof(uint64_t); k++)
            dst[k] = __atomic_load_n(&src[k], __ATOMIC_RELAXED);
    }
    if (per_disk) {
        for (int d = 0; d < e->nfds; d++) {
            per_disk[d].requests = __atomic_load_n(&e->d[d].requests, __ATOMIC_RELAXED);
            per_disk[d].bytes = __atomic_load_n(&e->d[d].bytes, __ATOMIC_RELAXED);
            per_disk[d].busy_ns = __atomic_load_n(&e->d[d].busy_ns, __ATOMIC_RELAXED);
        }
    }
}
