/* A team of threads that stays together for a whole decode step (decode_stack.c): a barrier
 * between ops and counters from which the threads claim an op's chunks of work.
 *
 * Waiting threads spin, then yield the core, and never sleep: with a parallel region per op,
 * libgomp puts a waiting thread to sleep after GOMP_SPINCOUNT spins (the worker sets 2000, so
 * that a core shared with another process is not burnt), and waking it costs tens of
 * microseconds on these VMs, two wake-ups an op.
 */
#ifndef TRIODE_TEAM_H
#define TRIODE_TEAM_H

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#define SPINS_BEFORE_YIELD 4000

/* The last thread to arrive starts the next generation; the others spin, then yield the core
 * (never sleep: a sleeping thread's wake-up is what this file avoids). */
typedef struct {
    atomic_int arrived, generation;
} team_barrier;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline void team_wait(team_barrier *barrier, int threads) {
    const int generation = atomic_load_explicit(&barrier->generation, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&barrier->arrived, 1, memory_order_acq_rel) == threads - 1) {
        atomic_store_explicit(&barrier->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&barrier->generation, generation + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&barrier->generation, memory_order_acquire) == generation; spins++) {
        if (spins < SPINS_BEFORE_YIELD) cpu_relax();
        else sched_yield();
    }
}

/* A claim counter, alone on its cache line (the threads' own counters of an op would
 * otherwise bounce one line between the cores at every claim). */
typedef struct {
    _Alignas(64) atomic_long value;
} counter;

static inline int64_t claim(counter *c) {
    return atomic_fetch_add_explicit(&c->value, 1, memory_order_relaxed);
}

/* Chunks [0, chunks) of an op, a contiguous share per thread with a counter each, so that
 * each thread streams its own run of weights; a thread that has claimed all of its share
 * goes on with the others'. (All chunks from one counter interleave the threads' chunks; on
 * the 8B-shaped step that was 0-10% slower in same-process comparisons.) */
typedef struct {
    counter *counters;
    int64_t chunks;
    int visited;
} share_claim;

static inline int64_t claim_share(share_claim *c, int me, int threads) {
    for (; c->visited < threads; c->visited++) {
        const int owner = (me + c->visited) % threads;
        const int64_t begin = c->chunks * owner / threads, end = c->chunks * (owner + 1) / threads;
        const int64_t chunk = begin + claim(&c->counters[owner]);
        if (chunk < end) return chunk;
    }
    return -1;
}

#endif
