/* Every decoder layer of one step in one call: the same kernels, in the same order and on the
   same buffers, as model.LlamaModel.hidden calls one by one from Python on the cpu attention
   backend (RMSNorm, the fused QKV projection, the rotary embedding, the K/V store, decode and
   prefill attention, the output projection into the residual stream, RMSNorm, gate/up with
   SwiGLU, down into the residual stream), so the bits are the same. From Python each layer
   cost ~110 us of interpreter work around ~10 kernel calls (a fifth of a decode step on the
   built-in model); here it is one call a step (cpu_layers.py). */
#include <stdint.h>

#include "tandem.h"

#define RUN(call)                \
    do {                         \
        const int rc_ = (call);  \
        if (rc_ != 0) return rc_; \
    } while (0)

/* Layers 0 .. num_layers - 1 of w over step s. Returns 0, or the first failing kernel's code
   (-1 out of memory, -2 a shape or slot it refuses, -3 a projection's shape). */
int layers_bf16(const layer_weights *w, int64_t num_layers, const step_t *s) {
    const int64_t T = s->tokens, D = s->hidden, hd = s->head_dim;
    const int64_t q_size = s->heads * hd, kv_size = s->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size, group = s->heads / s->kv_heads;
    const int lt = s->linear_threads, at = s->attention_threads;
    for (int64_t i = 0; i < num_layers; i++) {
        const layer_weights *l = w + i;
        uint16_t *keys = s->cache + i * s->layer_stride, *values = keys + s->kv_stride;
        RUN(rms_norm_bf16(s->x, D, l->input_norm, s->h, T, D, s->eps, s->threads));
        RUN(linear_bf16(s->h, D, l->qkv, l->qkv_bias, s->qkv, T, qkv_size, D, 0, 0, lt));
        RUN(rotary_bf16(s->qkv, qkv_size, s->qkv + q_size, qkv_size, s->q, s->k, s->cos,
                        s->sin, s->num_positions, s->positions, T, s->heads, s->kv_heads, hd,
                        s->threads));
        RUN(store_kv_bf16(s->k, kv_size, s->qkv + q_size + kv_size, qkv_size, keys, values,
                          s->slot_blocks, s->slot_offsets, T, kv_size, s->num_blocks,
                          s->block_size, s->block_stride, s->tok_stride));
        for (int64_t r = 0; r < s->num_decode_runs; r++) {
            const decode_run *d = s->decodes + r;
            RUN(decode_attention_bf16(s->q + d->start * q_size, s->attn + d->start * q_size,
                                      keys, values, d->tables, d->table_stride, d->seq_lens,
                                      d->num_seqs, d->query_len, s->kv_heads, group, hd,
                                      s->block_size, s->block_stride, s->tok_stride, s->scale,
                                      at));
        }
        if (s->num_spans)
            RUN(prefill_attention_bf16(s->q, s->attn, keys, values, s->prefill_tables,
                                       s->prefill_table_stride, s->spans,
                                       s->spans + s->num_spans, s->spans + 2 * s->num_spans,
                                       s->num_spans, s->kv_heads, group, hd, s->block_size,
                                       s->block_stride, s->tok_stride, s->scale, at));
        RUN(linear_bf16(s->attn, q_size, l->o, l->o_bias, s->x, T, D, q_size, 0, 1, lt));
        RUN(rms_norm_bf16(s->x, D, l->post_norm, s->h, T, D, s->eps, s->threads));
        RUN(linear_bf16(s->h, D, l->gate_up, l->gate_up_bias, s->act, T, 2 * s->intermediate,
                        D, 1, 0, lt));
        RUN(linear_bf16(s->act, s->intermediate, l->down, l->down_bias, s->x, T, D,
                        s->intermediate, 0, 1, lt));
    }
    return 0;
}
