// Note [Reducer] in reducer.h.
#include "reducer/reducer.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/error.h"

namespace meshcoll::reducer {

Reducer::Reducer(std::shared_ptr<comm::Backend> backend, std::vector<comm::ArrayView> buckets,
                 std::vector<Slot> slots, std::vector<std::string> names, RedOp op,
                 bool launches)
    : backend_(std::move(backend)), slots_(std::move(slots)), names_(std::move(names)),
      op_(op), launches_(launches) {
  if (names_.size() != slots_.size())
    throw InvalidArgument(str_cat("Reducer: ", slots_.size(), " slots but ", names_.size(),
                                  " names"));
  buckets_.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) buckets_[b].buf = std::move(buckets[b]);
  elem_size_.resize(slots_.size());
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.bucket >= buckets_.size() || s.offset + s.count > buckets_[s.bucket].buf.count)
      throw InvalidArgument(str_cat("Reducer: the slot of '", names_[i], "' (bucket ", s.bucket,
                                    ", elements ", s.offset, "+", s.count,
                                    ") lies outside its bucket"));
    buckets_[s.bucket].members.push_back(i);
    elem_size_[i] = dtype_size(buckets_[s.bucket].buf.dtype);
  }
  splits_ = launches_ && !backend_->device_memory() && backend_->transport() == "shm";
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::vector<size_t>& m = buckets_[b].members;  // in the bucket's layout order
    std::sort(m.begin(), m.end(),
              [&](size_t x, size_t y) { return slots_[x].offset < slots_[y].offset; });
    if (buckets_[b].members.empty())
      throw InvalidArgument(str_cat("Reducer: bucket ", b, " holds no gradient"));
    buckets_[b].missing = buckets_[b].members.size();
  }
  // Note [In-place gradients]: on shared memory a bucket with large slots makes a call for
  // each, and one for its smaller ones, staged end to end.
  staged_at_.assign(slots_.size(), SIZE_MAX);
  for (Bucket& b : buckets_) {
    if (!splits_) break;
    for (size_t i : b.members) (bytes_of(i) >= kInPlaceBytes ? b.large : b.small).push_back(i);
    size_t total = 0;
    for (size_t i : b.small) total += slots_[i].count;
    if (b.large.empty() || total == 0) {
      b.small.clear();  // a call of `buf` (or of the large ones alone)
      continue;
    }
    size_t at = 0;
    for (size_t i : b.small) {
      staged_at_[i] = at;
      at += slots_[i].count;
    }
    const size_t bytes = total * dtype_size(b.buf.dtype);
    std::shared_ptr<void> mem(::operator new(bytes), [](void* p) { ::operator delete(p); });
    b.stage = b.buf;
    b.stage.data = mem.get();
    b.stage.count = total;
    b.stage.owner = std::move(mem);
    b.stage.shape_hash = b.stage.row_hash = 1;
  }
  src_.assign(slots_.size(), 0);
  out_.assign(slots_.size(), 0);
  given_.assign(slots_.size(), false);
  in_place_.assign(slots_.size(), false);
  remaining_ = slots_.size();
}

Reducer::~Reducer() {
  try {
    abandon();  // launched buckets' memory stays in use until their all-reduces end
  } catch (...) {
  }
}

uintptr_t Reducer::slot_address(size_t i) const {
  const Slot& s = slots_.at(i);
  return reinterpret_cast<uintptr_t>(buckets_[s.bucket].buf.data) + s.offset * elem_size_[i];
}

