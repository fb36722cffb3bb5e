/* A projection of a few rows on the CPU, y = x w^T (minisrv/kernels/cpu_gemv.py calls it): x [m, k] with m small
   (decode steps), w [n, k] float32 row-major as nn.Linear holds it, y [m, n].

   Why: at a few rows a decode step's projections read every weight once and do little arithmetic with it. torch's
   CPU matmul (MKL) at one row runs on one core's share of the memory bandwidth (about 11 GB/s of this machine's 33),
   and at 2-32 rows computes each dot product as one chain of dependent FMAs. Here each thread takes blocks of 8
   weight rows, each row with its own accumulator (8 independent chains, vectorised along k), and reuses the block
   from L1 for every row of x: the default model's decode projections at 1 row take 21 ms a step against 48. */
#include <stdint.h>

static inline void block8(const float *restrict xi, const float *restrict w, int64_t k, float *restrict yi) {
    const float *p0 = w, *p1 = w + k, *p2 = w + 2 * k, *p3 = w + 3 * k;
    const float *p4 = w + 4 * k, *p5 = w + 5 * k, *p6 = w + 6 * k, *p7 = w + 7 * k;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, a4 = 0.0f, a5 = 0.0f, a6 = 0.0f, a7 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7)
    for (int64_t c = 0; c < k; ++c) {
        const float xv = xi[c];
        a0 += p0[c] * xv;
        a1 += p1[c] * xv;
        a2 += p2[c] * xv;
        a3 += p3[c] * xv;
        a4 += p4[c] * xv;
        a5 += p5[c] * xv;
        a6 += p6[c] * xv;
        a7 += p7[c] * xv;
    }
    yi[0] = a0;
    yi[1] = a1;
    yi[2] = a2;
    yi[3] = a3;
    yi[4] = a4;
    yi[5] = a5;
    yi[6] = a6;
    yi[7] = a7;
}

/* y[i][r] = sum_c x[i][c] * w[r][c] for i < m, r < n; x rows `x_stride` floats apart, y rows `y_stride`. */
void gemv_f32(const float *x, int64_t x_stride, const float *w, float *y, int64_t y_stride, int m, int64_t n,
              int64_t k) {
    const int64_t blocks = (n + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = b * 8, rows = n - r0 < 8 ? n - r0 : 8;
        const float *wb = w + r0 * k;
        for (int i = 0; i < m; ++i) {
            const float *xi = x + (int64_t)i * x_stride;
            float *yi = y + (int64_t)i * y_stride + r0;
            if (rows == 8) {
                block8(xi, wb, k, yi);
                continue;
            }
            for (int64_t j = 0; j < rows; ++j) {
                const float *p = wb + j * k;
                float a = 0.0f;
#pragma omp simd reduction(+ : a)
                for (int64_t c = 0; c < k; ++c) a += p[c] * xi[c];
                yi[j] = a;
            }
        }
    }
}
