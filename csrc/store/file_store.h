// File-backed key-value store for rendezvous on a shared filesystem (torch's
// init_method="file:///shared/path"): one file that every process opens, local disk or NFS.
//
// The file is an append-only log. Every operation takes an exclusive POSIX record lock on
// the whole file (fcntl F_SETLK, polled until the store's timeout: unlike flock it works over
// NFS with lockd; on NFS it is also the cache-coherency point, so no fsync is needed), reads
// the records appended since this process last read, applies itself by appending a record,
// and unlocks. get/wait poll (1 ms backoff doubling to 50 ms) until the keys exist or the
// deadline passes.
//
// Format (little-endian): header "MCFS" + u32 version; then records
//   u8 op (1 = set, 2 = delete), u32 key length, key, u32 value length, value
// (a delete has an empty value). add stores decimal ASCII, as the TCP store does.
//
// Cleanup: the reserved key kUsersKey counts the live FileStore objects (+1 on
// construction, -1 on destruction); the one that brings it to 0 unlinks the file under the
// lock. A process that joins after every earlier user has gone starts a fresh, empty file.
// A file left behind by a crashed job is the user's to delete: use a fresh path per job
// (e.g. one containing $SLURM_JOB_ID). A leftover file is reused as is, keys included.
//
// POSIX record locks belong to the process, not the descriptor (and closing any descriptor
// of the file drops them all), so all FileStores of one process also serialise on one mutex.
// The log is never compacted: it grows by one record per set/add/delete.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "store/store.h"

namespace meshcoll::store {

class FileStore : public Store {
 public:
  static constexpr const char* kUsersKey = "__meshcoll_file_store_users__";

  // Opens (or creates) the file at path; InvalidArgument if that fails (missing directory,
  // permission), Error if it is not a FileStore file. timeout is the default for get/wait.
  FileStore(std::string path, Millis timeout);
  ~FileStore() override;
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  using Store::check;
  using Store::set;
  void set(const std::string& key, const Bytes& value, Millis timeout) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys, Millis timeout) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;  // not counting kUsersKey
  Millis timeout() const override { return timeout_; }

  const std::string& path() const { return path_; }

 private:
  class Locked;
  void refresh();  // under the lock: applies the records appended since the last read
  void append(uint8_t op, const std::string& key, const Bytes& value);  // under the lock
  int64_t add_locked(const std::string& key, int64_t delta);
  bool same_file() const;  // path_ still names the file open as fd_
  void check_key(const char* what, const std::string& key, bool writes) const;
  [[noreturn]] void corrupted(uint64_t offset, const std::string& why) const;
  template <class Ready>
  void poll_until(const Deadline& d, Ready ready, const char* what,
                  const std::vector<std::string>& keys);
  std::string describe() const;

  std::string path_;
  Millis timeout_;
  int fd_ = -1;
  pid_t owner_pid_ = 0;  // a forked child's copy does not count as a user
  uint64_t offset_ = 0;  // bytes of the file applied to data_
  std::map<std::string, Bytes> data_;
};

}  // namespace meshcoll::store
