// Trees over TCP, of any arity (Note [Trees] in tree.h): the reduce and broadcast that tree
// all_reduce, reduce and broadcast run, and the flat ("direct") reduce and broadcast, which
// are the tree of one level.
//
// Both go segment by segment (segments of at most max_segment_bytes, the same count on every
// rank: plan.h's Segments), so a long vector pipelines through the levels: a rank forwards
// segment j while segment j + 1 is still on its way to it. A vector of one segment takes
// depth hops, each a whole-vector message, as the binomial tree did before other arities.
#include <cstring>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "cpu/algo/tree.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

void tree_broadcast(cpu::Comm& comm, MutBytes buf, int root, int arity, uint32_t tag,
                    size_t max_segment_bytes) {
  const int n = comm.size();
  const TreeNode t = tree_node(mod(comm.rank() - root, n), n, arity);
  auto peer = [&](int v) { return mod(v + root, n); };
  const Segments segs(buf.size, max_segment_bytes, 1);
  auto seg = [&](size_t j) {
    return MutBytes(buf.data + segs.offset(buf.size, j), segs.length(buf.size, j));
  };
  std::vector<transport::Request> recvs, sends;
  if (t.parent >= 0)  // every segment's receive posted at once: they arrive in order
    for (size_t j = 0; j < segs.count; ++j) recvs.push_back(comm.recv(peer(t.parent), tag, seg(j)));
  for (size_t j = 0; j < segs.count; ++j) {
    if (t.parent >= 0) comm.wait(recvs[j]);
    // The last child first: in a binomial tree it heads the largest subtree.
    for (auto c = t.children.rbegin(); c != t.children.rend(); ++c)
      sends.push_back(comm.send(peer(*c), tag, seg(j)));
  }
  comm.wait(sends);
}

void tree_reduce(cpu::Comm& comm, MutBytes buf, size_t count, DType dtype, RedOp op, int root,
                 int arity, uint32_t tag, size_t max_segment_bytes) {
  const int n = comm.size();
  const TreeNode t = tree_node(mod(comm.rank() - root, n), n, arity);
  auto peer = [&](int v) { return mod(v + root, n); };
  const size_t esz = dtype_size(dtype);
  const Segments segs(count, max_segment_bytes, esz);
  auto fold = reduce::lookup(dtype, op);
  const size_t seg_bytes = std::min(count, segs.seg_elems) * esz;
  uint8_t* tmp = t.children.empty() ? nullptr : comm.scratch(0, t.children.size() * seg_bytes);
  std::vector<transport::Request> recvs(t.children.size()), sends;
  for (size_t j = 0; j < segs.count; ++j) {
    const size_t off = segs.offset(count, j), len = segs.length(count, j);
    uint8_t* mine = buf.data + off * esz;
    for (size_t i = 0; i < t.children.size(); ++i)
      recvs[i] = comm.recv(peer(t.children[i]), tag, MutBytes(tmp + i * seg_bytes, len * esz));
    for (size_t i = 0; i < t.children.size(); ++i) {  // in the tree's order: deterministic
      comm.wait(recvs[i]);
      fold(mine, tmp + i * seg_bytes, len);
    }
    // Segment j is final here: it may go up while the next one comes in.
    if (t.parent >= 0) sends.push_back(comm.send(peer(t.parent), tag, ConstBytes(mine, len * esz)));
  }
  comm.wait(sends);
}

// The op only: dispatch.cc divides for avg. Off the root the partial sums go to scratch.
void tcp_reduce(cpu::Comm& comm, const ReduceArgs& a, int arity) {
  const size_t nbytes = a.count * dtype_size(a.dtype);
  MutBytes buf = comm.rank() == a.root ? a.out : MutBytes(comm.scratch(2, nbytes), nbytes);
  if (buf.data != a.in.data && nbytes) std::memcpy(buf.data, a.in.data, nbytes);
  if (comm.size() > 1)
    tree_reduce(comm, buf, a.count, a.dtype, a.op, a.root, arity, 0, a.max_segment_bytes);
}

}  // namespace meshcoll::algo
