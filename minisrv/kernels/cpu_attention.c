/* Decode attention over the paged KV pool, read in place (minisrv/kernels/cpu_attention.py builds and calls it).

   One query token per row; a verify step's queries of one request (the last token and its drafts) are consecutive
   rows of the same request row. Row b's keys are at slots req_to_token[rows[b] * r2t_stride + t] for t < kv_len[b];
   K and V are float32 rows [slot][kv_head][head_dim] with `kv_stride` floats between slots. Each (request, KV head)
   pair is one task: the G = Hq / Hkv query heads of each of its queries share every K and V row it reads, so K and V
   are read exactly once per step and never copied out of the pool. Scores are kept whole per task (two passes:
   scores, then softmax and the weighted sum of V), accumulated in float32. Threads: OpenMP, whose runtime is the
   one torch has already loaded (the same pool of threads). A sliding window of W tokens (window > 0) keeps a query's
   last W keys, its own included; soft-capping (softcap > 0) turns each scaled score s into softcap * tanh(s /
   softcap) before the softmax; sinks (not NULL: a logit per query head) join each softmax's maximum and denominator
   as a key without a value would. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __attribute__((always_inline)) float dot_n(const float *restrict a, const float *restrict b, int d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < d; ++i) acc += a[i] * b[i];
    return acc;
}

static inline __attribute__((always_inline)) void axpy_n(float *restrict y, float a, const float *restrict x,
                                                          int d) {
#pragma omp simd
    for (int i = 0; i < d; ++i) y[i] += a * x[i];
}

/* The common head sizes get loops of a known length (unrolled, no remainder handling). */
static inline float dot(const float *restrict a, const float *restrict b, int d) {
    return d == 64 ? dot_n(a, b, 64) : d == 128 ? dot_n(a, b, 128) : dot_n(a, b, d);
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int d) {
    if (d == 64) axpy_n(y, a, x, 64);
    else if (d == 128) axpy_n(y, a, x, 128);
    else axpy_n(y, a, x, d);
}

/* exp(x) for x <= 0 (a softmax's scores less their maximum), within 2 ulp (Cephes' expf: x = n ln2 + r, a degree-5
   polynomial in r, 2^n from the exponent bits; below -87 it returns exp(-87), about 1.6e-38, not 0). Written so that
   the compiler vectorises the loop calling it: libm's expf is a scalar call per score (without -ffast-math), and was
   most of a single sequence's decode attention (a 320-token context: 68 us a layer, keys hot in cache). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* The rows a task reads are wherever the page table puts them, which the hardware prefetcher cannot guess: each
   loop asks for the row PREFETCH_AHEAD tokens ahead (a decode step's attention at batch 32 of the cpu workload:
   2.4 -> 0.9-1.3 ms a layer, on an AVX2 machine, pools larger than the caches). */
#define PREFETCH_AHEAD 8

static inline void prefetch_row(const float *row, int d) {
    for (int c = 0; c < d; c += 16) __builtin_prefetch(row + c);  /* 16 floats: one 64-byte cache line */
}

/* The first key a query over n keys sees. */
static inline int first_key(int n, int window) { return window > 0 && n > window ? n - window : 0; }

/* q: [batch] rows of hq * d floats, `q_stride_t` apart; out: [batch, hq, d] contiguous. Consecutive rows with the
   same request row (a verify step's queries: the last token and its drafts) form one group, each query with its own
   kv_len: a task is (group, KV head), so the group's G = Hq / Hkv heads of every query share each K and V row read.
   Returns 0, or -1 when a task could not get its scratch memory (out is then incomplete). */
