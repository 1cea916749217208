#include "comm/agreement.h"

#include <algorithm>

#include "common/error.h"
#include "common/thread_name.h"

namespace meshcoll::comm {

namespace {
// The longest pause between idle rounds: a disagreement is found within about this long.
constexpr auto kIdlePause = std::chrono::milliseconds(10);
// The pause after a round that compared calls, while they stream (Note [Paced rounds] in
// agreement.h).
constexpr auto kStreamPause = std::chrono::microseconds(500);
// The channel's deadline while nothing waits to be compared (Note [Agreement on a side
// channel]): a job may sit in other code for a long time.
constexpr Millis kIdleDeadline{100LL * 24 * 3600 * 1000};
}  // namespace

// What each rank contributes to a round; the same size on every rank.
struct Agreement::Record {
  uint64_t issued = 0;   // calls this rank has issued
  uint64_t first = 0;    // the sequence number of descs[0]: the first call not yet compared
  uint32_t n = 0;        // descriptions in descs
  uint32_t leaving = 0;  // 1: this rank is destroying the group; `issued` is final
  OpDesc descs[kBatch];
};

Agreement::Agreement(std::shared_ptr<Backend> channel, Mode mode, Millis timeout,
                     const Ledger& ledger, Sink sink, RankNames names)
    : channel_(std::move(channel)), mode_(mode), timeout_(timeout), ledger_(ledger),
      sink_(std::move(sink)), rank_(channel_->rank()), size_(channel_->size()),
      names_(std::move(names)), all_(size_), counts_(size_, sizeof(Record)),
      peer_issued_(size_, 0), last_round_(Clock::now()) {
  channel_->skip_farewell();
}

std::shared_ptr<Agreement> Agreement::create(std::shared_ptr<Backend> channel, Mode mode,
                                             Millis timeout, const Ledger& ledger, Sink sink,
                                             RankNames names) {
  auto a = std::make_shared<Agreement>(std::move(channel), mode, timeout, ledger, std::move(sink),
                                       std::move(names));
  if (mode == Mode::kAsync && a->size_ > 1)
    a->checker_ = named_thread("mc-agreement", [self = a] { self->loop(); });
  return a;
}

// Runs on the checker thread when it held the last reference (stop() left it behind).
Agreement::~Agreement() {
  if (checker_.joinable()) checker_.detach();
}

void Agreement::note(uint64_t seq, const OpDesc& d) {
  if (size_ == 1) return;
  if (seq > peer_final_.load(std::memory_order_acquire))
    throw MismatchError(str_cat(
        describe_op(d), " [seq ", seq, "] on rank ", names_(rank_), ": rank ",
        names_(left_rank_.load()),
        " has destroyed the group after its call seq ", peer_final_.load(),
        ", so this call has no partner; every rank must make the same calls before destroy()"));
  // The ring holds calls not yet compared: wait for the checker when it is full (kRing calls
  // ahead of it), which a failure ends.
  while (seq - checked_.load(std::memory_order_acquire) > kRing) {
    if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  ring_[(seq - 1) % kRing] = Entry{seq, d};
  issued_.store(seq, std::memory_order_release);
  if (mode_ != Mode::kStrict) return;
  try {
    while (checked_.load(std::memory_order_relaxed) < seq && round(false, timeout_)) {
    }
  } catch (...) {
    fail(std::current_exception(), seq);
  }
  if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
}

void Agreement::await(uint64_t seq, Millis timeout) {
  if (size_ == 1) return;
  const Millis t = timeout.count() < 0 ? timeout_ : timeout;
  Deadline d(t);
  auto late = [&] {
    return TimeoutError(str_cat(desc_of(seq), " [seq ", seq, "] on rank ", names_(rank_),
                                ": not every rank issued it within ", t.count(), " ms",
                                census(seq), "; every rank must make the same calls"));
  };
  auto left = [&] { return d.poll_ms() < 0 ? kIdleDeadline : Millis(d.poll_ms()); };
  struct Awaiting {  // the checker sits out while this caller runs rounds
    std::atomic<int>& n;
    explicit Awaiting(std::atomic<int>& c) : n(c) { n.fetch_add(1, std::memory_order_acq_rel); }
    ~Awaiting() { n.fetch_sub(1, std::memory_order_acq_rel); }
  } awaiting(awaiting_);
  // Rounds run here, on the caller's thread (Note [Agreement before launch]); the checker's
  // rounds take the same mutex, so this rank's rounds stay one at a time.
  while (checked_.load(std::memory_order_acquire) < seq) {
    if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
    std::unique_lock<std::timed_mutex> lock(round_mu_, std::defer_lock);
    // A checker's idle round holds the mutex until a peer runs a round too. Past the
    // deadline the call was issued here but never launched: the group fails, as it would
    // had the round itself timed out.
    if (!lock.try_lock_for(left())) {
      fail(std::make_exception_ptr(late()), seq);
      break;
    }
    if (checked_.load(std::memory_order_acquire) >= seq) break;
    try {
      if (!round(false, left()) && !failed_.load())
        fail(std::make_exception_ptr(MismatchError(str_cat(
                 desc_of(seq), " [seq ", seq, "] on rank ", names_(rank_),
                 ": the peers have destroyed the group, so this call has no partner"))),
             seq);
    } catch (const TimeoutError&) {
      fail(std::make_exception_ptr(late()), seq);
    } catch (...) {
      fail(std::current_exception(), seq);
    }
  }
  if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
}

bool Agreement::round(bool leaving, Millis deadline) {
  Record mine;
  const uint64_t checked = checked_.load(std::memory_order_relaxed);
  mine.issued = issued_.load(std::memory_order_acquire);
  mine.first = checked + 1;
  mine.n = static_cast<uint32_t>(std::min<uint64_t>(kBatch, mine.issued - checked));
  mine.leaving = leaving ? 1 : 0;
  for (uint32_t i = 0; i < mine.n; ++i) mine.descs[i] = ring_[(checked + i) % kRing].desc;

  std::vector<Record>& all = all_;
  ArrayView in, out;
  in.data = &mine;
  in.count = sizeof(Record);
  in.dtype = DType::kUint8;
  out.data = all.data();
  out.count = sizeof(Record) * size_;
  out.dtype = DType::kUint8;
  CallOptions o;
  o.timeout = deadline;
  channel_->all_gather(in, out, counts_, false, o);

  uint32_t k = mine.n;
  for (const Record& r : all) k = std::min(k, r.n);
  for (uint32_t i = 0; i < k; ++i) {
    for (int p = 1; p < size_; ++p) {
      if (all[p].descs[i] == all[0].descs[i]) continue;
      const uint64_t seq = checked + 1 + i;
      fail(std::make_exception_ptr(MismatchError(str_cat(
               "collective mismatch (found by the agreement check): rank ", names_(0), " called ",
               describe_op(all[0].descs[i]), " [seq ", seq, "] but rank ", names_(p), " called ",
               describe_op(all[p].descs[i]), " [seq ", seq, "]",
               all[0].descs[i].shape != all[p].descs[i].shape ? " (their shapes, splits or block layouts differ)" : "",
               "; every rank of a group must call the same collectives, with the same count, "
               "dtype, op and root, in the same order. Results of this call and later ones "
               "are void (MESHCOLL_CHECK=strict checks before each call is launched)"))),
           seq);
      return false;
    }
  }
  checked_.store(checked + k, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(census_mu_);
    for (int p = 0; p < size_; ++p) peer_issued_[p] = all[p].issued;
    last_round_ = Clock::now();
  }
  bool more = true;
  for (int p = 0; p < size_; ++p) {
    if (!all[p].leaving || checked + k < all[p].issued) continue;
    more = false;  // rank p compared everything it issued and is gone: no round can run
    if (p == rank_) continue;
    left_rank_ = p;
    peer_final_.store(all[p].issued, std::memory_order_release);
    const uint64_t mine_now = issued_.load(std::memory_order_acquire);
    if (mine_now > all[p].issued) {
      fail(std::make_exception_ptr(MismatchError(str_cat(
               "rank ", names_(p), " destroyed the group after its call seq ", all[p].issued,
               " but rank ", names_(rank_), " called ", desc_of(all[p].issued + 1), " [seq ",
               all[p].issued + 1, "]: it has no partner; every rank must make the same calls "
               "before destroy()"))),
           all[p].issued + 1);
    }
  }
  return more;
}

void Agreement::loop() {
  auto pause = std::chrono::microseconds(0);
  for (;;) {
    const bool leaving = stopping_.load(std::memory_order_acquire);
    uint64_t compared = 0;  // calls this round compared: the same on every rank
    // A caller in await() runs the rounds itself: stay out of its way (Note [Agreement
    // before launch]).
    if (leaving || awaiting_.load(std::memory_order_acquire) == 0) {
      std::lock_guard<std::timed_mutex> lock(round_mu_);
      // Read under the lock: progress counts only what this round compared, not what a
      // caller's round did while this thread waited for the lock.
      const uint64_t before = checked_.load(std::memory_order_relaxed);
      const bool waiting = issued_.load(std::memory_order_acquire) > before;
      try {
        if (!round(leaving, waiting || leaving ? timeout_ : kIdleDeadline)) break;
      } catch (...) {
        // A failure while calls wait to be compared (or while leaving) is the group's; one
        // after everything agreed and this rank stopped is only the peers leaving.
        if (waiting || !leaving)
          fail(same_type(std::current_exception(),
                         str_cat("the group's host side channel (its agreement check, Note "
                                 "[Agreement on a side channel]) failed: ",
                                 message_of(std::current_exception()))),
               before + 1);
        break;
      }
      compared = checked_.load(std::memory_order_relaxed) - before;
    }
    if (compared > 0) {
      // Note [Paced rounds]: at once only while leaving or after a full batch.
      if (leaving || compared >= kBatch) {
        pause = std::chrono::microseconds(0);
        continue;
      }
      pause = kStreamPause;
    } else {
      pause = std::min<std::chrono::microseconds>(pause * 2 + std::chrono::microseconds(50),
                                                  kIdlePause);
    }
    std::unique_lock<std::mutex> lock(wake_mu_);
    wake_.wait_for(lock, pause, [&] { return stopping_.load() && !leaving; });
  }
  std::lock_guard<std::mutex> lock(wake_mu_);
  done_ = true;
  wake_.notify_all();
}

void Agreement::fail(std::exception_ptr error, uint64_t seq) {
  {
    std::lock_guard<std::mutex> lock(census_mu_);
    if (error_) return;
    error_ = error;
  }
  failed_.store(true, std::memory_order_release);
  // This runs on the checker thread too, where an exception would end the process: a sink
  // that cannot act (a GPU whose driver is gone at exit) leaves the failure recorded here.
  try {
    sink_(error, seq);
  } catch (...) {
  }
}

std::string Agreement::desc_of(uint64_t seq) const {
  if (stopped_.load()) return "a collective";  // a checker left behind: the ledger may be gone
  for (const CallRecord& r : ledger_.recent())
    if (r.seq == seq) return describe_op(r.desc);
  return "a collective";
}

std::string Agreement::census(uint64_t seq) const {
  if (size_ == 1) return "";
  std::vector<uint64_t> issued;
  Clock::time_point at;
  {
    std::lock_guard<std::mutex> lock(census_mu_);
    issued = peer_issued_;
    at = last_round_;
  }
  std::string never;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || issued[p] >= seq) continue;
    never += str_cat(never.empty() ? "" : "; ", "rank ", names_(p), " (its last call: ",
                     issued[p] ? str_cat(desc_of(issued[p]), " [seq ", issued[p], "]")
                               : std::string("none"),
                     ")");
  }
  const auto ago = std::chrono::duration_cast<Millis>(Clock::now() - at).count();
  if (never.empty())
    return str_cat("; every rank had issued it (as of ", ago, " ms ago): look for a rank whose "
                   "GPU is stuck or slow");
  return str_cat("; never issued by ", never, " (as of ", ago, " ms ago",
                 ago > 2 * kIdlePause.count() ? ": those ranks stopped answering; stopped or hung?"
                                              : "",
                 ")");
}

void Agreement::stop(bool abandon) {
  if (stopped_.exchange(true)) return;
  if (abandon && size_ > 1 && !failed_.load())
    channel_->fail(str_cat("rank ", names_(rank_), " destroyed the group after it failed there"));
  if (checker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(wake_mu_);
      stopping_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    // Leaving rounds compare what remains (bounded by the timeout); a round held by a peer
    // that does not answer (stopped) is left to end on its own.
    std::unique_lock<std::mutex> lock(wake_mu_);
    const bool done = wake_.wait_for(lock, abandon ? Millis(1000) : timeout_ + Millis(1000),
                                     [&] { return done_; });
    lock.unlock();
    if (!done) {
      checker_.detach();
      return;
    }
    checker_.join();
  }
  try {
    channel_->shutdown();
  } catch (const std::exception&) {
    // The channel failed already (a peer died): nothing is left to close cleanly.
  }
}

}  // namespace meshcoll::comm
