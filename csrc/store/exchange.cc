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

namespace {
Millis store_call(const Deadline& d) { return std::max(left_of(d), Millis(500)); }

// The ranks r whose keys[r] is not set yet.
std::vector<int> missing_of(Store& store, const std::vector<std::string>& keys,
                            const Deadline& d) {
  std::vector<int> missing;
  for (int r = 0; r < static_cast<int>(keys.size()); ++r)
    if (!store.check({keys[r]}, store_call(d))) missing.push_back(r);
  return missing;
}

[[noreturn]] void never_got_there(int rank, const std::vector<int>& missing,
                                  const std::string& step, const Deadline& d,
                                  const RankNames& names) {
  std::string list;
  for (int r : missing) list += str_cat(list.empty() ? "" : ", ", names(r));
  throw TimeoutError(str_cat("rank ", names(rank), ": setting up this group timed out after ",
                             d.timeout().count(), " ms at step '", step, "': rank(s) ", list,
                             " never got there; they are stuck, or did not create this group"));
}

// Waits until every rank r has set keys[r]: in short slices, so that a dead peer (`check`)
// and a Ctrl-C (Note [Interrupts]) are noticed between them. TimeoutError at d naming the
// ranks that never did.
void wait_for_ranks(Store& store, const std::vector<std::string>& keys, const std::string& step,
                    int rank, const Deadline& d, const WaitCheck& check,
                    const RankNames& names) {
  const auto since = Clock::now();
  for (;;) {
    try {
      store.wait(keys, std::min(left_of(d), Millis(100)));
      return;
    } catch (const TimeoutError&) {
      check_interrupt(names(rank), since);
      std::vector<int> missing = missing_of(store, keys, d);
      if (missing.empty()) return;
      if (check) check(missing);
      if (d.expired()) never_got_there(rank, missing, step, d, names);
    }
  }
}

std::vector<std::string> keys_of(const std::string& step, int size) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(str_cat(step, "/", r));
  return keys;
}
}  // namespace

std::vector<std::string> exchange(Store& store, const std::string& step, int rank, int size,
                                  const std::string& mine, const Deadline& d,
                                  const WaitCheck& check, const RankNames& names) {
  const std::vector<std::string> keys = keys_of(step, size);
  store.set(keys[rank], Bytes(mine.begin(), mine.end()), store_call(d));
  fault_point(step);
  wait_for_ranks(store, keys, step, rank, d, check, names);
  std::vector<std::string> out;
  for (const auto& k : keys) {
    auto v = store.get(k, store_call(d));
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

namespace {
// What differs among the ranks' lists ("" when nothing does), as the message says it.
std::string disagreement(const Settings& shared, const std::vector<std::string>& all) {
  const int size = static_cast<int>(all.size());
  std::vector<std::string> who(size), lists(size);
  for (int r = 0; r < size; ++r) {
    const size_t nl = all[r].find('\n');
    who[r] = nl == std::string::npos ? "?" : all[r].substr(0, nl);
    lists[r] = nl == std::string::npos ? all[r] : all[r].substr(nl + 1);
  }
  if (std::all_of(lists.begin(), lists.end(), [&](const std::string& s) { return s == lists[0]; }))
    return "";
  // Every rank lists the same settings in the same order (the same code made each list).
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
  return str_cat("the ranks of this group disagree on settings they must share: ", wrong,
                 ". Every rank of a group must use the same value: set it alike in every "
                 "rank's environment (or pass the same argument)");
}

// The leader's verdict, one letter and a text: 'O'k; 'M'ismatch (what differs); 'T'imeout,
// 'P'eer error (the leader's own error, which ends the setup for every rank).
constexpr const char* kVerdict = "settings/verdict";

void publish_verdict(Store& store, char kind, const std::string& text, const Deadline& d) {
  const std::string v = str_cat(std::string(1, kind), text);
  store.set(kVerdict, Bytes(v.begin(), v.end()), store_call(d));
}
}  // namespace

// Note [Shared settings] in exchange.h. Rank 0 reads every list and publishes a verdict that
// the others wait for: O(size) store operations in all, where every rank reading every list
// took O(size^2) (at 1024 ranks, a million gets for each group made).
void agree_on_settings(Store& store, int rank, int size, const Settings& shared,
                       const Deadline& d, const WaitCheck& check, const RankNames& names) {
  std::string mine;
  for (const auto& [name, value] : shared) mine += str_cat(name, "\t", value, "\n");
  // Each list travels after its publisher's global rank, which names it in a message: a
  // rank whose view of the members is wrong would misname the others.
  mine = str_cat(names(rank), "\n", mine);
  const std::vector<std::string> keys = keys_of("settings", size);
  store.set(keys[rank], Bytes(mine.begin(), mine.end()), store_call(d));
  fault_point("settings");
  std::string verdict;
  if (rank == 0) {
    try {
      wait_for_ranks(store, keys, "settings", rank, d, check, names);
    } catch (const std::exception& e) {
      // Told to every rank, which would otherwise wait out the deadline for the verdict.
      const bool timeout = dynamic_cast<const TimeoutError*>(&e) != nullptr;
      try {
        publish_verdict(store, timeout ? 'T' : 'P', e.what(), d);
      } catch (const std::exception&) {  // the store is gone: each rank finds out itself
      }
      throw;
    }
    std::vector<std::string> all;
    for (const auto& k : keys) {
      auto v = store.get(k, store_call(d));
      all.emplace_back(v.begin(), v.end());
    }
    const std::string wrong = disagreement(shared, all);
    publish_verdict(store, wrong.empty() ? 'O' : 'M', wrong, d);
    verdict = str_cat(wrong.empty() ? "O" : "M", wrong);
  } else {
    const auto since = Clock::now();
    for (;;) {
      try {
        store.wait({kVerdict}, std::min(left_of(d), Millis(100)));
        break;
      } catch (const TimeoutError&) {
        check_interrupt(names(rank), since);
        if (check) check({0});  // rank 0's death, at once; it reports the others'
        if (d.expired()) {
          std::vector<int> missing = missing_of(store, keys, d);
          if (!missing.empty()) never_got_there(rank, missing, "settings", d, names);
          throw TimeoutError(str_cat(
              "rank ", names(rank), ": setting up this group timed out after ",
              d.timeout().count(), " ms at step 'settings': every rank got there, but rank ",
              names(0), ", which compares their settings, never answered; it is stuck or "
              "died"));
        }
      }
    }
    auto v = store.get(kVerdict, store_call(d));
    verdict.assign(v.begin(), v.end());
  }
  const char kind = verdict.empty() ? 'O' : verdict[0];
  const std::string text = verdict.empty() ? "" : verdict.substr(1);
  if (kind == 'M') throw MismatchError(str_cat("rank ", names(rank), ": ", text));
  if (kind == 'T') throw TimeoutError(str_cat("rank ", names(rank), ": rank ", names(0),
                                              " gave up on this group's setup: ", text));
  if (kind == 'P') throw PeerError(str_cat("rank ", names(rank), ": rank ", names(0),
                                           " gave up on this group's setup: ", text));
}

}  // namespace meshcoll::store
