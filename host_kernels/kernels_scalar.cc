// Portable micro-kernels: plain C++, no intrinsics. Eight independent partial sums
// per dot keep the loop free of a serial dependency (and let a compiler vectorise
// it without reassociating), so this path is a usable fallback, not a toy.
#include <atomic>
#include <cstring>
#include <stdexcept>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "amx.h"
#include "kernels.h"

namespace ftjax {
namespace {

template <typename W, int R, int J>
void dot_scalar(const void* const* rows_v, const float* const* vecs, int64_t n,
                float* out) {
  constexpr int kLanes = 8;
  const W* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const W*>(rows_v[r]);
  float acc[R][J][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int r = 0; r < R; ++r) {
      float w[kLanes];
      for (int l = 0; l < kLanes; ++l) w[l] = weight_at(rows[r], i + l);
      for (int j = 0; j < J; ++j)
        for (int l = 0; l < kLanes; ++l) acc[r][j][l] += w[l] * vecs[j][i + l];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      float s = 0.f;
      for (int l = 0; l < kLanes; ++l) s += acc[r][j][l];
      for (int64_t t = i; t < n; ++t) s += weight_at(rows[r], t) * vecs[j][t];
      out[r * J + j] = s;
    }
  }
}

template <typename W>
void gemv_scalar(const void* rows, int64_t row_stride, int64_t num_rows, const float* vec,
                 int64_t n, float* out) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const void* row = static_cast<const char*>(rows) + r * row_stride;
    dot_scalar<W, 1, 1>(&row, &vec, n, out + r);
  }
}

float sum_scalar(const float* data, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += data[i + l];
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += data[i];
  return s;
}

#define FTJAX_ROW(W, R) \
  { nullptr, &dot_scalar<W, R, 1>, &dot_scalar<W, R, 2>, &dot_scalar<W, R, 3> }
#define FTJAX_TABLE(W)                                                                     \
  DotTable {                                                                               \
    {{}, FTJAX_ROW(W, 1), FTJAX_ROW(W, 2), FTJAX_ROW(W, 3), FTJAX_ROW(W, 4)}, &gemv_scalar<W> \
  }

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k{FTJAX_TABLE(float), FTJAX_TABLE(uint16_t), block_table_scalar(WeightType::kQ8_0),
                         block_table_scalar(WeightType::kQ4_0),
                         block_table_scalar(WeightType::kQ4_K), block_table_scalar(WeightType::kQ6_K),
                         block_table_scalar(WeightType::kMXFP4), block_table_scalar(WeightType::kFP8_E4M3),
                         block_table_scalar(WeightType::kQ4_K_OR_Q6_K), &sum_scalar, 0};
  return k;
}

#undef FTJAX_ROW
#undef FTJAX_TABLE

namespace {

int64_t default_gemv_prefetch() {
#if defined(__x86_64__) || defined(__i386__)
  uint32_t a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    if (std::strcmp(vendor, "GenuineIntel") == 0) return 4096;
    // AMD where AUTO is the AVX2 table (no AVX-512: Zen 2 / Zen 3 class)
    if (std::strcmp(vendor, "AuthenticAMD") == 0 && !cpu_has_avx512()) return 1024;
  }
#endif
  return 0;
}

std::atomic<int64_t>& gemv_prefetch() {
  static std::atomic<int64_t> bytes{default_gemv_prefetch()};
  return bytes;
}

}  // namespace

int64_t gemv_prefetch_bytes() { return gemv_prefetch().load(std::memory_order_relaxed); }
void set_gemv_prefetch_bytes(int64_t bytes) { gemv_prefetch().store(bytes, std::memory_order_relaxed); }

const Kernels* select_kernels(Isa isa) {
  const Kernels* avx2 = cpu_has_avx2_fma() ? avx2_kernels() : nullptr;
  const Kernels* avx512 = cpu_has_avx512() ? avx512_kernels() : nullptr;
  const Kernels* avx512_bf16 = cpu_has_avx512_bf16() ? avx512_bf16_kernels() : nullptr;
  switch (isa) {
    case Isa::kScalar:
      return &scalar_kernels();
    case Isa::kAvx2:
      return avx2;
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx512Bf16:
      return avx512_bf16;
    case Isa::kAmxBf16:  // the exact kernels; prompt calls take the tiles (tiles_granted)
    case Isa::kAvx512Bf16Tiles:
      if (!tiles_granted(isa)) return nullptr;
      [[fallthrough]];
    case Isa::kAuto:
    default:
      return avx512 ? avx512 : avx2 ? avx2 : &scalar_kernels();  // exact: AVX512_BF16 is asked for
  }
}

const Kernels& require_kernels(Isa isa) {
  const Kernels* kernels = select_kernels(isa);
  if (kernels == nullptr) throw std::invalid_argument("requested ISA is not available on this CPU");
  return *kernels;
}

}  // namespace ftjax
