// The LDTILECFG operand every AMX unit fills (gemm_q4x8_amx.cpp and gemm_q6k_amx.cpp through amx_tiles.h,
// attention_amx.cpp): palette 1, per tile register its rows and bytes per row.
// Owns only this layout (Intel SDM, LDTILECFG); knows nothing of which tiles a kernel uses or how. Plain C: included
// by units compiled with AMX flags and by none other, and it includes no C++ library header.
#pragma once
#include <stdint.h>

struct alignas(64) DwTileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];  // bytes per row of tile register i
    uint8_t rows[16];    // rows of tile register i
};