bool Reducer::mark(size_t i, uintptr_t src, uintptr_t out) {
  if (i >= slots_.size())
    throw InvalidArgument(str_cat("Reducer: gradient index ", i, " out of range (", slots_.size(),
                                  " gradients)"));
  if (given_[i])
    throw InvalidArgument(str_cat("the gradient of '", names_[i], "' was already given in this "
                                  "step; finish the step (wait()) before the next one's"));
  if (splits_) {
    // Note [In-place gradients]: a range that overlaps a gradient averaged in place would be
    // read changed; and a later launch must know what was given, to not average in place a
    // gradient that overlaps another.
    const uintptr_t n = bytes_of(i);
    size_t j = overlapping(in_place_spans_, src, src + n, i);
    if (j == SIZE_MAX && out != 0) j = overlapping(in_place_spans_, out, out + n, i);
    if (j != SIZE_MAX) {
      const std::string msg = str_cat(
          "rank ", backend_->names()(backend_->rank()), ": the gradient of '", names_[i],
          "' shares memory with the gradient of '", names_[j], "', which this step already "
          "averages in place (data parallelism's buckets); give every parameter a gradient "
          "in memory of its own. The group is failed on every rank");
      backend_->fail(msg, std::make_exception_ptr(InvalidArgument(msg)));
      throw InvalidArgument(msg);
    }
    given_spans_.emplace(src, std::make_pair(src + n, i));
    if (out != 0 && out != src) given_spans_.emplace(out, std::make_pair(out + n, i));
    longest_span_ = std::max<size_t>(longest_span_, n);
  }
  given_[i] = true;
  src_[i] = src;
  out_[i] = out;
  order_.push_back(i);
  --remaining_;
  Bucket& b = buckets_[slots_[i].bucket];
  --b.missing;
  return next_launch_ < buckets_.size() && buckets_[next_launch_].missing == 0 && launches_;
}

std::vector<size_t> Reducer::missing() const {
  std::vector<size_t> out;
  for (const Bucket& b : buckets_)
    for (size_t i : b.members)
      if (!given_[i]) out.push_back(i);
  return out;
}

std::vector<comm::CopySpan> Reducer::spans_in(const Bucket& b) const {
  std::vector<comm::CopySpan> spans;
  for (size_t i : b.members) {
    const uintptr_t slot = slot_address(i);
    if (src_[i] != slot)
      spans.push_back({reinterpret_cast<const void*>(src_[i]), reinterpret_cast<void*>(slot),
                       slots_[i].count * elem_size_[i]});
  }
  return spans;
}

uintptr_t Reducer::home(size_t i) const {
  if (staged_at_[i] == SIZE_MAX) return slot_address(i);
  const Bucket& b = buckets_[slots_[i].bucket];
  return reinterpret_cast<uintptr_t>(b.stage.data) + staged_at_[i] * elem_size_[i];
}

bool Reducer::copies_early(size_t i) const {
  // A large slot's all-reduce reads its gradient where it was given (Note [In-place
  // gradients]).
  return launches_ && !backend_->device_memory() && given_[i] && src_[i] != home(i) &&
         !(splits_ && bytes_of(i) >= kInPlaceBytes);
}

void Reducer::copy_in(size_t i) {
  if (!copies_early(i)) return;
  const uintptr_t to = home(i);
  copy({{reinterpret_cast<const void*>(src_[i]), reinterpret_cast<void*>(to), bytes_of(i)}},
       nullptr);
  src_[i] = to;  // its launch copies nothing more
}

void Reducer::copy(const std::vector<comm::CopySpan>& spans, comm::Stream stream) {
  for (const comm::CopySpan& s : spans) stats_.copied_bytes += s.bytes;
  backend_->copy_spans(spans, stream);
}

void Reducer::launch_ready(comm::Stream stream) {
  if (!launches_) return;
  try {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].missing == 0) {
      Bucket& b = buckets_[next_launch_];
      b.t_launch = comm::monotonic_seconds();
      if (b.large.empty()) {
        copy(spans_in(b), stream);
        comm::CallOptions o;
        o.async = true;
        o.stream = stream;
        b.work = backend_->all_reduce(b.buf, b.buf, op_, o);
      } else {
        launch_calls(b, stream);
      }
      // Stamped when it completes (Note [Stats]); GPU work quietly (Note [Quiet stamps]).
      b.ticket = stamps_.add(b.work, backend_->device_memory());
      ++next_launch_;
    }
  } catch (...) {
    // A bucket that could not be launched has no average: the step is dropped (its launched
    // buckets waited for), so no later finish() could copy out data nobody reduced.
    abandon();
    throw;
  }
}

