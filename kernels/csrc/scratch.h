#ifndef DGEMMA_SCRATCH_H
#define DGEMMA_SCRATCH_H
#include <stdlib.h>
/* Each library that includes this has its own per-thread buffers (kernels/native.py builds one .so per source). */
static __thread void *buf[2];
static __thread size_t cap[2];
static inline void *scratch(int i, size_t n) {  /* this thread's buffer i, grown (never shrunk): no allocation a call */
    if (cap[i] < n) {
        free(buf[i]);
        buf[i] = aligned_alloc(64, (n + 63) / 64 * 64);
        cap[i] = buf[i] ? n : 0;
    }
    return buf[i];
}
#endif
