/* Decode attention for float32 paged KV on x86 CPUs with AVX2 and FMA (the torch backend's
   decode on CPUs our bfloat16 kernels do not run on: float32 is what `dtype: auto` serves there).

   The same contract as decode_attention.c's bfloat16 kernel, in float32: one call covers a
   step's run of sequences that decode the same number of query rows, every KV head, K/V read in
   place from the block table (no gather), the KV group's query heads and rows sharing each key
   read. Per (sequence, KV head): scores as float dot products, 8 keys at a time; a softmax per
   query row over the keys it sees; the output accumulated in float. A query row's result
   depends only on its own keys, so a draft-verifying row equals the plain decode row at that
   position, bit for bit. Built into its own library with -mavx2 -mfma (kernel_build.AVX2). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "tandem.h"

#define INLINE static inline __attribute__((always_inline))
#define MAX_ROWS 64   /* query rows per KV head: group * query_len */
#define MAX_CHUNKS 32 /* head_dim / 8 */

/* e^x = 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2: a degree-6 polynomial (~1 ulp). */
INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lane i of the result: the sum of the lanes of a[i]. */
INLINE __m256 sum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

INLINE float hsum(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* One sequence, every KV head. rows = group * qlen query rows per KV head; chunks = d / 8.
   s: scratch [rows][stride] floats (one KV head at a time). */
INLINE void attend_seq(const float *q, float *out, const float *k, const float *v,
                       const int32_t *table, int64_t len, int64_t qlen, int64_t hkv,
                       int64_t group, const int rows, const int chunks, int64_t bs,
                       int64_t block_stride, int64_t tok_stride, float scale, float *s,
                       int64_t stride, int64_t *off) {
    const int64_t hq = hkv * group, d = 8 * chunks;
    for (int64_t blk = 0, j = 0; j < len; blk++) {
        int64_t base = (int64_t)table[blk] * block_stride;
        for (int64_t o = 0; o < bs && j < len; o++, j++) off[j] = base + o * tok_stride;
    }
    for (int64_t j = len; j < stride + 8; j++) off[j] = off[0];
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t h = 0; h < hkv; h++) {
        /* Pass 1: scores, 8 keys at a time (past len: key 0 again, never read below). */
        for (int64_t j0 = 0; j0 < len; j0 += 8) {
            const int64_t *kp = off + j0;
            for (int r = 0; r < rows; r++) {
                const float *qr = q + ((r / group) * hq + h * group + r % group) * d;
                __m256 a[8];
                for (int i = 0; i < 8; i++) {
                    const float *kj = k + kp[i] + h * d;
                    a[i] = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(kj));
                    for (int c = 1; c < chunks; c++)
                        a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * c),
                                               _mm256_loadu_ps(kj + 8 * c), a[i]);
                }
                _mm256_storeu_ps(s + r * stride + j0, _mm256_mul_ps(sum8(a), vscale));
            }
        }
        /* Softmax of each row over its keys (row r sees len - qlen + r / group + 1). */
        float inv[MAX_ROWS];
        int64_t seen[MAX_ROWS];
        for (int r = 0; r < rows; r++) {
            const int64_t keys = len - qlen + r / group + 1;
            float *sr = s + r * stride;
            int64_t j = 0;
            __m256 m = _mm256_set1_ps(sr[0]);
            for (; j + 8 <= keys; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sr + j));
            float mx = hmax(m);
            for (; j < keys; j++) mx = sr[j] > mx ? sr[j] : mx;
            const __m256 vmx = _mm256_set1_ps(mx);
            __m256 sum = _mm256_setzero_ps();
            for (j = 0; j + 8 <= keys; j += 8) {
                __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), vmx));
                _mm256_storeu_ps(sr + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            if (j < keys) {  /* the last keys this row sees, through the same polynomial */
                float tail[8] = {0};
                for (int64_t t = j; t < keys; t++) tail[t - j] = sr[t] - mx;
                __m256 e = exp256(_mm256_loadu_ps(tail));
                float et[8];
                _mm256_storeu_ps(et, e);
                float rest = 0.0f;
                for (int64_t t = j; t < keys; t++) sr[t] = et[t - j], rest += et[t - j];
                sum = _mm256_add_ps(sum, _mm256_setr_ps(rest, 0, 0, 0, 0, 0, 0, 0));
            }
            inv[r] = 1.0f / hsum(sum);
            seen[r] = keys;
        }
        /* Pass 2: outputs, accumulated in float. */
        __m256 acc[MAX_ROWS > 8 ? 8 : MAX_ROWS][MAX_CHUNKS];
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const int rn = rows - r0 < 8 ? rows - r0 : 8;
            for (int r = 0; r < rn; r++)
                for (int c = 0; c < chunks; c++) acc[r][c] = _mm256_setzero_ps();
            int64_t most = 0;
            for (int r = 0; r < rn; r++) most = seen[r0 + r] > most ? seen[r0 + r] : most;
            for (int64_t j = 0; j < most; j++) {
                const float *vj = v + off[j] + h * d;
                for (int r = 0; r < rn; r++) {
                    if (j >= seen[r0 + r]) continue;
                    __m256 p = _mm256_set1_ps(s[(r0 + r) * stride + j]);
                    for (int c = 0; c < chunks; c++)
                        acc[r][c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), acc[r][c]);
                }
            }
            for (int r = 0; r < rn; r++) {
                const int rr = r0 + r;
                float *dst = out + ((rr / group) * hq + h * group + rr % group) * d;
                __m256 f = _mm256_set1_ps(inv[rr]);
                for (int c = 0; c < chunks; c++)
                    _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(acc[r][c], f));
            }
        }
    }
}

