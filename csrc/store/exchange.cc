#include "store/exchange.h"

#include <algorithm>

#include "common/config.h"
#include "common/error.h"
#include "common/interrupt.h"

namespace meshcoll::store {

namespace {
Millis left_of(const Deadline& d) {
  int ms = d.poll_ms();
  return Millis(ms < 0 ? 24LL * 3600 * 1000 : ms);
}

// The values of a list of "name\tvalue\n" lines.
std::vector<std::string> values_of(const std::string& list) {
  std::vector<std::string> out;
  for (size_t at = 0; at < list.size();) {
    size_t tab = list.find('\t', at), end = list.find('\n', at);
    out.push_back(list.substr(tab + 1, end - tab - 1));
    at = end + 1;
  }
  return out;
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
  // Wait in short slices, so that a dead peer and a Ctrl-C (Note [Interrupts]) are noticed
  // between them.
  const auto since = Clock::now();
  for (;;) {
    try {
      store.wait(keys, std::min(left_of(d), Millis(100)));
      break;
    } catch (const TimeoutError&) {
      check_interrupt(names(rank), since);
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


// Note [Shared settings] in exchange.h.
void agree_on_settings(Store& store, int rank, int size, const Settings& shared,
                       const Deadline& d, const WaitCheck& check, const RankNames& names) {
  std::string mine;
  for (const auto& [name, value] : shared) mine += str_cat(name, "\t", value, "\n");
  // Each list travels after its publisher's global rank, which names it in a message: a
  // rank whose view of the members is wrong would misname the others.
  auto all = exchange(store, "settings", rank, size, str_cat(names(rank), "\n", mine), d, check,
                      names);
  std::vector<std::string> who(size), lists(size);
  for (int r = 0; r < size; ++r) {
    const size_t nl = all[r].find('\n');
    who[r] = nl == std::string::npos ? "?" : all[r].substr(0, nl);
    lists[r] = nl == std::string::npos ? all[r] : all[r].substr(nl + 1);
  }
  if (std::all_of(lists.begin(), lists.end(), [&](const std::string& s) { return s == mine; }))
    return;
  // Every rank runs this code, so every list names the same settings in the same order.
  std::vector<std::vector<std::string>> values;
  for (const auto& list : lists) values.push_back(values_of(list));
  std::string wrong;
  for (size_t i = 0; i < shared.size(); ++i) {
    std::vector<std::pair<std::string, std::string>> held;  // value, its ranks
    for (int r = 0; r < size; ++r) {
      const std::string v = i < values[r].size() ? values[r][i] : "(unknown)";
      auto it = std::find_if(held.begin(), held.end(), [&](const auto& h) { return h.first == v; });
      if (it == held.end()) {
        held.push_back({v, str_cat("rank ", who[r])});
      } else {
        it->second += str_cat(", ", who[r]);
      }
    }
    if (held.size() < 2) continue;
    wrong += str_cat(wrong.empty() ? "" : "; ", shared[i].first, " is ");
    for (size_t h = 0; h < held.size(); ++h)
      wrong += str_cat(h ? " but " : "", held[h].first, " on ", held[h].second);
  }
  throw MismatchError(str_cat("rank ", names(rank), ": the ranks of this group disagree on "
                              "settings they must share: ", wrong, ". Every rank of a group "
                              "must use the same value: set it alike in every rank's "
                              "environment (or pass the same argument)"));
}

}  // namespace meshcoll::store
