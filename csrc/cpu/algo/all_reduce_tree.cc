// Tree all-reduce: a tree reduce to rank 0, then a tree broadcast from it, of the call's arity
// (Note [Trees] in tree.h; tree_kary.cc). Binomial: 2 ceil(log2 n) steps of the whole vector,
// the fewest steps, so the lowest latency for small vectors; each rank folds its children in
// a fixed order, so results are deterministic.

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

void tree_all_reduce(cpu::Comm& comm, const AllreduceArgs& a) {
  tree_reduce(comm, a.out, a.count, a.dtype, a.op, 0, a.arity, 0, a.max_segment_bytes);
  tree_broadcast(comm, a.out, 0, a.arity, 1, a.max_segment_bytes);
}

// Pipelined chain (broadcast's "ring"): every link carries the vector once, segments in
// flight on all links at once.
void chain_broadcast(cpu::Comm& comm, const BroadcastArgs& a) {
  const int n = comm.size();
  const int v = mod(comm.rank() - a.root, n);
  const int prev = mod(comm.rank() - 1, n), next = mod(comm.rank() + 1, n);
  const Segments segs(a.buf.size, a.max_segment_bytes, 1);
  std::vector<transport::Request> recvs, sends;
  auto seg = [&](size_t j) {
    return MutBytes(a.buf.data + segs.offset(a.buf.size, j), segs.length(a.buf.size, j));
  };
  if (v > 0)
    for (size_t j = 0; j < segs.count; ++j) recvs.push_back(comm.recv(prev, 0, seg(j)));
  for (size_t j = 0; j < segs.count; ++j) {
    if (v > 0) comm.wait(recvs[j]);
    if (v < n - 1) sends.push_back(comm.send(next, 0, seg(j)));
  }
  comm.wait(sends);
}

}  // namespace meshcoll::algo
