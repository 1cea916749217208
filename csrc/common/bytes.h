// Non-owning byte ranges. size_t for every count.
#pragma once

#include <cstddef>
#include <cstdint>

namespace meshcoll {

struct ConstBytes {
  const uint8_t* data = nullptr;
  size_t size = 0;
  ConstBytes() = default;
  ConstBytes(const void* p, size_t n) : data(static_cast<const uint8_t*>(p)), size(n) {}
  ConstBytes slice(size_t off, size_t n) const { return {data + off, n}; }
};

struct MutBytes {
  uint8_t* data = nullptr;
  size_t size = 0;
  MutBytes() = default;
  MutBytes(void* p, size_t n) : data(static_cast<uint8_t*>(p)), size(n) {}
  MutBytes slice(size_t off, size_t n) const { return {data + off, n}; }
  operator ConstBytes() const { return {data, size}; }
};

}  // namespace meshcoll
