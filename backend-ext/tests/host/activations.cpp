// The element-wise kernels of `src/gemm/kernels.cu` (`act_forward`, `act_backward`, `add_bias`)
// run on the host, every thread of their launch grid in turn, against the activations and
// their derivatives computed here in double from their definitions:
//
// - GELU `z·Φ(z)`, `d/dz = Φ(z) + z·φ(z)`;
// - ReLU;
// - SwiGLU `silu(g)·u` on `[g | u]`, its two halves' derivatives;
// - GPT-OSS's clamped SwiGLU, `(clamp(u) + 1)·g_c·σ(α·g_c)` with `g_c = min(g, limit)`, no
//   gradient through a bound that clamped.
//
// Several jobs a launch (experts with different rows, one with none), each at its own place in
// a buffer with a gap before it, with and without input biases, outputs in f32 and in bf16; at
// the launch grid the path makes and at one of three blocks, where each thread walks many
// elements.
// What it holds: every value each kernel writes (to 1e-6 relative in f32, to one bf16 step in
// bf16), the biases added in place, nothing written in the gaps, and the rows of the next job
// untouched. Exits 1 on the first difference (printed). Built and run by
// `tests/kernels_on_host.rs`.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "cuda_stub.h"

dim3 blockIdx, blockDim, threadIdx, gridDim;

#include "../../src/gemm/kernels.cu"

static const float SENTINEL = -12345.0f;

