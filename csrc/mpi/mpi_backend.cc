#include "mpi/mpi_backend.h"

#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <optional>
#include <thread>

#include "common/check.h"
#include "common/error.h"
#include "common/interrupt.h"
#include "mpi/mpi_api.h"
#include "reduce/kernels.h"

namespace meshcoll::mpi {

using comm::ArrayView;
using comm::WorkPtr;

struct MpiBackend::Finish {
  DType dtype = DType::kUint8;
  void* avg = nullptr;  // divide these elements by the group size once MPI is done (avg)
  size_t avg_count = 0;
};

namespace {
// MPI counts are ints: larger calls are refused before anything is sent (every rank refuses
// the same call, as the counts are part of what the ranks agree on).
int int_count(size_t n, const char* what) {
  if (n > static_cast<size_t>(INT_MAX))
    throw InvalidArgument(str_cat(what, ": ", n, " elements; MPI takes at most ", INT_MAX,
                                  " per call (its counts are ints): split the call"));
  return static_cast<int>(n);
}

// Per-rank counts and their offsets, as MPI's v-collectives take them.
struct Layout {
  std::vector<int> counts, displs;
};
Layout layout_of(const std::vector<size_t>& counts, const char* what) {
  Layout l;
  size_t at = 0;
  for (size_t n : counts) {
    l.counts.push_back(int_count(n, what));
    l.displs.push_back(int_count(at, what));
    at += n;
  }
  int_count(at, what);
  return l;
}

bool overlap(const ArrayView& a, const ArrayView& b) {
  const auto x = reinterpret_cast<uintptr_t>(a.data), y = reinterpret_cast<uintptr_t>(b.data);
  return a.bytes() && b.bytes() && x < y + b.bytes() && y < x + a.bytes();
}

// MPI takes no input that overlaps the output except its own in-place forms, which place
// blocks otherwise than meshcoll's (Note [Overlapping buffers] in comm/backend.cc): such an
// input is copied first (held in `keep` until the call completes).
const void* unaliased(const ArrayView& in, const ArrayView& out,
                      std::vector<std::shared_ptr<void>>& keep) {
  if (!overlap(in, out)) return in.data;
  auto copy = std::shared_ptr<uint8_t>(new uint8_t[in.bytes()], std::default_delete<uint8_t[]>());
  std::memcpy(copy.get(), in.data, in.bytes());
  keep.push_back(copy);
  return copy.get();
}

int code(DType t) { return static_cast<int>(t); }
int code(RedOp op) { return static_cast<int>(op); }
}  // namespace

// Note [all_reduce over point-to-point]
// Open MPI runs MPI_Iallreduce through libnbc, which builds a schedule at each call and
// advances it a round per MPI_Test: on the 2-core VM about twice its blocking MPI_Allreduce
// (coll/tuned) below 8 KiB, and slower still above (docs/performance.md, 2026-11-28, "the
// flat MPI backend"). A blocking call would have no deadline (MPI cannot cancel it), so a
// synchronous all_reduce runs tuned's own algorithms here instead, as steps of nonblocking
// sends and receives (the shim's isendrecv, on the communicator's private duplicate, so
// they never match the user's point-to-point) under the same progress loop and deadline as
// any call, reducing with meshcoll's kernels between steps:
//  - for blocks (the array / N) below kRingBlockBytes, recursive doubling: log2(N)
//    exchanges of the whole array (the ranks past the largest power of two first hand
//    theirs to a partner, and get the result back from it at the end);
//  - from there, a ring: a reduce-scatter then an all_gather of N blocks, 2 (N - 1) steps,
//    each moving one block.
// Every rank ends with the same bits: an exchange combines the lower rank's partial first on
// both sides, and the ring reduces each block once, then copies it. The tag is the call's
// sequence number (mod 32768, the least MPI_TAG_UB MPI allows), so the steps of one call
// never match another's. Asynchronous all_reduces keep MPI_Iallreduce: a schedule advances
// only while its own Work is tested, so two Works waited for in different orders on two
// ranks would wait on each other, where libnbc advances every schedule at any MPI call.
class Schedule {
 public:
  // The ring from blocks (count / N) of this size: below, its 2 (N - 1) steps cost more than
  // recursive doubling's larger transfers (Open MPI's shared-memory transport copies
  // messages above 4 KiB after a handshake, and a step is bandwidth-bound from about 32 KiB).
  static constexpr size_t kRingBlockBytes = 64 << 10;

