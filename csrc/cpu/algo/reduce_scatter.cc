// reduce_scatter (and reduce_scatter_v) over TCP: a ring over per-rank block counts, so the
// uneven variant is the same code. dispatch.cc decides when it runs (Note [Dispatch]).
#include <cstring>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

// Ring reduce-scatter over a working copy of the input: at step t this rank forwards block
// (rank-t-1) and folds the incoming block (rank-t-2) into its copy; after n-1 steps it holds
// block `rank` fully reduced. Segments pipeline as in ring_all_reduce.
// The sum (or other op) only: dispatch.cc divides for avg.
void ring_reduce_scatter(cpu::Comm& comm, const ReduceScatterArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const size_t esz = dtype_size(a.dtype);
  std::vector<size_t> bytes(n);
  for (int i = 0; i < n; ++i) bytes[i] = a.counts[i] * esz;
  const auto off = prefix_offsets(bytes);
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  uint8_t* work = comm.scratch(2, off[n]);
  if (off[n]) std::memcpy(work, a.in.data, off[n]);
  const size_t max_count = max_of(a.counts);
  const Segments segs(max_count, a.max_segment_bytes, esz);
  const size_t tmp_bytes = segs.count * segs.seg_elems * esz;
  uint8_t* tmp[2] = {comm.scratch(0, tmp_bytes), comm.scratch(1, tmp_bytes)};
  auto fold = reduce::lookup(a.dtype, a.op);
  auto seg = [&](int block, size_t j) {
    size_t len = a.counts[block];
    return MutBytes(work + off[block] + segs.offset(len, j) * esz, segs.length(len, j) * esz);
  };
  auto post_recvs = [&](int t, std::vector<transport::Request>& into) {
    int b = mod(r - t - 2, n);
    for (size_t j = 0; j < segs.count; ++j)
      into[j] = comm.recv(left, t, MutBytes(tmp[t % 2] + segs.offset(a.counts[b], j) * esz,
                                            seg(b, j).size));
  };
  std::vector<transport::Request> recvs(segs.count), next(segs.count), sends;
  post_recvs(0, recvs);
  for (size_t j = 0; j < segs.count; ++j) sends.push_back(comm.send(right, 0, seg(mod(r - 1, n), j)));
  for (int t = 0; t < n - 1; ++t) {
    if (t + 1 < n - 1) post_recvs(t + 1, next);
    const int b = mod(r - t - 2, n);
    for (size_t j = 0; j < segs.count; ++j) {
      comm.wait(recvs[j]);
      MutBytes s = seg(b, j);
      if (s.size) fold(s.data, tmp[t % 2] + segs.offset(a.counts[b], j) * esz, s.size / esz);
      if (t + 1 < n - 1) sends.push_back(comm.send(right, t + 1, s));
    }
    recvs.swap(next);
  }
  comm.wait(sends);
  if (bytes[r]) std::memcpy(a.out.data, work + off[r], bytes[r]);
}

}  // namespace meshcoll::algo
