#include "cpu/hierarchy.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <numeric>

#include "common/error.h"
#include "common/interrupt.h"
#include "reduce/kernels.h"

namespace meshcoll::cpu {

using comm::ArrayView;
using comm::CallOptions;

std::shared_ptr<const Hierarchy> Hierarchy::make(std::shared_ptr<comm::Backend> local,
                                                 std::shared_ptr<comm::Backend> leaders,
                                                 std::vector<int> host, int rank) {
  const char* what = "set_hierarchy";
  const int n = static_cast<int>(host.size());
  if (!local) throw InvalidArgument(str_cat(what, ": local is None"));
  if (rank < 0 || rank >= n)
    throw InvalidArgument(str_cat(what, ": rank ", rank, " is out of range for ", n, " hosts"));
  auto h = std::make_shared<Hierarchy>();
  int hosts = 0;
  for (int g = 0; g < n; ++g) {
    if (host[g] < 0 || host[g] > hosts)
      throw InvalidArgument(str_cat(what, ": host ", host[g], " of group rank ", g,
                                    " is not numbered in order of the hosts' first ranks"));
    if (host[g] == hosts) ++hosts;
  }
  h->host_size.assign(hosts, 0);
  h->local_rank.resize(n);
  for (int g = 0; g < n; ++g) h->local_rank[g] = static_cast<int>(h->host_size[host[g]]++);
  h->block_offset.assign(hosts, 0);
  for (int k = 1; k < hosts; ++k) h->block_offset[k] = h->block_offset[k - 1] + h->host_size[k - 1];
  h->by_host.resize(n);
  std::iota(h->by_host.begin(), h->by_host.end(), 0);
  std::stable_sort(h->by_host.begin(), h->by_host.end(),
                   [&](int a, int b) { return host[a] < host[b]; });
  for (int i = 0; i < n; ++i) h->in_place = h->in_place && h->by_host[i] == i;

  const int mine = host[rank];
  if (local->size() != static_cast<int>(h->host_size[mine]) || local->rank() != h->local_rank[rank])
    throw InvalidArgument(str_cat(what, ": local is rank ", local->rank(), " of ", local->size(),
                                  " but group rank ", rank, " is rank ", h->local_rank[rank],
                                  " of the ", h->host_size[mine], " ranks of its host"));
  const bool leader = h->local_rank[rank] == 0;
  if (leader != static_cast<bool>(leaders))
    throw InvalidArgument(str_cat(what, ": group rank ", rank, (leader ? " leads" : " does not lead"),
                                  " its host but leaders is ", (leaders ? "a group" : "None")));
  if (leaders && (leaders->size() != hosts || leaders->rank() != mine))
    throw InvalidArgument(str_cat(what, ": leaders is rank ", leaders->rank(), " of ",
                                  leaders->size(), " but this rank leads host ", mine, " of ", hosts));
  h->local = std::move(local);
  h->leaders = std::move(leaders);
  h->host = std::move(host);
  return h;
}

namespace {

// The steps of one composed call: each gets what is left of the parent operation's deadline
// (at least 1 ms, so a step that starts late still fails with its own timeout rather than
// running unbounded) and carries the parent's call (Note [Steps carry their call] in
// comm/backend.cc); the name of the running one is kept for a timeout's message.
class Steps {
 public:
  explicit Steps(const Comm& parent) : parent_(parent) {}
  // The options of step `name` ("local all_reduce"); `tuning`: the parent call's.
  CallOptions operator()(const char* name, const comm::AllReduceTuning& tuning = {}) {
    at_ = name;
    CallOptions o;
    const int left = parent_.deadline().poll_ms();
    o.timeout = Millis(left < 0 ? INT_MAX : std::max(left, 1));
    o.tuning = tuning;
    o.within = &parent_.current();
    return o;
  }
  const char* at() const { return at_; }

