/* The model's elementwise steps in bfloat16, one pass each instead of torch's several ops
   (each of which reads and writes the whole tensor): RMSNorm, SwiGLU's silu(gate) * up, the
   rotary embedding of a step's queries and keys in one call, and the store of its keys and
   values into the paged cache. Each rounds to bfloat16 where torch's ops on bfloat16 tensors
   do, so the rotary embedding and the product are torch's bits; RMSNorm's sum and silu's exp
   differ from torch's in float rounding only (see tests/engine/test_cpu_kernels.py). Rows are
   independent; row r of an input starts at r * stride, outputs are contiguous. RMSNorm and
   the rotary embedding split prefill-sized calls over the helper thread too (threads 2:
   pool.c), ROWS_PER_UNIT rows a unit. */
#include <math.h>
#include <string.h>

#include "pool.h"
#include "simd.h"
#include "tandem.h"

#define ROWS_PER_UNIT 32

/* out = w * bf16(x * rsqrt(mean(x^2) + eps)), x in float (model.rms_norm): one row. */
INLINE void rms_norm_row(const uint16_t *xr, const uint16_t *w, uint16_t *o, int64_t dim,
                         float eps) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        __m512 v = bf16x16(xr + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (i < dim) {
        __m512 v = bf16x16_n(xr + i, (int)(dim - i));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
    for (i = 0; i + 16 <= dim; i += 16)
        store_bf16x16(o + i, _mm512_mul_ps(bf16x16(w + i),
                                           round_bf16(_mm512_mul_ps(bf16x16(xr + i), scale))));
    if (i < dim) {
        int n = (int)(dim - i);
        store_bf16x16_n(o + i, _mm512_mul_ps(bf16x16_n(w + i, n),
                                             round_bf16(_mm512_mul_ps(bf16x16_n(xr + i, n), scale))), n);
    }
}

typedef struct {
    const uint16_t *x, *w;
    uint16_t *out;
    int64_t stride, rows, dim;
    float eps;
} norm_job;

static void norm_unit(void *ctx, int64_t u, int helper) {
    (void)helper;
    const norm_job *j = ctx;
    for (int64_t r = u * ROWS_PER_UNIT; r < j->rows && r < (u + 1) * ROWS_PER_UNIT; r++)
        rms_norm_row(j->x + r * j->stride, j->w, j->out + r * j->dim, j->dim, j->eps);
}

int rms_norm_bf16(const uint16_t *x, int64_t stride, const uint16_t *w, uint16_t *out,
                  int64_t rows, int64_t dim, float eps, int threads) {
    norm_job job = {x, w, out, stride, rows, dim, eps};
    const int64_t units = (rows + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
    if (units == 1) norm_unit(&job, 0, 0);
    else pool_run(&(pool_job){norm_unit, NULL, NULL, &job}, units, threads);
    return 0;
}

/* out = bf16(silu(gate)) * up, gate = row[0:dim], up = row[dim:2 dim] (F.silu(gate) * up). */
int silu_mul_bf16(const uint16_t *gate_up, int64_t stride, uint16_t *out, int64_t rows,
                  int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * stride, *u = g + dim;
        uint16_t *o = out + r * dim;
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) store_bf16x16(o + i, silu_mul(bf16x16(g + i), bf16x16(u + i)));
        if (i < dim) {
            int n = (int)(dim - i);
            store_bf16x16_n(o + i, silu_mul(bf16x16_n(g + i, n), bf16x16_n(u + i, n)), n);
        }
    }
    return 0;
}

/* out = x * cos + rotate_half(x) * sin of one head, each product and the sum rounded to
   bfloat16 (as torch computes it on bfloat16 tensors). */
INLINE void rotary_head(const uint16_t *xh, uint16_t *o, const uint16_t *c, const uint16_t *s,
                        int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        __m512 x1 = bf16x16(xh + i), x2 = bf16x16(xh + half + i);
        __m512 a = round_bf16(_mm512_mul_ps(x1, bf16x16(c + i)));
        __m512 b = round_bf16(_mm512_mul_ps(negate(x2), bf16x16(s + i)));
        store_bf16x16(o + i, _mm512_add_ps(a, b));
        a = round_bf16(_mm512_mul_ps(x2, bf16x16(c + half + i)));
        b = round_bf16(_mm512_mul_ps(x1, bf16x16(s + half + i)));
        store_bf16x16(o + half + i, _mm512_add_ps(a, b));
    }
}

