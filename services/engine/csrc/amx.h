/* What the AMX kernels share (linear.c, prefill_attention.c): eight tiles of 16 rows x 64
   bytes, configured per thread before its first tile instruction and released after. */
#ifndef TANDEM_AMX_H
#define TANDEM_AMX_H

#include <stdint.h>
#include <immintrin.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* A constant: built on the stack, GCC drops the stores to it (it does not see ldtilecfg read
   them). */
static const tile_config TILES = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* pool_job start / finish hooks of an AMX kernel's units, on whichever thread runs them. */
static inline void amx_start(void *ctx, int helper) {
    (void)ctx, (void)helper;
    _tile_loadconfig(&TILES);
}

static inline void amx_finish(void *ctx, int helper) {
    (void)ctx, (void)helper;
    _tile_release();
}

#endif
