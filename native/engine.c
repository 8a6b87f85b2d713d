/*
 * swarmfs native engine.  See engine.h for the interface.
 *
 * io_uring back end: one ring per engine, SQ = queue depth, CQ = 2 x SQ.
 * se_execute fills as many SQEs as the ring holds, submits them and waits in
 * one io_uring_enter (io_uring_submit_and_wait), reaps CQEs in batches
 * (io_uring_peek_batch_cqe + one io_uring_cq_advance), and resubmits the rest
 * of short transfers and requests that ended with -EAGAIN/-EINTR.  When the
 * plan fits in the ring, the whole plan costs a single io_uring_enter.
 * Files are registered once at open; buffers can be registered as fixed
 * buffers (READ_FIXED/WRITE_FIXED) where the kernel and RLIMIT_MEMLOCK allow.
 *
 * Thread back end: up to nthreads pthreads per call pull request indices from
 * an atomic counter and issue pread/pwrite with the same retry rules.
 *
 * The data kernels (gather/scatter, checksums, bucket assignment, medoid
 * scoring) are in kernels.c.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/uio.h>

#include <liburing.h>

#define CQE_BATCH 256

struct buf_slot {
    char *addr;
    uint64_t len;
    int used;
};

struct se_engine {
    int kind;
    int nfds;
    int fds[SE_MAX_DISKS];
    unsigned qd;
    pthread_mutex_t mu;
    se_counters c;
    se_disk_counters d[SE_MAX_DISKS];
    /* io_uring */
    struct io_uring ring;
    int files_registered;
    int buffers_supported;
    struct buf_slot slots[SE_MAX_BUFFERS];
    /* threads */
    unsigned nthreads;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
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
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * queue_depth;
    ret = io_uring_queue_init_params(queue_depth, &e->ring, &p);
    if (ret < 0) {
        pthread_mutex_destroy(&e->mu);
        free(e);
        return ret;
    }
    e->qd = p.sq_entries < queue_depth ? p.sq_entries : queue_depth;
    e->files_registered = io_uring_register_files(&e->ring, fds, (unsigned)nfds) == 0;
    e->buffers_supported = io_uring_register_buffers_sparse(&e->ring, SE_MAX_BUFFERS) == 0;
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
    *out = e;
    return 0;
}

int se_kind(const se_engine *e) { return e->kind; }
unsigned se_queue_depth(const se_engine *e) { return e->qd; }
int se_files_registered(const se_engine *e) { return e->files_registered; }

int se_register_buffer(se_engine *e, void *addr, uint64_t len)
{
    if (e->kind != SE_KIND_URING || !e->buffers_supported)
        return -EOPNOTSUPP;
    if (!addr || len == 0 || len > (1ull << 30))
        return -EINVAL;
    pthread_mutex_lock(&e->mu);
    int slot = -ENOSPC;
    for (int i = 0; i < SE_MAX_BUFFERS; i++) {
        if (!e->slots[i].used) {
            slot = i;
            break;
        }
    }
    if (slot >= 0) {
        struct iovec iov = {.iov_base = addr, .iov_len = (size_t)len};
        __u64 tag = 0;
        int ret = io_uring_register_buffers_update_tag(&e->ring, (unsigned)slot, &iov, &tag, 1);
        if (ret < 0) {
            slot = ret;
        } else {
            e->slots[slot].addr = addr;
            e->slots[slot].len = len;
            e->slots[slot].used = 1;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return slot;
}

int se_unregister_buffer(se_engine *e, int slot)
{
    if (e->kind != SE_KIND_URING || slot < 0 || slot >= SE_MAX_BUFFERS)
        return -EINVAL;
    pthread_mutex_lock(&e->mu);
    int ret = 0;
    if (e->slots[slot].used) {
        struct iovec iov = {.iov_base = NULL, .iov_len = 0};
        __u64 tag = 0;
        ret = io_uring_register_buffers_update_tag(&e->ring, (unsigned)slot, &iov, &tag, 1);
        if (ret >= 0)
            ret = 0;
        memset(&e->slots[slot], 0, sizeof(e->slots[slot]));
    }
    pthread_mutex_unlock(&e->mu);
    return ret;
}

/* Shared bookkeeping of one se_execute call. */
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
    uint64_t first_ns[SE_MAX_DISKS];
    uint64_t last_ns[SE_MAX_DISKS];
    uint64_t dreq[SE_MAX_DISKS];
    uint64_t dbytes[SE_MAX_DISKS];
    uint64_t failed;
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
        e->d[d].requests += x->dreq[d];
        e->d[d].bytes += x->dbytes[d];
        if (x->last_ns[d] > x->first_ns[d])
            e->d[d].busy_ns += x->last_ns[d] - x->first_ns[d];
    }
    e->c.executes++;
}

