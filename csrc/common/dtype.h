// Element types and reduction ops shared by every layer. Enum values travel on the wire
// (agreement-check headers), so they are fixed and byte-sized.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshcoll {

enum class DType : uint8_t {
  kBool = 0,
  kInt8 = 1,
  kUint8 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  // NCCL only (2.24+): the CPU backend has no float8 kernels and numpy no float8 dtype.
  kFloat8E4M3 = 9,   // float8_e4m3fn (OCP E4M3: no infinities)
  kFloat8E5M2 = 10,  // float8_e5m2
};
inline constexpr int kNumDTypes = 11;

enum class RedOp : uint8_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kAvg = 4,  // sum, then divided by the group size once at the end
  kBand = 5,
  kBor = 6,
  kBxor = 7,
};
inline constexpr int kNumRedOps = 8;

size_t dtype_size(DType t);
const char* dtype_name(DType t);   // numpy-style names: "float32", "bfloat16", ...
const char* redop_name(RedOp op);  // "sum", "prod", ...
bool is_floating(DType t);
// Inverse of dtype_name / redop_name; false when the name is unknown.
bool dtype_from_name(const std::string& name, DType* out);
bool redop_from_name(const std::string& name, RedOp* out);

}  // namespace meshcoll
