/* A few cached scratch blocks (scratch.h). Concurrent calls each take their own
 * block; a block is kept for the next call unless it is larger than KEEP, so a
 * process holds at most SLOTS * KEEP bytes it is not using. A training step holds
 * up to four at once: a vjp's kept activations (the step before's still alive), its
 * forward's scratch and its pullback's. Blocks from 2 MiB are
 * aligned to 2 MiB and offered to the kernel as huge pages (fewer faults and TLB
 * misses when a block is first touched). */
#define _DEFAULT_SOURCE /* MADV_HUGEPAGE under -std=c11 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include "scratch.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define SLOTS 4
#define KEEP ((size_t)256 << 20)
#define HUGE ((size_t)2 << 20)

static struct {
    float *p;
    size_t cap; /* bytes */
    int busy;
} slot[SLOTS];
static atomic_flag lock = ATOMIC_FLAG_INIT;

static void acquire(void)
{
    while (atomic_flag_test_and_set_explicit(&lock, memory_order_acquire))
        ;
}

static void release(void) { atomic_flag_clear_explicit(&lock, memory_order_release); }

static float *fresh(size_t bytes)
{
    const size_t align = bytes >= HUGE ? HUGE : 64;
    float *p = aligned_alloc(align, (bytes + align - 1) / align * align);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (p && align == HUGE)
        madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

float *mb_scratch_take(size_t n)
{
    const size_t bytes = (n ? n : 1) * sizeof(float);
    int best = -1, spare = -1;
    acquire();
    for (int i = 0; i < SLOTS; i++) {
        if (slot[i].busy)
            continue;
        if (slot[i].cap >= bytes && (best < 0 || slot[i].cap < slot[best].cap))
            best = i;
        if (spare < 0 || slot[i].cap < slot[spare].cap)
            spare = i;
    }
    if (best >= 0) {
        slot[best].busy = 1;
        release();
        return slot[best].p;
    }
    if (spare < 0 || bytes > KEEP) {
        release();
        return fresh(bytes);
    }
    /* replace the smallest free block */
    float *old = slot[spare].p;
    slot[spare].p = NULL;
    slot[spare].cap = 0;
    slot[spare].busy = 1;
    release();
    free(old);
    float *p = fresh(bytes);
    acquire();
    slot[spare].p = p;
    slot[spare].cap = p ? bytes : 0;
    slot[spare].busy = p != NULL;
    release();
    return p;
}

void mb_scratch_give(float *p)
{
    if (!p)
        return;
    acquire();
    for (int i = 0; i < SLOTS; i++)
        if (slot[i].p == p) {
            slot[i].busy = 0;
            release();
            return;
        }
    release();
    free(p);
}
