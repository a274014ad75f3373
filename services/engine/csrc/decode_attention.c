/* Decode attention for bfloat16 paged KV on x86 CPUs with AVX-512 BF16 (Tandem's "cpu" backend).

   Built by engine/cpu_kernels.py with the system's C compiler the first time an engine needs
   it, loaded with ctypes; the Python side checks shapes before calling. One call covers a step's run of
   sequences that decode the same number of query rows (1, or 1 + draft tokens): every sequence,
   every KV head, K/V read in place from the block table (no gather), the KV group's query heads
   and rows sharing each key read. Per (sequence, KV head): scores in float from bf16 dot
   products (vdpbf16ps), 16 keys at a time; a softmax per query row over the keys it sees; the
   output accumulated in float over the bf16 values and rounded to bfloat16 once. A query row's
   result depends only on its own keys, so a draft-verifying row equals the plain decode row at
   that position, bit for bit.

   On the calling thread, and with threads 2 on the kernels' helper thread too (pool.c: the
   engine gives torch one thread per worker on small machines); the call releases the GIL
   (ctypes), so the rest of the process keeps running. */
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "simd.h"
#include "tandem.h"

#define MAX_ROWS 64   /* query rows per KV head: group * query_len */
#define MAX_CHUNKS 8  /* head_dim / 32 */

/* Lane i of the result: the sum of the lanes of a[i]. */
INLINE __m512 sum16(const __m512 *a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* One sequence, every KV head. rows = group * qlen query rows per KV head; chunks = d / 32.
   s: scratch [hkv][rows][stride] floats. */
INLINE void attend_seq(const uint16_t *q, uint16_t *out, const uint16_t *k, const uint16_t *v,
                       const int32_t *table, int64_t len, int64_t qlen, int64_t hkv,
                       int64_t group, const int rows, const int chunks, int64_t bs,
                       int64_t block_stride, int64_t tok_stride, float scale, float *s,
                       int64_t stride, int64_t *off) {
    const int64_t hq = hkv * group, d = 32 * chunks;
    for (int64_t blk = 0, j = 0; j < len; blk++) {
        int64_t base = (int64_t)table[blk] * block_stride;
        for (int64_t o = 0; o < bs && j < len; o++, j++) off[j] = base + o * tok_stride;
    }
    for (int64_t j = len; j < stride + 16; j++) off[j] = off[0];
    const __m512 vscale = _mm512_set1_ps(scale);
    /* Pass 1: scores, 16 keys at a time (past len: key 0 again, masked out below). */
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t *kp = off + j0;
        if (j0 + 16 < len)
            for (int i = 0; i < 16; i++)
                for (int64_t l = 0; l < hkv * d; l += 32) _mm_prefetch((const char *)(k + kp[16 + i] + l), _MM_HINT_T0);
        for (int i = 0; i < 16; i++)
            for (int64_t l = 0; l < hkv * d; l += 32) _mm_prefetch((const char *)(v + kp[i] + l), _MM_HINT_T1);
        for (int64_t h = 0; h < hkv; h++) {
            for (int r = 0; r < rows; r++) {
                const uint16_t *qr = q + ((r / group) * hq + h * group + r % group) * d;
                __m512bh qc[MAX_CHUNKS];
                for (int c = 0; c < chunks; c++) qc[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
                __m512 a[16];
                for (int i = 0; i < 16; i++) {
                    const uint16_t *kj = k + kp[i] + h * d;
                    a[i] = _mm512_setzero_ps();
                    for (int c = 0; c < chunks; c++)
                        a[i] = _mm512_dpbf16_ps(a[i], qc[c], (__m512bh)_mm512_loadu_si512(kj + 32 * c));
                }
                _mm512_storeu_ps(s + (h * rows + r) * stride + j0, _mm512_mul_ps(sum16(a), vscale));
            }
        }
    }
    /* Softmax of each row over its keys (row r sees len - qlen + r / group + 1); zeros after. */
    float inv[MAX_ROWS * 16];
    for (int64_t hr = 0; hr < hkv * rows; hr++) {
        int64_t keys = len - qlen + (hr % rows) / group + 1, j = 0;
        float *sr = s + hr * stride;
        __m512 m = _mm512_set1_ps(sr[0]);
        for (; j + 16 <= keys; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sr + j));
        __mmask16 tail = (__mmask16)((1u << (keys - j)) - 1);
        m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, sr + j));
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m)), sum = _mm512_setzero_ps();
        for (j = 0; j + 16 <= keys; j += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mx));
            _mm512_storeu_ps(sr + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (j < len) {  /* the last keys this row sees, then zeros up to len */
            __m512 e = _mm512_maskz_mov_ps(
                tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + j), mx)));
            _mm512_storeu_ps(sr + j, e);
            sum = _mm512_add_ps(sum, e);
            for (j += 16; j < len; j += 16) _mm512_storeu_ps(sr + j, _mm512_setzero_ps());
        }
        inv[hr] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* Pass 2: outputs, accumulated in float per KV head. */
    for (int64_t h = 0; h < hkv; h++) {
        __m512 acc[MAX_ROWS][2 * MAX_CHUNKS];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 2 * chunks; c++) acc[r][c] = _mm512_setzero_ps();
        const float *sh = s + h * rows * stride;
        for (int64_t j = 0; j < len; j++) {
            const uint16_t *vj = v + off[j] + h * d;
            __m512 vf[2 * MAX_CHUNKS];
            for (int c = 0; c < 2 * chunks; c++) vf[c] = bf16x16(vj + 16 * c);
            for (int r = 0; r < rows; r++) {
                __m512 p = _mm512_set1_ps(sh[r * stride + j]);
                for (int c = 0; c < 2 * chunks; c++) acc[r][c] = _mm512_fmadd_ps(p, vf[c], acc[r][c]);
            }
        }
        for (int r = 0; r < rows; r++) {
            uint16_t *dst = out + ((r / group) * hq + h * group + r % group) * d;
            __m512 f = _mm512_set1_ps(inv[h * rows + r]);
            for (int c = 0; c < 2 * chunks; c++)
                store_bf16x16(dst + 16 * c, _mm512_mul_ps(acc[r][c], f));
        }
    }
}

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    const int32_t *tables, *seq_lens;
    int64_t table_stride, qlen, hkv, group, d, bs, block_stride, tok_stride, stride;
    float scale;
    float *s[2];     /* scratch per thread (pool.c: caller 0, helper 1) */
    int64_t *off[2];
} job_t;

