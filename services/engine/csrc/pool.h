/* A call's work split between the calling thread and one helper thread (pool.c). */
#ifndef TANDEM_POOL_H
#define TANDEM_POOL_H

#include <stdint.h>

typedef struct {
    /* Unit u of the work, on the caller (helper 0) or the helper (1): the caller takes units
       from the front, the helper from the back, each one at a time. */
    void (*unit)(void *ctx, int64_t u, int helper);
    /* Before a thread's first unit and after its last (either may be NULL). */
    void (*start)(void *ctx, int helper);
    void (*finish)(void *ctx, int helper);
    void *ctx;
} pool_job;

/* Runs units 0..units-1 of job and returns when all are done: threads 1 on the calling thread
   alone, 2 with the helper (started the first time) taking what it reaches. One caller at a
   time (an engine's step runs on one thread). */
void pool_run(const pool_job *job, int64_t units, int threads);

#endif
