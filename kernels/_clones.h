/* kernels/_clones.h: CLONES, for a function whose loops the compiler vectorizes. On x86-64 Linux
   the function is compiled for AVX-512, AVX2 and the baseline, and the loader picks the widest the
   CPU has (an ifunc); elsewhere it is compiled once for the baseline. Shared by kernels/_rope.c
   and kernels/_standardize.c. */
#ifndef KERNELS_CLONES_H
#define KERNELS_CLONES_H

#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

#endif
