/* Linear layers in bfloat16 on Intel AMX (Sapphire Rapids on): out = x @ w.T (+ bias), float
   accumulation, one rounding to bfloat16. The weight is packed once as AMX "B" tiles
   (cpu_kernels.AmxLinear), so a step streams it in order, 1 KiB a tile; x's rows are the "A"
   tiles, read in place. 2 x 2 tiles of 16 x 16 results at a time. Each output row is summed in
   the same order whatever the other rows are (batch-invariant: a speculative verify row is its
   plain decode row's bits). */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "pool.h"
#include "simd.h"
#include "tandem.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define CHUNK_BYTES (1 << 20)
#define PREFETCH_TILES 16

/* Asks Linux for the AMX tile state in this process (once; every thread then has it). */
int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -2;
}

/* Tiles (amx.h): 0-3 the 2 x 2 float results, 4-5 x's rows, 6-7 w's columns. */

/* A float tile (16 rows of x by 16 outputs) plus bias, rounded into out; with residual, added
   to what out holds once rounded (torch's x + linear(h) on bfloat16 tensors), rounded again. */
INLINE void write_tile(const float *buf, const uint16_t *bias, int64_t rows, uint16_t *out,
                       int64_t out_stride, int residual) {
    __m512 b = bias ? bf16x16(bias) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows && m < 16; m++) {
        __m512 y = _mm512_add_ps(_mm512_load_ps(buf + 16 * m), b);
        if (residual) y = _mm512_add_ps(bf16x16(out + m * out_stride), round_bf16(y));
        store_bf16x16(out + m * out_stride, y);
    }
}

/* Gate and up tiles (16 rows of x by 16 outputs each) plus their biases, each rounded to
   bfloat16 as the projection's output would be, into silu(gate) * up. */
INLINE void write_swiglu(const float *gate, const float *up, const uint16_t *bias_gate,
                         const uint16_t *bias_up, int64_t rows, uint16_t *out,
                         int64_t out_stride) {
    __m512 bg = bias_gate ? bf16x16(bias_gate) : _mm512_setzero_ps();
    __m512 bu = bias_up ? bf16x16(bias_up) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows && m < 16; m++)
        store_bf16x16(out + m * out_stride,
                      silu_mul(round_bf16(_mm512_add_ps(_mm512_load_ps(gate + 16 * m), bg)),
                               round_bf16(_mm512_add_ps(_mm512_load_ps(up + 16 * m), bu))));
}

/* One call's work, in units of one pair of w's 16-output blocks (32 outputs, the whole of K)
   for one chunk of x's rows (pool.c: the caller takes them from the front, a helper thread
   from the back). */
typedef struct {
    const uint16_t *x, *tail, *w, *bias;
    uint16_t *out;
    int64_t x_stride, M, N, K, KB, NB, full, chunk, pairs;
    int swiglu, residual;
} job_t;

/* w's tiles PREFETCH_TILES ahead of tile kb of a pair's two streams, into L2, running on into
   the next pair this thread will take (nxt; NULL: none). The hardware's prefetcher alone: 12.1
   GB/s at 1 row, 13.1 with. */
INLINE void prefetch(const uint16_t *b0, const uint16_t *nxt, int64_t kb, int64_t KB) {
    int64_t t = kb + PREFETCH_TILES;
    const char *p0, *p1;
    if (t < KB) {
        p0 = (const char *)(b0 + t * 512);
        p1 = (const char *)(b0 + (KB + t) * 512);
    } else if (nxt && t - KB < KB) {
        p0 = (const char *)(nxt + (t - KB) * 512);
        p1 = (const char *)(nxt + t * 512);
    } else {
        return;
    }
    for (int j = 0; j < 16; j++) {
        _mm_prefetch(p0 + 64 * j, _MM_HINT_T1);
        _mm_prefetch(p1 + 64 * j, _MM_HINT_T1);
    }
}

