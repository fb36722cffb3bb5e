/* A decode step's decoder layers in one call, on the CPU, for a model whose projections are kept in GGUF blocks
   (minisrv/kernels/cpu_decode.py calls it): per layer, add + RMSNorm, the qkv product, neox rotary, the K/V store
   into the pool, paged attention, the o product, add + RMSNorm, gate_up, SiLU-and-mul, down: the same kernels the
   layers call one by one from Python (this file includes their sources), in the same order, on the same buffers.

   Why: at one sequence a step of the default model is 30 layers x 10 kernel calls, each wrapped in torch and
   Python calls that took as long as the arithmetic (14.8 ms a step, of which the kernels about 9). */
#include "cpu_attention.c"
#include "cpu_blocks.c"
#include "cpu_ops.c"

/* One layer's weights and KV pool, as the Python side lays them out (its pointers stay valid while the model and
   pool live). */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const uint8_t *qkv, *o, *gate_up, *down; /* block records (cpu_blocks.c) */
    const uint8_t *qkv_l, *o_l, *gate_up_l, *down_l; /* their layout bytes, one a group of 4 rows */
    float *k, *v;                         /* the layer's pool, [slots][hkv][d], kv_stride floats a slot */
} DecodeLayer;

typedef struct {
    int layers, hidden, hq, hkv, d, inter;
    float eps, scale;
    int64_t kv_stride;
    int window; /* every layer's sliding window (0: none) */
} DecodeShape;

/* x [m, hidden]: the embedding in, the last layer's MLP output out; residual [m, hidden]: the residual stream out
   (the model's final add + norm follows in Python). scratch: m * ((hq + 2 hkv) d + hq d + 2 inter + inter) floats.
   pos [m]; loc [m] (each token's pool slot); req_to_token, rows, kv_lens as paged_decode_f32 takes them.
   aux [m, n_aux * hidden]: the residual stream entering each layer of aux_layers (n_aux 0: none read).
   Returns 0, or -1 where attention could not get its scratch memory. */
int decode_layers_f32(const DecodeLayer *layer, const DecodeShape *s, float *x, float *residual, float *scratch,
                      int m, const int64_t *pos, const int64_t *loc, const float *cos_sin,
                      const int32_t *req_to_token, int64_t r2t_stride, const int64_t *rows, const int32_t *kv_lens,
                      int n_aux, const int32_t *aux_layers, float *aux) {
    const int H = s->hidden, d = s->d, qkv_w = (s->hq + 2 * s->hkv) * d, att_w = s->hq * d;
    float *qkv = scratch, *att = qkv + (int64_t)m * qkv_w, *gu = att + (int64_t)m * att_w;
    float *act = gu + (int64_t)m * 2 * s->inter;
    for (int l = 0; l < s->layers; ++l, ++layer) {
        if (l == 0) {
            memcpy(residual, x, sizeof(float) * (size_t)m * (size_t)H);
            rmsnorm_f32(residual, x, m, 1, H, 0, H, 0, layer->input_norm, H, s->eps);
        } else {
            add_rmsnorm_f32(x, H, residual, H, layer->input_norm, m, H, s->eps);
        }
        for (int j = 0; j < n_aux; ++j)
            if (aux_layers[j] == l)
                for (int t = 0; t < m; ++t)
                    memcpy(aux + ((int64_t)t * n_aux + j) * H, residual + (int64_t)t * H, sizeof(float) * (size_t)H);
        blocks_matmul(x, H, layer->qkv, layer->qkv_l, qkv, qkv_w, m, qkv_w, H);
        rope_neox_f32(pos, qkv, qkv_w, s->hq, qkv + att_w, qkv_w, s->hkv, d, d, cos_sin, m);
        for (int t = 0; t < m; ++t) {
            const size_t row = sizeof(float) * (size_t)s->hkv * (size_t)d;
            memcpy(layer->k + loc[t] * s->kv_stride, qkv + (int64_t)t * qkv_w + att_w, row);
            memcpy(layer->v + loc[t] * s->kv_stride, qkv + (int64_t)t * qkv_w + att_w + s->hkv * d, row);
        }
        if (paged_decode_f32(qkv, qkv_w, att, layer->k, layer->v, s->kv_stride, req_to_token, r2t_stride, rows,
                             kv_lens, m, s->hq, s->hkv, d, s->scale, s->window, 0.0f, NULL) != 0)
            return -1;
        blocks_matmul(att, att_w, layer->o, layer->o_l, x, H, m, H, att_w);
        add_rmsnorm_f32(x, H, residual, H, layer->post_norm, m, H, s->eps);
        blocks_matmul(x, H, layer->gate_up, layer->gate_up_l, gu, 2 * s->inter, m, 2 * s->inter, H);
        silu_mul_f32(gu, 2 * s->inter, act, m, s->inter);
        blocks_matmul(act, s->inter, layer->down, layer->down_l, x, H, m, H, s->inter);
    }
    return 0;
}