typedef struct {
    const float *q, *k, *v;
    float *out;
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
    const int64_t qlen = j->qlen, rows = j->group * qlen, chunks = j->d / 8;
    const int64_t width = qlen * j->hkv * j->group * j->d;
    const float *qb = j->q + b * width;
    float *ob = j->out + b * width;
    const int32_t *table = j->tables + b * j->table_stride;
    const int64_t len = j->seq_lens[b];
    float *s = j->s[helper];
    int64_t *off = j->off[helper];
    CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(1, 16) CASE(2, 16) CASE(4, 16)
    attend_seq(qb, ob, j->k, j->v, table, len, qlen, j->hkv, j->group, (int)rows, (int)chunks,
               j->bs, j->block_stride, j->tok_stride, j->scale, s, j->stride, off);
}

/* As decode_attention_bf16 (tandem.h), in float32. */
int decode_attention_f32(const float *q, float *out, const float *k, const float *v,
                         const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                         int64_t n, int64_t qlen, int64_t hkv, int64_t group, int64_t d,
                         int64_t bs, int64_t block_stride, int64_t tok_stride, float scale,
                         int threads) {
    int64_t rows = group * qlen, chunks = d / 8, maxlen = 0;
    if (d % 8 || chunks > MAX_CHUNKS || rows > MAX_ROWS) return -2;
    for (int64_t b = 0; b < n; b++) if (seq_lens[b] > maxlen) maxlen = seq_lens[b];
    const int64_t stride = (maxlen + 7) & ~7;
    job_t job = {q, k, v, out, tables, seq_lens, table_stride, qlen, hkv, group, d, bs,
                 block_stride, tok_stride, stride, scale, {NULL, NULL}, {NULL, NULL}};
    const int scratches = threads > 1 && n > 1 ? 2 : 1;
    int ok = 1;
    for (int t = 0; t < scratches; t++) {
        job.s[t] = aligned_alloc(32, sizeof(float) * rows * stride);
        job.off[t] = malloc(sizeof(int64_t) * (stride + 8));
        ok = ok && job.s[t] && job.off[t];
    }
    if (ok) pool_run(&(pool_job){unit, NULL, NULL, &job}, n, scratches);
    for (int t = 0; t < scratches; t++) {
        free(job.s[t]);
        free(job.off[t]);
    }
    return ok ? 0 : -1;
}
