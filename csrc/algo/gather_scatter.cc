// Block-moving collectives: all_gather (ring), reduce_scatter (ring), all_to_all (pairwise),
// gather and scatter (direct to/from root), and the dissemination barrier. Every one takes
// per-rank block sizes, so the uneven (_v) variants are the same code. On one host each hands
// over to its shared-memory version (shm_collectives.cc).
#include <cstring>
#include <numeric>

#include "algo/collectives.h"
#include "algo/plan.h"
#include "common/check.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

// Ring all-gather: at step s this rank forwards block (rank-s) to the right and receives
// block (rank-s-1) from the left, straight into the output. Every receive region is distinct
// and is only sent on after it has arrived, so all receives are posted up front and each
// segment is forwarded the moment it lands.
void all_gather(comm::Comm& comm, const AllGatherArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const auto off = prefix_offsets(a.bytes);
  MC_CHECK_EQ(off[n], a.out.size);
  if (a.in.data != a.out.data + off[r] && a.bytes[r])
    std::memcpy(a.out.data + off[r], a.in.data, a.bytes[r]);
  if (n == 1) return;
  if (comm.shm()) {
    shm_all_gather(comm, a);
    return;
  }
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

// Ring reduce-scatter over a working copy of the input: at step t this rank forwards block
// (rank-t-1) and folds the incoming block (rank-t-2) into its copy; after n-1 steps it holds
// block `rank` fully reduced. Segments pipeline as in ring_all_reduce.
void reduce_scatter(comm::Comm& comm, const ReduceScatterArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const size_t esz = dtype_size(a.dtype);
  std::vector<size_t> bytes(n);
  for (int i = 0; i < n; ++i) bytes[i] = a.counts[i] * esz;
  const auto off = prefix_offsets(bytes);
  MC_CHECK_EQ(off[n], a.in.size);
  MC_CHECK_EQ(bytes[r], a.out.size);
  if (n == 1) {
    if (a.out.data != a.in.data && bytes[0]) std::memcpy(a.out.data, a.in.data, bytes[0]);
  } else if (comm.shm()) {
    shm_reduce_scatter(comm, a);
  } else {
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
  if (a.op == RedOp::kAvg) reduce::divide_by(a.dtype, a.out.data, a.counts[r], n);
}

// Pairwise exchange: every receive and send is posted at once, sends in the order
// rank+1, rank+2, ... so that no single rank is everyone's first target.
void all_to_all(comm::Comm& comm, const AllToAllArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const auto soff = prefix_offsets(a.send_bytes);
  const auto roff = prefix_offsets(a.recv_bytes);
  MC_CHECK_EQ(soff[n], a.in.size);
  MC_CHECK_EQ(roff[n], a.out.size);
  MC_CHECK_EQ(a.send_bytes[r], a.recv_bytes[r]);
  if (comm.shm() && n > 1) {
    shm_all_to_all(comm, a);
    return;
  }
  std::vector<transport::Request> reqs;
  for (int s = 1; s < n; ++s) {
    int from = mod(r - s, n);
    reqs.push_back(comm.recv(from, 0, MutBytes(a.out.data + roff[from], a.recv_bytes[from])));
  }
  for (int s = 1; s < n; ++s) {
    int to = mod(r + s, n);
    reqs.push_back(comm.send(to, 0, ConstBytes(a.in.data + soff[to], a.send_bytes[to])));
  }
  if (a.send_bytes[r]) std::memmove(a.out.data + roff[r], a.in.data + soff[r], a.send_bytes[r]);
  comm.wait(reqs);
}

void gather(comm::Comm& comm, const GatherArgs& a) {
  const int n = comm.size(), r = comm.rank();
  if (comm.shm() && n > 1) {
    shm_gather(comm, a);
    return;
  }
  if (r != a.root) {
    comm.wait(comm.send(a.root, 0, a.in));
    return;
  }
  const auto off = prefix_offsets(a.bytes);
  std::vector<transport::Request> reqs;
  for (int p = 0; p < n; ++p)
    if (p != r) reqs.push_back(comm.recv(p, 0, MutBytes(a.out.data + off[p], a.bytes[p])));
  if (a.bytes[r]) std::memmove(a.out.data + off[r], a.in.data, a.bytes[r]);
  comm.wait(reqs);
}

void scatter(comm::Comm& comm, const GatherArgs& a) {
  const int n = comm.size(), r = comm.rank();
  if (comm.shm() && n > 1) {
    shm_scatter(comm, a);
    return;
  }
  if (r != a.root) {
    comm.wait(comm.recv(a.root, 0, a.out));
    return;
  }
  const auto off = prefix_offsets(a.bytes);
  std::vector<transport::Request> reqs;
  for (int p = 0; p < n; ++p)
    if (p != r) reqs.push_back(comm.send(p, 0, ConstBytes(a.in.data + off[p], a.bytes[p])));
  if (a.bytes[r]) std::memmove(a.out.data, a.in.data + off[r], a.bytes[r]);
  comm.wait(reqs);
}

// Dissemination barrier: in round k every rank signals rank+2^k and waits for rank-2^k;
// after ceil(log2 n) rounds every rank has heard, transitively, from every other.
void barrier(comm::Comm& comm) {
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return;
  if (comm.shm()) {
    shm_barrier(comm);
    return;
  }
  uint32_t round = 0;
  for (int k = 1; k < n; k <<= 1, ++round) {
    comm.wait({comm.send(mod(r + k, n), round, ConstBytes()),
               comm.recv(mod(r - k, n), round, MutBytes())});
  }
}

}  // namespace meshcoll::algo