size_t Reducer::overlapping(const Spans& spans, uintptr_t lo, uintptr_t hi,
                             size_t except) const {
  if (lo >= hi) return SIZE_MAX;
  // A range that overlaps [lo, hi) starts before hi and at most longest_span_ before lo.
  auto it = spans.lower_bound(lo > longest_span_ ? lo - longest_span_ : 0);
  for (; it != spans.end() && it->first < hi; ++it)
    if (it->second.first > lo && it->second.second != except) return it->second.second;
  return SIZE_MAX;
}

void Reducer::launch_calls(Bucket& b, comm::Stream stream) {
  comm::CallOptions o;
  o.async = true;
  o.stream = stream;
  auto issue = [&](comm::ArrayView in, comm::ArrayView v, bool last) {
    in.shape_hash = in.row_hash = v.shape_hash = v.row_hash = 1;  // flat, alike on every rank
    comm::WorkPtr w = backend_->all_reduce(in, v, op_, o);
    if (last)
      b.work = std::move(w);
    else
      b.earlier.push_back(std::move(w));
  };
  for (size_t k = 0; k < b.large.size(); ++k) {
    const size_t i = b.large[k];
    const uintptr_t src = src_[i], slot = slot_address(i);
    const size_t n = bytes_of(i);
    comm::ArrayView v = b.buf;
    v.count = slots_[i].count;
    v.data = reinterpret_cast<void*>(slot);
    comm::ArrayView in = v;  // read by the call, kept alive by the caller
    in.owner.reset();
    if (out_[i] == src && src != slot &&
        overlapping(given_spans_, src, src + n, i) == SIZE_MAX) {
      in.data = reinterpret_cast<void*>(src);
      v = in;
      in_place_[i] = true;
      in_place_spans_.emplace(src, std::make_pair(src + n, i));
    } else if (src + n <= slot || slot + n <= src) {
      in.data = reinterpret_cast<void*>(src);  // into its slot, no copy
    } else if (src != slot) {
      // Partly in its own slot: an all-reduce's x and out are the same or apart (Note
      // [Overlapping buffers] in comm/backend.cc).
      copy({{reinterpret_cast<const void*>(src), reinterpret_cast<void*>(slot), n}}, stream);
    }
    issue(in, v, k + 1 == b.large.size() && b.small.empty());
  }
  if (b.small.empty()) return;
  std::vector<comm::CopySpan> spans;  // those not copied as they arrived
  for (size_t i : b.small)
    if (src_[i] != home(i))
      spans.push_back({reinterpret_cast<const void*>(src_[i]), reinterpret_cast<void*>(home(i)),
                       bytes_of(i)});
  copy(spans, stream);
  issue(b.stage, b.stage, true);
}

std::vector<size_t> Reducer::take_complete(comm::Stream stream) {
  std::vector<size_t> taken;
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].missing == 0) {
    Bucket& b = buckets_[next_launch_];
    copy(spans_in(b), stream);
    taken.push_back(next_launch_++);
  }
  return taken;
}

void Reducer::spans_out(size_t bi, std::vector<comm::CopySpan>* spans) const {
  for (size_t i : buckets_.at(bi).members) {
    const uintptr_t slot = slot_address(i);
    if (staged_at_[i] != SIZE_MAX) {  // the average is in the stage (Note [In-place gradients])
      spans->push_back({reinterpret_cast<const void*>(home(i)),
                        reinterpret_cast<void*>(out_[i] != 0 ? out_[i] : slot), bytes_of(i)});
      continue;
    }
    if (out_[i] != 0 && out_[i] != slot && !in_place_[i])  // Note [In-place gradients]
      spans->push_back({reinterpret_cast<const void*>(slot), reinterpret_cast<void*>(out_[i]),
                        slots_[i].count * elem_size_[i]});
  }
}

void Reducer::copy_out(size_t bi, comm::Stream stream) {
  std::vector<comm::CopySpan> spans;
  spans_out(bi, &spans);
  copy(spans, stream);
}

