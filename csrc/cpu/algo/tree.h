// The rooted trees of reduce, broadcast and tree all_reduce: pure arithmetic over ranks, no
// sockets.
//
// Note [Trees]
// A tree is laid over the ranks relative to its root (v = (rank - root) mod n, so the root is
// v = 0), and its shape is given by an arity:
// - 0, the binomial tree: v's parent is v less its lowest set bit, its children v + 2^i for
//   each 2^i below that bit (every power of two below n at the root). ceil(log2 n) levels;
//   the root has log2 n children, whose subtrees halve in size. The fewest hops for a whole
//   vector sent step by step (what tree all_reduce did alone before other arities).
// - k >= 2, the k-ary tree in heap order: v's parent (v - 1) / k, its children kv + 1 ...
//   kv + k. About log_k n levels, at most k children per rank, so a rank's links carry at
//   most k + 1 copies of each segment and fan-out is bounded however many ranks there are;
//   a larger k trades fan-out for fewer levels, which wins where each level costs a
//   synchronisation (shared memory) or a hop of latency (many ranks).
// - k >= n - 1: one level, the root with every other rank as a child: the flat ("direct")
//   reduce and broadcast are this tree, so they share its code.
// A reduce folds a rank's own values first, then each child's in the order `children` lists
// them; every rank builds the same tree, so the result is deterministic (it differs between
// arities only by the order of floating-point additions).
#pragma once

#include <algorithm>
#include <vector>

namespace meshcoll::algo {

inline constexpr int kBinomial = 0;  // the arity that names the binomial tree

struct TreeNode {
  int parent = -1;            // relative rank; -1 at the root
  std::vector<int> children;  // relative ranks, in the order a reduce folds them
  int depth = 0;              // levels between this rank and the root
};

inline int tree_parent(int v, int arity) {
  if (v == 0) return -1;
  return arity == kBinomial ? (v & (v - 1)) : (v - 1) / arity;
}

inline int tree_depth(int v, int arity) {
  int d = 0;
  for (; v > 0; v = tree_parent(v, arity)) ++d;
  return d;
}

// Relative rank v's place in the tree over n ranks.
inline TreeNode tree_node(int v, int n, int arity) {
  TreeNode t;
  t.parent = tree_parent(v, arity);
  t.depth = tree_depth(v, arity);
  if (arity == kBinomial) {
    for (int m = 1; m < n && !(v & m); m <<= 1)
      if (v + m < n) t.children.push_back(v + m);
  } else {
    for (long c = long(v) * arity + 1; c <= long(v) * arity + arity && c < n; ++c)
      t.children.push_back(static_cast<int>(c));
  }
  return t;
}

// The deepest rank's depth: how many levels a level-by-level schedule runs.
inline int tree_height(int n, int arity) {
  int h = 0;
  for (int v = n - 1; v > 0; --v) h = std::max(h, tree_depth(v, arity));
  return h;
}

}  // namespace meshcoll::algo
