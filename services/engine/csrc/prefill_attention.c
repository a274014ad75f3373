/* Prefill attention for bfloat16 paged KV on Intel AMX (the cpu backend's prefill chunks).

   One call covers a step's prefill spans: span s's q_len query rows (rows q_start.. of q) are
   the last of its ctx_len keys, each seeing the keys up to its own position (causal, over
   whatever of its context was cached before). Per span and KV head, the keys are first packed
   from the block table into AMX tiles (K transposed for S = Q K^T, V in pairs of keys for
   O = P V); then per 16 query rows (the KV group's heads folded in, as the decode kernel
   does): the scores in float on AMX, a softmax per row over the keys it sees (float, our exp),
   P as two bfloat16 terms (its rounding and the rest: ~16 bits), O = P V in float on AMX,
   divided by the row's sum and rounded to bfloat16 once. A row's result depends on its own query and keys only: a prompt prefilled
   whole, in chunks or after a cached prefix gives the same bits.

   Both phases are split between the calling thread and the kernels' helper (pool.c). */
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "pool.h"
#include "simd.h"
#include "tandem.h"

#define MAX_HEAD_DIM 256

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    const int32_t *tables;
    const int64_t *q_start, *q_len, *ctx_len, *first_unit; /* per span */
    int64_t n, table_stride, hkv, group, d, bs, block_stride, tok_stride;
    float scale;
    uint16_t **kt, **vt; /* per (span, KV head): packed K^T and V tiles */
    float *scores[2];    /* per thread (pool.c: caller 0, helper 1): [16][max keys] */
    uint16_t *p[2];      /*                                       2 x [16][max keys] */
} job_t;

INLINE const uint16_t *key_row(const job_t *j, const uint16_t *base, int64_t s, int64_t key,
                               int64_t h) {
    const int32_t block = j->tables[s * j->table_stride + key / j->bs];
    return base + block * j->block_stride + (key % j->bs) * j->tok_stride + h * j->d;
}

