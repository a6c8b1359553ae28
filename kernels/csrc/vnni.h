/* The instruction sets the int8 kernels need, tested once for every source that includes this: AVX-512 BW, VL,
   VNNI (`vpdpbusd`), VBMI (byte permutes) and BF16 (the bf16 output rounding). Where the compiler targets all of
   them VNNI is 1 and the kernels compile; elsewhere it is 0 and each library builds stubs: its entry points return
   0 and its `*_ok` says so, and the Python side takes the torch path. */
#ifndef DGEMMA_VNNI_H
#define DGEMMA_VNNI_H
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BF16__)
#include <immintrin.h>
#define VNNI 1
#else
#define VNNI 0
#pragma GCC diagnostic ignored "-Wunused-parameter" /* the entry points' stubs: they only return 0 */
#endif
#endif
