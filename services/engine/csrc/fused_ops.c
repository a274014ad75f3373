/* The model's elementwise steps in bfloat16, one pass each instead of torch's several ops
   (each of which reads and writes the whole tensor): RMSNorm, SwiGLU's silu(gate) * up and
   the rotary embedding. Each rounds to bfloat16 where torch's ops on bfloat16 tensors do, so
   the rotary embedding and the product are torch's bits; RMSNorm's sum and silu's exp differ
   from torch's in float rounding only (see tests/engine/test_cpu_kernels.py). Rows are
   independent; row r of an input starts at r * stride, outputs are contiguous. */
#include <math.h>

#include "simd.h"

/* out = w * bf16(x * rsqrt(mean(x^2) + eps)), x in float (model.rms_norm). */
int rms_norm_bf16(const uint16_t *x, int64_t stride, const uint16_t *w, uint16_t *out,
                  int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * stride;
        uint16_t *o = out + r * dim;
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

/* out = x * cos + rotate_half(x) * sin per head, each product and the sum rounded to bfloat16
   (as torch computes it on bfloat16 tensors); x: [tokens, heads, head_dim] with token rows
   stride apart (a view into the fused qkv projection), cos/sin: [positions, head_dim]. */
int rotary_bf16(const uint16_t *x, int64_t stride, uint16_t *out, const uint16_t *cos,
                const uint16_t *sin, const int64_t *positions, int64_t tokens, int64_t heads,
                int64_t head_dim) {
    int64_t half = head_dim / 2;
    if (head_dim % 32) return -2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + t * stride + h * head_dim;
            uint16_t *o = out + (t * heads + h) * head_dim;
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
    }
    return 0;
}