void Reducer::finish(comm::Stream stream) {
  if (remaining_ != 0) {
    std::string missing;
    size_t shown = 0;
    for (size_t i = 0; i < slots_.size() && shown < 10; ++i)
      if (!given_[i]) missing += str_cat(shown++ ? ", " : "", names_[i]);
    if (remaining_ > shown) missing += str_cat(", ... (", remaining_, " in all)");
    throw InvalidArgument(str_cat("no gradient was given for ", missing, "; give every "
                                  "gradient before finishing the step (the step stays open)"));
  }
  std::exception_ptr error;
  try {
    settle();
  } catch (...) {
    error = std::current_exception();
  }
  const double t_wait = comm::monotonic_seconds();
  const bool device = backend_->device_memory();
  // A GPU stream waits for every all-reduce, then one copy kernel writes every average out
  // (a launch per bucket would cost the host more, and the copies run after the last
  // all-reduce either way); on the CPU each bucket is copied as soon as it is waited for.
  std::vector<comm::CopySpan> outs;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    if (b.work) {
      const Flight f{b.ticket, b.t_launch, t_wait, b.buf.bytes()};
      try {
        if (device) {
          b.work->wait(Millis(-1), true, stream);  // the stream waits, not the host
          unsettled_.push_back(f);
        } else {
          comm::CompletionStamps::Stamp s = stamps_.take(f.ticket);
          count(s, f);
          if (s.error) std::rethrow_exception(s.error);
          for (comm::WorkPtr& w : b.earlier) w->wait(Millis(-1));  // done: raises a failure
        }
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) continue;
    if (device)
      spans_out(bi, &outs);
    else
      copy_out(bi, stream);
  }
  if (!error) copy(outs, stream);
  if (order_.size() == slots_.size() && first_order_.empty()) first_order_ = order_;
  end_step();
  if (error) std::rethrow_exception(error);
}

bool Reducer::done() {
  for (Bucket& b : buckets_)
    if (b.work && !b.work->is_completed()) return false;
  return true;
}

void Reducer::abandon() {
  // The step is dropped: a failure of its all-reduces is the group's, which its next call
  // raises. Taking the stamp waits for the all-reduce (its buffer is in use until then).
  for (Bucket& b : buckets_) {
    // Done before b.work, but a launch that failed part way has none: wait for them
    // without raising (the failure is the group's, raised by its next call).
    for (comm::WorkPtr& w : b.earlier)
      while (!w->is_completed()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (b.work) stamps_.take(b.ticket);
  }
  end_step();
}

void Reducer::end_step() {
  for (Bucket& b : buckets_) {
    b.work.reset();
    b.earlier.clear();
    b.missing = b.members.size();
  }
  std::fill(given_.begin(), given_.end(), false);
  std::fill(in_place_.begin(), in_place_.end(), false);
  given_spans_.clear();
  in_place_spans_.clear();
  longest_span_ = 0;
  std::fill(src_.begin(), src_.end(), 0);
  std::fill(out_.begin(), out_.end(), 0);
  order_.clear();
  remaining_ = slots_.size();
  next_launch_ = 0;
}

void Reducer::count(const comm::CompletionStamps::Stamp& s, const Flight& f) {
  const double start = std::max(f.t_launch, prev_end_);
  prev_end_ = s.end;
  stats_.calls += 1;
  stats_.bytes += f.bytes;
  stats_.comm_seconds += s.end - start;
  stats_.overlapped_seconds += std::max(0.0, std::min(s.end, f.t_wait) - start);
}

void Reducer::settle() {
  std::vector<Flight> flights;
  flights.swap(unsettled_);
  std::exception_ptr error;
  for (const Flight& f : flights) {
    comm::CompletionStamps::Stamp s = stamps_.take(f.ticket);
    count(s, f);
    if (s.error && !error) error = s.error;
  }
  if (error) std::rethrow_exception(error);
}

Reducer::Stats Reducer::stats() {
  settle();
  return stats_;
}

void Reducer::reset_stats() {
  try {
    settle();  // count nothing of before the reset later
  } catch (...) {
  }
  stats_ = Stats{};
}

}  // namespace meshcoll::reducer