  // All_reduce of `count` elements of `buf`, in place, over the communicator `comm` (the
  // call's sequence number `seq` tags its messages). Receives into set_scratch()'s memory,
  // scratch_bytes() of it.
  Schedule(int rank, int size, void* buf, size_t count, DType dtype, RedOp op, uint64_t seq,
           void* comm)
      : rank_(rank), size_(size),
        ring_(count / size * dtype_size(dtype) >= kRingBlockBytes),
        buf_(static_cast<uint8_t*>(buf)), count_(count), elem_(dtype_size(dtype)),
        dtype_(dtype), fn_(reduce::lookup(dtype, op)), tag_(static_cast<int>(seq & 0x7fff)),
        comm_(comm) {
    if (ring_) {
      steps_ = 2 * (size - 1);
      return;
    }
    while (pof2_ * 2 <= size) pof2_ *= 2;
    rem_ = size - pof2_;
    me_ = rank < 2 * rem_ ? (rank % 2 ? rank / 2 : -1) : rank - rem_;
    int log2 = 0;
    while ((1 << log2) < pof2_) ++log2;
    steps_ = (rank < 2 * rem_ ? 2 : 0) + (me_ >= 0 ? log2 : 0);
  }
  size_t scratch_bytes() const { return (ring_ ? count_ / size_ + 1 : count_) * elem_; }
  void set_scratch(std::shared_ptr<uint8_t> scratch) { scratch_ = std::move(scratch); }
  const std::shared_ptr<uint8_t>& scratch() const { return scratch_; }

  // Starts the next step (under MpiLock): 0 or MPI's error.
  int start(void** req) {
    step_ = ring_ ? ring_step(next_) : doubling_step(next_);
    uint8_t* into = step_.reduce ? scratch_.get() : buf_ + step_.recv_at * elem_;
    return api().isendrecv(buf_ + step_.send_at * elem_, static_cast<int>(step_.send_count),
                           step_.to, into, static_cast<int>(step_.recv_count), step_.from,
                           code(dtype_), tag_, comm_, req);
  }
  // The step started last completed: its reduction. Whether another step follows.
  bool advance() {
    if (step_.reduce) {
      uint8_t* mine = buf_ + step_.recv_at * elem_;
      if (step_.peer_first) {  // the lower rank's partial on the left, on both sides
        fn_(scratch_.get(), mine, step_.recv_count);
        std::memcpy(mine, scratch_.get(), step_.recv_count * elem_);
      } else {
        fn_(mine, scratch_.get(), step_.recv_count);
      }
    }
    return ++next_ < steps_;
  }

 private:
  struct Step {
    int to = -1, from = -1;              // peers (-1: none)
    size_t send_at = 0, send_count = 0;  // elements of the buffer
    // Elements received: into scratch to reduce into the buffer at recv_at (`reduce`), or
    // straight into the buffer at recv_at.
    size_t recv_at = 0, recv_count = 0;
    bool reduce = false;
    bool peer_first = false;  // reduce: the peer's partial is the left operand
  };

  // Recursive doubling among the largest power of two of ranks (pof2_); each of the first
  // rem_ odd ranks first takes its even neighbour's array, and hands it the result last.
  Step doubling_step(int i) const {
    const size_t n = count_;
    if (rank_ < 2 * rem_) {
      const bool odd = rank_ % 2;
      if (i == 0) return odd ? Step{-1, rank_ - 1, 0, 0, 0, n, true, true}
                             : Step{rank_ + 1, -1, 0, n, 0, 0, false, false};
      if (i == steps_ - 1) return odd ? Step{rank_ - 1, -1, 0, n, 0, 0, false, false}
                                      : Step{-1, rank_ + 1, 0, 0, 0, n, false, false};
      --i;
    }
    const int other = me_ ^ (1 << i), peer = other < rem_ ? other * 2 + 1 : other + rem_;
    return Step{peer, peer, 0, n, 0, n, true, other < me_};
  }

