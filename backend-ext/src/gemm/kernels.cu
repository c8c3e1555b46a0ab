// The element-wise kernels of the CUDA expert path (mpipemoe-cuda, src/gemm): the activation
// with its input bias, its derivative, an output bias, and the pointer tables of cuBLAS's
// grouped GEMM. Compiled once per process by NVRTC; launched on the path's own stream between
// its GEMMs. Every kernel works on the blocks of one partition's experts, each block described by
// its base pointers and row count in a table passed by value (no upload, nothing to keep alive).
//
// The formulas are those of the crate's composed activations (src/experts/activation.rs):
// exact GELU `z * 0.5 * (1 + erf(z / sqrt(2)))`, ReLU, SwiGLU `silu(gate) * up` on `[gate | up]`,
// and GPT-OSS's clamped SwiGLU.

#define MAX_JOBS 64
#define MAX_PTRS 384

struct Job {
    unsigned long long p0;
    unsigned long long p1;
    unsigned long long p2;
    unsigned long long p3;
    unsigned long long bias;
    unsigned int rows;
    unsigned int pad;
};

struct Jobs {
    unsigned int n;
    unsigned int pad;
    Job job[MAX_JOBS];
};

struct Ptrs {
    unsigned int n;
    unsigned int pad;
    unsigned long long ptr[MAX_PTRS];
};

// f32 to bf16 bits, rounding to nearest even (NaN stays a quiet NaN): the operands of the bf16
// precision's products. Written out so that NVRTC needs no CUDA header.
__device__ __forceinline__ unsigned short bf16_of(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Stores `v` at element `i` of `p`: f32, or bf16 where `half` is set.
__device__ __forceinline__ void store(void* p, unsigned long long i, float v, int half) {
    if (half) {
        ((unsigned short*)p)[i] = bf16_of(v);
    } else {
        ((float*)p)[i] = v;
    }
}

__device__ __forceinline__ float sigmoid_of(float x) {
    return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float gelu_of(float z) {
    return z * (0.5f * (1.0f + erff(z * 0.70710678118654752440f)));
}

// d gelu / dz = Phi(z) + z * phi(z).
__device__ __forceinline__ float gelu_slope(float z) {
    float cdf = 0.5f * (1.0f + erff(z * 0.70710678118654752440f));
    float pdf = expf(-0.5f * z * z) * 0.39894228040143267794f;
    return cdf + z * pdf;
}

// A thread's walk over the elements of a `width`-wide block in a grid-stride loop: element
// `i`, its row `r` and column `c`. Each turn steps the row and column by the stride's quotient
// and remainder, with one carry, instead of dividing them out at every element: a 64-bit
// division is a long software routine on the device, not an instruction, and the element-wise
// kernels made two an element, more work than the element's memory traffic. Here each thread
// divides once, at its first element. Widths are below 2^31 (d_hidden), so `c + step_cols`
// does not wrap.
struct Walk {
    unsigned long long i;
    unsigned long long step;
    unsigned long long r;
    unsigned long long step_rows;
    unsigned int c;
    unsigned int step_cols;
    unsigned int width;
};

// This thread's first element of the grid-stride loop (blocks in x).
__device__ __forceinline__ Walk walk(unsigned int width) {
    Walk at;
    at.i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    at.step = (unsigned long long)gridDim.x * blockDim.x;
    at.r = at.i / width;
    at.c = (unsigned int)(at.i % width);
    at.step_rows = at.step / width;
    at.step_cols = (unsigned int)(at.step % width);
    at.width = width;
    return at;
}

__device__ __forceinline__ void advance(Walk* at) {
    at->i += at->step;
    at->r += at->step_rows;
    at->c += at->step_cols;
    if (at->c >= at->width) {
        at->c -= at->width;
        at->r += 1;
    }
}

// kind: 0 GELU, 1 ReLU, 2 SwiGLU, 3 clamped SwiGLU. Per block: p0 = z ([rows, d_inner], biases
// added in place where `bias` is set), p1 = a ([rows, d_hidden], bf16 where `half`) or 0 for the
// bias alone.
extern "C" __global__ void act_forward(int kind, float alpha, float limit, unsigned int d_hidden,
                                       int half, const Jobs jobs) {
    const Job job = jobs.job[blockIdx.y];
    const bool gated = kind >= 2;
    const unsigned int d_inner = gated ? 2 * d_hidden : d_hidden;
    float* z = (float*)job.p0;
    void* a = (void*)job.p1;
    const float* bias = (const float*)job.bias;
    const unsigned long long total = (unsigned long long)job.rows * d_hidden;
    for (Walk at = walk(d_hidden); at.i < total; advance(&at)) {
        const unsigned long long r = at.r;
        const unsigned int c = at.c;
        float* zr = z + r * d_inner;
        float g = zr[c];
        float u = 0.0f;
        if (bias) {
            g += bias[c];
            zr[c] = g;
        }
        if (gated) {
            u = zr[c + d_hidden];
            if (bias) {
                u += bias[c + d_hidden];
                zr[c + d_hidden] = u;
            }
        }
        if (!a) {
            continue;
        }
        float out;
        if (kind == 0) {
            out = gelu_of(g);
        } else if (kind == 1) {
            out = fmaxf(g, 0.0f);
        } else if (kind == 2) {
            out = g * sigmoid_of(g) * u;
        } else {
            const float gc = fminf(g, limit);
            const float uc = fminf(fmaxf(u, -limit), limit);
            out = (uc + 1.0f) * (gc * sigmoid_of(gc * alpha));
        }
        store(a, r * d_hidden + c, out, half);
    }
}

// Per block: p0 = z [rows, d_inner], p1 = grad_a [rows, d_hidden], p2 = a out [rows, d_hidden],
// p3 = grad_z out [rows, d_inner]; the two outputs in bf16 where `half`.
extern "C" __global__ void act_backward(int kind, float alpha, float limit, unsigned int d_hidden,
                                        int half, const Jobs jobs) {
    const Job job = jobs.job[blockIdx.y];
    const bool gated = kind >= 2;
    const unsigned int d_inner = gated ? 2 * d_hidden : d_hidden;
    const float* z = (const float*)job.p0;
    const float* ga = (const float*)job.p1;
    void* a = (void*)job.p2;
    void* gz = (void*)job.p3;
    const unsigned long long total = (unsigned long long)job.rows * d_hidden;
    for (Walk at = walk(d_hidden); at.i < total; advance(&at)) {
        const unsigned long long r = at.r;
        const unsigned int c = at.c;
        const float* zr = z + r * d_inner;
        const unsigned long long at_a = r * d_hidden + c;
        const unsigned long long at_g = r * d_inner + c;
        const float g = zr[c];
        const float grad = ga[r * d_hidden + c];
        if (kind == 0) {
            store(a, at_a, gelu_of(g), half);
            store(gz, at_g, grad * gelu_slope(g), half);
        } else if (kind == 1) {
            store(a, at_a, fmaxf(g, 0.0f), half);
            store(gz, at_g, g > 0.0f ? grad : 0.0f, half);
        } else if (kind == 2) {
            const float u = zr[c + d_hidden];
            const float s = sigmoid_of(g);
            const float silu = g * s;
            store(a, at_a, silu * u, half);
            store(gz, at_g + d_hidden, grad * silu, half);
            store(gz, at_g, (grad * u) * (s * (g * (1.0f - s) + 1.0f)), half);
        } else {
            const float u = zr[c + d_hidden];
            const float gc = fminf(g, limit);
            const float uc = fminf(fmaxf(u, -limit), limit);
            const float s = sigmoid_of(gc * alpha);
            const float glu = gc * s;
            store(a, at_a, (uc + 1.0f) * glu, half);
            // The clamps pass no gradient where they clamped (the bounds themselves pass it).
            store(gz, at_g + d_hidden, (u > limit || u < -limit) ? 0.0f : grad * glu, half);
            const float slope = (gc * (1.0f - s)) * alpha + 1.0f;
            store(gz, at_g, (g > limit) ? 0.0f : (grad * (uc + 1.0f)) * (s * slope), half);
        }
    }
}

// Per block: p0 = out [rows, width]; adds the block's bias row to every row.
extern "C" __global__ void add_bias(unsigned int width, const Jobs jobs) {
    const Job job = jobs.job[blockIdx.y];
    float* out = (float*)job.p0;
    const float* bias = (const float*)job.bias;
    const unsigned long long total = (unsigned long long)job.rows * width;
    for (Walk at = walk(width); at.i < total; advance(&at)) {
        out[at.i] += bias[at.c];
    }
}

// The lane's half of a hand-over (handover.rs): spins until the word at `flag` (which a cubecl
// kernel stores) equals `seq`, at most `bound` turns; on giving up stores `seq` at `gave_up`.
// One thread: the atomic read (`atomicAdd(p, 0)`) goes to memory on every turn.
extern "C" __global__ void wait_flag(unsigned int* flag, unsigned int seq, unsigned int bound,
                                     unsigned int* gave_up) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    for (unsigned int turn = 0;; ++turn) {
        if (atomicAdd(flag, 0u) == seq) {
            return;
        }
        if (turn >= bound) {
            atomicExch(gave_up, seq);
            return;
        }
    }
}

// Stores `seq` at `flag` once every earlier kernel of the stream is done (stream order), for a
// cubecl kernel that spins on it.
extern "C" __global__ void set_flag(unsigned int* flag, unsigned int seq) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        __threadfence();
        atomicExch(flag, seq);
    }
}

