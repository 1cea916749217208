// all_gather (and all_gather_v) over TCP: a ring over per-rank block sizes, so the uneven
// variant is the same code. dispatch.cc decides when it runs (Note [Dispatch]).

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"

namespace meshcoll::algo {

// Ring all-gather: at step s this rank forwards block (rank-s) to the right and receives
// block (rank-s-1) from the left, straight into the output. Every receive region is distinct
// and is only sent on after it has arrived, so all receives are posted up front and each
// segment is forwarded the moment it lands.
// This rank's own block is already in place (dispatch.cc).
void ring_all_gather(cpu::Comm& comm, const AllGatherArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const auto off = prefix_offsets(a.bytes);
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  const Segments segs(max_of(a.bytes), a.max_segment_bytes, 1);
  auto seg = [&](int block, size_t j) {
    size_t len = a.bytes[block];
    return MutBytes(a.out.data + off[block] + segs.offset(len, j), segs.length(len, j));
  };
  std::vector<transport::Request> recvs, sends;
  for (int s = 0; s < n - 1; ++s)
    for (size_t j = 0; j < segs.count; ++j)
      recvs.push_back(comm.recv(left, s, seg(mod(r - s - 1, n), j)));
  for (size_t j = 0; j < segs.count; ++j) sends.push_back(comm.send(right, 0, seg(r, j)));
  for (int s = 0; s < n - 1; ++s) {
    for (size_t j = 0; j < segs.count; ++j) {
      comm.wait(recvs[s * segs.count + j]);
      if (s + 1 < n - 1) sends.push_back(comm.send(right, s + 1, seg(mod(r - s - 1, n), j)));
    }
  }
  comm.wait(sends);
}

}  // namespace meshcoll::algo
