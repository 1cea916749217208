#include "store/exchange.h"

#include <algorithm>

#include "common/config.h"
#include "common/error.h"

namespace meshcoll::store {

namespace {
Millis left_of(const Deadline& d) {
  int ms = d.poll_ms();
  return Millis(ms < 0 ? 24LL * 3600 * 1000 : ms);
}
}  // namespace

std::vector<std::string> exchange(Store& store, const std::string& step, int rank, int size,
                                  const std::string& mine, const Deadline& d,
                                  const WaitCheck& check, const RankNames& names) {
  auto call = [&] { return std::max(left_of(d), Millis(500)); };
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(str_cat(step, "/", r));
  store.set(keys[rank], Bytes(mine.begin(), mine.end()), call());
  fault_point(step);
  // Wait in short slices, so that a dead peer is noticed between them.
  for (;;) {
    try {
      store.wait(keys, std::min(left_of(d), Millis(100)));
      break;
    } catch (const TimeoutError&) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r)
        if (!store.check({keys[r]}, call())) missing.push_back(r);
      if (missing.empty()) break;
      if (check) check(missing);
      if (d.expired()) {
        std::string list;
        for (int r : missing) list += str_cat(list.empty() ? "" : ", ", names(r));
        throw TimeoutError(str_cat("rank ", names(rank), ": setting up this group timed out after ",
                                   d.timeout().count(), " ms at step '", step, "': rank(s) ",
                                   list, " never got there; they are stuck, or did not create "
                                   "this group"));
      }
    }
  }
  std::vector<std::string> out;
  for (const auto& k : keys) {
    auto v = store.get(k, call());
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

}  // namespace meshcoll::store