 private:
  const Comm& parent_;
  const char* at_ = "first";
};

// Runs `body` (the steps); on an error, fails both children before rethrowing it (the
// parent's execute then fails the parent). The failed step's group told its own ranks; the
// ranks waiting in the other child learn it from this at once, instead of at their timeout
// (Note [Hierarchy], Failures). A child that already failed runs the extra failure as a
// no-op. While the steps wait they watch the parent's own links (Note [Steps watch their
// call's group] in common/interrupt.h); a failure found there is the parent's, raised as is.
template <class Body>
void run_steps(Comm& parent, const Hierarchy& h, const char* what, Body&& body) {
  Steps steps(parent);
  std::exception_ptr from_group;  // a failure found on the parent's own links
  auto on_parent = [&](void (Comm::*fn)()) {
    try {
      (parent.*fn)();
    } catch (...) {
      from_group = std::current_exception();
      throw;
    }
  };
  try {
    on_parent(&Comm::set_composed);  // a stray frame of another call may be there already
    WaitWatch watch([&] { on_parent(&Comm::watch); });
    body(steps);
  } catch (...) {
    std::exception_ptr error = from_group ? from_group : std::current_exception();
    const int me = parent.global_rank(parent.rank());
    // A disagreement stays a MismatchError on the ranks of the other child, and a timeout a
    // TimeoutError: each rank it reaches then joins the parent's census, taken over the whole
    // group (the children take none: Comm::set_serves_steps), which names the rank that never
    // came whichever host it is on. A death reaches them as the PeerError that names it.
    std::exception_ptr like;
    try {
      std::rethrow_exception(error);
    } catch (const TimeoutError&) {
      // Note [Blame in a composed call's timeout]
      // A step waits for the ranks of its host or for the other hosts' leaders, which may
      // themselves be waiting for the rank that never came: the step's own message ("rank 0
      // had not arrived", "waiting for: receive from rank 2") names a healthy leader as often
      // as not, and it would come first, before the census that names the late rank. So a
      // step's timeout says only which step timed out and leaves blame to the parent's
      // census, which follows it. A peer's timeout relayed on the parent's
      // links (from_group) was written the same way. The step's own message is kept for
      // the one case where the census names nobody (Comm::execute): a rank that came late
      // to a step the others had already left reports from the group's next call, and the
      // step's wait is then all that names it.
      if (!from_group) {
        parent.set_step_timeout(message_of(error));
        error = same_type(error, str_cat("rank ", me, ": hierarchical ", what, " timed out after ",
                                         parent.deadline().timeout().count(), " ms in its ",
                                         steps.at(), " step (a step waits on ranks that may "
                                         "wait in turn: the group's census says who never "
                                         "came)"));
      }
      like = error;
    } catch (const MismatchError&) {
      // The steps' descriptions fingerprint the whole call (Note [Steps carry their call] in
      // comm/backend.cc): steps that look alike yet differ served different calls.
      if (!from_group)
        error = same_type(error, str_cat(message_of(error), ". The steps of a hierarchical call "
                                         "carry the whole call, so the ranks named made different "
                                         "calls (another root, count, dtype, op, shape or "
                                         "coalesced block) or were at different calls of the "
                                         "group, even where their steps look alike"));
      like = error;
    } catch (...) {
    }
    const std::string why = str_cat("rank ", me, " of a group of ", parent.size(),
                                    ": hierarchical ", what, " failed: ", message_of(error));
    for (comm::Backend* child : {h.local.get(), h.leaders.get()}) {
      if (!child) continue;
      try {
        child->fail(why, like);
      } catch (const std::exception&) {  // the child was shut down: nobody waits there
      }
    }
    std::rethrow_exception(error);
  }
}

// The options of one level's step: the call's, running that level's algorithm.
comm::AllReduceTuning level(const comm::AllReduceTuning& call, uint8_t algorithm) {
  comm::AllReduceTuning t = call;
  t.algorithm = algorithm;
  t.local_algorithm = t.global_algorithm = 0;
  return t;
}

}  // namespace

// local all_reduce (shm) -> leaders all_reduce (TCP) -> local broadcast from the leader.
// After the first step each leader holds its host's reduction; after the second, the whole
// group's; the broadcast gives every rank of a host the leader's bytes, so all ranks end
// bitwise equal. avg reduces with sum and divides at the end, as a flat avg does.
void hier_all_reduce(Comm& parent, const Hierarchy& h, const ArrayView& in,
                     const ArrayView& out, RedOp op, const comm::AllReduceTuning& tuning) {
  run_steps(parent, h, "all_reduce", [&](Steps& step) {
    const RedOp red = op == RedOp::kAvg ? RedOp::kSum : op;
    const auto local = level(tuning, tuning.local_algorithm);
    const auto global = level(tuning, tuning.global_algorithm);
    h.local->all_reduce(in, out, red, step("local all_reduce", local));
    if (h.leaders) h.leaders->all_reduce(out, out, red, step("leaders' all_reduce", global));
    h.local->broadcast(out, 0, step("local broadcast"));
    if (op == RedOp::kAvg) reduce::divide_by(out.dtype, out.data, out.count, parent.size());
  });
}

// On the root's host the root's bytes reach its leader first (local broadcast from the root),
// then every leader (leaders broadcast from the root's host), then every other host's ranks
// (local broadcast from their leader).
void hier_broadcast(cpu::Comm& parent, const Hierarchy& h, const ArrayView& buf, int root,
                    const comm::AllReduceTuning& tuning) {
  run_steps(parent, h, "broadcast", [&](Steps& step) {
    const int root_host = h.host[root];
    const auto local = level(tuning, tuning.local_algorithm);
    const auto global = level(tuning, tuning.global_algorithm);
    if (h.host[parent.rank()] == root_host) {
      h.local->broadcast(buf, h.local_rank[root], step("local broadcast from the root", local));
      if (h.leaders) h.leaders->broadcast(buf, root_host, step("leaders' broadcast", global));
    } else {
      if (h.leaders) h.leaders->broadcast(buf, root_host, step("leaders' broadcast", global));
      h.local->broadcast(buf, 0, step("local broadcast", local));
    }
  });
}

// local gather to the leader -> leaders all_gather_v of the host blocks -> local broadcast of
// the result. Leaders lay the blocks out host by host (hosts may differ in size, but the sizes
// are known: no round to exchange them). When each host's ranks are contiguous that is group
// rank order, so the gather and the all_gather write straight into `out`; otherwise they go
// to scratch memory and the leader puts the rows in group-rank order.
void hier_all_gather(Comm& parent, const Hierarchy& h, const ArrayView& in,
                     const ArrayView& out) {
  run_steps(parent, h, "all_gather", [&](Steps& step) {
    const size_t n = in.count, row = in.bytes();
    const int me = parent.rank(), mine = h.host[me];
    ArrayView rows = out;  // the host-block layout
    rows.owner = nullptr;
    if (!h.in_place) rows.data = parent.scratch(0, out.bytes());
    ArrayView block = rows;  // this host's block; written on the leader only
    block.count = h.leaders ? h.host_size[mine] * n : 0;
    block.data = static_cast<uint8_t*>(rows.data) + h.block_offset[mine] * row;
    block.row_hash = in.shape_hash;  // leaders compare the blocks' shape (all_gather_v's rows)
    h.local->gather(in, block, std::vector<size_t>(h.host_size[mine], n), 0,
                    step("local gather"));
    if (h.leaders) {
      std::vector<size_t> counts(h.host_size.size());
      for (size_t k = 0; k < counts.size(); ++k) counts[k] = h.host_size[k] * n;
      h.leaders->all_gather(block, rows, counts, true, step("leaders' all_gather"));
      if (!h.in_place && row)
        for (size_t i = 0; i < h.by_host.size(); ++i)
          std::memcpy(static_cast<uint8_t*>(out.data) + h.by_host[i] * row,
                      static_cast<uint8_t*>(rows.data) + i * row, row);
    }
    h.local->broadcast(out, 0, step("local broadcast"));
  });
}

}  // namespace meshcoll::cpu
