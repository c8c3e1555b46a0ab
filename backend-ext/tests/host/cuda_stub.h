// Host stand-ins for what NVRTC gives `src/gemm/kernels.cu`, so that a C++ compiler builds the
// kernels as plain functions (`tests/kernels_on_host.rs`): the qualifiers, the thread indices
// (globals the harness sets before each call, one call per thread of the grid), and the
// intrinsics the source uses, with their device meaning on one thread.
#include <math.h>
#include <string.h>

#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 {
    unsigned x, y, z;
};
extern dim3 blockIdx, blockDim, threadIdx, gridDim;

inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    unsigned int old = *p;
    *p = old + v;
    return old;
}
inline unsigned int atomicExch(unsigned int* p, unsigned int v) {
    unsigned int old = *p;
    *p = v;
    return old;
}
inline void __threadfence() {}
