// all_reduce: validation, algorithm selection, and the direct (reference) algorithm.
#include <cstring>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "common/check.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

void all_reduce(cpu::Comm& comm, const AllreduceArgs& a) {
  const size_t nbytes = a.count * dtype_size(a.dtype);
  if (comm.size() == 1) {  // avg over one rank is the value itself
    if (a.out.data != a.in.data && nbytes) std::memcpy(a.out.data, a.in.data, nbytes);
    return;
  }
  AllreduceArgs b = a;
  Algorithm algo = a.algorithm;
  if (algo == Algorithm::kAuto) {  // the table's arity, not the config's (Note [Selection table])
    const Choice c = select_algorithm(Selects::kAllReduce, comm.shm() != nullptr, nbytes,
                                      comm.size(), a.select);
    algo = c.algorithm;
    b.arity = c.arity;
  }
  if (algo == Algorithm::kShm && !comm.shm())
    throw InvalidArgument(str_cat("all_reduce: algorithm 'shm' needs every rank on one host "
                                  "with shared memory; this group uses ", comm.shm_status()));
  if (algo != Algorithm::kTree) b.arity = 0;  // only a tree has one (OpDesc::arity)
  comm.set_algorithm(algorithm_name(algo), static_cast<uint8_t>(algo), b.arity);
  // Shared memory reads x where it is (Note [Out-of-place shared-memory all_reduce]); every
  // other algorithm works in place on out.
  if (algo != Algorithm::kShm && a.out.data != a.in.data && nbytes) {
    std::memcpy(a.out.data, a.in.data, nbytes);
    b.in = ConstBytes(a.out.data, nbytes);
  }
  bool divided = false;  // an average the algorithm divided itself
  switch (algo) {
    case Algorithm::kShm: divided = shm_all_reduce(comm, b); break;
    case Algorithm::kRing: ring_all_reduce(comm, b); break;
    case Algorithm::kTree: tree_all_reduce(comm, b); break;
    case Algorithm::kHalvingDoubling: halving_doubling_all_reduce(comm, b); break;
    default: direct_all_reduce(comm, b); break;
  }
  if (a.op == RedOp::kAvg && !divided)
    reduce::divide_by(a.dtype, a.out.data, a.count, comm.size());
}

// Direct: every rank sends its vector to rank 0, which folds them in rank order and sends
// the result back. 2(n-1) messages through one rank: the reference, and the fastest for
// tiny vectors on two or three ranks, where it is one round trip.
void direct_all_reduce(cpu::Comm& comm, const AllreduceArgs& a) {
  const int n = comm.size();
  const size_t nbytes = a.count * dtype_size(a.dtype);
  if (comm.rank() != 0) {
    comm.wait({comm.send(0, 0, ConstBytes(a.out.data, nbytes)),
               comm.recv(0, 1, a.out)});
    return;
  }
  auto fn = reduce::lookup(a.dtype, a.op);
  uint8_t* tmp = comm.scratch(0, nbytes * (n - 1));
  std::vector<transport::Request> recvs;
  for (int p = 1; p < n; ++p) recvs.push_back(comm.recv(p, 0, MutBytes(tmp + (p - 1) * nbytes, nbytes)));
  for (int p = 1; p < n; ++p) {
    comm.wait(recvs[p - 1]);
    fn(a.out.data, tmp + (p - 1) * nbytes, a.count);
  }
  std::vector<transport::Request> sends;
  for (int p = 1; p < n; ++p) sends.push_back(comm.send(p, 1, ConstBytes(a.out.data, nbytes)));
  comm.wait(sends);
}

}  // namespace meshcoll::algo
