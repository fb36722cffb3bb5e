/* Projections over weights kept in llama.cpp's 32-wide blocks (minisrv/kernels/cpu_blocks.py calls these): every
   weight is w = d * q + m, q a byte, d and m one float32 pair per 32 weights of a row (layout 0) or, for Q6_K's
   16-weight sub-blocks, one d per 16 weights with m = -32 d (layout 1). Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K
   and Q6_K tensors all say exactly that (models/gguf_repack.py), so w is the value the float32 path dequantises,
   to the bit: these kernels read 1.25 bytes a weight instead of 4 and do the arithmetic in float32.

   Layout (models/gguf_blocks.py packs it): rows in groups of 4; a group's row segment of 32 columns is one 160-byte
   record, float d[4], float m[4] (layout 1: the d of columns 16..31), then uint8 q[4][32]; records run along k,
   then groups along n; one layout byte a group (layouts NULL: all 0). One decode step
   then reads each group as a single forward stream (separate q, d and m arrays made 12 short streams per group,
   and the kernel ran at a third of the memory bandwidth).

   One row of x (a single sequence's decode step): each weight is widened, scaled and multiplied in registers (AVX2
   where the compiler targets it). More rows: a group's weights are dequantised once into a float32 tile in L1 and
   every row of x is multiplied with it. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define QB 32           /* columns a block */
#define REC 160         /* bytes a record: 4 rows x 32 columns */
#define KC 1024         /* columns of a tile (4 x 1024 floats: 16 KB) */
#define MAX_M 32        /* rows of x a call (the Python side splits larger batches) */

/* row r's (d, m) for columns 0..15 (s[0], s[1]) and 16..31 (s[2], s[3]) */
static inline void row_scales(const uint8_t *rec, int r, int layout, float s[4]) {
    const float *dm = (const float *)rec;
    if (layout) {
        s[0] = dm[r], s[1] = -32.0f * dm[r], s[2] = dm[4 + r], s[3] = -32.0f * dm[4 + r];
    } else {
        s[0] = s[2] = dm[r];
        s[1] = s[3] = dm[4 + r];
    }
}

/* one record row's 32 weights into t */
static inline void dequant_row(const uint8_t *rec, int r, int layout, float *t) {
    float s[4];
    row_scales(rec, r, layout, s);
    const uint8_t *q = rec + 32 + r * QB;
#pragma omp simd
    for (int j = 0; j < QB / 2; ++j) t[j] = s[0] * (float)q[j] + s[1];
#pragma omp simd
    for (int j = QB / 2; j < QB; ++j) t[j] = s[2] * (float)q[j] + s[3];
}

static inline void dequant_record(const uint8_t *rec, int layout, float *t0, float *t1, float *t2, float *t3) {
    float *rows[4] = {t0, t1, t2, t3};
    for (int r = 0; r < 4; ++r) dequant_row(rec, r, layout, rows[r]);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen8(const uint8_t *q, __m256 d, __m256 m) {
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    return _mm256_fmadd_ps(qf, d, m);
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* the group's 4 rows . x0 (and . x1 where two rows of x are given), straight from the records: each weight is
   widened once for both. A record's rows one after the other, so that a row's d and m stay in two registers. */
static inline __attribute__((always_inline)) void group_direct(const float *x0, const float *x1, const uint8_t *rec,
                                                              int64_t blocks, float *y0, float *y1, const int layout) {
    __m256 a[4], b[4];
    for (int r = 0; r < 4; ++r) a[r] = b[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk, rec += REC) {
        /* a few records ahead: the hardware prefetcher alone leaves the stream latency-bound */
        _mm_prefetch((const char *)rec + 6 * REC, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 6 * REC + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 6 * REC + 128, _MM_HINT_T0);
        const float *u = x0 + blk * QB, *t = x1 != NULL ? x1 + blk * QB : NULL;
        for (int r = 0; r < 4; ++r) {
            float s[4];
            row_scales(rec, r, layout, s);
            const __m256 d0 = _mm256_set1_ps(s[0]), m0 = _mm256_set1_ps(s[1]);
            const __m256 d1 = _mm256_set1_ps(s[2]), m1 = _mm256_set1_ps(s[3]);
            const uint8_t *q = rec + 32 + r * QB;
            for (int v = 0; v < QB; v += 8) {
                const __m256 w = widen8(q + v, v < QB / 2 ? d0 : d1, v < QB / 2 ? m0 : m1);
                a[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(u + v), a[r]);
                if (t != NULL) b[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(t + v), b[r]);
            }
        }
    }
    for (int r = 0; r < 4; ++r) {
        y0[r] = hsum8(a[r]);
        if (x1 != NULL) y1[r] = hsum8(b[r]);
    }
}

/* y[i][0..3] = the group's 4 rows . x[i] for i < M (M = 4 or 8, a constant where it is inlined): one weight row at
   a time through the whole record stream (from L1 after the first), each weight widened once for M rows, whose M
   accumulators are independent chains */
static inline __attribute__((always_inline)) void group_many(const float *x, int64_t x_stride, const uint8_t *rec0,
                                                            int64_t blocks, float *y, int64_t y_stride, const int M,
                                                            const int layout) {
    for (int r = 0; r < 4; ++r) {
        __m256 acc[8];
        for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
        const uint8_t *rec = rec0;
        for (int64_t blk = 0; blk < blocks; ++blk, rec += REC) {
            if (r == 0) {
                _mm_prefetch((const char *)rec + 6 * REC, _MM_HINT_T0);
                _mm_prefetch((const char *)rec + 6 * REC + 64, _MM_HINT_T0);
                _mm_prefetch((const char *)rec + 6 * REC + 128, _MM_HINT_T0);
            }
            float s[4];
            row_scales(rec, r, layout, s);
            const __m256 d0 = _mm256_set1_ps(s[0]), m0 = _mm256_set1_ps(s[1]);
            const __m256 d1 = _mm256_set1_ps(s[2]), m1 = _mm256_set1_ps(s[3]);
            const uint8_t *q = rec + 32 + r * QB;
            const float *xb = x + blk * QB;
            for (int v = 0; v < QB; v += 8) {
                const __m256 w = widen8(q + v, v < QB / 2 ? d0 : d1, v < QB / 2 ? m0 : m1);
                for (int i = 0; i < M; ++i)
                    acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + (int64_t)i * x_stride + v), acc[i]);
            }
        }
        for (int i = 0; i < M; ++i) y[(int64_t)i * y_stride + r] = hsum8(acc[i]);
    }
}
#endif