typedef struct {
    const uint16_t *q, *k, *cos, *sin;
    uint16_t *q_out, *k_out;
    const int64_t *positions;
    int64_t q_stride, k_stride, tokens, q_heads, k_heads, head_dim;
} rotary_job;

static void rotary_unit(void *ctx, int64_t u, int helper) {
    (void)helper;
    const rotary_job *j = ctx;
    const int64_t d = j->head_dim, half = d / 2;
    for (int64_t t = u * ROWS_PER_UNIT; t < j->tokens && t < (u + 1) * ROWS_PER_UNIT; t++) {
        const uint16_t *c = j->cos + j->positions[t] * d, *s = j->sin + j->positions[t] * d;
        for (int64_t h = 0; h < j->q_heads; h++)
            rotary_head(j->q + t * j->q_stride + h * d, j->q_out + (t * j->q_heads + h) * d, c, s,
                        half);
        for (int64_t h = 0; h < j->k_heads; h++)
            rotary_head(j->k + t * j->k_stride + h * d, j->k_out + (t * j->k_heads + h) * d, c, s,
                        half);
    }
}

/* The rotary embedding of a step's queries q [tokens, q_heads, head_dim] and keys k [tokens,
   k_heads, head_dim] (token rows q_stride / k_stride apart: views into the fused qkv
   projection; heads contiguous) into contiguous q_out and k_out, at positions[t] of cos/sin
   [num_positions, head_dim]. Returns -2 for a position outside the tables. */
int rotary_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                uint16_t *q_out, uint16_t *k_out, const uint16_t *cos, const uint16_t *sin,
                int64_t num_positions, const int64_t *positions, int64_t tokens,
                int64_t q_heads, int64_t k_heads, int64_t head_dim, int threads) {
    if (head_dim % 32) return -2;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -2;
    rotary_job job = {q, k, cos, sin, q_out, k_out, positions, q_stride, k_stride, tokens,
                      q_heads, k_heads, head_dim};
    const int64_t units = (tokens + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
    if (units == 1) rotary_unit(&job, 0, 0);
    else pool_run(&(pool_job){rotary_unit, NULL, NULL, &job}, units, threads);
    return 0;
}

/* The step's keys and values (token t's width elements at k + t * k_stride, v + t * v_stride)
   into the paged cache: token t's at block blocks[t], offset offsets[t] of key_cache and
   value_cache (num_blocks blocks, block_stride elements apart, of block_size tokens
   tok_stride apart, a token's width elements contiguous). Returns -2, writing nothing, when a
   slot is outside the cache. */
int store_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                  uint16_t *key_cache, uint16_t *value_cache, const int64_t *blocks,
                  const int64_t *offsets, int64_t tokens, int64_t width, int64_t num_blocks,
                  int64_t block_size, int64_t block_stride, int64_t tok_stride) {
    for (int64_t t = 0; t < tokens; t++) /* every slot checked before anything is written */
        if (blocks[t] < 0 || blocks[t] >= num_blocks || offsets[t] < 0
            || offsets[t] >= block_size)
            return -2;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t at = blocks[t] * block_stride + offsets[t] * tok_stride;
        memcpy(key_cache + at, k + t * k_stride, (size_t)width * 2);
        memcpy(value_cache + at, v + t * v_stride, (size_t)width * 2);
    }
    return 0;
}

/* Each row's index of its largest value, the first of equal ones, a NaN counting as largest
   (the first NaN): torch's x.max(dim=-1).indices of float32 rows [rows, cols], stride apart. */
int argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * stride;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        int64_t i = 0;
        for (; i + 16 <= cols && !nan; i += 16) {
            __m512 v = _mm512_loadu_ps(p + i);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_max_ps(best, v);
        }
        float m = _mm512_reduce_max_ps(best);
        for (; i < cols && !nan; i++) {
            if (p[i] != p[i]) nan = 1;
            else if (p[i] > m) m = p[i];
        }
        int64_t at = 0;
        if (!nan) {  /* the first equal to the largest, 16 at a time */
            const __m512 vm = _mm512_set1_ps(m);
            for (; at + 16 <= cols; at += 16) {
                __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + at), vm, _CMP_EQ_OQ);
                if (eq) {
                    at += __builtin_ctz(eq);
                    break;
                }
            }
        }
        for (; at < cols; at++)  /* the first NaN; the tail */
            if (nan ? p[at] != p[at] : p[at] == m) break;
        out[r] = at;
    }
    return 0;
}