/* ---- io_uring ---------------------------------------------------------- */

static int64_t uring_execute(struct exec_ctx *x, int64_t *queue, uint32_t *prog,
                             int64_t nq, int buf_slot)
{
    se_engine *e = x->e;
    struct io_uring *ring = &e->ring;
    struct io_uring_cqe *cqes[CQE_BATCH];
    int64_t n = x->n;
    int64_t qhead = 0, qtail = nq, remaining = nq;
    unsigned inflight = 0;
    int fatal = 0;

    while (remaining > 0) {
        uint64_t t = 0;
        while (!fatal && qhead < qtail && inflight < e->qd) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
            if (!sqe)
                break;
            int64_t i = queue[qhead % n];
            qhead++;
            int fd = e->files_registered ? x->disk[i] : e->fds[x->disk[i]];
            char *addr = x->buf + x->dst[i] + prog[i];
            unsigned nbytes = x->len[i] - prog[i];
            uint64_t offset = x->off[i] + prog[i];
            if (buf_slot >= 0) {
                if (x->op == SE_OP_READ)
                    io_uring_prep_read_fixed(sqe, fd, addr, nbytes, offset, buf_slot);
                else
                    io_uring_prep_write_fixed(sqe, fd, addr, nbytes, offset, buf_slot);
                if (prog[i] == 0)
                    e->c.fixed_requests++;
            } else if (x->op == SE_OP_READ) {
                io_uring_prep_read(sqe, fd, addr, nbytes, offset);
            } else {
                io_uring_prep_write(sqe, fd, addr, nbytes, offset);
            }
            if (e->files_registered)
                sqe->flags |= IOSQE_FIXED_FILE;
            io_uring_sqe_set_data64(sqe, (uint64_t)i);
            inflight++;
            e->c.sqes++;
            int d = x->disk[i];
            if (!x->first_ns[d]) {
                if (!t)
                    t = now_ns();
                x->first_ns[d] = t;
            }
        }
        if (inflight == 0) {
            /* fatal submit error: everything still queued fails */
            break;
        }
        unsigned wait_nr = (fatal || qhead == qtail) ? inflight : 1;
        int ret = io_uring_submit_and_wait(ring, wait_nr);
        e->c.submit_calls++;
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && !fatal) {
            /* The ring refuses submissions: fail what is queued, drain what is in flight. */
            fatal = ret;
            while (qhead < qtail) {
                int64_t i = queue[qhead % n];
                qhead++;
                x->status[i] = ret;
                x->failed++;
                e->c.errors++;
                e->c.requests++;
                remaining--;
            }
        }
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
                e->c.cqes++;
                x->last_ns[d] = tc;
                if (res == -EAGAIN || res == -EINTR) {
                    e->c.retries++;
                    queue[qtail % n] = i;
                    qtail++;
                    continue;
                }
                if (res < 0 || (res == 0 && x->len[i] > prog[i])) {
                    x->status[i] = res < 0 ? res : -ENODATA;
                    x->failed++;
                    e->c.errors++;
                    e->c.requests++;
                    x->dreq[d]++;
                    x->dbytes[d] += prog[i];
                    e->c.bytes += prog[i];
                    remaining--;
                    continue;
                }
                prog[i] += (uint32_t)res;
                if (prog[i] < x->len[i]) {
                    e->c.short_resubmits++;
                    queue[qtail % n] = i;
                    qtail++;
                    continue;
                }
                x->status[i] = (int32_t)x->len[i];
                e->c.requests++;
                e->c.bytes += x->len[i];
                x->dreq[d]++;
                x->dbytes[d] += x->len[i];
                remaining--;
            }
            io_uring_cq_advance(ring, got);
        } while (got == CQE_BATCH);
        if (fatal && inflight == 0)
            break;
    }
    /* Anything still queued (only after a fatal submit error) fails. */
    while (qhead < qtail) {
        int64_t i = queue[qhead % n];
        qhead++;
        x->status[i] = fatal ? fatal : -EIO;
        x->failed++;
        e->c.errors++;
        e->c.requests++;
    }
    return 0;
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
        while (done < x->len[i]) {
            char *addr = x->buf + x->dst[i] + done;
            size_t nbytes = x->len[i] - done;
            off_t offset = (off_t)(x->off[i] + done);
            ssize_t r = x->op == SE_OP_READ ? pread(fd, addr, nbytes, offset)
                                            : pwrite(fd, addr, nbytes, offset);
            if (r < 0) {
                if (errno == EINTR || errno == EAGAIN) {
                    retries++;
                    continue;
                }
                st = -errno;
                break;
            }
            if (r == 0) {
                st = -ENODATA;
                break;
            }
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
        e->c.requests++;
        e->c.bytes += done;
        e->c.retries += retries;
        e->c.short_resubmits += shorts;
        e->c.sqes++;
        e->c.cqes++;
        if (st) {
            x->failed++;
            e->c.errors++;
        }
        pthread_mutex_unlock(a->mu);
    }
    return NULL;
}