/* r[i]: row i of 16 x 16 32-bit elements; becomes row i of their transpose. */
INLINE void transpose16(__m512i r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps((__m512)r[i], (__m512)r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps((__m512)r[i], (__m512)r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = (__m512i)_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = (__m512i)_mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Span s, KV head h: K^T as B tiles of S = Q K^T (tile (t, c): keys 16t.., head dims 32c..;
   row p holds, for each key, its dims 32c + 2p, 32c + 2p + 1: 16 keys' 64 bytes transposed as
   32-bit pairs) and V as B tiles of O = P V (tile (kc, dt): keys 32kc.., dims 16dt..; row p
   holds, for each dim, keys 2p and 2p + 1 interleaved). Keys past the context are zeros. */
static void pack(void *ctx, int64_t u, int helper) {
    (void)helper;
    const job_t *j = ctx;
    const int64_t s = u / j->hkv, h = u % j->hkv, keys = j->ctx_len[s], d = j->d;
    const int64_t chunks = d / 32, dtiles = d / 16;
    uint16_t *kt = j->kt[u];
    for (int64_t t = 0; t < (keys + 15) / 16; t++) {
        const uint16_t *rows[16];
        for (int64_t n = 0; n < 16; n++)
            rows[n] = t * 16 + n < keys ? key_row(j, j->k, s, t * 16 + n, h) : NULL;
        for (int64_t c = 0; c < chunks; c++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++)
                r[n] = rows[n] ? _mm512_loadu_si512(rows[n] + 32 * c) : _mm512_setzero_si512();
            transpose16(r);
            uint16_t *tile = kt + (t * chunks + c) * 512;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(tile + 32 * p, r[p]);
        }
    }
    uint16_t *vt = j->vt[u];
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t kc = 0; kc < (keys + 31) / 32; kc++)
        for (int p = 0; p < 16; p++) {
            const int64_t k0 = kc * 32 + 2 * p;
            const uint16_t *r0 = k0 < keys ? key_row(j, j->v, s, k0, h) : NULL;
            const uint16_t *r1 = k0 + 1 < keys ? key_row(j, j->v, s, k0 + 1, h) : NULL;
            for (int64_t dt = 0; dt < dtiles; dt++) {
                const __m256i a = r0 ? _mm256_loadu_si256((const __m256i *)(r0 + dt * 16)) : zero;
                const __m256i b = r1 ? _mm256_loadu_si256((const __m256i *)(r1 + dt * 16)) : zero;
                _mm512_storeu_si512(vt + (kc * dtiles + dt) * 512 + p * 32,
                                    _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
            }
        }
}

/* Tile dt % 4's float results (16 rows x 16 dims) times each row's 1 / sum, into out. */
INLINE void write_rows(const job_t *j, const float *buf, const float *inv, int64_t s,
                       int64_t h, int64_t r0, int rows, int64_t dt) {
    const int64_t hq = j->hkv * j->group;
    for (int m = 0; m < rows; m++) {
        const int64_t r = r0 + m, i = r / j->group, g = r % j->group;
        uint16_t *dst = j->out + ((j->q_start[s] + i) * hq + h * j->group + g) * j->d + dt * 16;
        store_bf16x16(dst, _mm512_mul_ps(_mm512_load_ps(buf + 16 * m), _mm512_set1_ps(inv[m])));
    }
}

/* Span s, KV head h, query rows 16rg.. (row r: query i = r / group, its head g = r % group). */
static void attend(void *ctx, int64_t u, int helper) {
    const job_t *j = ctx;
    int64_t s = 0;
    while (s + 1 < j->n && j->first_unit[s + 1] <= u) s++;
    const int64_t groups = (j->q_len[s] * j->group + 15) / 16;
    const int64_t h = (u - j->first_unit[s]) / groups, r0 = (u - j->first_unit[s]) % groups * 16;
    const int64_t d = j->d, chunks = d / 32, dtiles = d / 16, hq = j->hkv * j->group;
    const int64_t past = j->ctx_len[s] - j->q_len[s]; /* keys before the span's first query */
    const int64_t total = j->q_len[s] * j->group;
    const int rows = (int)(total - r0 < 16 ? total - r0 : 16);
    const int64_t keys = past + (r0 + rows - 1) / j->group + 1; /* what the last row sees */
    const int64_t ktiles = (keys + 15) / 16, pairs = (keys + 31) / 32;
    const int64_t sstride = ktiles * 16, pstride = pairs * 32;
    uint16_t qbuf[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float buf[256] __attribute__((aligned(64))), inv[16];
    float *sc = j->scores[helper];
    uint16_t *p = j->p[helper];
    memset(qbuf, 0, sizeof(uint16_t) * 16 * d);
    for (int m = 0; m < rows; m++) {
        const int64_t r = r0 + m, i = r / j->group, g = r % j->group;
        memcpy(qbuf + m * d, j->q + ((j->q_start[s] + i) * hq + h * j->group + g) * d,
               (size_t)d * 2);
    }
    const int64_t unit = s * j->hkv + h;
    const uint16_t *kt = j->kt[unit], *vt = j->vt[unit];
    /* S = Q K^T, 16 keys a tile. */
    for (int64_t t = 0; t < ktiles; t++) {
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(4, qbuf + 32 * c, d * 2);
            _tile_loadd(6, kt + (t * chunks + c) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, sc + t * 16, sstride * 4);
    }
    /* Softmax of each row over the keys it sees; P (unnormalised) as two bfloat16 terms, its
       rounding and what that lost (P to ~16 bits, as SDPA keeps it in float), zeros after. */
    uint16_t *lo = p + 16 * pstride;
    const __m512 vscale = _mm512_set1_ps(j->scale);
    for (int m = 0; m < 16; m++) {
        const int64_t seen = m < rows ? past + (r0 + m) / j->group + 1 : 0;
        const float *sr = sc + m * sstride;
        uint16_t *pr = p + m * pstride, *lr = lo + m * pstride;
        int64_t x = 0;
        inv[m] = 0.0f;
        if (seen) {
            __m512 mx = _mm512_set1_ps(sr[0]);
            for (; x + 16 <= seen; x += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + x));
            __mmask16 tail = (__mmask16)((1u << (seen - x)) - 1);
            mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, sr + x));
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 sum = _mm512_setzero_ps();
            for (x = 0; x + 16 <= seen; x += 16) {
                __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + x), top),
                                                vscale));
                sum = _mm512_add_ps(sum, e);
                store_bf16x16(pr + x, e);
                store_bf16x16(lr + x, _mm512_sub_ps(e, round_bf16(e)));
            }
            if (x < seen) {
                __m512 e = _mm512_maskz_mov_ps(tail, exp512(_mm512_mul_ps(
                    _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + x), top), vscale)));
                sum = _mm512_add_ps(sum, e);
                store_bf16x16(pr + x, e);
                store_bf16x16(lr + x, _mm512_sub_ps(e, round_bf16(e)));
                x += 16;
            }
            inv[m] = 1.0f / _mm512_reduce_add_ps(sum);
        }
        for (; x < pstride; x += 16) {
            store_bf16x16(pr + x, _mm512_setzero_ps());
            store_bf16x16(lr + x, _mm512_setzero_ps());
        }
    }
    /* O = P V, four tiles of 16 dims at a time (result tile T: dims 16(dt + T).., its V tile
       loaded into tile B), 32 keys a step. Tile numbers are immediates: one macro per tile. */
