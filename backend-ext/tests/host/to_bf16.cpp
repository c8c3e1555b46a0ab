// The bf16 conversion kernel of `src/gemm/kernels.cu` run on the host, every thread of its grid
// in turn, against rounding to nearest even found by distance here: every length from 0 to a few thousand's
// worth of tails, source and destination at every alignment the wide path takes or refuses,
// values in range, tiny, huge, infinite and NaN; nothing written outside the range. Exits 1 on
// the first difference (printed). Built and run by `tests/kernels_on_host.rs`.
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "cuda_stub.h"

dim3 blockIdx, blockDim, threadIdx, gridDim;

#include "../../src/gemm/kernels.cu"

// Round to nearest, ties to even, found by distance rather than by the kernel's bit trick: the
// two bf16 values around `x` (its top 16 bits, and the next value away from zero, one bf16
// unit further: past the largest finite value that is 2^128, where rounding goes to infinity),
// the nearer one, the even one on a tie. A NaN keeps its sign and top bits and becomes quiet.
static unsigned short expected(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);
    }
    const unsigned short toward_zero = (unsigned short)(u >> 16);
    if ((u & 0xffffu) == 0) {
        return toward_zero;
    }
    const int biased = (toward_zero >> 7) & 0xff;
    const double unit = ldexp(1.0, (biased == 0 ? 1 : biased) - 127 - 7);
    unsigned int low_bits = (unsigned int)toward_zero << 16;
    float low_f;
    memcpy(&low_f, &low_bits, 4);
    const double low = fabs((double)low_f);
    const double below = fabs((double)x) - low;
    const double above = low + unit - fabs((double)x);
    const bool up = below > above || (below == above && (toward_zero & 1));
    return (unsigned short)(toward_zero + (up ? 1 : 0));
}

// The launch `Kernels::to_bf16` makes (256 threads, blocks for every element, at most 4,096).
static void launch(const float* src, unsigned short* dst, unsigned long long n) {
    unsigned long long blocks = (n + 255) / 256;
    blocks = blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks);
    gridDim = {(unsigned)blocks, 1, 1};
    blockDim = {256, 1, 1};
    for (unsigned b = 0; b < gridDim.x; b++) {
        for (unsigned t = 0; t < blockDim.x; t++) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            to_bf16(src, dst, n);
        }
    }
}

int main() {
    const unsigned long long lengths[] = {0, 1, 2, 3, 4, 5, 7, 8, 255, 256, 1023, 1025, 4096, 1048576 + 3};
    // Exact values, ties (low half 0x8000: down to an even top, up from an odd one, and up to
    // infinity past the largest finite value), subnormals, infinities and NaNs, as bits.
    const unsigned int special_bits[] = {0x00000000u, 0x80000000u, 0x3f800000u, 0xbfc00000u, 0x3f808000u,
                                         0x3f818000u, 0x7f7f8000u, 0xff7f7fffu, 0x00018000u, 0x7f800000u,
                                         0xff800000u, 0x7fc00001u, 0xff812345u, 0x7f7fffffu};
    const int n_specials = sizeof(special_bits) / sizeof(special_bits[0]);
    float specials[n_specials];
    memcpy(specials, special_bits, sizeof(special_bits));
    unsigned wide = 0;
    for (unsigned long long n : lengths) {
        // Offsets in elements: 16-byte aligned sources and 8-byte aligned destinations take the
        // wide path, the others the narrow one.
        for (int src_at : {0, 1, 2, 3}) {
            for (int dst_at : {0, 1, 2, 4}) {
                std::vector<float> src(n + 8);
                std::vector<unsigned short> dst(n + 8, 0xBEEF);
                for (size_t i = 0; i < src.size(); i++) {
                    src[i] = i % 5 == 0 ? specials[i / 5 % n_specials] : (float)((rand() % 200001) - 100000) / 77.0f;
                }
                const float* s = src.data() + src_at;
                unsigned short* d = dst.data() + dst_at;
                wide += ((unsigned long long)s % 16 == 0 && (unsigned long long)d % 8 == 0) && n >= 4;
                launch(s, d, n);
                for (unsigned long long i = 0; i < n; i++) {
                    if (d[i] != expected(s[i])) {
                        printf("n %llu, offsets %d %d: element %llu of %a is %04x, expected %04x\n", n, src_at,
                               dst_at, i, s[i], d[i], expected(s[i]));
                        return 1;
                    }
                }
                for (size_t i = 0; i < dst.size(); i++) {
                    if ((i < (size_t)dst_at || i >= dst_at + n) && dst[i] != 0xBEEF) {
                        printf("n %llu, offsets %d %d: wrote outside the range at %zu\n", n, src_at, dst_at, i);
                        return 1;
                    }
                }
            }
        }
    }
    if (wide == 0) {
        printf("no run took the wide path\n");
        return 1;
    }
    printf("ok: %u runs on the wide path\n", wide);
    return 0;
}