// Four floats and four bf16 values, for the conversion's wide loads and stores (C++11's
// alignas: NVRTC compiles this source without CUDA's headers, which define float4 and uint2).
struct alignas(16) Floats4 {
    float x, y, z, w;
};
struct alignas(8) Halves4 {
    unsigned int lo, hi;
};

// dst[i] = bf16(src[i]) for i < n: the f32 operands of the bf16 precision's products. A pass
// over memory and nothing else, so it moves four values a thread and turn (one 16-byte load,
// one 8-byte store) where both addresses allow it, and the tail (or everything, where they do
// not) one by one. The bf16 of the lower address goes to the low half of each word (the
// device is little-endian).
extern "C" __global__ void to_bf16(const float* src, unsigned short* dst, unsigned long long n) {
    const unsigned long long first = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long done = 0;
    if ((((unsigned long long)src) & 15ull) == 0 && (((unsigned long long)dst) & 7ull) == 0) {
        const unsigned long long quads = n / 4;
        const Floats4* wide_src = (const Floats4*)src;
        Halves4* wide_dst = (Halves4*)dst;
        for (unsigned long long q = first; q < quads; q += stride) {
            const Floats4 v = wide_src[q];
            Halves4 out;
            out.lo = (unsigned int)bf16_of(v.x) | ((unsigned int)bf16_of(v.y) << 16);
            out.hi = (unsigned int)bf16_of(v.z) | ((unsigned int)bf16_of(v.w) << 16);
            wide_dst[q] = out;
        }
        done = quads * 4;
    }
    for (unsigned long long i = done + first; i < n; i += stride) {
        dst[i] = bf16_of(src[i]);
    }
}

// dst[i] = ptrs.ptr[i]: the device pointer arrays of cuBLAS's grouped GEMM.
extern "C" __global__ void fill_ptrs(const Ptrs ptrs, unsigned long long* dst) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < ptrs.n) {
        dst[i] = ptrs.ptr[i];
    }
}