/* acc[i][0..3] += the group's 4 rows . x[i], columns [c0, c0 + kc), through a dequantised tile */
static void group_tile(const float *x, int64_t x_stride, const uint8_t *rec, int layout, int64_t c0, int64_t kc,
                       int m, float acc[][4]) {
    float tile[4 * KC] __attribute__((aligned(64)));
    for (int64_t b = 0; b < kc / QB; ++b)
        dequant_record(rec + b * REC, layout, tile + b * QB, tile + KC + b * QB, tile + 2 * KC + b * QB,
                       tile + 3 * KC + b * QB);
    const float *t0 = tile, *t1 = tile + KC, *t2 = tile + 2 * KC, *t3 = tile + 3 * KC;
    for (int i = 0; i < m; ++i) {
        const float *xi = x + (int64_t)i * x_stride + c0;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t c = 0; c < kc; ++c) {
            const float xv = xi[c];
            a0 += t0[c] * xv;
            a1 += t1[c] * xv;
            a2 += t2[c] * xv;
            a3 += t3[c] * xv;
        }
        acc[i][0] += a0;
        acc[i][1] += a1;
        acc[i][2] += a2;
        acc[i][3] += a3;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* y[i][g's 4 rows] for every row i < m of x: 8 rows of x at a time, then 4, then pairs, then one (layout a constant
   where it is inlined, so each layout has its own loop) */
static inline __attribute__((always_inline)) void group_rows(const float *x, int64_t x_stride, const uint8_t *rec,
                                                            int64_t blocks, float *y, int64_t y_stride, int m,
                                                            const int layout) {
    int i = 0;
    for (; i + 8 <= m; i += 8)
        group_many(x + (int64_t)i * x_stride, x_stride, rec, blocks, y + (int64_t)i * y_stride, y_stride, 8, layout);
    for (; i + 4 <= m; i += 4)
        group_many(x + (int64_t)i * x_stride, x_stride, rec, blocks, y + (int64_t)i * y_stride, y_stride, 4, layout);
    for (; i + 2 <= m; i += 2)
        group_direct(x + (int64_t)i * x_stride, x + (int64_t)(i + 1) * x_stride, rec, blocks,
                     y + (int64_t)i * y_stride, y + (int64_t)(i + 1) * y_stride, layout);
    if (i < m) group_direct(x + (int64_t)i * x_stride, NULL, rec, blocks, y + (int64_t)i * y_stride, NULL, layout);
}
#endif

/* y[i][r] = sum_c x[i][c] * w[r][c] for i < m (m <= MAX_M), r < n (a multiple of 4), k a multiple of 32 */
void blocks_matmul(const float *x, int64_t x_stride, const uint8_t *w, const uint8_t *layouts, float *y,
                   int64_t y_stride, int m, int64_t n, int64_t k) {
    const int64_t groups = n / 4, blocks = k / QB;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *rec = w + g * blocks * REC;
        const int layout = layouts != NULL && layouts[g];
#if defined(__AVX2__) && defined(__FMA__)
        if (layout) group_rows(x, x_stride, rec, blocks, y + g * 4, y_stride, m, 1);
        else group_rows(x, x_stride, rec, blocks, y + g * 4, y_stride, m, 0);
#else
        float acc[MAX_M][4];
        memset(acc, 0, sizeof(acc));
        for (int64_t c0 = 0; c0 < k; c0 += KC) {
            const int64_t kc = k - c0 < KC ? k - c0 : KC;
            group_tile(x, x_stride, rec + (c0 / QB) * REC, layout, c0, kc, m, acc);
        }
        for (int i = 0; i < m; ++i)
            memcpy(y + (int64_t)i * y_stride + g * 4, acc[i], 4 * sizeof(float));
#endif
    }
}

