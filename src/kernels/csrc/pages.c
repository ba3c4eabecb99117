/* Commits the pages of address ranges before anything writes them (engine.worker.kv_pages).
 *
 * A CPU KV cache is a lazily mapped anonymous mapping (host_memory.zeroed_tensor): each 4 KiB
 * page is faulted in by the first write to it, and those writes are a step's KV copies, one
 * page at a time on one thread while the other waits. MADV_POPULATE_WRITE (Linux 5.14) faults
 * a whole range in one call without touching its contents; here the OpenMP team shares the
 * ranges, so both cores clear pages at once.
 */
#define _DEFAULT_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Below this many bytes the calling thread commits alone: waking the team costs more than a
 * few dozen pages (see elementwise.c). */
#define PARALLEL_MIN_BYTES (256 << 10)

/* Commits ranges [starts[i], starts[i] + lengths[i]), each page aligned; 0, or the errno of a
 * range that failed (EINVAL from a kernel without MADV_POPULATE_WRITE, ENOMEM without memory). */
int triode_populate_pages(const int64_t *starts, const int64_t *lengths, int64_t ranges)
{
    int64_t total = 0;
    for (int64_t i = 0; i < ranges; i++)
        total += lengths[i];
    int failure = 0;
#pragma omp parallel for schedule(dynamic, 1) if (total >= PARALLEL_MIN_BYTES)
    for (int64_t i = 0; i < ranges; i++) {
        if (madvise((void *)(uintptr_t)starts[i], (size_t)lengths[i], MADV_POPULATE_WRITE)) {
#pragma omp atomic write
            failure = errno;
        }
    }
    return failure;
}
