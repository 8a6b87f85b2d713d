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
 * Requests to disks that cannot read without blocking (tmpfs) run on the
 * engine's threads beside the ring (mixed_execute), or with IOSQE_ASYNC on
 * request (se_set_blocking_mode).
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

#include <fcntl.h>
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

static void free_engine(se_engine *e)
{
    for (int d = 0; d < e->nfds; d++)
        if (e->fds[d] >= 0)
            close(e->fds[d]);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* A new engine holding its own duplicates of fds (closed by se_close), so
 * that every path reads the files it was opened with, as the ring's
 * registered files do, even if the caller closes or reuses its numbers.
 * NULL with *err on failure. */
static se_engine *alloc_engine(int kind, const int *fds, int nfds, int *err)
{
    se_engine *e = calloc(1, sizeof(*e));
    if (!e) {
        *err = -ENOMEM;
        return NULL;
    }
    e->kind = kind;
    e->nfds = nfds;
    e->retry_limit = SE_DEFAULT_RETRY_LIMIT;
    e->wait_div = 4;   /* 4 and 8 measured alike; 1 (refill after every CQE) is slower */
    pthread_mutex_init(&e->mu, NULL);
    for (int d = 0; d < nfds; d++)
        e->fds[d] = -1;
    for (int d = 0; d < nfds; d++) {
        e->fds[d] = fcntl(fds[d], F_DUPFD_CLOEXEC, 0);
        if (e->fds[d] < 0) {
            *err = -errno;
            free_engine(e);
            return NULL;
        }
    }
    return e;
}

int se_uring_open(se_engine **out, const int *fds, int nfds, unsigned queue_depth)
{
    int ret = check_fds(fds, nfds);
    if (ret)
        return ret;
    if (queue_depth == 0 || queue_depth > 32768)
        return -EINVAL;
    se_engine *e = alloc_engine(SE_KIND_URING, fds, nfds, &ret);
    if (!e)
        return ret;
    ret = rings_open(e, queue_depth);
    if (ret < 0) {
        free_engine(e);
        return ret;
    }
    e->nthreads = e->qd < 32 ? e->qd : 32;
    for (int d = 0; d < nfds; d++) {
        e->punt[d] = !supports_nowait(e->fds[d]);
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
    se_engine *e = alloc_engine(SE_KIND_THREADS, fds, nfds, &ret);
    if (!e)
        return ret;
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
int se_blocking_disks(const se_engine *e) { return e->npunt; }

/* The one rule for a uring engine: requests to disk d run on its threads
 * (a blocking disk, in SE_BLOCKING_THREADS mode). */
static int on_threads(const se_engine *e, int d)
{
    return e->blocking_mode == SE_BLOCKING_THREADS && e->punt[d];
}

/* Whether any disk of a uring engine is on_threads (a call may be mixed). */
static int some_on_threads(const se_engine *e)
{
    return e->blocking_mode == SE_BLOCKING_THREADS && e->npunt;
}

int se_disk_on_threads(const se_engine *e, int d)
{
    return e->kind == SE_KIND_THREADS || (d >= 0 && d < e->nfds && on_threads(e, d));
}
void se_set_blocking_mode(se_engine *e, int mode) { e->blocking_mode = mode; }
void se_set_retry_limit(se_engine *e, unsigned limit) { e->retry_limit = limit; }

void se_close(se_engine *e)
{
    if (!e)
        return;
    rings_close(e);
    free_engine(e);
}

/* ---- execution ---------------------------------------------------------- */

/* Bookkeeping of one se_execute call. */
struct exec_ctx {
    se_engine *e;
    se_requests rq;          /* the caller's requests */
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
static int check_request(const struct exec_ctx *x, int64_t i)
{
    uint64_t buflen = x->rq.buflen;
    if (x->rq.disk[i] < 0 || x->rq.disk[i] >= x->e->nfds)
        return -EBADF;
    if (x->rq.len[i] == 0 || x->rq.dst[i] > buflen || x->rq.len[i] > buflen - x->rq.dst[i])
        return -EINVAL;
    if (x->rq.off[i] > (uint64_t)INT64_MAX - x->rq.len[i])
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

/* Request i is over: status st (bytes, or -errno) after done bytes. */
static void finish_request(struct exec_ctx *x, int64_t i, int32_t st, uint64_t done)
{
    int d = x->rq.disk[i];
    x->status[i] = st;
    x->lc.requests++;
    x->lc.bytes += done;
    x->dreq[d]++;
    x->dbytes[d] += done;
    if (st < 0) {
        x->failed++;
        x->lc.errors++;
    }
}

/* ---- io_uring ---------------------------------------------------------- */

/* One uring_execute call: the requests to (re)submit, a ring buffer of
 * request indices (capacity n), and the call's progress.  Its steps: fill
 * the SQ, enter (submit and wait), reap the CQEs (requeueing the rest of a
 * short transfer and a transient failure), and after each round check for
 * a failed enter, a round without progress or a stall. */
struct uring_run {
    struct exec_ctx *x;
    struct se_ring *r;
    se_exec_info *info;
    int64_t *queue;
    uint32_t *prog;          /* bytes done per request */
    int buf_slot;
    int64_t qh, qt, qcount;  /* the queue's head, tail and length */
    int64_t remaining;       /* requests not over */
    unsigned inflight;       /* SQEs filled and not reaped (in the SQ or the kernel) */
    unsigned fails;          /* rounds in a row without progress */
    uint64_t t_progress;     /* first round without progress (0: made progress) */
    int last_err;
};

/* Whether valid request i is the ring's: not one that a mixed call runs on
 * its threads (those may still be running when the ring's share gives up). */
static int ring_owns(const struct exec_ctx *x, int64_t i)
{
    return !on_threads(x->e, x->rq.disk[i]);
}

/* Request i (what is left of it) to the back of the queue. */
static void uring_requeue(struct uring_run *u, int64_t i)
{
    u->queue[u->qt] = i;
    if (++u->qt == u->x->rq.n)
        u->qt = 0;
    u->qcount++;
}

/* The SQE of what is left of request i. */
static void uring_prep(struct uring_run *u, struct io_uring_sqe *sqe, int64_t i)
{
    struct exec_ctx *x = u->x;
    const int fixed_file = u->r->files_registered;
    int d = x->rq.disk[i];
    int fd = fixed_file ? d : x->e->fds[d];
    uint32_t done = u->prog[i];
    char *addr = x->rq.buf + x->rq.dst[i] + done;
    unsigned nbytes = x->rq.len[i] - done;
    uint64_t offset = x->rq.off[i] + done;
    if (u->buf_slot >= 0) {
        if (x->rq.op == SE_OP_READ)
            io_uring_prep_read_fixed(sqe, fd, addr, nbytes, offset, u->buf_slot);
        else
            io_uring_prep_write_fixed(sqe, fd, addr, nbytes, offset, u->buf_slot);
        if (done == 0)
            x->lc.fixed_requests++;
    } else if (x->rq.op == SE_OP_READ) {
        io_uring_prep_read(sqe, fd, addr, nbytes, offset);
    } else {
        io_uring_prep_write(sqe, fd, addr, nbytes, offset);
    }
    if (fixed_file)
        sqe->flags |= IOSQE_FIXED_FILE;
    if (x->e->punt[d])
        sqe->flags |= IOSQE_ASYNC;
    io_uring_sqe_set_data64(sqe, (uint64_t)i);
}

/* Fill the SQ from the queue, up to the ring's depth in flight. */
static void uring_fill(struct uring_run *u)
{
    struct exec_ctx *x = u->x;
    uint64_t t = 0;
    while (u->qcount > 0 && u->inflight < u->r->qd) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&u->r->ring);
        if (!sqe)
            break;
        int64_t i = u->queue[u->qh];
        if (++u->qh == x->rq.n)
            u->qh = 0;
        u->qcount--;
        uring_prep(u, sqe, i);
        u->inflight++;
        x->lc.sqes++;
        int d = x->rq.disk[i];
        if (!x->first_ns[d]) {
            if (!t)
                t = now_ns();
            x->first_ns[d] = t;
        }
    }
}

/* Submit and wait in one io_uring_enter.  Everything queued is in the
 * ring: wait for all of it.  Otherwise wait for a fraction, so that each
 * enter refills a batch.  Never block for ever in one enter: wake up every
 * second to check for a stall (SE_STALL_NS without any completion).
 * Returns the enter's result. */
static int uring_enter(struct uring_run *u)
{
    unsigned wait_nr = u->inflight;
    if (u->qcount > 0) {
        wait_nr = u->inflight / u->x->e->wait_div;
        if (wait_nr < 1)
            wait_nr = 1;
    }
    struct __kernel_timespec ts = {.tv_sec = 1, .tv_nsec = 0};
    struct io_uring_cqe *first = NULL;
    uint64_t tw = now_ns();   /* long_waits: waits of a second or more */
    int ret = io_uring_submit_and_wait_timeout(&u->r->ring, &first, wait_nr, &ts, NULL);
    u->x->lc.submit_calls++;
    if (now_ns() - tw >= 1000000000ull)
        u->x->lc.long_waits++;
    return ret;
}

/* Request i completed with res at tc: a transient failure (-EAGAIN,
 * -EINTR) or a short transfer goes back to the queue; an error, or an end
 * of the disk before len, fails it; else it is done.  Returns 1 for
 * progress (anything but a transient failure). */
static int uring_complete(struct uring_run *u, int64_t i, int res, uint64_t tc)
{
    struct exec_ctx *x = u->x;
    u->inflight--;
    x->last_ns[x->rq.disk[i]] = tc;
    if (res == -EAGAIN || res == -EINTR) {
        x->lc.retries++;
        u->last_err = res;
        uring_requeue(u, i);
        return 0;
    }
    if (res > 0 && u->prog[i] + (uint32_t)res < x->rq.len[i]) {
        u->prog[i] += (uint32_t)res;
        x->lc.short_resubmits++;
        uring_requeue(u, i);
        return 1;
    }
    if (res < 0 || (res == 0 && x->rq.len[i] > u->prog[i]))
        finish_request(x, i, res < 0 ? res : -ENODATA, u->prog[i]);
    else
        finish_request(x, i, (int32_t)x->rq.len[i], x->rq.len[i]);
    u->remaining--;
    return 1;
}

/* Reap the CQEs there are, in batches (peek a batch, advance the CQ once).
 * Returns 1 if any request made progress. */
static int uring_reap(struct uring_run *u)
{
    struct io_uring *ring = &u->r->ring;
    struct io_uring_cqe *cqes[CQE_BATCH];
    int progress = 0;
    unsigned got;
    do {
        got = io_uring_peek_batch_cqe(ring, cqes, CQE_BATCH);
        if (!got)
            break;
        uint64_t tc = now_ns();
        for (unsigned k = 0; k < got; k++)
            progress |= uring_complete(u, (int64_t)io_uring_cqe_get_data64(cqes[k]),
                                       cqes[k]->res, tc);
        u->x->lc.cqes += got;
        io_uring_cq_advance(ring, got);
    } while (got == CQE_BATCH);
    return progress;
}

/* Stop retrying: count it.  Returns 1 (give up). */
static int uring_gave_up(struct uring_run *u)
{
    u->info->gave_up = 1;
    u->x->lc.gave_up++;
    return 1;
}

/* After a round whose enter returned ret: a failed enter is counted (and
 * ends the call unless transient); a round without progress backs off and
 * ends the call after retry_limit rounds in a row, or, while requests wait
 * in the kernel (a timed-out or interrupted wait is not a failure), after
 * SE_STALL_NS without any completion.  Returns 1 to give up. */
static int uring_stall(struct uring_run *u, int ret, int progress)
{
    int waiting = (ret == -ETIME || ret == -EINTR || ret >= 0) &&
                  u->inflight > io_uring_sq_ready(&u->r->ring);
    if (ret < 0 && ret != -ETIME) {
        u->x->lc.enter_errors++;
        u->x->lc.retries++;
        u->info->enter_failures++;
        u->info->enter_errno = -ret;
        u->last_err = ret;
        if (!transient_enter_error(ret))
            return 1;
    }
    if (progress) {
        u->fails = 0;
        u->t_progress = 0;
        return 0;
    }
    if (u->remaining == 0)
        return 0;
    uint64_t tn = now_ns();
    if (!u->t_progress)
        u->t_progress = tn;
    if (waiting) {
        if (tn - u->t_progress < SE_STALL_NS) {
            if (ret != -ETIME)
                backoff(1);
            return 0;
        }
        u->last_err = -ETIMEDOUT;
        return uring_gave_up(u);
    }
    if (++u->fails > u->x->e->retry_limit)
        return uring_gave_up(u);
    backoff(u->fails);
    return 0;
}

/* The call gave up.  The ring is in an unknown state (SQEs the kernel has
 * not taken, requests it has taken and not completed): fail what is left
 * and retire the ring.  Requests still in the kernel may yet write to the
 * buffer: the caller must not reuse it (info->abandoned). */
static void uring_abandon(struct uring_run *u)
{
    struct exec_ctx *x = u->x;
    unsigned in_sq = io_uring_sq_ready(&u->r->ring);
    u->info->abandoned = u->inflight > in_sq ? u->inflight - in_sq : 0;
    int err = u->last_err ? u->last_err : -EIO;
    for (int64_t i = 0; i < x->rq.n; i++)
        if (x->status[i] == 0 && ring_owns(x, i))
            finish_request(x, i, err, u->prog[i]);
    u->r->broken = 1;
}

/* The nq queued requests on ring r: rounds of fill, enter, reap and the
 * stall check until every request is over or the call gives up. */
static void uring_execute(struct exec_ctx *x, struct se_ring *r, int64_t *queue,
                          uint32_t *prog, int64_t nq, int buf_slot, se_exec_info *info)
{
    struct uring_run u = {.x = x, .r = r, .info = info, .queue = queue, .prog = prog,
                          .buf_slot = buf_slot, .qt = nq == x->rq.n ? 0 : nq, .qcount = nq,
                          .remaining = nq};
    int give_up = 0;
    while (u.remaining > 0 && !give_up) {
        uring_fill(&u);
        int ret = uring_enter(&u);
        int progress = uring_reap(&u);
        give_up = uring_stall(&u, ret, progress);
    }
    if (give_up)
        uring_abandon(&u);
}

/* Add the tallies of y (a thread's, or the threads' share of a mixed call)
 * to x; gave_up is or-ed (the per-call count is the caller's). */
static void merge_ctx(struct exec_ctx *x, const struct exec_ctx *y)
{
    const uint64_t *src = (const uint64_t *)&y->lc;
    uint64_t *dst = (uint64_t *)&x->lc;
    size_t nsum = offsetof(se_counters, in_flight) / sizeof(uint64_t);
    for (size_t k = 0; k < nsum; k++)
        dst[k] += src[k];
    for (int d = 0; d < x->e->nfds; d++) {
        if (!y->dreq[d])
            continue;
        x->dreq[d] += y->dreq[d];
        x->dbytes[d] += y->dbytes[d];
        if (!x->first_ns[d] || (y->first_ns[d] && y->first_ns[d] < x->first_ns[d]))
            x->first_ns[d] = y->first_ns[d];
        if (y->last_ns[d] > x->last_ns[d])
            x->last_ns[d] = y->last_ns[d];
    }
    x->failed += y->failed;
    x->gave_up |= y->gave_up;
}

/* ---- threads ----------------------------------------------------------- */

struct thread_arg {
    struct exec_ctx *x;
    const int64_t *queue;
    int64_t nq;
    int64_t *next;
    pthread_mutex_t *mu;
};

/* A worker: pull request indices until none is left, tallying in a
 * context of its own (no lock per request), added to a->x at the end. */
static void *thread_main(void *p)
{
    struct thread_arg *a = p;
    struct exec_ctx *shared = a->x;
    se_engine *e = shared->e;
    struct exec_ctx own = {.e = e, .rq = shared->rq, .status = shared->status};
    struct exec_ctx *x = &own;
    for (;;) {
        int64_t k = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
        if (k >= a->nq)
            break;
        int64_t i = a->queue[k];
        int d = x->rq.disk[i];
        int fd = e->fds[d];
        uint64_t t0 = now_ns();
        uint32_t done = 0;
        int32_t st = 0;
        uint64_t retries = 0, shorts = 0;
        unsigned fails = 0;
        while (done < x->rq.len[i]) {
            char *addr = x->rq.buf + x->rq.dst[i] + done;
            size_t nbytes = x->rq.len[i] - done;
            off_t offset = (off_t)(x->rq.off[i] + done);
            ssize_t r = x->rq.op == SE_OP_READ ? pread(fd, addr, nbytes, offset)
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
            if (done < x->rq.len[i])
                shorts++;
        }
        uint64_t t1 = now_ns();
        finish_request(x, i, st ? st : (int32_t)x->rq.len[i], done);
        if (!x->first_ns[d] || t0 < x->first_ns[d])
            x->first_ns[d] = t0;
        if (t1 > x->last_ns[d])
            x->last_ns[d] = t1;
        x->lc.retries += retries;
        x->lc.short_resubmits += shorts;
        x->lc.sqes++;
        x->lc.cqes++;
        if (st && fails > e->retry_limit)
            x->gave_up = 1;
    }
    pthread_mutex_lock(a->mu);
    merge_ctx(shared, &own);
    pthread_mutex_unlock(a->mu);
    return NULL;
}

/* Run queue[0..nq) with pread/pwrite on nt threads: nt - 1 helpers and the
 * caller, which first runs first(arg) if given (the ring's share of a mixed
 * call) and then pulls requests like the helpers. */
static void threads_run(struct exec_ctx *x, const int64_t *queue, int64_t nq, unsigned nt,
                        void (*first)(void *), void *arg)
{
    pthread_t tids[1024];
    int64_t next = 0;
    pthread_mutex_t mu;
    pthread_mutex_init(&mu, NULL);
    struct thread_arg a = {.x = x, .queue = queue, .nq = nq, .next = &next, .mu = &mu};
    unsigned started = 0;
    x->lc.submit_calls++;   /* before the helpers, which add to x->lc when done */
    for (unsigned k = 1; k < nt && k <= 1024; k++) {
        if (pthread_create(&tids[started], NULL, thread_main, &a) != 0)
            break;
        started++;
    }
    if (first)
        first(arg);
    thread_main(&a); /* the caller works too; with nt == 1 it works alone */
    for (unsigned k = 0; k < started; k++)
        pthread_join(tids[k], NULL);
    pthread_mutex_destroy(&mu);
}

static void threads_execute(struct exec_ctx *x, const int64_t *queue, int64_t nq)
{
    unsigned nt = x->e->nthreads ? x->e->nthreads : 1;
    if ((int64_t)nt > nq)
        nt = (unsigned)nq;
    threads_run(x, queue, nq, nt, NULL, NULL);
    if (x->gave_up)
        x->lc.gave_up++;
}

/* Run the nq queued requests on this thread's ring of e, or with pread
 * (counted as a fallback) where the ring cannot be set up.  buf_slot is
 * used only when this ring has registered that buffer and it holds the
 * whole of buf. */
static void uring_call(struct exec_ctx *x, int64_t *queue, uint32_t *prog, int64_t nq,
                       se_exec_info *info)
{
    se_engine *e = x->e;
    int buf_slot = x->rq.buf_slot;
    uint64_t buflen = x->rq.buflen;
    int err = 0;
    struct se_ring *r = get_ring(e, &err);
    if (!r) {
        info->fallback = 1;
        info->ring_errno = -err;
        x->lc.fallback_executes++;
        threads_execute(x, queue, nq);
        return;
    }
    ring_sync_buffers(e, r, buf_slot);
    if (buf_slot >= 0) {
        struct slot *s = buf_slot < SE_MAX_BUFFERS ? &r->mirror[buf_slot] : NULL;
        if (!s || !s->id || x->rq.buf < s->addr || x->rq.buf + buflen > s->addr + s->len)
            buf_slot = -1;
    }
    info->fixed = buf_slot >= 0;
    uring_execute(x, r, queue, prog, nq, buf_slot, info);
    if (r->broken)
        ring_destroy_own(e, r);
}

/* Requests to blocking disks per thread of a mixed call (up to nthreads):
 * a tmpfs pread of 4 KiB is a microsecond or two of memcpy, a thread tens of
 * microseconds to start.  On tmpfs (2-vCPU AMD EPYC, 4 disks) calls of 16 to
 * 16,384 reads of 4 KiB ran 2.2-3.1x faster than on io-wq with 1 to 32
 * threads alike (one per 8, 32, 64 or 128 requests), 1.4-1.6x at 64 and
 * 128 KiB; fewer threads cost less CPU. */
#define BLOCKING_PER_THREAD 32

/* The ring's share of a mixed call, run by the caller while the threads
 * start on the rest. */
struct ring_share {
    struct exec_ctx *x;
    int64_t *queue;
    uint32_t *prog;
    int64_t nq;
    se_exec_info *info;
};

static void ring_share_run(void *p)
{
    struct ring_share *r = p;
    if (r->nq > 0)
        uring_call(r->x, r->queue, r->prog, r->nq, r->info);
}

/* A uring call with requests to blocking disks (punt[]): those run on
 * threads with pread/pwrite while the caller runs the rest on its ring, then
 * helps the threads.  queue[0..nq) is split in place: the ring's share stays
 * in queue, the blocking share moves to its own array. */
static void mixed_execute(struct exec_ctx *x, int64_t *queue, uint32_t *prog, int64_t nq,
                          se_exec_info *info)
{
    se_engine *e = x->e;
    int64_t *blocking = malloc(sizeof(int64_t) * (size_t)nq);
    struct exec_ctx *y = calloc(1, sizeof(*y));
    if (!blocking || !y) {   /* no memory for the split: all with pread */
        free(blocking);
        free(y);
        threads_execute(x, queue, nq);
        return;
    }
    int64_t nr = 0, nb = 0;
    for (int64_t k = 0; k < nq; k++) {
        int64_t i = queue[k];
        if (on_threads(e, x->rq.disk[i]))
            blocking[nb++] = i;
        else
            queue[nr++] = i;
    }
    y->e = e;
    y->rq = x->rq;
    y->status = x->status;
    y->lc.thread_requests = (uint64_t)nb;
    int64_t want = (nb + BLOCKING_PER_THREAD - 1) / BLOCKING_PER_THREAD;
    unsigned cap = e->nthreads ? e->nthreads : 1;
    unsigned nt = want < (int64_t)cap ? (unsigned)want : cap;
    if (nr > 0 && nb > 0)
        nt++;   /* the caller is on the ring first: one more helper */
    struct ring_share share = {.x = x, .queue = queue, .prog = prog, .nq = nr, .info = info};
    if (nb > 0)
        threads_run(y, blocking, nb, nt, ring_share_run, &share);
    else
        ring_share_run(&share);
    if (y->gave_up && !info->gave_up && !x->gave_up)
        x->lc.gave_up++;   /* one count per call, whichever share gave up */
    merge_ctx(x, y);
    free(blocking);
    free(y);
}

int64_t se_execute(se_engine *e, const se_requests *rq, int32_t *status, se_exec_info *info)
{
    se_exec_info dummy;
    if (!info)
        info = &dummy;
    memset(info, 0, sizeof(*info));
    if (!e || !rq || rq->n < 0 || (rq->op != SE_OP_READ && rq->op != SE_OP_WRITE))
        return -EINVAL;
    const int64_t n = rq->n;
    if (n == 0)
        return 0;
    if (!rq->disk || !rq->off || !rq->len || !rq->dst || !rq->buf || !status)
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
    x->rq = *rq;
    x->status = status;

    int64_t nq = 0;
    for (int64_t i = 0; i < n; i++) {
        int r = check_request(x, i);
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
    if (nq > 0 && e->kind == SE_KIND_URING && some_on_threads(e))
        mixed_execute(x, queue, prog, nq, info);
    else if (nq > 0 && e->kind == SE_KIND_URING)
        uring_call(x, queue, prog, nq, info);
    else if (nq > 0)
        threads_execute(x, queue, nq);
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
