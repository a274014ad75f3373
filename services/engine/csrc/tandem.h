/* The C ABI of Tandem's CPU kernels: every function the library exports and every struct it
   shares with Python, declared once. Each source includes it (the compiler checks each
   definition against its declaration); cpu_kernels.py binds the functions with ctypes and,
   when it loads the library, compares its structs' sizes and offsets with
   tandem_abi_layout's; tests/engine/test_cpu_abi.py checks its argument lists against this
   file. Every function returns 0, or a negative code: -1 out of memory, -2 a shape or slot it
   refuses, -3 a projection's shape. Tensors are bfloat16 as uint16_t unless named _f32. */
#ifndef TANDEM_H
#define TANDEM_H

#include <stdint.h>

/* fused_ops.c */
int rms_norm_bf16(const uint16_t *x, int64_t stride, const uint16_t *w, uint16_t *out,
                  int64_t rows, int64_t dim, float eps, int threads);
int silu_mul_bf16(const uint16_t *gate_up, int64_t stride, uint16_t *out, int64_t rows,
                  int64_t dim);
int rotary_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                uint16_t *q_out, uint16_t *k_out, const uint16_t *cos, const uint16_t *sin,
                int64_t num_positions, const int64_t *positions, int64_t tokens,
                int64_t q_heads, int64_t k_heads, int64_t head_dim, int threads);
int store_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                  uint16_t *key_cache, uint16_t *value_cache, const int64_t *blocks,
                  const int64_t *offsets, int64_t tokens, int64_t width, int64_t num_blocks,
                  int64_t block_size, int64_t block_stride, int64_t tok_stride);
int argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out);

/* decode_attention.c */
int decode_attention_bf16(const uint16_t *q, uint16_t *out, const uint16_t *k, const uint16_t *v,
                          const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                          int64_t n, int64_t qlen, int64_t hkv, int64_t group, int64_t d,
                          int64_t bs, int64_t block_stride, int64_t tok_stride, float scale,
                          int threads);

/* decode_attention_f32.c (AVX2 and FMA; a library of its own: kernel_build.AVX2_BUILD) */
int decode_attention_f32(const float *q, float *out, const float *k, const float *v,
                         const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                         int64_t n, int64_t qlen, int64_t hkv, int64_t group, int64_t d,
                         int64_t bs, int64_t block_stride, int64_t tok_stride, float scale,
                         int threads);

/* linear.c and prefill_attention.c (AMX: built where the compiler has its intrinsics) */
int amx_enable(void);
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                uint16_t *out, int64_t M, int64_t N, int64_t K, int swiglu, int residual,
                int threads);
int prefill_attention_bf16(const uint16_t *q, uint16_t *out, const uint16_t *k,
                           const uint16_t *v, const int32_t *tables, int64_t table_stride,
                           const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len,
                           int64_t n, int64_t hkv, int64_t group, int64_t d, int64_t bs,
                           int64_t block_stride, int64_t tok_stride, float scale, int threads);

/* layers.c (AMX): a step's decoder layers in one call */
/* One layer's weights: norms [hidden], projections as linear.c's tiles, biases or NULL. */
typedef struct {
    const uint16_t *input_norm, *post_norm;
    const uint16_t *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
} layer_weights;

/* Decoding sequences with query_len rows each, from row start on (cpu_backend.KernelBatch). */
typedef struct {
    int64_t start, num_seqs, query_len, table_stride;
    const int32_t *tables, *seq_lens;
} decode_run;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    /* The paged cache [blocks, layers, 2, block_size, kv_heads, head_dim] by its strides. */
    uint16_t *cache;
    int64_t num_blocks, block_size, block_stride, layer_stride, kv_stride, tok_stride;
    const uint16_t *cos, *sin; /* [num_positions, head_dim] */
    int64_t num_positions;
    /* The step: its tokens' positions and cache slots, decode runs, prefill spans ([3, n]:
       first row, query rows, keys) with their block tables. */
    int64_t tokens;
    const int64_t *positions, *slot_blocks, *slot_offsets;
    const decode_run *decodes;
    int64_t num_decode_runs;
    const int64_t *spans;
    int64_t num_spans, prefill_table_stride;
    const int32_t *prefill_tables;
    /* x: the residual stream [tokens, hidden], in and out; the rest scratch: h [tokens,
       hidden], qkv [tokens, (heads + 2 kv_heads) head_dim], q [tokens, heads, head_dim], k
       [tokens, kv_heads, head_dim], attn [tokens, heads * head_dim], act [tokens,
       intermediate]. */
    uint16_t *x, *h, *qkv, *q, *k, *attn, *act;
    int threads, linear_threads, attention_threads;
} step_t;

int layers_bf16(const layer_weights *w, int64_t num_layers, const step_t *s);

/* abi.c: the shared structs' layout, written to out (at most capacity values): for
   layer_weights, decode_run and step_t in turn, its size then each field's offset in
   declaration order. Returns how many values the full layout has. */
int64_t tandem_abi_layout(int64_t *out, int64_t capacity);

#endif