  // A ring: N - 1 steps of reduce-scatter (rank r ends with block r + 1 whole), then N - 1 of
  // all_gather. Block b: count / N elements, one more for the first count % N.
  Step ring_step(int i) const {
    auto block = [&](int b) { return ((b % size_) + size_) % size_; };
    auto at = [&](int b) {
      return count_ / size_ * b + std::min<size_t>(b, count_ % size_);
    };
    const bool gather = i >= size_ - 1;
    if (gather) i -= size_ - 1;
    const int sb = block(rank_ - i + gather), rb = block(rank_ - i - 1 + gather);
    return Step{block(rank_ + 1), block(rank_ - 1), at(sb), at(sb + 1) - at(sb), at(rb),
                at(rb + 1) - at(rb), !gather, false};
  }

  const int rank_, size_;
  const bool ring_;
  uint8_t* const buf_;
  const size_t count_, elem_;
  const DType dtype_;
  const reduce::ReduceFn fn_;
  const int tag_;
  void* const comm_;
  int pof2_ = 1, rem_ = 0, me_ = -1;  // recursive doubling's
  int steps_ = 0, next_ = 0;
  Step step_;  // the one started last
  std::shared_ptr<uint8_t> scratch_;
};

// One MPI operation: completed by MPI_Test in wait() (Note [MPI failure model]).
class MpiWork final : public comm::Work {
 public:
  MpiWork(std::shared_ptr<MpiBackend> b, void* req, const char* what, const OpDesc& desc,
          uint64_t seq, uint64_t p2p, int peer, MpiBackend::Finish finish, Millis timeout,
          std::vector<std::shared_ptr<void>> keep, std::optional<Schedule> schedule)
      : b_(std::move(b)), req_(req), what_(what), desc_(desc), seq_(seq), p2p_(p2p),
        peer_(peer), finish_(finish), start_(Clock::now()), deadline_(timeout, start_),
        timeout_(timeout), keep_(std::move(keep)), schedule_(std::move(schedule)) {
    b_->ledger().pending().issued();
  }

  void wait(Millis timeout, bool /*has_stream*/, comm::Stream /*stream*/) override {
    std::unique_lock<std::mutex> lock(mu_);
    const auto since = Clock::now();
    const Deadline mine(timeout, since);  // the wait's own, if shorter than the operation's
    for (int spins = 0; !done_; ++spins) {
      // While spinning, the clock and the hook only every 64th test: the test that finds the
      // call complete comes sooner (a test takes about a tenth of a microsecond).
      const bool checks = spins % 64 == 0 || spins >= 2000;
      step(checks);
      if (done_) break;
      if (!checks) continue;
      if (mine.expired())
        throw TimeoutError(str_cat(b_->where(), ": ", what_, " did not complete within the wait's ",
                                   timeout.count(), " ms; it goes on (wait again)"));
      try {
        check_interrupt(b_->names()(b_->rank()), since);
      } catch (const Interrupted&) {
        b_->fail_group(std::current_exception(), true);
        abandon();
        end(std::current_exception());
        break;
      }
      // Spin briefly (a small call completes within microseconds), then yield. MPI's
      // nonblocking collectives often progress only inside MPI calls (Open MPI's libnbc), so
      // a long call is tested at once whenever this thread runs again; only a wait that lasts
      // past a second (a late peer) sleeps between tests.
      if (spins < 2000) continue;
      if (Clock::now() - since < std::chrono::seconds(1)) {
        sched_yield();
      } else {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        lock.lock();
      }
    }
    if (error_) {
      b_->failure_.mark_reported();
      std::rethrow_exception(error_);
    }
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    step();
    return done_;
  }

  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> lock(mu_);
    step();
    return error_;
  }

