// Key-value store for rendezvous: transport addresses, NCCL unique ids, group ids.
// Every call is bounded by a timeout; values are byte strings.
#pragma once

#include <charconv>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/deadline.h"

namespace meshcoll::store {

using Bytes = std::vector<uint8_t>;

// Note [Store deadlines]
// Every call is bounded. Calls that wait for keys (get, wait) take their own timeout; the
// others answer at once unless the store's host is stopped, overloaded or gone, and are
// bounded by the store's default timeout, except set and check, which also take one: group
// setup bounds them by the group's deadline and a timeout's census by its own short one, so
// a stopped store host fails a call within that call's own timeout (plus a little).
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const Bytes& value, Millis timeout) = 0;
  void set(const std::string& key, const Bytes& value) { set(key, value, timeout()); }
  // Waits until the key exists (TimeoutError after `timeout`).
  virtual Bytes get(const std::string& key, Millis timeout) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets key to desired if its value equals expected (or if it is absent and expected is
  // empty); returns the value after the call.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected,
                            const Bytes& desired) = 0;
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  virtual bool check(const std::vector<std::string>& keys, Millis timeout) = 0;
  bool check(const std::vector<std::string>& keys) { return check(keys, timeout()); }
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;
  virtual Millis timeout() const = 0;  // default for calls without their own
};

// add()'s arithmetic, one for every store: a value holds decimal ASCII; absent or empty is 0.
enum class AddResult { kOk, kNotDecimal, kOverflow };
inline AddResult add_decimal(const Bytes& value, int64_t delta, int64_t* sum) {
  int64_t cur = 0;
  if (!value.empty()) {
    const char* b = reinterpret_cast<const char*>(value.data());
    const char* e = b + value.size();
    auto [p, ec] = std::from_chars(b, e, cur);
    if (ec != std::errc() || p != e) return AddResult::kNotDecimal;
  }
  return __builtin_add_overflow(cur, delta, sum) ? AddResult::kOverflow : AddResult::kOk;
}

// Namespaces another store: every key gets "prefix/". num_keys counts the whole store.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base)
      : prefix_(std::move(prefix) + "/"), base_(std::move(base)) {}
  using Store::check;
  using Store::set;
  void set(const std::string& key, const Bytes& value, Millis t) override {
    base_->set(k(key), value, t);
  }
  Bytes get(const std::string& key, Millis t) override { return base_->get(k(key), t); }
  int64_t add(const std::string& key, int64_t delta) override { return base_->add(k(key), delta); }
  Bytes compare_set(const std::string& key, const Bytes& e, const Bytes& d) override {
    return base_->compare_set(k(key), e, d);
  }
  void wait(const std::vector<std::string>& keys, Millis t) override { base_->wait(ks(keys), t); }
  bool check(const std::vector<std::string>& keys, Millis t) override {
    return base_->check(ks(keys), t);
  }
  bool delete_key(const std::string& key) override { return base_->delete_key(k(key)); }
  int64_t num_keys() override { return base_->num_keys(); }
  Millis timeout() const override { return base_->timeout(); }
  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string k(const std::string& key) const { return prefix_ + key; }
  std::vector<std::string> ks(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& key : keys) out.push_back(k(key));
    return out;
  }
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace meshcoll::store
