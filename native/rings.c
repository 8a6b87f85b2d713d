/*
 * swarmfs native engine: per-thread io_uring rings and fixed buffers.
 *
 * One ring per (engine, thread), as liburing's documentation and 3FS USRBIO
 * recommend: a ring is set up the first time a thread executes (or registers
 * a buffer), with IORING_SETUP_SINGLE_ISSUER, DEFER_TASKRUN and COOP_TASKRUN
 * where the kernel has them; the disks are registered files of
 * every ring.  A thread finds its rings in a thread-local table keyed by the
 * engine's unique id; a pthread key destructor tears them down when the thread
 * exits, se_close tears down all of an engine's rings, and a ring that broke
 * (io_uring_enter kept failing) is torn down after the call.  Locks: g_mu
 * (live engines) before e->mu (an engine's ring list and buffer table); none
 * is held while requests are in flight.
 *
 * Fixed buffers: the engine keeps a table of registered buffers (address,
 * length, a unique id) and a generation number; a ring registers a buffer
 * when its thread first reads into it, and drops registrations of buffers
 * that left the table once the generation moves.
 */
#include "engine_int.h"

#include <sys/uio.h>

/* ---- live engines and per-thread rings --------------------------------- */

struct tls_ent {
    uint64_t id;
    struct se_ring *r;
};

struct tls_tab {
    int n, cap;
    struct tls_ent *ent;
};

static __thread struct tls_tab *tls;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_key;
static int g_key_ok;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static se_engine *g_live;
static uint64_t g_next_id;

static se_engine *find_live(uint64_t id)  /* g_mu held */
{
    for (se_engine *e = g_live; e; e = e->gnext)
        if (e->id == id)
            return e;
    return NULL;
}

static void ring_free(se_engine *e, struct se_ring *r)
{
    io_uring_queue_exit(&r->ring);
    free(r);
    ADD(e->c.rings_closed, 1);
}

/* Unlink r from e's list (g_mu or the engine's liveness guaranteed). */
static void ring_unlink(se_engine *e, struct se_ring *r)
{
    pthread_mutex_lock(&e->mu);
    for (struct se_ring **pp = &e->rings; *pp; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
}

/* Thread exit: tear down this thread's rings of engines still open.  Rings
 * of closed engines were torn down by se_close (their ids are not live). */
static void tls_destructor(void *p)
{
    struct tls_tab *t = p;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < t->n; i++) {
        se_engine *e = find_live(t->ent[i].id);
        if (e) {
            ring_unlink(e, t->ent[i].r);
            ring_free(e, t->ent[i].r);
        }
    }
    pthread_mutex_unlock(&g_mu);
    free(t->ent);
    free(t);
    tls = NULL;
}

static void make_key(void)
{
    g_key_ok = pthread_key_create(&g_key, tls_destructor) == 0;
}

static struct se_ring *tls_find(const se_engine *e)
{
    struct tls_tab *t = tls;
    if (!t)
        return NULL;
    for (int i = 0; i < t->n; i++)
        if (t->ent[i].id == e->id)
            return t->ent[i].r;
    return NULL;
}

static void tls_remove(const se_engine *e)
{
    struct tls_tab *t = tls;
    if (!t)
        return;
    for (int i = 0; i < t->n; i++) {
        if (t->ent[i].id == e->id) {
            t->ent[i] = t->ent[--t->n];
            return;
        }
    }
}

