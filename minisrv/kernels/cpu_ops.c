/* A decoder layer's elementwise steps on the CPU, each one pass over its rows (minisrv/kernels/cpu_ops.py calls
   them): RMSNorm, the residual add fused into it, SiLU-and-mul, neox rotary in place. float32, float32 sums.
   torch runs each as several kernels (a norm is pow, mean, add, rsqrt, two muls), each a pass over memory and a
   dispatch; in a decode step, where rows are few, the dispatches cost more than the arithmetic. */
#include <math.h>
#include <stdint.h>

static inline float inv_rms(const float *restrict x, int dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; ++i) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

/* out[r] = w * x[r] / rms(x[r]) for rows r = (a, b), a < outer, b < inner: row (a, b) starts at a * s_outer +
   b * s_inner (x and out alike), so a [T, H, D] view of a fused projection's output is normed head by head. */
void rmsnorm_f32(const float *x, float *out, int64_t outer, int64_t inner, int64_t x_so, int64_t x_si,
                 int64_t o_so, int64_t o_si, const float *w, int dim, float eps) {
#pragma omp parallel for if (outer * inner * dim > 32768)
    for (int64_t r = 0; r < outer * inner; ++r) {
        const int64_t a = r / inner, b = r % inner;
        const float *xr = x + a * x_so + b * x_si;
        float *orow = out + a * o_so + b * o_si;
        const float s = inv_rms(xr, dim, eps);
#pragma omp simd
        for (int i = 0; i < dim; ++i) orow[i] = w[i] * (xr[i] * s);
    }
}

/* residual[r] += x[r]; x[r] = w * residual[r] / rms(residual[r]) */
void add_rmsnorm_f32(float *x, int64_t x_stride, float *residual, int64_t r_stride, const float *w, int64_t rows,
                     int dim, float eps) {
#pragma omp parallel for if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = x + r * x_stride, *rr = residual + r * r_stride;
#pragma omp simd
        for (int i = 0; i < dim; ++i) rr[i] += xr[i];
        const float s = inv_rms(rr, dim, eps);
#pragma omp simd
        for (int i = 0; i < dim; ++i) xr[i] = w[i] * (rr[i] * s);
    }
}

/* out[r] = silu(gu[r, :inter]) * gu[r, inter:] */
void silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t rows, int inter) {
#pragma omp parallel for if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * gu_stride, *u = g + inter;
        float *o = out + r * inter;
        for (int i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Neox rotary in place on q [T, hq, d] and k [T, hkv, d] (heads and dims contiguous, rows `*_stride` apart) at
   positions pos[T], turning the first rd dims of each head (rd < d: partial rotary, the rest pass through);
   cos_sin[p] = cos(p f_0..f_{rd/2-1}) | sin(...). */
void rope_neox_f32(const int64_t *pos, float *q, int64_t q_stride, int hq, float *k, int64_t k_stride, int hkv,
                   int d, int rd, const float *cos_sin, int64_t tokens) {
    const int half = rd / 2;
#pragma omp parallel for if (tokens * (hq + hkv) * d > 32768)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_sin + pos[t] * rd, *s = c + half;
        for (int h = 0; h < hq + hkv; ++h) {
            float *x = h < hq ? q + t * q_stride + (int64_t)h * d : k + t * k_stride + (int64_t)(h - hq) * d;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}
