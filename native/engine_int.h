/*
 * swarmfs native engine: internal definitions shared by engine.c (open,
 * close, execution, counters) and rings.c (per-thread io_uring rings and
 * fixed buffers).  Not part of the cffi interface (that is engine.h).
 */
#ifndef SWARMFS_ENGINE_INT_H
#define SWARMFS_ENGINE_INT_H

#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <liburing.h>

#ifndef IORING_SETUP_SUBMIT_ALL
#define IORING_SETUP_SUBMIT_ALL (1U << 7)
#endif
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif

#define CQE_BATCH 256
#define MIN_QD 8
#define BACKOFF_MAX_NS 1000000ull
#define SE_STALL_NS 60000000000ull  /* requests in the kernel, no completion for 60 s: give up */

#define ADD(field, v) __atomic_fetch_add(&(field), (v), __ATOMIC_RELAXED)
#define SUB(field, v) __atomic_fetch_sub(&(field), (v), __ATOMIC_RELAXED)

struct slot {
    char *addr;
    uint64_t len;
    uint64_t id;     /* unique per registration; 0 = empty */
};

struct se_ring {
    struct io_uring ring;
    unsigned qd;
    int files_registered;
    int bufs_ok;             /* sparse fixed-buffer table registered */
    int broken;              /* enter gave up: tear down after the call */
    uint64_t buf_gen;        /* engine table generation seen */
    struct slot mirror[SE_MAX_BUFFERS];   /* what this ring has registered */
    uint64_t want[SE_MAX_BUFFERS];        /* table ids as of buf_gen */
    uint64_t failed[SE_MAX_BUFFERS];      /* id whose registration failed here */
    struct se_ring *next;    /* engine's list (under e->mu) */
};

struct se_engine {
    int kind;
    int nfds;
    int fds[SE_MAX_DISKS];
    unsigned qd;
    unsigned nthreads;
    unsigned retry_limit;
    unsigned setup_flags;    /* io_uring_setup flags every ring uses */
    int ring_flags;          /* SE_RING_* */
    int files_registered;
    unsigned char punt[SE_MAX_DISKS]; /* no RWF_NOWAIT: threads, or IOSQE_ASYNC */
    int npunt;
    int blocking_mode;       /* SE_BLOCKING_*: where requests to punt disks run */
    unsigned wait_div;       /* wait for inflight / wait_div CQEs while more is queued */
    uint64_t id;
    pthread_mutex_t mu;      /* ring list and buffer table; never held across I/O */
    struct se_ring *rings;
    struct slot table[SE_MAX_BUFFERS];
    uint64_t buf_gen;
    uint64_t next_buf_id;
    se_counters c;           /* atomics */
    se_disk_counters d[SE_MAX_DISKS];
    se_engine *gnext;        /* live engines (under g_mu) */
};

/* rings.c */
/* Set up the calling thread's ring (finding the setup flags the kernel takes
 * and the depth locked memory allows), fill in e's ring fields, publish e as
 * live.  Returns 0 or -errno (e is then not published). */
int rings_open(se_engine *e, unsigned queue_depth);
/* Unpublish e and tear down every ring of it (no call may be running). */
void rings_close(se_engine *e);
/* Publish e as live (an engine without rings: the threads engine). */
void engine_publish(se_engine *e);
/* This thread's ring of e, set up on first use; NULL (*err) if impossible. */
struct se_ring *get_ring(se_engine *e, int *err);
/* Tear down this thread's ring r of e (it broke). */
void ring_destroy_own(se_engine *e, struct se_ring *r);
/* Bring r's fixed-buffer registrations up to date for a call using slot. */
void ring_sync_buffers(se_engine *e, struct se_ring *r, int slot);

#endif
