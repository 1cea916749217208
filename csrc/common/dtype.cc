#include "common/dtype.h"

namespace meshcoll {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBool:
    case DType::kInt8:
    case DType::kUint8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: return 1;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt32:
    case DType::kFloat32: return 4;
    case DType::kInt64:
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBool: return "bool";
    case DType::kInt8: return "int8";
    case DType::kUint8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat8E4M3: return "float8_e4m3fn";  // torch's and ml_dtypes' names
    case DType::kFloat8E5M2: return "float8_e5m2";
  }
  return "unknown";
}

const char* redop_name(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "sum";
    case RedOp::kProd: return "prod";
    case RedOp::kMin: return "min";
    case RedOp::kMax: return "max";
    case RedOp::kAvg: return "avg";
    case RedOp::kBand: return "band";
    case RedOp::kBor: return "bor";
    case RedOp::kBxor: return "bxor";
  }
  return "unknown";
}

bool is_floating(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 ||
         t == DType::kFloat64 || t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2;
}

bool dtype_from_name(const std::string& name, DType* out) {
  for (int i = 0; i < kNumDTypes; ++i) {
    if (name == dtype_name(static_cast<DType>(i))) {
      *out = static_cast<DType>(i);
      return true;
    }
  }
  return false;
}

bool redop_from_name(const std::string& name, RedOp* out) {
  for (int i = 0; i < kNumRedOps; ++i) {
    if (name == redop_name(static_cast<RedOp>(i))) {
      *out = static_cast<RedOp>(i);
      return true;
    }
  }
  return false;
}

}  // namespace meshcoll
