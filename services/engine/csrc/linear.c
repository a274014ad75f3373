/* Linear layers in bfloat16 on Intel AMX (Sapphire Rapids on): out = x @ w.T (+ bias), float
   accumulation, one rounding to bfloat16. The weight is packed once as AMX "B" tiles
   (cpu_linear.AmxLinear), so a step streams it in order, 1 KiB a tile; x's rows are the "A"
   tiles, read in place. 2 x 2 tiles of 16 x 16 results at a time. Each output row is summed in
   the same order whatever the other rows are (batch-invariant: a speculative verify row is its
   plain decode row's bits). */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define CHUNK_BYTES (1 << 20)
#define PREFETCH_TILES 16

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Asks Linux for the AMX tile state in this process (once; every thread then has it). */
int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -2;
}

/* Eight 16 x 64-byte tiles: 0-3 the 2 x 2 float results, 4-5 x's rows, 6-7 w's columns. */
static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* A float tile (16 rows of x by 16 outputs) plus bias, rounded into out. */
INLINE void write_tile(const float *buf, const uint16_t *bias, int64_t rows, uint16_t *out,
                       int64_t out_stride) {
    __m512 b = bias ? bf16x16(bias) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows && m < 16; m++)
        store_bf16x16(out + m * out_stride, _mm512_add_ps(_mm512_load_ps(buf + 16 * m), b));
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

/* out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]). x's rows at x + m * x_stride, out contiguous;
   w packed by the caller as AMX B tiles: tile (nb, kb) (outputs nb*16.., inputs kb*32..) at
   w + (nb * K/32 + kb) * 512, its row p holding, for each of its 16 outputs n, the pair
   w[n][kb*32 + 2p], w[n][kb*32 + 2p + 1]. K % 32 == 0, N % 16 == 0. Each output row depends
   on its own input row only, summed in the same order whatever M is.
   swiglu: w's blocks of 16 outputs alternate gate and up (block 2j: gate outputs 16j.., 2j + 1:
   the same up outputs) and out is [M, N / 2], silu(gate) * up (SwiGLU's activation, written
   without the [M, N] projection). */
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                uint16_t *out, int64_t M, int64_t N, int64_t K, int swiglu) {
    if (K % 32 || N % 16 || (swiglu && N % 32)) return -3;
    const int64_t KB = K / 32, NB = N / 16;
    /* The last rows when fewer than 16: copied beside zeros (a tile load reads 16 rows). */
    const int64_t full = M / 16 * 16;
    uint16_t *tail = NULL;
    float *buf = aligned_alloc(64, 2048);
    if (M > full) tail = calloc((size_t)(16 * K), sizeof(uint16_t));
    if (!buf || (M > full && !tail)) {
        free(buf);
        free(tail);
        return -1;
    }
    for (int64_t m = full; m < M; m++)
        memcpy(tail + (m - full) * K, x + m * x_stride, (size_t)K * 2);
    /* Rows of x taken at once: as many as keep them near 1 MiB (in L2 across w's blocks). */
    int64_t chunk = CHUNK_BYTES / (K * 2) / 32 * 32;
    if (chunk < 32) chunk = 32;
    configure();
    const char *end = (const char *)(w + N * K);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t c1 = M - c0 < chunk ? M : c0 + chunk;
        for (int64_t nb = 0; nb < NB; nb += 2) {
            const int two_n = nb + 1 < NB;
            const uint16_t *b0 = w + nb * KB * 512, *b1 = b0 + KB * 512;
            for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                const int two_m = m0 + 16 < c1;
                const uint16_t *a0 = m0 < full ? x + m0 * x_stride : tail;
                const uint16_t *a1 = m0 + 16 < full ? x + (m0 + 16) * x_stride : tail;
                const int64_t s0 = (m0 < full ? x_stride : K) * 2;
                const int64_t s1 = (m0 + 16 < full ? x_stride : K) * 2;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < KB; kb++) {
                    if (m0 == c0) {
                        /* w's tiles PREFETCH_TILES ahead in both streams, into L2 (the
                           hardware's prefetcher alone: 12.1 GB/s at 1 row, 13.1 with). */
                        const char *p0 = (const char *)(b0 + (kb + PREFETCH_TILES) * 512);
                        const char *p1 = (const char *)(b1 + (kb + PREFETCH_TILES) * 512);
                        for (int j = 0; j < 16; j++) {
                            if (p0 + 64 * j < end) _mm_prefetch(p0 + 64 * j, _MM_HINT_T1);
                            if (p1 + 64 * j < end) _mm_prefetch(p1 + 64 * j, _MM_HINT_T1);
                        }
                    }
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
                if (swiglu) {
                    const int64_t width = N / 2;
                    uint16_t *o = out + m0 * width + nb * 8;
                    const uint16_t *bg = bias ? bias + nb * 8 : NULL;
                    const uint16_t *bu = bias ? bias + width + nb * 8 : NULL;
                    _tile_stored(0, buf, 64);
                    _tile_stored(1, buf + 256, 64);
                    write_swiglu(buf, buf + 256, bg, bu, M - m0, o, width);
                    if (two_m) {
                        _tile_stored(2, buf, 64);
                        _tile_stored(3, buf + 256, 64);
                        write_swiglu(buf, buf + 256, bg, bu, M - m0 - 16, o + 16 * width, width);
                    }
                    continue;
                }
                uint16_t *o = out + m0 * N + nb * 16;
                const uint16_t *bb = bias ? bias + nb * 16 : NULL;
                _tile_stored(0, buf, 64);
                write_tile(buf, bb, M - m0, o, N);
                if (two_n) {
                    _tile_stored(1, buf, 64);
                    write_tile(buf, bb ? bb + 16 : NULL, M - m0, o + 16, N);
                }
                if (two_m) {
                    _tile_stored(2, buf, 64);
                    write_tile(buf, bb, M - m0 - 16, o + 16 * N, N);
                    if (two_n) {
                        _tile_stored(3, buf, 64);
                        write_tile(buf, bb ? bb + 16 : NULL, M - m0 - 16, o + 16 * N + 16, N);
                    }
                }
            }
        }
    }
    _tile_release();
    free(buf);
    free(tail);
    return 0;
}