/* Record r as this thread's ring of e; drops entries of closed engines. */
static int tls_add(se_engine *e, struct se_ring *r)
{
    pthread_once(&g_once, make_key);
    if (!g_key_ok)
        return -EAGAIN;
    pthread_mutex_lock(&g_mu);
    struct tls_tab *t = tls;
    if (!t) {
        t = calloc(1, sizeof(*t));
        if (!t || pthread_setspecific(g_key, t) != 0) {
            free(t);
            pthread_mutex_unlock(&g_mu);
            return -ENOMEM;
        }
        tls = t;
    }
    int k = 0;
    for (int i = 0; i < t->n; i++)
        if (find_live(t->ent[i].id))
            t->ent[k++] = t->ent[i];
    t->n = k;
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 4;
        struct tls_ent *ne = realloc(t->ent, sizeof(*ne) * (size_t)cap);
        if (!ne) {
            pthread_mutex_unlock(&g_mu);
            return -ENOMEM;
        }
        t->ent = ne;
        t->cap = cap;
    }
    t->ent[t->n].id = e->id;
    t->ent[t->n].r = r;
    t->n++;
    pthread_mutex_lock(&e->mu);
    r->next = e->rings;
    e->rings = r;
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_unlock(&g_mu);
    return 0;
}

/* ---- ring set-up ------------------------------------------------------- */

/* DEFER_TASKRUN (Linux 6.1+, needs SINGLE_ISSUER): completions, including
 * those of requests io-wq ran (every read of a tmpfs file), are queued as task
 * work that the ring's own thread runs in a batch when it waits
 * (io_uring_enter with GETEVENTS), instead of each io-wq worker taking the
 * completion lock, filling the CQE and waking the waiter itself.  At 4 KiB on
 * tmpfs that is worth about a tenth of the IOPS (docs/benchmarks.md section
 * 1); fio uses it too.  The flip side: completions reach the CQ ring only
 * while the ring's thread waits in it, which se_execute always does until its
 * requests are reaped (a ring torn down with requests in flight hands its task
 * work to the kernel's exit work).  An earlier engine with it hung once in a
 * full suite run, in an unbounded io_uring_submit_and_wait with three punted
 * O_DIRECT writes outstanding (cause not established; a wake-up that never
 * came fits).  Waits are now bounded: each io_uring_enter waits at most a
 * second, and the next one runs whatever task work is pending, so a missed
 * wake-up costs at most a second (long_waits counts waits of a second or
 * more) and requests without any completion for SE_STALL_NS fail with
 * ETIMEDOUT: a stall is an error, not a hang.  Repeated suite runs and a
 * stress of punted O_DIRECT writes from many threads (tests/test_engine.py)
 * did not reproduce it.  COOP_TASKRUN (no task-work IPIs) is the fallback on
 * kernels without DEFER_TASKRUN. */
static const unsigned flag_attempts[] = {
    IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_COOP_TASKRUN |
        IORING_SETUP_SUBMIT_ALL,
    IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SUBMIT_ALL,
    IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SUBMIT_ALL,
    IORING_SETUP_SUBMIT_ALL,
    0,
};

static int ring_init(struct se_ring *r, const se_engine *e, unsigned qd, unsigned flags)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    p.flags = flags | IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * qd;
    int ret = io_uring_queue_init_params(qd, &r->ring, &p);
    if (ret < 0)
        return ret;
    r->qd = p.sq_entries < qd ? p.sq_entries : qd;
    r->files_registered = io_uring_register_files(&r->ring, e->fds, (unsigned)e->nfds) == 0;
    r->bufs_ok = io_uring_register_buffers_sparse(&r->ring, SE_MAX_BUFFERS) == 0;
    return 0;
}

/* Set up a ring of e->qd entries, halving the depth down to MIN_QD when the
 * kernel lacks locked memory (-ENOMEM).  Returns the ring or NULL (*err). */
static struct se_ring *ring_create(se_engine *e, unsigned qd, int *err)
{
    struct se_ring *r = calloc(1, sizeof(*r));
    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    int ret;
    for (;;) {
        ret = ring_init(r, e, qd, e->setup_flags);
        if (ret != -ENOMEM || qd <= MIN_QD)
            break;
        qd /= 2;
    }
    if (ret < 0) {
        free(r);
        *err = ret;
        __atomic_store_n(&e->c.last_ring_errno, (int64_t)-ret, __ATOMIC_RELAXED);
        return NULL;
    }
    ADD(e->c.rings_created, 1);
    return r;
}

