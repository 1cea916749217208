// Pure chunk and segment math for the collectives: no sockets, tested directly.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace meshcoll::algo {

// `count` elements split into `n` blocks as evenly as possible: the first count % n blocks
// hold one element more. Block i covers [offset(i), offset(i) + length(i)).
struct Blocks {
  size_t count = 0;
  size_t n = 1;
  Blocks(size_t count_, size_t n_) : count(count_), n(n_) {}
  size_t length(size_t i) const { return count / n + (i < count % n ? 1 : 0); }
  size_t offset(size_t i) const { return i * (count / n) + std::min(i, count % n); }
};

// A block cut into segments of at most seg_elems elements, so that sending, receiving and
// reducing of consecutive segments overlap. Every rank computes the same segment count
// from the largest block, so segment j of any block matches segment j on the peer; trailing
// segments of shorter blocks may be empty (zero-byte messages keep the steps in lockstep).
struct Segments {
  size_t seg_elems = 1;
  size_t count = 1;  // segments per block
  Segments(size_t max_block_elems, size_t max_segment_bytes, size_t elem_size) {
    seg_elems = std::max<size_t>(1, max_segment_bytes / std::max<size_t>(1, elem_size));
    count = std::max<size_t>(1, (max_block_elems + seg_elems - 1) / seg_elems);
  }
  // Offset and length (elements) of segment j inside a block of block_len elements.
  size_t offset(size_t block_len, size_t j) const { return std::min(j * seg_elems, block_len); }
  size_t length(size_t block_len, size_t j) const {
    size_t off = offset(block_len, j);
    return std::min(seg_elems, block_len - off);
  }
};

inline int mod(long a, long n) { return static_cast<int>(((a % n) + n) % n); }

// Where each of a list of blocks starts when they are laid end to end; the last entry is the
// total.
inline std::vector<size_t> prefix_offsets(const std::vector<size_t>& sizes) {
  std::vector<size_t> off(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) off[i + 1] = off[i] + sizes[i];
  return off;
}
inline size_t max_of(const std::vector<size_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

// Largest power of two <= n (n >= 1).
inline int pow2_floor(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

}  // namespace meshcoll::algo