static int64_t threads_execute(struct exec_ctx *x, const int64_t *queue, int64_t nq)
{
    se_engine *e = x->e;
    unsigned nt = e->nthreads;
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
    e->c.submit_calls++;
    thread_main(&a); /* the caller works too; with nt == 1 it works alone */
    for (unsigned k = 0; k < started; k++)
        pthread_join(tids[k], NULL);
    pthread_mutex_destroy(&mu);
    return 0;
}

int64_t se_execute(se_engine *e, int op, int64_t n,
                   const int32_t *disk, const uint64_t *off,
                   const uint32_t *len, const uint64_t *dst,
                   char *buf, uint64_t buflen, int buf_slot,
                   int32_t *status)
{
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
    x->e = e;
    x->op = op;
    x->n = n;
    x->disk = disk;
    x->off = off;
    x->len = len;
    x->dst = dst;
    x->buf = buf;
    x->status = status;

    pthread_mutex_lock(&e->mu);
    int64_t nq = 0;
    for (int64_t i = 0; i < n; i++) {
        int r = check_request(x, i, buflen);
        if (r) {
            status[i] = r;
            x->failed++;
            e->c.errors++;
            e->c.requests++;
        } else {
            status[i] = 0;
            queue[nq++] = i;
        }
    }
    if (e->kind == SE_KIND_URING) {
        if (buf_slot >= 0) {
            struct buf_slot *s = buf_slot < SE_MAX_BUFFERS ? &e->slots[buf_slot] : NULL;
            if (!s || !s->used || buf < s->addr || buf + buflen > s->addr + s->len)
                buf_slot = -1;
        }
        uring_execute(x, queue, prog, nq, buf_slot);
    } else {
        threads_execute(x, queue, nq);
    }
    finish_counters(x);
    pthread_mutex_unlock(&e->mu);
    int64_t failed = (int64_t)x->failed;
    free(x);
    free(queue);
    free(prog);
    return failed;
}

void se_get_counters(se_engine *e, se_counters *c, se_disk_counters *per_disk)
{
    pthread_mutex_lock(&e->mu);
    if (c)
        *c = e->c;
    if (per_disk)
        memcpy(per_disk, e->d, sizeof(se_disk_counters) * (size_t)e->nfds);
    pthread_mutex_unlock(&e->mu);
}

void se_close(se_engine *e)
{
    if (!e)
        return;
    if (e->kind == SE_KIND_URING)
        io_uring_queue_exit(&e->ring);
    pthread_mutex_destroy(&e->mu);
    free(e);
}
