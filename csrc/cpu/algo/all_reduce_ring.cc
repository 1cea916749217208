// Ring all-reduce: reduce-scatter then all-gather around the ring, 2(n-1) steps, each rank
// sending 2(n-1)/n of the vector: bandwidth-optimal for large vectors.
#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

// The vector is cut into n chunks, and each chunk into segments (Note in plan.h).
// Steps t = 0 .. n-2 are the reduce-scatter: at step t this rank forwards chunk (rank-t)
// and folds the incoming chunk (rank-t-1) into its own copy. After step n-2 this rank owns
// the fully reduced chunk (rank+1). Steps t = n-1 .. 2n-3 are the all-gather: at step
// n-1+s it forwards chunk (rank+1-s) and receives the final chunk (rank-s) straight into
// the output. In both phases the chunk sent at step t+1 is the chunk received at step t,
// so the loop is one pipeline: as soon as segment j of step t has landed (and been reduced)
// it goes out as segment j of step t+1, while later segments are still on the wire.
// Receives for step t+1 are posted when step t starts, alternating between two scratch
// buffers in the reduce-scatter, so early data lands in place instead of being buffered.
void ring_all_reduce(cpu::Comm& comm, const AllreduceArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  const size_t esz = dtype_size(a.dtype);
  const Blocks chunks(a.count, n);
  const Segments segs(chunks.length(0), a.max_segment_bytes, esz);
  const int steps = 2 * (n - 1);
  const size_t chunk_bytes = segs.count * segs.seg_elems * esz;
  uint8_t* scratch[2] = {comm.scratch(0, chunk_bytes), comm.scratch(1, chunk_bytes)};
  auto fold = reduce::lookup(a.dtype, a.op);

  auto tx_chunk = [&](int t) { return t < n - 1 ? mod(r - t, n) : mod(r + 1 - (t - (n - 1)), n); };
  auto rx_chunk = [&](int t) { return t < n - 1 ? mod(r - t - 1, n) : mod(r - (t - (n - 1)), n); };
  // Segment j of chunk c inside the output: (pointer, bytes).
  auto out_seg = [&](int c, size_t j) {
    size_t len = chunks.length(c);
    return MutBytes(a.out.data + (chunks.offset(c) + segs.offset(len, j)) * esz,
                    segs.length(len, j) * esz);
  };
  auto post_recvs = [&](int t, std::vector<transport::Request>& into) {
    int c = rx_chunk(t);
    for (size_t j = 0; j < segs.count; ++j) {
      MutBytes dst = out_seg(c, j);
      if (t < n - 1) {
        size_t len = chunks.length(c);
        dst = MutBytes(scratch[t % 2] + segs.offset(len, j) * esz, dst.size);
      }
      into[j] = comm.recv(left, static_cast<uint32_t>(t), dst);
    }
  };

  std::vector<transport::Request> recvs(segs.count), next(segs.count), sends;
  sends.reserve(segs.count * steps);
  post_recvs(0, recvs);
  for (size_t j = 0; j < segs.count; ++j) sends.push_back(comm.send(right, 0, out_seg(tx_chunk(0), j)));
  for (int t = 0; t < steps; ++t) {
    if (t + 1 < steps) post_recvs(t + 1, next);
    const int c = rx_chunk(t);
    for (size_t j = 0; j < segs.count; ++j) {
      comm.wait(recvs[j]);
      MutBytes seg = out_seg(c, j);
      if (t < n - 1 && seg.size)
        fold(seg.data, scratch[t % 2] + segs.offset(chunks.length(c), j) * esz, seg.size / esz);
      if (t + 1 < steps) sends.push_back(comm.send(right, static_cast<uint32_t>(t + 1), seg));
    }
    recvs.swap(next);
  }
  comm.wait(sends);
}

}  // namespace meshcoll::algo