 private:
  // One MPI_Test, and what follows from it (under mu_); `checks`: and, if the call is not
  // complete, whether the group failed or the deadline passed.
  void step(bool checks = true) {
    if (done_) return;
    int complete = 0, rc;
    {
      MpiLock mpi;
      rc = api().test(req_, &complete);
    }
    // A schedule's next step starts as soon as one completed (Note [all_reduce over
    // point-to-point]); its reduction runs outside the lock.
    while (!rc && complete && schedule_ && schedule_->advance()) {
      MpiLock mpi;
      rc = schedule_->start(&req_);
      if (!rc) rc = api().test(req_, &complete);
    }
    if (rc) {  // the request is gone: MPI is done with the buffers
      b_->inside_mpi_.fetch_sub(1);
      inside_mpi().fetch_sub(1);
      auto e = mismatch_or(std::make_exception_ptr(Error(str_cat(
          b_->where(), ": ", describe(), " failed inside MPI: ", api().error_text(rc),
          "; the group failed"))));
      b_->fail_group(e, true);
      end(e);
    } else if (complete) {
      b_->inside_mpi_.fetch_sub(1);
      inside_mpi().fetch_sub(1);
      if (finish_.avg)
        reduce::divide_by(finish_.dtype, finish_.avg, finish_.avg_count,
                          static_cast<size_t>(b_->size()));
      b_->ledger().add_totals(desc_, static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start_).count()));
      end(nullptr);
    } else if (!checks) {
    } else if (b_->failed()) {
      abandon();
      end(b_->failure_for(str_cat(b_->where(), ": ", describe(), ": ")));
    } else if (deadline_.expired()) {
      const std::string who =
          seq_ && b_->agreement_ ? b_->agreement_->census(seq_) : std::string();
      auto e = std::make_exception_ptr(TimeoutError(str_cat(
          b_->where(), ": ", describe(), " did not complete within ", timeout_.count(), " ms",
          who,
          who.empty() ? (p2p_ ? str_cat(". Global rank ", b_->names()(peer_),
                                        " may have died or not posted the matching call")
                              : std::string(". A peer may have died, or not called the same "
                                            "collectives in the same order"))
                      : "",
          ". MPI cannot cancel it: the group failed, and the job ends by MPI_Abort when the "
          "group is destroyed or the process exits (README, MPI)")));
      b_->fail_group(e, true);
      abandon();
      end(e);
    }
  }

  // The group failed with this operation inside MPI (Note [MPI failure model]).
  void abandon() {
    std::lock_guard<std::mutex> lock(b_->mu_);
    for (auto& k : keep_) b_->abandoned_.push_back(std::move(k));
    if (schedule_) b_->abandoned_.push_back(schedule_->scratch());
  }

  // An MPI error of a call the ranks disagreed on is that disagreement: the check says so.
  std::exception_ptr mismatch_or(std::exception_ptr e) {
    if (!seq_ || !b_->agreement_) return e;
    try {
      b_->agreement_->await(seq_, Millis(2000));
    } catch (const MismatchError&) {
      return std::current_exception();
    } catch (...) {
    }
    return e;
  }

  void end(std::exception_ptr e) {
    if (auto intruded = b_->ledger().pending().ended(); intruded && !e) e = intruded;
    const auto state = e ? comm::CallState::kFailed : comm::CallState::kDone;
    if (seq_) b_->ledger().set_state(seq_, state, "mpi");
    if (p2p_) b_->ledger().p2p_state(p2p_, state);
    error_ = e;
    keep_.clear();
    done_ = true;
  }

  std::string describe() const {
    return seq_ ? str_cat(describe_op(desc_), " [seq ", seq_, "]")
                : str_cat(what_, " ", describe_op(desc_), " with global rank ", b_->names()(peer_));
  }

  std::shared_ptr<MpiBackend> b_;
  void* req_;
  const char* what_;
  OpDesc desc_;
  uint64_t seq_, p2p_;
  int peer_;
  MpiBackend::Finish finish_;
  Clock::time_point start_;
  Deadline deadline_;
  Millis timeout_;
  std::vector<std::shared_ptr<void>> keep_;
  std::optional<Schedule> schedule_;  // none: one MPI call
  std::mutex mu_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A composed call's Work (Note [Hierarchy on MPI]): the composer's, and this group's record
