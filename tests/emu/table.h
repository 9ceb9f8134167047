/* The kernels by name (tests/emu): each entry calls its kernel from a cuLaunchKernel
 * parameter array (one pointer per parameter, to a value of the parameter's type)
 * and gives the parameters' sizes, so a launch can be copied and replayed later. */
#include <stddef.h>
#include <string.h>
#include <utility>

template <class T> static T mb_emu_arg(void *p)
{
    T v;
    memcpy((void *)&v, p, sizeof v);
    return v;
}

template <auto F> struct mb_emu_entry;
template <class... A, void (*F)(A...)> struct mb_emu_entry<F> {
    template <size_t... I> static void call(void **p, std::index_sequence<I...>)
    {
        F(mb_emu_arg<A>(p[I])...);
    }
    static void run(void **p) { call(p, std::index_sequence_for<A...>{}); }
    static constexpr int nargs = sizeof...(A);
    static constexpr size_t sizes[] = {sizeof(A)..., 0}; /* never empty */
};

struct mb_emu_kernel {
    const char *name;
    void (*run)(void **);
    int nargs;
    const size_t *sizes;
};

#define MB_EMU_KERNEL(k) \
    {#k, mb_emu_entry<k>::run, mb_emu_entry<k>::nargs, mb_emu_entry<k>::sizes},

extern "C" const mb_emu_kernel mb_emu_kernels[] = {
#include "kernels.inc" /* written by build.py: one MB_EMU_KERNEL(name) per kernel */
};
extern "C" const size_t mb_emu_nkernels = sizeof mb_emu_kernels / sizeof *mb_emu_kernels;