#define CASE(R, C) \
    if (rows == R && chunks == C) { \
        attend_seq(qb, ob, j->k, j->v, table, len, qlen, j->hkv, j->group, R, C, j->bs, \
                   j->block_stride, j->tok_stride, j->scale, s, j->stride, off); return; }

/* Sequence b, every KV head. */
static void unit(void *ctx, int64_t b, int helper) {
    const job_t *j = ctx;
    const int64_t qlen = j->qlen, rows = j->group * qlen, chunks = j->d / 32;
    const int64_t width = qlen * j->hkv * j->group * j->d;
    const uint16_t *qb = j->q + b * width;
    uint16_t *ob = j->out + b * width;
    const int32_t *table = j->tables + b * j->table_stride;
    const int64_t len = j->seq_lens[b];
    float *s = j->s[helper];
    int64_t *off = j->off[helper];
    CASE(1, 2) CASE(2, 2) CASE(3, 2) CASE(4, 2) CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4)
    attend_seq(qb, ob, j->k, j->v, table, len, qlen, j->hkv, j->group, (int)rows, (int)chunks,
               j->bs, j->block_stride, j->tok_stride, j->scale, s, j->stride, off);
}

/* n sequences decoding qlen query rows each (sequence b's rows from b * qlen on).
   q, out: [n * qlen, hkv * group, d] bf16, contiguous. Key j of sequence b, KV head h:
   k + tables[b * table_stride + j / bs] * block_stride + (j % bs) * tok_stride + h * d
   (v likewise), d contiguous. threads 2: the helper thread takes sequences beside the caller
   (pool.c). Returns 0, or -1 (out of memory), -2 (shape not supported). */
int decode_attention_bf16(const uint16_t *q, uint16_t *out, const uint16_t *k, const uint16_t *v,
                          const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                          int64_t n, int64_t qlen, int64_t hkv, int64_t group, int64_t d,
                          int64_t bs, int64_t block_stride, int64_t tok_stride, float scale,
                          int threads) {
    int64_t rows = group * qlen, chunks = d / 32, maxlen = 0;
    if (d % 32 || chunks > MAX_CHUNKS || rows > MAX_ROWS || hkv * rows > MAX_ROWS * 16) return -2;
    for (int64_t b = 0; b < n; b++) if (seq_lens[b] > maxlen) maxlen = seq_lens[b];
    const int64_t stride = (maxlen + 15) & ~15;
    job_t job = {q, k, v, out, tables, seq_lens, table_stride, qlen, hkv, group, d, bs,
                 block_stride, tok_stride, stride, scale, {NULL, NULL}, {NULL, NULL}};
    const int scratches = threads > 1 && n > 1 ? 2 : 1;
    int ok = 1;
    for (int t = 0; t < scratches; t++) {
        job.s[t] = aligned_alloc(64, sizeof(float) * hkv * rows * stride);
        job.off[t] = malloc(sizeof(int64_t) * (stride + 16));
        ok = ok && job.s[t] && job.off[t];
    }
    if (ok) pool_run(&(pool_job){unit, NULL, NULL, &job}, n, scratches);
    for (int t = 0; t < scratches; t++) {
        free(job.s[t]);
        free(job.off[t]);
    }
    return ok ? 0 : -1;
}