/* This thread's ring of e, set up on first use; NULL (*err) if impossible. */
struct se_ring *get_ring(se_engine *e, int *err)
{
    struct se_ring *r = tls_find(e);
    if (r)
        return r;
    r = ring_create(e, e->qd, err);
    if (!r)
        return NULL;
    int ret = tls_add(e, r);
    if (ret) {
        ring_free(e, r);
        *err = ret;
        return NULL;
    }
    return r;
}

void ring_destroy_own(se_engine *e, struct se_ring *r)
{
    tls_remove(e);
    ring_unlink(e, r);
    ring_free(e, r);
}

/* Bring r's fixed buffers up to date for a call that uses slot (or -1):
 * registrations of buffers that left the engine table are dropped (their
 * pages unpinned) once the table generation moves, and the buffer in slot is
 * registered in this ring on first use, so a ring pins only the buffers its
 * thread reads into.  A registration that failed (e.g. RLIMIT_MEMLOCK) is not
 * retried for the same buffer in the same ring. */
void ring_sync_buffers(se_engine *e, struct se_ring *r, int slot)
{
    uint64_t g = __atomic_load_n(&e->buf_gen, __ATOMIC_ACQUIRE);
    if (slot >= SE_MAX_BUFFERS)
        slot = -1;
    if (g == r->buf_gen &&
        (slot < 0 || r->mirror[slot].id || r->failed[slot] == r->want[slot]))
        return;
    if (!r->bufs_ok) {
        r->buf_gen = g;
        return;
    }
    pthread_mutex_lock(&e->mu);
    __u64 tag = 0;
    if (g != r->buf_gen) {
        for (int s = 0; s < SE_MAX_BUFFERS; s++) {
            r->want[s] = e->table[s].id;
            if (r->mirror[s].id && r->mirror[s].id != e->table[s].id) {
                struct iovec none = {.iov_base = NULL, .iov_len = 0};
                io_uring_register_buffers_update_tag(&r->ring, (unsigned)s, &none, &tag, 1);
                memset(&r->mirror[s], 0, sizeof(r->mirror[s]));
            }
        }
        r->buf_gen = __atomic_load_n(&e->buf_gen, __ATOMIC_RELAXED);
    }
    if (slot >= 0 && !r->mirror[slot].id && e->table[slot].id &&
        r->failed[slot] != e->table[slot].id) {
        struct iovec iov = {.iov_base = e->table[slot].addr,
                            .iov_len = (size_t)e->table[slot].len};
        int ret = io_uring_register_buffers_update_tag(&r->ring, (unsigned)slot, &iov, &tag, 1);
        if (ret < 0) {
            r->failed[slot] = e->table[slot].id;
            ADD(e->c.buffer_register_errors, 1);
            __atomic_store_n(&e->c.last_buffer_errno, (int64_t)-ret, __ATOMIC_RELAXED);
        } else {
            r->mirror[slot] = e->table[slot];
        }
    }
    pthread_mutex_unlock(&e->mu);
}

/* ---- engine open / close --------------------------------------------- */

void engine_publish(se_engine *e)
{
    pthread_mutex_lock(&g_mu);
    e->id = ++g_next_id;
    e->gnext = g_live;
    g_live = e;
    pthread_mutex_unlock(&g_mu);
}