// of the call closed once it ended.
class ComposedWork final : public comm::Work {
 public:
  ComposedWork(std::shared_ptr<MpiBackend> b, WorkPtr inner, const OpDesc& desc, uint64_t seq,
               Clock::time_point start)
      : b_(std::move(b)), inner_(std::move(inner)), desc_(desc), seq_(seq), start_(start) {
    b_->ledger().pending().issued();
  }

  void wait(Millis timeout, bool has_stream, comm::Stream stream) override {
    try {
      inner_->wait(timeout, has_stream, stream);
    } catch (const TimeoutError&) {
      if (!inner_->is_completed()) throw;  // the wait's own timeout: the call goes on
      end(std::current_exception());
      throw;
    } catch (...) {
      end(std::current_exception());
      throw;
    }
    if (auto e = end(nullptr)) std::rethrow_exception(e);
  }

  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    end(inner_->exception());
    return true;
  }

  std::exception_ptr exception() override {
    if (auto e = inner_->exception()) return e;
    std::lock_guard<std::mutex> lock(mu_);
    return error_;  // an intrusion's (Note [One issuing thread]), once it ended
  }

 private:
  // Once: closes the record; returns the error the Work ends with (an intrusion's, if any).
  std::exception_ptr end(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return error_;
    ended_ = true;
    if (auto intruded = b_->ledger().pending().ended(); intruded && !e) e = intruded;
    b_->end_composed(seq_, desc_, start_, e);
    error_ = e;
    return e;
  }

  std::shared_ptr<MpiBackend> b_;
  WorkPtr inner_;
  OpDesc desc_;
  uint64_t seq_;
  Clock::time_point start_;
  std::mutex mu_;
  bool ended_ = false;
  std::exception_ptr error_;
};

MpiBackend::MpiBackend(void* comm, int rank, int size, Millis timeout)
    : Backend(rank, size, false), comm_(comm), timeout_(timeout) {}

MpiBackend::~MpiBackend() {
  if (agreement_) agreement_->stop(true);  // dropped without destroy(): nothing to compare
}

std::shared_ptr<MpiBackend> MpiBackend::world(Millis timeout) {
  MpiApi& a = api();
  void* comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mpi_lock());
    if (int rc = a.comm_world(&comm))
      throw Error(str_cat("MPI rank ", a.rank, ": MPI_Comm_dup(MPI_COMM_WORLD) failed: ",
                          a.error_text(rc)));
  }
  return std::make_shared<MpiBackend>(comm, a.rank, a.size, timeout);
}

// MPI_Comm_split blocks until every rank of the group calls it, with no deadline of its own:
// the Python layer has every rank meet on the store first (under the setup's deadline).
std::shared_ptr<MpiBackend> MpiBackend::split(int color, int key, Millis timeout) {
  void* child = nullptr;
  int rank = 0, size = 0;
  {
    std::lock_guard<std::mutex> lock(mpi_lock());
    int rc = api().comm_split(comm_, color, key, &child);
    if (!rc && child) rc = api().comm_info(child, &rank, &size);
    if (rc) throw Error(str_cat(where(), ": MPI_Comm_split failed: ", api().error_text(rc)));
  }
  // MPI orders the members by (key, parent rank), as ProcessGroup.split does.
  return child ? std::make_shared<MpiBackend>(child, rank, size, timeout) : nullptr;
}

std::string MpiBackend::transport() const { return str_cat("mpi (", api().version, ")"); }

std::string MpiBackend::where() const { return str_cat(who(), " (MPI)"); }

void MpiBackend::set_agreement(std::shared_ptr<comm::Backend> channel,
                               comm::Agreement::Mode mode) {
  std::weak_ptr<MpiBackend> self = shared_from_this();
  agreement_ = comm::Agreement::create(
      std::move(channel), mode, timeout_, ledger(),
      [self](std::exception_ptr error, uint64_t /*seq*/) {
        if (auto b = self.lock()) b->fail_group(std::move(error), false);
      },
      names());
}