int paged_decode_f32(const float *q, int64_t q_stride_t, float *out, const float *k, const float *v,
                     int64_t kv_stride, const int32_t *req_to_token, int64_t r2t_stride, const int64_t *rows,
                     const int32_t *kv_len, int batch, int hq, int hkv, int d, float scale, int window,
                     float softcap, const float *sinks) {
    const int g = hq / hkv;
    int *first = (int *)malloc(sizeof(int) * (size_t)(batch + 1));  /* group i: rows first[i] .. first[i + 1] - 1 */
    if (first == NULL) return -1;
    int groups = 0, max_cells = 1;
    for (int b = 0; b < batch; ++b) {
        if (b == 0 || rows[b] != rows[b - 1]) first[groups++] = b;
    }
    first[groups] = batch;
    for (int i = 0; i < groups; ++i) {
        int len = 0;
        for (int b = first[i]; b < first[i + 1]; ++b) len = kv_len[b] > len ? kv_len[b] : len;
        const int cells = (first[i + 1] - first[i]) * len;
        max_cells = cells > max_cells ? cells : max_cells;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int task = 0; task < groups * hkv; ++task) {
        const int grp = task / hkv, h = task % hkv, b0 = first[grp], nq = first[grp + 1] - b0;
        const int32_t *slots = req_to_token + rows[b0] * r2t_stride;
        const int32_t *lens = kv_len + b0;
        int len = 0, lo = INT32_MAX;
        for (int i = 0; i < nq; ++i) {
            len = lens[i] > len ? lens[i] : len;
            lo = first_key(lens[i], window) < lo ? first_key(lens[i], window) : lo;
        }
        /* scores of query i's head j at token t: scores[(i * g + j) * len + t] */
        float *scores = (float *)malloc(sizeof(float) * (size_t)g * (size_t)max_cells);
        float *acc = (float *)malloc(sizeof(float) * (size_t)nq * (size_t)g * (size_t)d);
        float *denom = (float *)malloc(sizeof(float) * (size_t)nq * (size_t)g);
        if (scores == NULL || acc == NULL || denom == NULL) {
            free(scores);
            free(acc);
            free(denom);
            failed = 1;
            continue;
        }
        const int64_t head_off = (int64_t)h * d;
        for (int t = lo; t < len; ++t) {
            if (t + PREFETCH_AHEAD < len)
                prefetch_row(k + (int64_t)slots[t + PREFETCH_AHEAD] * kv_stride + head_off, d);
            const float *kr = k + (int64_t)slots[t] * kv_stride + head_off;
            for (int i = 0; i < nq; ++i) {
                if (t >= lens[i] || t < first_key(lens[i], window)) continue;
                const float *qh = q + (int64_t)(b0 + i) * q_stride_t + (int64_t)h * g * d;
                float *s = scores + (int64_t)i * g * len + t;
                for (int j = 0; j < g; ++j) s[(int64_t)j * len] = dot(qh + j * d, kr, d) * scale;
                if (softcap > 0.0f)
                    for (int j = 0; j < g; ++j) s[(int64_t)j * len] = softcap * tanhf(s[(int64_t)j * len] / softcap);
            }
        }
        for (int c = 0; c < nq * g; ++c) {
            const int n = lens[c / g], t0 = first_key(n, window);
            float *s = scores + (int64_t)c * len;
            const float sink = sinks != NULL ? sinks[h * g + c % g] : -INFINITY;
            float m = sink;
#pragma omp simd reduction(max : m)
            for (int t = t0; t < n; ++t) m = s[t] > m ? s[t] : m;
#pragma omp simd
            for (int t = t0; t < n; ++t) s[t] = exp_nonpositive(s[t] - m);
            float sum = sinks != NULL ? exp_nonpositive(sink - m) : 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = t0; t < n; ++t) sum += s[t];
            denom[c] = sum;
        }
        memset(acc, 0, sizeof(float) * (size_t)nq * (size_t)g * (size_t)d);
        for (int t = lo; t < len; ++t) {
            if (t + PREFETCH_AHEAD < len)
                prefetch_row(v + (int64_t)slots[t + PREFETCH_AHEAD] * kv_stride + head_off, d);
            const float *vr = v + (int64_t)slots[t] * kv_stride + head_off;
            for (int c = 0; c < nq * g; ++c) {
                const int n = lens[c / g];
                if (t < n && t >= first_key(n, window)) axpy(acc + (int64_t)c * d, scores[(int64_t)c * len + t], vr, d);
            }
        }
        for (int i = 0; i < nq; ++i) {
            float *o = out + (int64_t)(b0 + i) * hq * d + (int64_t)h * g * d;
            for (int j = 0; j < g; ++j) {
                const int c = i * g + j;
                const float inv = lens[i] > 0 ? 1.0f / denom[c] : 0.0f;
                for (int x = 0; x < d; ++x) o[j * d + x] = acc[(int64_t)c * d + x] * inv;
            }
        }
        free(scores);
        free(acc);
        free(denom);
    }
    free(first);
    return failed ? -1 : 0;
}
