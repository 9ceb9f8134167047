/* The launcher of the host emulation (tests/emu): blocks run one after another; each
 * GPU thread of a block is a fiber. Fibers run until they finish or park at a
 * barrier, and a barrier opens once every live thread it waits for has parked.
 * Between barriers a block's threads run in ascending order, or descending when the
 * launch's count plus the block's index is odd: deterministic, and a kernel that
 * reads what another thread writes without a barrier between them reads stale data
 * somewhere. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include "builtins.h"

#define MAX_THREADS 1024
#define SMEM_FLOATS (1 << 16)
#define STACK (256u << 10)

extern "C" {
dim3 threadIdx, blockIdx, blockDim, gridDim;
uint64_t mb_emu_lane[MAX_THREADS];
/* dynamic shared memory, under the names the kernels declare it by */
thread_local __attribute__((aligned(16))) float sm[SMEM_FLOATS], ring[SMEM_FLOATS];
}

namespace {
void start();

#if defined(__x86_64__) && !defined(MB_EMU_UCONTEXT)
/* A switch saves the callee-saved registers on the old stack and moves to the new
 * one: glibc's swapcontext also makes a system call (the signal mask), which took
 * most of the run time. */
extern "C" void mb_emu_switch(void **from, void *to);
asm(".pushsection .text\n.hidden mb_emu_switch\n.globl mb_emu_switch\n"
    ".type mb_emu_switch, @function\nmb_emu_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n"
    ".popsection\n");
struct Context {
    void *sp;
};
void resume(Context &from, Context &to) { mb_emu_switch(&from.sp, to.sp); }
/* The first switch pops six registers and returns into start(), whose stack pointer
 * is then 8 past a multiple of 16, as after a call. */
void prepare(Context &c, char *stack_end)
{
    void **sp = (void **)stack_end;
    *--sp = NULL;
    *--sp = (void *)start;
    for (int r = 0; r < 6; r++) *--sp = NULL;
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
void resume(Context &from, Context &to) { swapcontext(&from.uc, &to.uc); }
void prepare(Context &c, char *stack_end)
{
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack_end - STACK;
    c.uc.uc_stack.ss_size = STACK;
    makecontext(&c.uc, start, 0);
}
#endif

enum State { RUNNABLE, AT_BLOCK, AT_WARP, DONE };
struct Fiber {
    Context ctx;
    State state;
};
Fiber fibers[MAX_THREADS];
Context home;
char *stacks;
unsigned cur;
void (*body)(void **);
void **params;
char error[256];

void park(State s)
{
    fibers[cur].state = s;
    resume(fibers[cur].ctx, home);
}

void start()
{
    body(params);
    park(DONE); /* never resumed */
}

/* Open every barrier that all live threads of its group [a, b) have reached. */
bool release(unsigned a, unsigned b, State at)
{
    bool some = false;
    for (unsigned i = a; i < b; i++) {
        if (fibers[i].state != at && fibers[i].state != DONE) return false;
        some |= fibers[i].state == at;
    }
    for (unsigned i = a; i < b; i++)
        if (fibers[i].state == at) fibers[i].state = RUNNABLE;
    return some;
}

/* Run one block to its end; false on a deadlock (threads parked at barriers that
 * can never open: a barrier inside divergent code). */
bool run_block(unsigned n, bool descending)
{
    if (!stacks) {
        /* reserved, not committed: a fiber touches a few pages of its stack */
        stacks = (char *)mmap(NULL, (size_t)MAX_THREADS * STACK, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (stacks == MAP_FAILED) abort();
    }
    for (unsigned i = 0; i < n; i++) {
        prepare(fibers[i].ctx, stacks + (size_t)(i + 1) * STACK);
        fibers[i].state = RUNNABLE;
    }
    for (;;) {
        for (unsigned j = 0; j < n; j++) {
            const unsigned i = descending ? n - 1 - j : j;
            if (fibers[i].state == RUNNABLE) {
                cur = i;
                threadIdx = {i, 0, 0};
                resume(home, fibers[i].ctx);
            }
        }
        bool opened = release(0, n, AT_BLOCK);
        for (unsigned w = 0; w < n; w += 32)
            opened |= release(w, w + 32 < n ? w + 32 : n, AT_WARP);
        if (opened) continue;
        for (unsigned i = 0; i < n; i++)
            if (fibers[i].state != DONE) return false;
        return true;
    }
}
}

extern "C" void __syncthreads(void) { park(AT_BLOCK); }
extern "C" void mb_emu_warp_sync(void) { park(AT_WARP); }

/* Threads that passed MB_GRID_WAIT() (vendor.h), for the driver's check of a
 * programmatic dependent launch. */
extern "C" unsigned long long mb_emu_grid_waits;
unsigned long long mb_emu_grid_waits;
extern "C" void mb_emu_grid_wait(void) { mb_emu_grid_waits++; }

std::vector<mb_emu_copy> mb_emu_copies[MAX_THREADS]; /* builtins.h's cp.async */
int mb_emu_commits[MAX_THREADS];
void mb_emu_cp_reset(unsigned threads)
{
    for (unsigned t = 0; t < threads; t++) mb_emu_copies[t].clear(), mb_emu_commits[t] = 0;
}

static const char *fault;
extern "C" void mb_emu_fault(const char *what)
{
    if (!fault) fault = what;
}

/* Launch run (a kernel called from its parameter array) over the grid; NULL, or
 * what went wrong. */
extern "C" const char *mb_emu_launch(void (*run)(void **), void **args, unsigned gx,
                                     unsigned gy, unsigned gz, unsigned bx, size_t smem)
{
    if (bx == 0 || bx > MAX_THREADS || smem > sizeof sm) {
        snprintf(error, sizeof error, "block of %u threads with %zu bytes of dynamic shared "
                 "memory (at most %d and %zu here)", bx, smem, MAX_THREADS, sizeof sm);
        return error;
    }
    static unsigned launches;
    const unsigned odd = launches++ & 1;
    body = run;
    params = args;
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                blockIdx = {x, y, z};
                mb_emu_cp_reset(bx);
                if (!run_block(bx, (odd + x + y + z) & 1)) {
                    snprintf(error, sizeof error, "block (%u, %u, %u) deadlocked: threads wait "
                             "at barriers that not every live thread reaches", x, y, z);
                    return error;
                }
                if (fault) {
                    snprintf(error, sizeof error, "block (%u, %u, %u): %s", x, y, z, fault);
                    fault = NULL;
                    return error;
                }
            }
    return NULL;
}
