// What Algorithm::kAuto runs: one table for every collective that has a choice.
//
// Note [Selection table]
// kAuto picks by collective, family (shared memory when every rank is on one host, else
// TCP), world size and bytes: the first row of kTable that fits is the choice, with its
// arity when it is a tree (an explicit "tree" takes the caller's arity instead:
// CollectiveConfig.tree_arity). A row's threshold is a field of SelectConfig, so a group may
// move it (CollectiveConfig's tree_threshold_bytes and hd_threshold_bytes); the values are
// the defaults there. Each row says where it came from. The thresholds were measured on 2-8
// ranks only: where the row says "not measured" it keeps the choice the code made before the
// table, and the trees of other arities (Note [Trees] in tree.h), which should win at many
// ranks, are in no row yet: `meshcoll-bench --op all_reduce,broadcast,reduce --algo all`
// prints every algorithm side by side per size, the measurement that moves a row. A row
// added here is seen by CollectiveConfig.selection_table() and the bench.
#include "cpu/algo/collectives.h"
#include "cpu/algo/tree.h"

namespace meshcoll::algo {

namespace {

struct Rule {
  Selects coll;
  bool shm;
  int max_ranks;                      // at or below this many ranks; 0: any
  size_t SelectConfig::*max_bytes;    // at or below this threshold; nullptr: any size
  const char* threshold;              // its name, for the table's readers
  bool pow2_only;                     // only on power-of-two worlds
  Choice choice;
  const char* source;
};

constexpr const char* kLoopback =
    "bench/python/bench_algorithms.py, loopback TCP, 2-8 ranks (docs/performance.md, "
    "2026-11-26 5abf951: all_reduce thresholds over TCP)";
constexpr const char* kShmAllReduce =
    "compare_cpu.py and bench_algorithms.py, 2-8 ranks on one host: shared memory beat every "
    "TCP algorithm at every size (docs/performance.md, 2026-11-26 526dae3)";
constexpr const char* kNotMeasured =
    "not measured: the choice the code made before the table (to measure with meshcoll-bench "
    "--algo all at 16-64 ranks)";
constexpr const char* kOnly = "the family's only algorithm";

const Rule kTable[] = {
    // all_reduce
    {Selects::kAllReduce, true, 0, nullptr, "", false, {Algorithm::kShm, 0}, kShmAllReduce},
    {Selects::kAllReduce, false, 8, &SelectConfig::direct_threshold_bytes,
     "direct_threshold_bytes", false, {Algorithm::kDirect, 0}, kLoopback},
    {Selects::kAllReduce, false, 0, &SelectConfig::tree_threshold_bytes, "tree_threshold_bytes",
     false, {Algorithm::kTree, kBinomial}, kLoopback},
    {Selects::kAllReduce, false, 0, &SelectConfig::hd_threshold_bytes, "hd_threshold_bytes",
     true, {Algorithm::kHalvingDoubling, 0}, kLoopback},
    {Selects::kAllReduce, false, 0, nullptr, "", false, {Algorithm::kRing, 0}, kLoopback},
    // broadcast: shared memory flat (every rank copies from the root's area); over TCP a
    // binomial tree for small vectors and on two ranks, the pipelined chain above.
    {Selects::kBroadcast, true, 0, nullptr, "", false, {Algorithm::kDirect, 0}, kNotMeasured},
    {Selects::kBroadcast, false, 2, nullptr, "", false, {Algorithm::kTree, kBinomial},
     kNotMeasured},
    {Selects::kBroadcast, false, 0, &SelectConfig::broadcast_tree_bytes, "broadcast_tree_bytes",
     false, {Algorithm::kTree, kBinomial}, kNotMeasured},
    {Selects::kBroadcast, false, 0, nullptr, "", false, {Algorithm::kRing, 0}, kNotMeasured},
    // reduce: shared memory flat (the root folds every rank's values); over TCP binomial.
    {Selects::kReduce, true, 0, nullptr, "", false, {Algorithm::kDirect, 0}, kNotMeasured},
    {Selects::kReduce, false, 0, nullptr, "", false, {Algorithm::kTree, kBinomial}, kNotMeasured},
    // all_gather and reduce_scatter: one algorithm per family (dispatch.cc runs it), listed
    // so that the table shows every collective's choice.
    {Selects::kAllGather, true, 0, nullptr, "", false, {Algorithm::kShm, 0}, kOnly},
    {Selects::kAllGather, false, 0, nullptr, "", false, {Algorithm::kRing, 0}, kOnly},
    {Selects::kReduceScatter, true, 0, nullptr, "", false, {Algorithm::kShm, 0}, kOnly},
    {Selects::kReduceScatter, false, 0, nullptr, "", false, {Algorithm::kRing, 0}, kOnly},
};

bool fits(const Rule& r, Selects c, bool shm, size_t nbytes, int n, const SelectConfig& cfg) {
  return r.coll == c && r.shm == shm && (r.max_ranks == 0 || n <= r.max_ranks) &&
         (r.max_bytes == nullptr || nbytes <= cfg.*r.max_bytes) &&
         (!r.pow2_only || (n & (n - 1)) == 0);
}

}  // namespace

const char* selects_name(Selects c) {
  switch (c) {
    case Selects::kAllReduce: return "all_reduce";
    case Selects::kReduce: return "reduce";
    case Selects::kBroadcast: return "broadcast";
    case Selects::kAllGather: return "all_gather";
    case Selects::kReduceScatter: return "reduce_scatter";
  }
  return "unknown";
}

Choice select_algorithm(Selects c, bool shm, size_t nbytes, int world_size,
                        const SelectConfig& cfg) {
  for (const Rule& r : kTable)
    if (fits(r, c, shm, nbytes, world_size, cfg)) return r.choice;
  return {};  // unreachable: each (collective, family) ends with a row for any size
}

Algorithm select_all_reduce(size_t nbytes, int world_size, const SelectConfig& cfg) {
  return select_algorithm(Selects::kAllReduce, false, nbytes, world_size, cfg).algorithm;
}

std::vector<SelectRow> selection_table() {
  std::vector<SelectRow> rows;
  for (const Rule& r : kTable)
    rows.push_back({r.coll, r.shm, r.max_ranks, r.threshold, r.pow2_only, r.choice, r.source});
  return rows;
}

bool algorithm_allowed(Selects c, Algorithm a) {
  switch (c) {
    case Selects::kAllReduce: return true;
    case Selects::kReduce:
      return a == Algorithm::kAuto || a == Algorithm::kTree || a == Algorithm::kDirect;
    case Selects::kBroadcast:
      return a == Algorithm::kAuto || a == Algorithm::kTree || a == Algorithm::kDirect ||
             a == Algorithm::kRing;
    default: return a == Algorithm::kAuto;
  }
}

}  // namespace meshcoll::algo
