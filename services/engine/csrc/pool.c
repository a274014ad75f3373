/* The kernels' helper thread: a call's units are claimed one at a time, by the caller from the
   front and by the helper from the back, so each walks its memory in one direction, and a
   helper late to wake (asleep, or its core busy with the gateway) costs the caller nothing:
   the caller takes every unit the helper has not reached. Only units the helper has claimed
   are waited for. The helper spins SPIN_NS after a call (a decode step's calls come every few
   microseconds), then sleeps on a futex: an idle engine burns nothing. */
#define _GNU_SOURCE /* pthread_setname_np */
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

#include "pool.h"

#define SPIN_NS 200000
#define YIELD_AFTER 256 /* pauses (a few microseconds) before the caller, waiting for the
                           helper's last unit, yields its CPU (to the helper, if it waits for
                           it) */
#define FIELD 0xffffffULL /* front and back: 24 bits each, under a 16-bit generation */

static _Atomic uint64_t claims;
static _Atomic(const pool_job *) current;
static _Atomic int64_t helper_done;
static _Atomic uint32_t posted; /* the futex word: the generation last posted */
static _Atomic int sleeping;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int helper_started;

static int claim(uint64_t gen, int helper, int64_t *unit) {
    uint64_t cur = atomic_load(&claims);
    for (;;) {
        const uint64_t front = (cur >> 24) & FIELD, end = cur & FIELD;
        if ((cur >> 48) != gen || front >= end) return 0;
        const uint64_t next = helper ? cur - 1 : cur + (1ULL << 24);
        if (atomic_compare_exchange_weak(&claims, &cur, next)) {
            *unit = (int64_t)(helper ? end - 1 : front);
            return 1;
        }
    }
}

/* This thread's units of generation gen; the job is read only once one is claimed (the
   caller is then waiting for it, so the job is still there). */
static int64_t run_units(uint64_t gen, int helper) {
    const pool_job *job = NULL;
    int64_t unit, ran = 0;
    while (claim(gen, helper, &unit)) {
        if (!job) {
            job = atomic_load(&current);
            if (job->start) job->start(job->ctx, helper);
        }
        job->unit(job->ctx, unit, helper);
        ran++;
    }
    if (job && job->finish) job->finish(job->ctx, helper);
    return ran;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *helper_main(void *arg) {
    (void)arg;
    uint32_t seen = 0;
    for (;;) {
        uint32_t gen = atomic_load(&posted);
        if (gen == seen) {
            const int64_t until = now_ns() + SPIN_NS;
            while ((gen = atomic_load(&posted)) == seen && now_ns() < until) _mm_pause();
        }
        if (gen == seen) {
            atomic_store(&sleeping, 1);
            if (atomic_load(&posted) == seen)
                syscall(SYS_futex, &posted, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_store(&sleeping, 0);
            continue;
        }
        seen = gen;
        const int64_t ran = run_units(gen & 0xffff, 1);
        if (ran) atomic_fetch_add(&helper_done, ran);
    }
    return NULL;
}

static void start_helper(void) {
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    helper_started = pthread_create(&thread, &attr, helper_main, NULL) == 0;
    if (helper_started) pthread_setname_np(thread, "tandem-kernels"); /* as top -H shows it */
    pthread_attr_destroy(&attr);
}

static void run_alone(const pool_job *job, int64_t units) {
    if (job->start) job->start(job->ctx, 0);
    for (int64_t u = 0; u < units; u++) job->unit(job->ctx, u, 0);
    if (job->finish) job->finish(job->ctx, 0);
}

void pool_run(const pool_job *job, int64_t units, int threads) {
    static uint32_t generation;
    static atomic_flag busy = ATOMIC_FLAG_INIT;
    if (units <= 0) return;
    if (threads < 2 || units < 2 || (uint64_t)units > FIELD) {
        run_alone(job, units);
        return;
    }
    pthread_once(&once, start_helper);
    /* A second caller at once (none in an engine) runs alone rather than share the helper. */
    if (!helper_started || atomic_flag_test_and_set(&busy)) {
        run_alone(job, units);
        return;
    }
    const uint64_t gen = ++generation & 0xffff;
    atomic_store(&helper_done, 0);
    atomic_store(&current, job);
    atomic_store(&claims, gen << 48 | (uint64_t)units);
    atomic_store(&posted, generation);
    if (atomic_load(&sleeping)) syscall(SYS_futex, &posted, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    const int64_t ran = run_units(gen, 0);
    /* The helper counts its units once past its last: what it claimed is running. */
    for (int spins = 0; atomic_load(&helper_done) + ran < units; spins++) {
        if (spins < YIELD_AFTER) _mm_pause();
        else sched_yield();
    }
    atomic_flag_clear(&busy);
}