/* Unit u: outputs 32p.. (a pair of blocks; the last may be one) of rows c0.. (one chunk). */
static void run_unit(const job_t *j, int64_t u, int helper, float *buf) {
    const int64_t p = u % j->pairs, c0 = u / j->pairs * j->chunk;
    const int64_t c1 = j->M - c0 < j->chunk ? j->M : c0 + j->chunk, nb = 2 * p, KB = j->KB;
    const int64_t N = j->N, full = j->full, K = j->K;
    const int two_n = nb + 1 < j->NB;
    const uint16_t *b0 = j->w + nb * KB * 512, *b1 = b0 + KB * 512;
    const int64_t np = helper ? p - 1 : p + 1; /* the next pair this thread takes */
    const uint16_t *nxt = np >= 0 && 2 * np + 1 < j->NB ? j->w + 2 * np * KB * 512 : NULL;
    for (int64_t m0 = c0; m0 < c1; m0 += 32) {
        const int two_m = m0 + 16 < c1;
        const uint16_t *a0 = m0 < full ? j->x + m0 * j->x_stride : j->tail;
        const uint16_t *a1 = m0 + 16 < full ? j->x + (m0 + 16) * j->x_stride : j->tail;
        const int64_t s0 = (m0 < full ? j->x_stride : K) * 2;
        const int64_t s1 = (m0 + 16 < full ? j->x_stride : K) * 2;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < KB; kb++) {
            if (m0 == c0 && two_n) prefetch(b0, nxt, kb, KB);
            _tile_loadd(4, a0 + kb * 32, s0);
            _tile_loadd(6, b0 + kb * 512, 64);
            if (two_n) _tile_loadd(7, b1 + kb * 512, 64);
            if (two_m) _tile_loadd(5, a1 + kb * 32, s1);
            _tile_dpbf16ps(0, 4, 6);
            if (two_n) _tile_dpbf16ps(1, 4, 7);
            if (two_m) {
                _tile_dpbf16ps(2, 5, 6);
                if (two_n) _tile_dpbf16ps(3, 5, 7);
            }
        }
        if (j->swiglu) {
            const int64_t width = N / 2;
            uint16_t *o = j->out + m0 * width + nb * 8;
            const uint16_t *bg = j->bias ? j->bias + nb * 8 : NULL;
            const uint16_t *bu = j->bias ? j->bias + width + nb * 8 : NULL;
            _tile_stored(0, buf, 64);
            _tile_stored(1, buf + 256, 64);
            write_swiglu(buf, buf + 256, bg, bu, j->M - m0, o, width);
            if (two_m) {
                _tile_stored(2, buf, 64);
                _tile_stored(3, buf + 256, 64);
                write_swiglu(buf, buf + 256, bg, bu, j->M - m0 - 16, o + 16 * width, width);
            }
            continue;
        }
        uint16_t *o = j->out + m0 * N + nb * 16;
        const uint16_t *bb = j->bias ? j->bias + nb * 16 : NULL;
        _tile_stored(0, buf, 64);
        write_tile(buf, bb, j->M - m0, o, N, j->residual);
        if (two_n) {
            _tile_stored(1, buf, 64);
            write_tile(buf, bb ? bb + 16 : NULL, j->M - m0, o + 16, N, j->residual);
        }
        if (two_m) {
            _tile_stored(2, buf, 64);
            write_tile(buf, bb, j->M - m0 - 16, o + 16 * N, N, j->residual);
            if (two_n) {
                _tile_stored(3, buf, 64);
                write_tile(buf, bb ? bb + 16 : NULL, j->M - m0 - 16, o + 16 * N + 16, N,
                           j->residual);
            }
        }
    }
}

static void unit(void *ctx, int64_t u, int helper) {
    float buf[512] __attribute__((aligned(64)));
    run_unit(ctx, u, helper, buf);
}

/* out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]). x's rows at x + m * x_stride, out contiguous;
   w packed by the caller as AMX B tiles: tile (nb, kb) (outputs nb*16.., inputs kb*32..) at
   w + (nb * K/32 + kb) * 512, its row p holding, for each of its 16 outputs n, the pair
   w[n][kb*32 + 2p], w[n][kb*32 + 2p + 1]. K % 32 == 0, N % 16 == 0. Each output row depends
   on its own input row only, summed in the same order whatever M is (and whichever thread).
   swiglu: w's blocks of 16 outputs alternate gate and up (block 2j: gate outputs 16j.., 2j + 1:
   the same up outputs) and out is [M, N / 2], silu(gate) * up (SwiGLU's activation, written
   without the [M, N] projection). residual (not with swiglu): out holds a residual stream
   and becomes out + (x @ w.T + bias), the projection rounded to bfloat16 before the sum.
   threads 2: the helper thread takes units beside the caller (pool.c). */
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                uint16_t *out, int64_t M, int64_t N, int64_t K, int swiglu, int residual,
                int threads) {
    if (K % 32 || N % 16 || (swiglu && N % 32) || (swiglu && residual)) return -3;
    const int64_t full = M / 16 * 16;
    uint16_t *tail = NULL;
    if (M > full && !(tail = calloc((size_t)(16 * K), sizeof(uint16_t)))) return -1;
    for (int64_t m = full; m < M; m++)
        memcpy(tail + (m - full) * K, x + m * x_stride, (size_t)K * 2);
    /* Rows of x taken at once: as many as keep them near 1 MiB (in L2 across w's blocks). */
    int64_t chunk = CHUNK_BYTES / (K * 2) / 32 * 32;
    if (chunk < 32) chunk = 32;
    const int64_t NB = N / 16, pairs = (NB + 1) / 2, units = (M + chunk - 1) / chunk * pairs;
    job_t job = {x, tail, w, bias, out, x_stride, M, N, K, K / 32, NB, full, chunk, pairs,
                 swiglu, residual};
    pool_run(&(pool_job){unit, amx_start, amx_finish, &job}, units, threads);
    free(tail);
    return 0;
}