int rings_open(se_engine *e, unsigned queue_depth)
{
    struct se_ring *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    /* Find the flags this kernel takes, and the depth locked memory allows. */
    unsigned qd = queue_depth;
    size_t k = 0;
    int ret;
    for (;;) {
        ret = ring_init(r, e, qd, flag_attempts[k]);
        if (ret == -EINVAL && k + 1 < sizeof(flag_attempts) / sizeof(flag_attempts[0])) {
            k++;
            continue;
        }
        if (ret == -ENOMEM && qd > MIN_QD) {
            qd /= 2;
            continue;
        }
        break;
    }
    if (ret < 0) {
        free(r);
        return ret;
    }
    e->setup_flags = flag_attempts[k];
    e->ring_flags = ((e->setup_flags & IORING_SETUP_SINGLE_ISSUER) ? SE_RING_SINGLE_ISSUER : 0) |
                    ((e->setup_flags & IORING_SETUP_DEFER_TASKRUN) ? SE_RING_DEFER_TASKRUN : 0) |
                    ((e->setup_flags & IORING_SETUP_COOP_TASKRUN) ? SE_RING_COOP_TASKRUN : 0) |
                    ((e->setup_flags & IORING_SETUP_SUBMIT_ALL) ? SE_RING_SUBMIT_ALL : 0);
    e->qd = r->qd;
    e->files_registered = r->files_registered;
    e->c.rings_created = 1;
    engine_publish(e);
    ret = tls_add(e, r);
    if (ret) {
        rings_close(e);
        io_uring_queue_exit(&r->ring);
        free(r);
        return ret;
    }
    return 0;
}

void rings_close(se_engine *e)
{
    pthread_mutex_lock(&g_mu);
    for (se_engine **pp = &g_live; *pp; pp = &(*pp)->gnext) {
        if (*pp == e) {
            *pp = e->gnext;
            break;
        }
    }
    pthread_mutex_lock(&e->mu);
    struct se_ring *r = e->rings;
    e->rings = NULL;
    pthread_mutex_unlock(&e->mu);
    while (r) {
        struct se_ring *next = r->next;
        ring_free(e, r);
        r = next;
    }
    pthread_mutex_unlock(&g_mu);
    tls_remove(e);
}

/* ---- fixed buffers ----------------------------------------------------- */

int se_register_buffer(se_engine *e, void *addr, uint64_t len)
{
    if (e->kind != SE_KIND_URING)
        return -EOPNOTSUPP;
    if (!addr || len == 0 || len > (1ull << 30))
        return -EINVAL;
    int err = 0;
    struct se_ring *r = get_ring(e, &err);
    if (!r)
        return err;
    if (!r->bufs_ok)
        return -EOPNOTSUPP;
    pthread_mutex_lock(&e->mu);
    int slot = -ENOSPC;
    for (int i = 0; i < SE_MAX_BUFFERS; i++) {
        if (!e->table[i].id) {
            slot = i;
            break;
        }
    }
    uint64_t id = 0;
    if (slot >= 0) {
        id = ++e->next_buf_id;
        e->table[slot].addr = addr;
        e->table[slot].len = len;
        e->table[slot].id = id;
        ADD(e->c.buffers, 1);
        __atomic_fetch_add(&e->buf_gen, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&e->mu);
    if (slot < 0)
        return slot;
    ring_sync_buffers(e, r, slot);
    if (r->mirror[slot].id == id)
        return slot;
    /* not even this thread's ring could register it: take it out again */
    int64_t why = __atomic_load_n(&e->c.last_buffer_errno, __ATOMIC_RELAXED);
    se_unregister_buffer(e, slot);
    return why ? (int)-why : -EIO;
}

int se_unregister_buffer(se_engine *e, int slot)
{
    if (e->kind != SE_KIND_URING || slot < 0 || slot >= SE_MAX_BUFFERS)
        return -EINVAL;
    pthread_mutex_lock(&e->mu);
    int used = e->table[slot].id != 0;
    if (used) {
        memset(&e->table[slot], 0, sizeof(e->table[slot]));
        SUB(e->c.buffers, 1);
        __atomic_fetch_add(&e->buf_gen, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&e->mu);
    struct se_ring *r = tls_find(e);
    if (used && r)
        ring_sync_buffers(e, r, -1);   /* other rings drop it on their next call */
    return 0;
}

