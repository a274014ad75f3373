/* The shared structs' layout, for cpu_kernels.py to compare with its ctypes structs when it
   loads the library (tandem.h: tandem_abi_layout). */
#include <stddef.h>
#include <stdint.h>

#include "tandem.h"

#define F(type, field) (int64_t)offsetof(type, field)

int64_t tandem_abi_layout(int64_t *out, int64_t capacity) {
    const int64_t layout[] = {
        sizeof(layer_weights),
        F(layer_weights, input_norm), F(layer_weights, post_norm), F(layer_weights, qkv),
        F(layer_weights, qkv_bias), F(layer_weights, o), F(layer_weights, o_bias),
        F(layer_weights, gate_up), F(layer_weights, gate_up_bias), F(layer_weights, down),
        F(layer_weights, down_bias),
        sizeof(decode_run),
        F(decode_run, start), F(decode_run, num_seqs), F(decode_run, query_len),
        F(decode_run, table_stride), F(decode_run, tables), F(decode_run, seq_lens),
        sizeof(step_t),
        F(step_t, hidden), F(step_t, heads), F(step_t, kv_heads), F(step_t, head_dim),
        F(step_t, intermediate), F(step_t, eps), F(step_t, scale),
        F(step_t, cache), F(step_t, num_blocks), F(step_t, block_size), F(step_t, block_stride),
        F(step_t, layer_stride), F(step_t, kv_stride), F(step_t, tok_stride),
        F(step_t, cos), F(step_t, sin), F(step_t, num_positions),
        F(step_t, tokens), F(step_t, positions), F(step_t, slot_blocks), F(step_t, slot_offsets),
        F(step_t, decodes), F(step_t, num_decode_runs),
        F(step_t, spans), F(step_t, num_spans), F(step_t, prefill_table_stride),
        F(step_t, prefill_tables),
        F(step_t, x), F(step_t, h), F(step_t, qkv), F(step_t, q), F(step_t, k), F(step_t, attn),
        F(step_t, act),
        F(step_t, threads), F(step_t, linear_threads), F(step_t, attention_threads),
    };
    const int64_t n = (int64_t)(sizeof layout / sizeof layout[0]);
    for (int64_t i = 0; i < n && i < capacity; i++) out[i] = layout[i];
    return n;
}