/* out [n][k] float32: every weight (a prompt's projections go to torch's matmul over these) */
void blocks_dequant(const uint8_t *w, const uint8_t *layouts, float *out, int64_t n, int64_t k) {
    const int64_t groups = n / 4, blocks = k / QB;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        float *o = out + g * 4 * k;
        const int layout = layouts != NULL && layouts[g];
        for (int64_t b = 0; b < blocks; ++b)
            dequant_record(w + (g * blocks + b) * REC, layout, o + b * QB, o + k + b * QB, o + 2 * k + b * QB,
                           o + 3 * k + b * QB);
    }
}

/* out [t][k] float32: rows ids[0..t) of the matrix (a token embedding's lookup) */
void blocks_rows(const uint8_t *w, const uint8_t *layouts, const int64_t *ids, int64_t t, float *out, int64_t k) {
    const int64_t blocks = k / QB;
    for (int64_t i = 0; i < t; ++i) {
        const int64_t g = ids[i] / 4;
        const int layout = layouts != NULL && layouts[g];
        for (int64_t b = 0; b < blocks; ++b)
            dequant_row(w + (g * blocks + b) * REC, (int)(ids[i] % 4), layout, out + i * k + b * QB);
    }
}

static inline float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8), sign = (h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1fu) bits = sign | 0x7f800000u | (mant << 13);              /* inf, nan */
    else if (exp) bits = sign | ((exp + 112u) << 23) | (mant << 13);        /* normal */
    else if (!mant) bits = sign;                                             /* zero */
    else {                                                                   /* subnormal: normalised */
        uint32_t e = 0;
        while (!(mant & 0x400u)) { mant <<= 1; ++e; }
        bits = sign | ((113u - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The records of a [rows][cols] matrix from a GGUF tensor's blocks (raw: the file's bytes, row after row), in
   one pass: record row i of group g is the file's row src[4 g + i] (src NULL: in order; llama.cpp's q/k rows are
   interleaved for its rotary). kind: ggml's type id, 2 Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles, the low
   ones the first 16 weights; m = -8 d), 3 Q4_1 (20: f16 d, f16 m, nibbles), 8 Q8_0 (34: f16 d, 32 int8; q + 128
   with m = -128 d). Returns 0, or -1 for another kind. */
int blocks_pack(const uint8_t *raw, int kind, const int64_t *src, int64_t rows, int64_t cols, uint8_t *out) {
    const int64_t blocks = cols / QB, groups = rows / 4;
    const int64_t bytes = kind == 2 ? 18 : kind == 3 ? 20 : kind == 8 ? 34 : 0;
    if (!bytes) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        for (int i = 0; i < 4; ++i) {
            const int64_t r = src ? src[4 * g + i] : 4 * g + i;
            const uint8_t *blk = raw + r * blocks * bytes;
            for (int64_t b = 0; b < blocks; ++b, blk += bytes) {
                uint8_t *rec = out + (g * blocks + b) * REC, *q = rec + 32 + i * QB;
                const float d = half_to_float(blk);
                float m;
                if (kind == 8) {
                    m = d * -128.0f;
                    for (int j = 0; j < QB; ++j) q[j] = (uint8_t)((int)(int8_t)blk[2 + j] + 128);
                } else {
                    const uint8_t *nib = blk + (kind == 3 ? 4 : 2);
                    m = kind == 3 ? half_to_float(blk + 2) : d * -8.0f;
                    for (int j = 0; j < QB / 2; ++j) {
                        q[j] = nib[j] & 0x0f;
                        q[j + QB / 2] = nib[j] >> 4;
                    }
                }
                memcpy(rec + 4 * i, &d, 4);
                memcpy(rec + 16 + 4 * i, &m, 4);
            }
        }
    }
    return 0;
}

/* which path this build takes (the log says it) */
const char *blocks_simd_path(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return "AVX2 + FMA";
#else
    return "portable C (no AVX2 + FMA at build time)";
#endif
}