static float as_float(unsigned short bf16) {
    unsigned int bits = (unsigned int)bf16 << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double phi_cdf(double z) { return 0.5 * (1.0 + erf(z / sqrt(2.0))); }
static double phi_pdf(double z) { return exp(-0.5 * z * z) / sqrt(2.0 * M_PI); }

// The activation of one element: `g` (and `u` where gated).
static double act(int kind, double g, double u, double alpha, double limit) {
    switch (kind) {
        case 0: return g * phi_cdf(g);
        case 1: return g > 0 ? g : 0;
        case 2: return g * sigmoid(g) * u;
        default: {
            const double gc = g < limit ? g : limit;
            const double uc = u < -limit ? -limit : (u > limit ? limit : u);
            return (uc + 1) * gc * sigmoid(alpha * gc);
        }
    }
}

// d act / d g and d act / d u, each times `grad`.
static void act_grad(int kind, double g, double u, double alpha, double limit, double grad, double* dg, double* du) {
    *du = 0;
    switch (kind) {
        case 0: *dg = grad * (phi_cdf(g) + g * phi_pdf(g)); break;
        case 1: *dg = g > 0 ? grad : 0; break;
        case 2: {
            const double s = sigmoid(g);
            *dg = grad * u * (s + g * s * (1 - s));
            *du = grad * g * s;
            break;
        }
        default: {
            const double gc = g < limit ? g : limit;
            const double uc = u < -limit ? -limit : (u > limit ? limit : u);
            const double s = sigmoid(alpha * gc);
            *dg = g > limit ? 0 : grad * (uc + 1) * (s + alpha * gc * s * (1 - s));
            *du = (u > limit || u < -limit) ? 0 : grad * gc * s;
        }
    }
}

// The most blocks a launch takes in x: 4,096 as `Kernels::tables` caps them, or a few, so that
// every thread walks several elements of its job (the grid-stride loops and their row and column
// steps), which the kernels must get right at any grid.
static unsigned long long max_blocks = 4096;

// The launch `Kernels::tables` makes for `jobs` of `elements` a row: 256 threads, blocks for
// the largest job's elements (at most `max_blocks`) in x, one row of blocks per job in y.
template <typename F>
static void launch(const Jobs& jobs, unsigned long long elements, F kernel) {
    unsigned long long largest = 0;
    for (unsigned i = 0; i < jobs.n; i++) {
        const unsigned long long e = (unsigned long long)jobs.job[i].rows * elements;
        largest = e > largest ? e : largest;
    }
    unsigned long long x = (largest + 255) / 256;
    x = x < 1 ? 1 : (x > max_blocks ? max_blocks : x);
    gridDim = {(unsigned)x, jobs.n, 1};
    blockDim = {256, 1, 1};
    for (unsigned y = 0; y < gridDim.y; y++) {
        for (unsigned b = 0; b < gridDim.x; b++) {
            for (unsigned t = 0; t < blockDim.x; t++) {
                blockIdx = {b, y, 0};
                threadIdx = {t, 0, 0};
                kernel(jobs);
            }
        }
    }
}

static double uniform() { return (double)rand() / RAND_MAX * 8.0 - 4.0; }

static bool close(double got, double want, bool half, const char* what, size_t at) {
    // One bf16 step of the value (8 bits of mantissa), or 1e-6 relative in f32 (the kernel
    // computes in f32), with an absolute floor for values near zero.
    const double tol = half ? fabs(want) / 128.0 + 1e-6 : fabs(want) * 1e-6 + 1e-6;
    if (fabs(got - want) <= tol) {
        return true;
    }
    printf("%s at %zu: %.9g, expected %.9g\n", what, at, got, want);
    return false;
}

int main() {
    const unsigned d_hidden = 37;
    const unsigned rows[] = {5, 0, 13, 1, 70};
    const unsigned n_jobs = sizeof(rows) / sizeof(rows[0]);
    const double alpha = 1.702, limit = 1.5;
    int checked = 0;
    for (unsigned long long cap : {4096ull, 3ull}) {
    max_blocks = cap;
    for (int kind = 0; kind < 4; kind++) {
        const bool gated = kind >= 2;
        const unsigned d_inner = gated ? 2 * d_hidden : d_hidden;
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            for (int half = 0; half < 2; half++) {
                // Each job's blocks start after a gap of 3 rows, so a write past a job's rows
                // or before them lands in a gap or the next job's rows.
                std::vector<size_t> start(n_jobs);
                size_t total = 3;
                for (unsigned j = 0; j < n_jobs; j++) {
                    start[j] = total;
                    total += rows[j] + 3;
                }
                std::vector<float> z(total * d_inner), z0, ga(total * d_hidden), bias(n_jobs * d_inner);
                for (auto& v : z) v = (float)uniform();
                for (auto& v : ga) v = (float)uniform();
                for (auto& v : bias) v = (float)uniform();
                z0 = z;
                // Whether `row` belongs to a job (the others are gaps, never written).
                auto in_a_job = [&](size_t row) {
                    for (unsigned j = 0; j < n_jobs; j++) {
                        if (row >= start[j] && row < start[j] + rows[j]) return true;
                    }
                    return false;
                };
                // Outputs as 32-bit words filled with the sentinel (f32) or its bf16 pairs.
                std::vector<float> a(total * d_hidden, SENTINEL), gz(total * d_inner, SENTINEL);
                std::vector<unsigned short> a16(total * d_hidden, 0xBEEF), gz16(total * d_inner, 0xBEEF);
                void* a_out = half ? (void*)a16.data() : (void*)a.data();
                void* gz_out = half ? (void*)gz16.data() : (void*)gz.data();
                const size_t a_bytes = half ? 2 : 4;
                Jobs fwd = {}, bwd = {};
                fwd.n = bwd.n = n_jobs;
                for (unsigned j = 0; j < n_jobs; j++) {
                    fwd.job[j].p0 = (unsigned long long)(z.data() + start[j] * d_inner);
                    fwd.job[j].p1 = (unsigned long long)((char*)a_out + start[j] * d_hidden * a_bytes);
                    fwd.job[j].bias = with_bias ? (unsigned long long)(bias.data() + j * d_inner) : 0;
                    fwd.job[j].rows = rows[j];
                }
                launch(fwd, d_hidden, [&](const Jobs& jobs) { act_forward(kind, (float)alpha, (float)limit, d_hidden, half, jobs); });
                // z holds the biased pre-activation; a the activation.
                for (unsigned j = 0; j < n_jobs; j++) {
                    for (unsigned r = 0; r < rows[j]; r++) {
                        const size_t row = start[j] + r;
                        for (unsigned c = 0; c < d_inner; c++) {
                            const size_t i = row * d_inner + c;
                            const double want = (double)z0[i] + (with_bias ? bias[j * d_inner + c] : 0.0f);
                            if (!close(z[i], want, false, "biased z", i)) return 1;
                        }
                        for (unsigned c = 0; c < d_hidden; c++) {
                            const size_t i = row * d_hidden + c;
                            const double g = z[row * d_inner + c], u = gated ? z[row * d_inner + d_hidden + c] : 0;
                            const double got = half ? as_float(a16[i]) : a[i];
                            if (!close(got, act(kind, g, u, alpha, limit), half, "a", i)) return 1;
                            checked++;
                        }
                    }
                }
                // Nothing but the jobs' rows written: the gaps keep their values.
                for (size_t row = 0; row < total; row++) {
                    if (in_a_job(row)) continue;
                    for (unsigned c = 0; c < d_inner; c++) {
                        if (z[row * d_inner + c] != z0[row * d_inner + c]) {
                            printf("forward wrote z in a gap, row %zu\n", row);
                            return 1;
                        }
                    }
                    for (unsigned c = 0; c < d_hidden; c++) {
                        const size_t i = row * d_hidden + c;
                        if (half ? a16[i] != 0xBEEF : a[i] != SENTINEL) {
                            printf("forward wrote a in a gap, row %zu\n", row);
                            return 1;
                        }
                    }
                }
                // Backward on the biased z: a again, and dz.
                std::fill(a.begin(), a.end(), SENTINEL);
                std::fill(a16.begin(), a16.end(), 0xBEEF);
                for (unsigned j = 0; j < n_jobs; j++) {
                    bwd.job[j].p0 = (unsigned long long)(z.data() + start[j] * d_inner);
                    bwd.job[j].p1 = (unsigned long long)(ga.data() + start[j] * d_hidden);
                    bwd.job[j].p2 = (unsigned long long)((char*)a_out + start[j] * d_hidden * a_bytes);
                    bwd.job[j].p3 = (unsigned long long)((char*)gz_out + start[j] * d_inner * a_bytes);
                    bwd.job[j].rows = rows[j];
                }
                launch(bwd, d_hidden, [&](const Jobs& jobs) { act_backward(kind, (float)alpha, (float)limit, d_hidden, half, jobs); });
                for (unsigned j = 0; j < n_jobs; j++) {
                    for (unsigned r = 0; r < rows[j]; r++) {
                        const size_t row = start[j] + r;
                        for (unsigned c = 0; c < d_hidden; c++) {
                            const double g = z[row * d_inner + c], u = gated ? z[row * d_inner + d_hidden + c] : 0;
                            double dg, du;
                            act_grad(kind, g, u, alpha, limit, ga[row * d_hidden + c], &dg, &du);
                            const size_t ia = row * d_hidden + c, ig = row * d_inner + c;
                            if (!close(half ? as_float(a16[ia]) : a[ia], act(kind, g, u, alpha, limit), half, "a (backward)", ia)) return 1;
                            if (!close(half ? as_float(gz16[ig]) : gz[ig], dg, half, "dz", ig)) return 1;
                            if (gated && !close(half ? as_float(gz16[ig + d_hidden]) : gz[ig + d_hidden], du, half, "dz (up)", ig + d_hidden)) return 1;
                            checked += 2;
                        }
                    }
                }
                for (size_t row = 0; row < total; row++) {
                    for (unsigned c = 0; !in_a_job(row) && c < d_inner; c++) {
                        const size_t i = row * d_inner + c;
                        if (half ? gz16[i] != 0xBEEF : gz[i] != SENTINEL) {
                            printf("backward wrote dz in a gap, row %zu\n", row);
                            return 1;
                        }
                    }
                }
            }
        }
    }
    // add_bias: every row of each job plus its bias row, the gaps untouched.
    {
        const unsigned width = 19;
        const unsigned total_rows = 100;
        std::vector<float> out(total_rows * width), out0, bias(3 * width);
        for (auto& v : out) v = (float)uniform();
        for (auto& v : bias) v = (float)uniform();
        out0 = out;
        const unsigned starts[] = {1, 10, 20}, counts[] = {7, 0, 60};
        Jobs jobs = {};
        jobs.n = 3;
        for (unsigned j = 0; j < 3; j++) {
            jobs.job[j].p0 = (unsigned long long)(out.data() + starts[j] * width);
            jobs.job[j].bias = (unsigned long long)(bias.data() + j * width);
            jobs.job[j].rows = counts[j];
        }
        launch(jobs, width, [&](const Jobs& js) { add_bias(width, js); });
        for (unsigned row = 0; row < total_rows; row++) {
            int j = -1;
            for (unsigned k = 0; k < 3; k++) if (row >= starts[k] && row < starts[k] + counts[k]) j = (int)k;
            for (unsigned c = 0; c < width; c++) {
                const size_t i = row * width + c;
                const double want = (double)out0[i] + (j >= 0 ? bias[j * width + c] : 0.0f);
                if (!close(out[i], want, false, "add_bias", i)) return 1;
                checked++;
            }
        }
    }
    }
    printf("ok: %d values\n", checked);
    return 0;
}
