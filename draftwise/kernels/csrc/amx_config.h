// The LDTILECFG operand every AMX unit fills (gemm_q4x8_amx.cpp and gemm_q6k_amx.cpp through amx_tiles.h,
// attention_amx.cpp): palette 1, per tile register its rows and bytes per row.
// Owns only this layout (Intel SDM, LDTILECFG), the one way it is loaded and the one shape every unit gives its
// tiles (all 8 as 16 rows x 64 bytes); knows nothing of which tiles a kernel
// uses or how. Plain C: included by units compiled with AMX flags and by none other, and it includes no C++ library
// header.
#pragma once
#include <stdint.h>
#include "intrin.h"

struct alignas(64) DwTileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];  // bytes per row of tile register i
    uint8_t rows[16];    // rows of tile register i
};

// LDTILECFG from cfg. The empty asm with a memory clobber makes the compiler keep the stores that fill cfg: GCC 12
// treats _tile_loadconfig's operand as not read and dropped every colsb / rows store of an all-8-tile
// configuration (only palette survived, and the first tile instruction then faulted with SIGILL).
static inline void dw_load_tile_config(const DwTileConfig* cfg) {
    __asm__ volatile("" : : "r"(cfg) : "memory");
    _tile_loadconfig(cfg);
}

// Configures the calling thread's 8 tiles as 16 rows x 64 bytes each, palette 1 (release with _tile_release()).
static inline void dw_configure_tiles() {
    DwTileConfig cfg = {};
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    dw_load_tile_config(&cfg);
}
