// Tree all-reduce: a binomial-tree reduce to rank 0, then a binomial-tree broadcast.
// 2 ceil(log2 n) steps of the whole vector: the fewest steps, so the lowest latency for small
// vectors; each rank folds its children in a fixed order, so results are deterministic.
#include <cstring>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

namespace {
// Binomial broadcast of buf from `root`, tagged `tag`: relative rank v receives from
// v - lowbit(v), then sends to v + m for each lower power of two m. Used by tree all-reduce
// and by broadcast for small messages.
void binomial_broadcast(cpu::Comm& comm, MutBytes buf, int root, uint32_t tag) {
  const int n = comm.size();
  const int v = mod(comm.rank() - root, n);
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      comm.wait(comm.recv(mod(v - mask + root, n), tag, buf));
      break;
    }
    mask <<= 1;
  }
  std::vector<transport::Request> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < n) sends.push_back(comm.send(mod(v + mask + root, n), tag, buf));
  }
  comm.wait(sends);
}

// Binomial reduce into buf on `root`, tagged `tag`; buf is clobbered on non-roots.
void binomial_reduce(cpu::Comm& comm, MutBytes buf, size_t count, DType dtype, RedOp op,
                     int root, uint32_t tag) {
  const int n = comm.size();
  const int v = mod(comm.rank() - root, n);
  auto fold = reduce::lookup(dtype, op);
  uint8_t* tmp = comm.scratch(0, buf.size);
  for (int mask = 1; mask < n; mask <<= 1) {
    if (v & mask) {
      comm.wait(comm.send(mod(v - mask + root, n), tag, buf));
      return;
    }
    if (v + mask < n) {
      comm.wait(comm.recv(mod(v + mask + root, n), tag, MutBytes(tmp, buf.size)));
      fold(buf.data, tmp, count);
    }
  }
}
}  // namespace

void tree_all_reduce(cpu::Comm& comm, const AllreduceArgs& a) {
  binomial_reduce(comm, a.out, a.count, a.dtype, a.op, 0, 0);
  binomial_broadcast(comm, a.out, 0, 1);
}

// Pipelined chain for large broadcasts (every link carries the vector once, segments in
// flight on all links at once); binomial tree for small ones (log2 n steps).
void tcp_broadcast(cpu::Comm& comm, const BroadcastArgs& a) {
  const int n = comm.size();
  if (a.buf.size <= 64 * 1024 || n == 2) {
    binomial_broadcast(comm, a.buf, a.root, 0);
    return;
  }
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

// The sum (or other op) only: dispatch.cc divides for avg.
void tree_reduce(cpu::Comm& comm, const ReduceArgs& a) {
  const size_t nbytes = a.count * dtype_size(a.dtype);
  MutBytes buf = comm.rank() == a.root ? a.out : MutBytes(comm.scratch(2, nbytes), nbytes);
  if (buf.data != a.in.data && nbytes) std::memcpy(buf.data, a.in.data, nbytes);
  if (comm.size() > 1) binomial_reduce(comm, buf, a.count, a.dtype, a.op, a.root, 0);
}

}  // namespace meshcoll::algo
