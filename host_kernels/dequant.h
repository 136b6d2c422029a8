// Block-format rows widened to bf16: how the AMX-BF16 tiles and their vector form (amx.h)
// multiply weights stored in a block format (Q4_K, Q6_K, the tagged Q4_K-or-Q6_K, Q8_0;
// Q4_0 and MXFP4 in the scalar reference only) during prefill.
//
// A tile pass of 32 weight rows meets every token block of an expert (or, for a dense
// matrix, a chunk of 16 token blocks), so widening the pass's rows once into the tile
// scratch and then running the bf16 tiles costs a few vector operations per weight
// against 16-tokens' worth of multiply-adds per weight: the K formats' sub-block scales
// (6-bit per 32 weights for Q4_K, 8-bit per 16 for Q6_K) need no per-tile float work.
//
// Each value is computed with the float32 operations of gguf's dequantiser (the numpy
// twin `Format.to_f32_numpy`): Q4_K (d * sc) * q - (dmin * m), Q6_K (d * sc) * (q - 32),
// Q8_0 d * q, Q4_0 d * (q - 8), MXFP4 e8m0_half * 2v; then rounded to bf16, nearest even
// (to_bf16). So a widened row equals the numpy twin's row rounded to bf16, bit for bit
// (tests/test_amx.py), and the tiles' numerics are those of bf16 weights: the weights
// rounded once more (2^-9 relative, against Q4_K's own ~12% error), the activations
// rounded to bf16 as for bf16 checkpoints. Runs only when asked for (Isa::kAmxBf16,
// Isa::kAvx512Bf16Tiles).
#pragma once

#include <cstdint>

#include "kernels.h"

namespace ftjax {

// Whether dequant_bf16 has a vector version for weight type w on this CPU (AVX512-BF16,
// which every AMX CPU has): the tiles take only those formats (a scalar widening would
// cost more than the exact kernels it replaces). bf16 rows count (a copy).
bool dequant_bf16_fast(WeightType w);

// row (K weights of type w, K whole blocks; bf16 bits for kBF16) -> bf16 bits: values
// 32c .. 32c + 31 at out + c * chunk_stride (uint16 units; 32 for a plain row). The
// vector version where dequant_bf16_fast(w), else the scalar reference.
void dequant_bf16(WeightType w, const void* row, int64_t K, uint16_t* out, int64_t chunk_stride);
// The scalar reference: every type of block_weights() > 1 but FP8, and bf16; false for
// the others (f32, FP8), out untouched.
bool dequant_bf16_scalar(WeightType w, const void* row, int64_t K, uint16_t* out, int64_t chunk_stride);

}  // namespace ftjax