void MpiBackend::set_hierarchy(std::shared_ptr<comm::Backend> composer) {
  MC_ARG_CHECK(composer && composer->size() == size() && composer->rank() == rank(),
               "set_hierarchy: the composer must be a group of the same ranks");
  composer_ = std::move(composer);
}

template <class MakeCall>
WorkPtr MpiBackend::composed(Call& c, MakeCall&& issue) {
  open(c);
  const auto start = Clock::now();
  WorkPtr w;
  try {
    w = issue(c.opts);  // the composer holds the arrays of an async call itself
  } catch (...) {
    end_composed(c.seq, c.desc, start, std::current_exception());
    throw;
  }
  if (w) return std::make_shared<ComposedWork>(shared_from_this(), std::move(w), c.desc, c.seq,
                                               start);
  end_composed(c.seq, c.desc, start, nullptr);
  return nullptr;
}

void MpiBackend::end_composed(uint64_t seq, const OpDesc& desc, Clock::time_point start,
                              std::exception_ptr error) {
  ledger().set_state(seq, error ? comm::CallState::kFailed : comm::CallState::kDone,
                     "hierarchy");
  if (error) {
    fail_group(error, false);  // the composer told the peers
    failure_.mark_reported();
    return;
  }
  ledger().add_totals(desc, static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()));
}

void MpiBackend::check_reduction(DType dt, RedOp op) const {
  reduce::lookup(dt, op);  // TypeMismatch naming both: the pairs meshcoll's kernels lack
}

void MpiBackend::check_options(const char* what, const comm::CallOptions& o) const {
  if (o.tuning.algorithm != 0)
    throw InvalidArgument(str_cat(what, ": the algorithm is a CPU-backend choice; MPI picks its "
                                  "own (see your MPI's tuning options)"));
}

void MpiBackend::fail_group(std::exception_ptr error, bool relay) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.record(error)) return;
    failed_.store(true, std::memory_order_release);
  }
  if (relay && agreement_) agreement_->relay(message_of(error), error);
}

std::exception_ptr MpiBackend::failure_for(const std::string& context) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.failed()) return nullptr;
  // As on NCCL, later calls raise the failure's own type (Note [Failure types]).
  return failure_.for_call(context + message_of(failure_.error()), true);
}

void MpiBackend::open(Call& c) {
  if (failed()) {
    failure_.mark_reported();
    std::rethrow_exception(failure_for(str_cat(where(), ": ", c.what, ": the group failed: ")));
  }
  if (c.p2p) return;  // point-to-point takes no collective number (Note [Call ledger])
  c.seq = ledger().open_collective(c.desc);
  if (!agreement_) return;
  try {
    agreement_->note(c.seq, c.desc);  // strict: compared here, before MPI is called
  } catch (...) {
    ledger().set_state(c.seq, comm::CallState::kFailed);
    failure_.mark_reported();
    throw;
  }
}