#define PV(T, B)                                    \
    if (nt > T) {                                   \
        _tile_loadd(B, vk + T * 512, 64);           \
        _tile_dpbf16ps(T, 4, B);                    \
        _tile_dpbf16ps(T, 5, B);                    \
    }
#define WRITE(T)                                                \
    if (nt > T) {                                               \
        _tile_stored(T, buf, 64);                               \
        write_rows(j, buf, inv, s, h, r0, rows, dt + T);        \
    }
    for (int64_t dt = 0; dt < dtiles; dt += 4) {
        const int64_t nt = dtiles - dt < 4 ? dtiles - dt : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < pairs; kc++) {
            const uint16_t *vk = vt + (kc * dtiles + dt) * 512;
            _tile_loadd(4, p + kc * 32, pstride * 2);
            _tile_loadd(5, lo + kc * 32, pstride * 2);
            PV(0, 6) PV(1, 7) PV(2, 6) PV(3, 7)
        }
        WRITE(0) WRITE(1) WRITE(2) WRITE(3)
    }
#undef PV
#undef WRITE
}

/* n spans: span s's q_len[s] query rows are rows q_start[s].. of q and out ([T, hkv * group, d]
   bf16, contiguous), the last of its ctx_len[s] keys, whose K/V (already stored) are read
   through tables[s * table_stride ..] as the decode kernel reads them. d % 32 == 0, d <= 256.
   threads 2: the kernels' helper takes units too (pool.c). Returns 0, or -1 (out of memory),
   -2 (shape not supported). */
int prefill_attention_bf16(const uint16_t *q, uint16_t *out, const uint16_t *k,
                           const uint16_t *v, const int32_t *tables, int64_t table_stride,
                           const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len,
                           int64_t n, int64_t hkv, int64_t group, int64_t d, int64_t bs,
                           int64_t block_stride, int64_t tok_stride, float scale, int threads) {
    if (d % 32 || d > MAX_HEAD_DIM || n < 1) return -2;
    int64_t max_keys = 0, units = 0, packed = 0;
    for (int64_t s = 0; s < n; s++) {
        if (q_len[s] < 1 || q_len[s] > ctx_len[s]) return -2;
        const int64_t padded = (ctx_len[s] + 31) / 32 * 32;
        if (padded > max_keys) max_keys = padded;
        units += hkv * ((q_len[s] * group + 15) / 16);
        packed += 2 * hkv * padded * d;
    }
    const int scratches = threads > 1 ? 2 : 1;
    job_t job = {q, k, v, out, tables, q_start, q_len, ctx_len, NULL, n, table_stride, hkv,
                 group, d, bs, block_stride, tok_stride, scale, NULL, NULL, {NULL, NULL},
                 {NULL, NULL}};
    int64_t *first_unit = malloc(sizeof(int64_t) * n);
    job.kt = malloc(sizeof(uint16_t *) * n * hkv);
    job.vt = malloc(sizeof(uint16_t *) * n * hkv);
    /* One allocation for every span's and head's packed keys and values. */
    uint16_t *tiles = aligned_alloc(64, sizeof(uint16_t) * packed);
    int ok = first_unit && job.kt && job.vt && tiles;
    for (int t = 0; t < scratches; t++) {
        job.scores[t] = aligned_alloc(64, sizeof(float) * 16 * max_keys);
        job.p[t] = aligned_alloc(64, sizeof(uint16_t) * 2 * 16 * max_keys);
        ok = ok && job.scores[t] && job.p[t];
    }
    if (ok) {
        uint16_t *next = tiles;
        for (int64_t s = 0, unit = 0; s < n; s++) {
            first_unit[s] = unit;
            unit += hkv * ((q_len[s] * group + 15) / 16);
            const int64_t size = (ctx_len[s] + 31) / 32 * 32 * d;
            for (int64_t h = 0; h < hkv; h++, next += 2 * size) {
                job.kt[s * hkv + h] = next;
                job.vt[s * hkv + h] = next + size;
            }
        }
        job.first_unit = first_unit;
        pool_run(&(pool_job){pack, NULL, NULL, &job}, n * hkv, threads);
        pool_run(&(pool_job){attend, amx_start, amx_finish, &job}, units, threads);
    }
    for (int t = 0; t < scratches; t++) {
        free(job.scores[t]);
        free(job.p[t]);
    }
    free(tiles);
    free(first_unit);
    free(job.kt);
    free(job.vt);
    return ok ? 0 : -1;
}