template <class Start>
WorkPtr MpiBackend::run(Call& c, Start&& start, Finish finish, int peer,
                        std::optional<Schedule>&& schedule) {
  void* req = nullptr;
  int rc;
  {
    MpiLock lock;
    rc = start(&req);
  }
  if (rc) {
    auto e = std::make_exception_ptr(Error(str_cat(where(), ": ", c.what, ": MPI refused the "
                                                   "call: ", api().error_text(rc))));
    if (c.seq) ledger().set_state(c.seq, comm::CallState::kFailed);
    fail_group(e, true);
    failure_.mark_reported();
    std::rethrow_exception(e);
  }
  inside_mpi_.fetch_add(1);
  inside_mpi().fetch_add(1);
  const Millis timeout = c.opts.timeout.count() < 0 ? timeout_ : c.opts.timeout;
  auto w = std::make_shared<MpiWork>(shared_from_this(), req, c.what, c.desc, c.seq, c.p2p, peer,
                                     finish, timeout, std::move(c.keep), std::move(schedule));
  if (c.p2p ? c.opts.wait : !c.opts.async) {  // ends here, on every path
    w->wait(Millis(-1), false, nullptr);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Note [MPI failure model]: destroy() waits for what nobody waited for.
  live_.erase(std::remove_if(live_.begin(), live_.end(),
                             [](const std::weak_ptr<MpiWork>& p) { return p.expired(); }),
              live_.end());
  live_.push_back(w);
  return w;
}

WorkPtr MpiBackend::do_all_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op) {
  if (composer_)
    return composed(c, [&](const comm::CallOptions& o) {
      return composer_->all_reduce(in, out, op, o);
    });
  const int n = int_count(in.count, c.what);
  open(c);
  Finish f{in.dtype, op == RedOp::kAvg ? out.data : nullptr, out.count};
  if (c.opts.async || size() == 1)
    return run(c, [&](void** req) {
      return api().iallreduce(in.data, out.data, n, code(in.dtype), code(op), comm_, req);
    }, f);
  // Note [all_reduce over point-to-point]: in out's place.
  if (in.data != out.data) std::memcpy(out.data, in.data, in.bytes());
  std::optional<Schedule> s(std::in_place, rank(), size(), out.data, out.count, in.dtype, op,
                            c.seq, comm_);
  const size_t bytes = s->scratch_bytes();
  if (scratch_bytes_ < bytes) {  // kept for later calls: a large one faults no new pages
    scratch_.reset(new uint8_t[bytes], std::default_delete<uint8_t[]>());
    scratch_bytes_ = bytes;
  }
  s->set_scratch(scratch_);  // the Work's: MPI may still write into it, should the call fail
  return run(c, [&](void** req) { return s->start(req); }, f, -1, std::move(s));
}

WorkPtr MpiBackend::do_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op,
                              int root) {
  const int n = int_count(in.count, c.what);
  open(c);
  const bool mine = rank() == root;
  Finish f{in.dtype, op == RedOp::kAvg && mine ? out.data : nullptr, out.count};
  return run(c, [&](void** req) {
    return api().ireduce(in.data, out.data, n, code(in.dtype), code(op), root, comm_, req);
  }, f);
}

WorkPtr MpiBackend::do_broadcast(Call& c, const ArrayView& buf, int root) {
  if (composer_)
    return composed(c, [&](const comm::CallOptions& o) {
      return composer_->broadcast(buf, root, o);
    });
  const int n = int_count(buf.count, c.what);
  open(c);
  return run(c, [&](void** req) {
    return api().ibcast(buf.data, n, code(buf.dtype), root, comm_, req);
  }, Finish{});
}

WorkPtr MpiBackend::do_all_gather(Call& c, const ArrayView& in, const ArrayView& out,
                                  const std::vector<size_t>& counts) {
  // The hierarchy gathers equal blocks only (the _v form runs flat, as on the CPU backend).
  if (composer_ && std::all_of(counts.begin(), counts.end(), [&](size_t n) { return n == in.count; }))
    return composed(c, [&](const comm::CallOptions& o) {
      return composer_->all_gather(in, out, counts, false, o);
    });
  auto l = layout_of(counts, c.what);
  open(c);
  // The in-place form (x is out's block of this rank) is MPI's own.
  const bool in_place = overlap(in, out);
  auto shared = std::make_shared<Layout>(std::move(l));
  c.keep.push_back(shared);  // MPI reads the counts until the call completes
  return run(c, [&](void** req) {
    return api().iallgatherv(in.data, shared->counts[rank()], out.data, shared->counts.data(),
                             shared->displs.data(), code(in.dtype), in_place, comm_, req);
  }, Finish{});
}

WorkPtr MpiBackend::do_reduce_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                                      const std::vector<size_t>& counts, RedOp op) {
  auto l = std::make_shared<Layout>(layout_of(counts, c.what));
  open(c);
  c.keep.push_back(l);
  const void* src = unaliased(in, out, c.keep);
  Finish f{in.dtype, op == RedOp::kAvg ? out.data : nullptr, out.count};
  return run(c, [&](void** req) {
    return api().ireduce_scatter(src, out.data, l->counts.data(), code(in.dtype), code(op), comm_,
                                 req);
  }, f);
}

WorkPtr MpiBackend::do_all_to_all(Call& c, const ArrayView& in, const ArrayView& out,
                                  const std::vector<size_t>& send_counts,
                                  const std::vector<size_t>& recv_counts) {
  auto s = std::make_shared<Layout>(layout_of(send_counts, c.what));
  auto r = std::make_shared<Layout>(layout_of(recv_counts, c.what));
  open(c);
  c.keep.push_back(s);
  c.keep.push_back(r);
  return run(c, [&](void** req) {
    return api().ialltoallv(in.data, s->counts.data(), s->displs.data(), out.data,
                            r->counts.data(), r->displs.data(), code(in.dtype), comm_, req);
  }, Finish{});
}

WorkPtr MpiBackend::do_gather(Call& c, const ArrayView& in, const ArrayView& out,
                              const std::vector<size_t>& counts, int root) {
  auto l = std::make_shared<Layout>(layout_of(counts, c.what));
  open(c);
  c.keep.push_back(l);
  const void* src = rank() == root ? unaliased(in, out, c.keep) : in.data;
  return run(c, [&](void** req) {
    return api().igatherv(src, l->counts[rank()], out.data, l->counts.data(), l->displs.data(),
                          code(in.dtype), root, comm_, req);
  }, Finish{});
}

WorkPtr MpiBackend::do_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                               const std::vector<size_t>& counts, int root) {
  auto l = std::make_shared<Layout>(layout_of(counts, c.what));
  open(c);
  c.keep.push_back(l);
  const void* src = rank() == root ? unaliased(in, out, c.keep) : in.data;
  return run(c, [&](void** req) {
    return api().iscatterv(src, l->counts.data(), l->displs.data(), out.data, l->counts[rank()],
                           code(out.dtype), root, comm_, req);
  }, Finish{});
}

WorkPtr MpiBackend::do_barrier(Call& c) {
  open(c);
  return run(c, [&](void** req) { return api().ibarrier(comm_, req); }, Finish{});
}

WorkPtr MpiBackend::do_send(Call& c, const ArrayView& buf, int peer, uint32_t tag) {
  const int n = int_count(buf.count, c.what);
  const int t = int_count(tag, "send: tag");
  open(c);
  return run(c, [&](void** req) {
    return api().isend(buf.data, n, code(buf.dtype), peer, t, comm_, req);
  }, Finish{}, peer);
}

WorkPtr MpiBackend::do_recv(Call& c, const ArrayView& buf, int peer, uint32_t tag) {
  const int n = int_count(buf.count, c.what);
  const int t = int_count(tag, "recv: tag");
  open(c);
  return run(c, [&](void** req) {
    return api().irecv(buf.data, n, code(buf.dtype), peer, t, comm_, req);
  }, Finish{}, peer);
}

void MpiBackend::do_fail(const std::string& message, std::exception_ptr like) {
  fail_group(like ? same_type(like, message) : std::make_exception_ptr(PeerError(message)), true);
}

void MpiBackend::do_shutdown() {
  // The composer's queued calls first: they end this group's records (Note [Hierarchy on MPI]).
  if (composer_) {
    try {
      composer_->shutdown();
    } catch (...) {  // its failure was (or is now) raised by its calls
    }
  }
  // Works nobody waited for end here, each within its deadline.
  std::vector<std::weak_ptr<MpiWork>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live.swap(live_);
  }
  for (auto& p : live)
    if (auto w = p.lock()) {
      try {
        w->wait(Millis(-1), false, nullptr);
      } catch (...) {  // the group failed: its first failure was (or is now) raised
      }
    }
  if (agreement_) agreement_->stop(failed());
  // Operations MPI still holds (Note [MPI failure model]): freeing the communicator under
  // them is erroneous and MPI_Finalize would wait for them. The job ends now, as documented.
  if (inside_mpi_.load() > 0) abort_job();
  if (comm_) {
    std::lock_guard<std::mutex> lock(mpi_lock());
    api().comm_free(comm_);
    comm_ = nullptr;
  }
}

}  // namespace meshcoll::mpi
