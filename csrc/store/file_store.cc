#include "store/file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/error.h"

namespace meshcoll::store {

namespace {

constexpr char kMagic[4] = {'M', 'C', 'F', 'S'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 8;  // magic + u32 version
constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpDelete = 2;
constexpr uint32_t kMaxKeyBytes = 64 * 1024;  // the TCP store's limits
constexpr uint32_t kMaxValueBytes = 64u * 1024 * 1024;
constexpr Millis kFirstBackoff{1};
constexpr Millis kMaxBackoff{50};

// All FileStores of this process: POSIX record locks do not exclude threads of one process,
// and closing any descriptor of a file drops every lock the process holds on it. Leaked so
// that stores destroyed during exit still find it.
std::mutex& process_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

bool pwrite_all(int fd, const char* p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return true;
}

// Bytes read (fewer than n at end of file), or -1 with errno set.
ssize_t pread_all(int fd, char* p, size_t n, uint64_t off) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, p + got, n - got, static_cast<off_t>(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

// Bounded like every blocking call: a holder that hangs (a stopped process, a dead NFS
// client whose lock the server keeps) becomes a TimeoutError, not a hang. Holds last
// microseconds, so polling from 50 us (doubling to 10 ms) costs little.
void lock_file(int fd, const std::string& who, Millis timeout) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;  // l_start = l_len = 0: the whole file, however long it grows
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto backoff = std::chrono::microseconds(50);
  while (::fcntl(fd, F_SETLK, &fl) != 0) {
    int err = errno;
    if (err == EINTR) continue;
    if (err != EACCES && err != EAGAIN)
      throw SystemError(str_cat(
          who, ": locking the file (fcntl F_SETLK) failed: ", errno_text(err),
          err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS
              ? "; the filesystem does not support POSIX locks (NFS needs lockd / NFSv4)"
              : ""));
    if (std::chrono::steady_clock::now() >= deadline)
      throw TimeoutError(str_cat(who, ": another process held the file's lock for more than ",
                                 timeout.count(), " ms (a stopped or hung process?)"));
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(10000));
  }
}

void unlock_file(int fd) {
  struct flock fl {};
  fl.l_type = F_UNLCK;
  fl.l_whence = SEEK_SET;
  (void)::fcntl(fd, F_SETLK, &fl);
}

std::string names(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) s += (i ? ", " : "") + keys[i];
  if (keys.size() > 8) s += str_cat(", ... (", keys.size(), " keys)");
  return s;
}

// At most 32 bytes of a value, non-printable ones as \xNN, for error messages.
std::string preview(const Bytes& v) {
  static const char* hex = "0123456789abcdef";
  std::string s = "'";
  for (size_t i = 0; i < v.size() && i < 32; ++i) {
    uint8_t c = v[i];
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      s.push_back(static_cast<char>(c));
    } else {
      s += "\\x";
      s.push_back(hex[c >> 4]);
      s.push_back(hex[c & 15]);
    }
  }
  s += v.size() > 32 ? "'..." : "'";
  return s;
}

}  // namespace

// The process mutex and the file's record lock, released in the reverse order.
class FileStore::Locked {
 public:
  explicit Locked(const FileStore& s) : Locked(s, s.timeout_) {}
  Locked(const FileStore& s, Millis timeout) : guard_(process_mutex()), fd_(s.fd_) {
    lock_file(fd_, s.describe(), timeout);
  }
  ~Locked() { unlock_file(fd_); }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;

 private:
  std::lock_guard<std::mutex> guard_;
  int fd_;
};

FileStore::FileStore(std::string path, Millis timeout) : timeout_(timeout) {
  if (path.empty()) throw InvalidArgument("FileStore: the path is empty");
  if (path[0] != '/') {  // absolute, so that a later chdir does not move the file
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd))) path = str_cat(cwd, "/", path);
  }
  path_ = std::move(path);
  owner_pid_ = ::getpid();
  auto close_fd = [this] {
    std::lock_guard<std::mutex> g(process_mutex());
    ::close(fd_);
    fd_ = -1;
  };
  for (;;) {
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
      int err = errno;
      throw InvalidArgument(str_cat("FileStore: cannot open or create ", path_, ": ", errno_text(err),
                                    err == ENOENT ? " (does the directory exist on every node?)"
                                                  : ""));
    }
    fd_ = fd;
    try {
      struct stat st {};
      if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode))
        throw InvalidArgument(str_cat("FileStore: ", path_, " is not a regular file"));
      bool joined = false;
      {
        Locked lock(*this);
        // The last user of an earlier store on this path may have unlinked the file between
        // our open and our lock: open the path again (a fresh file).
        if (same_file()) {
          refresh();
          add_locked(kUsersKey, 1);
          joined = true;
        }
      }
      if (joined) return;
    } catch (...) {
      close_fd();
      throw;
    }
    close_fd();
    offset_ = 0;
    data_.clear();
  }
}

FileStore::~FileStore() {
  if (fd_ < 0) return;
  if (::getpid() == owner_pid_) {  // not a forked child's copy
    try {
      Locked lock(*this);
      refresh();
      if (add_locked(kUsersKey, -1) <= 0 && same_file()) ::unlink(path_.c_str());
    } catch (...) {
      // A destructor cannot throw; a corrupted or vanished file stays for the user to delete.
    }
  }
  std::lock_guard<std::mutex> g(process_mutex());
  ::close(fd_);
}

std::string FileStore::describe() const { return str_cat("file store ", path_); }

bool FileStore::same_file() const {
  struct stat a {}, b {};
  if (::fstat(fd_, &a) != 0 || ::stat(path_.c_str(), &b) != 0) return false;
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

void FileStore::corrupted(uint64_t offset, const std::string& why) const {
  throw Error(str_cat(describe(), ": not a meshcoll FileStore file, or corrupted (", why,
                      " at byte offset ", offset,
                      "); delete it or use a fresh path (one per job)"));
}

void FileStore::refresh() {
  struct stat st {};
  if (::fstat(fd_, &st) != 0)
    throw SystemError(str_cat(describe(), ": fstat failed: ", errno_text(errno)));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < offset_)
    corrupted(size, str_cat("the file shrank from ", offset_, " bytes"));
  if (offset_ == 0) {
    if (size == 0) {  // we created it, or a `touch`ed file: write the header
      std::string h(kMagic, sizeof(kMagic));
      put_u32(h, kVersion);
      if (!pwrite_all(fd_, h.data(), h.size(), 0)) {
        int err = errno;
        (void)!::ftruncate(fd_, 0);
        throw SystemError(str_cat(describe(), ": writing the header failed: ", errno_text(err)));
      }
      offset_ = kHeaderBytes;
      return;
    }
    char h[kHeaderBytes];
    ssize_t got = pread_all(fd_, h, sizeof(h), 0);
    if (got < 0) throw SystemError(str_cat(describe(), ": read failed: ", errno_text(errno)));
    if (static_cast<uint64_t>(got) < kHeaderBytes || std::memcmp(h, kMagic, sizeof(kMagic)) != 0)
      corrupted(0, "no FileStore header");
    uint32_t version = get_u32(h + 4);
    if (version != kVersion)
      throw Error(str_cat(describe(), ": FileStore format version ", version,
                          " is not supported (this meshcoll reads ", kVersion,
                          "); use the same meshcoll version on every rank, or a fresh path"));
    offset_ = kHeaderBytes;
  }
  if (size == offset_) return;
  std::string buf(size - offset_, '\0');
  ssize_t got = pread_all(fd_, buf.data(), buf.size(), offset_);
  if (got < 0) throw SystemError(str_cat(describe(), ": read failed: ", errno_text(errno)));
  if (static_cast<size_t>(got) != buf.size())  // only a non-FileStore writer can shrink it
    corrupted(offset_ + static_cast<uint64_t>(got), "the file ends before its size");
  size_t pos = 0;
  while (pos < buf.size()) {
    const uint64_t at = offset_;  // of this record
    const size_t left = buf.size() - pos;
    if (left < 5) corrupted(at, "truncated record");
    uint8_t op = static_cast<uint8_t>(buf[pos]);
    if (op != kOpSet && op != kOpDelete) corrupted(at, str_cat("unknown record type ", int(op)));
    uint32_t klen = get_u32(&buf[pos + 1]);
    if (klen > kMaxKeyBytes) corrupted(at, str_cat("key length ", klen));
    if (left < 9ull + klen) corrupted(at, "truncated record");
    uint32_t vlen = get_u32(&buf[pos + 5 + klen]);
    if (vlen > kMaxValueBytes) corrupted(at, str_cat("value length ", vlen));
    if (left < 9ull + klen + vlen) corrupted(at, "truncated record");
    std::string key = buf.substr(pos + 5, klen);
    if (op == kOpSet) {
      const char* v = &buf[pos + 9 + klen];
      data_[key] = Bytes(v, v + vlen);
    } else {
      data_.erase(key);
    }
    pos += 9ull + klen + vlen;
    offset_ += 9ull + klen + vlen;
  }
}

void FileStore::append(uint8_t op, const std::string& key, const Bytes& value) {
  std::string rec;
  rec.reserve(9 + key.size() + value.size());
  rec.push_back(static_cast<char>(op));
  put_u32(rec, static_cast<uint32_t>(key.size()));
  rec += key;
  put_u32(rec, static_cast<uint32_t>(value.size()));
  rec.append(value.begin(), value.end());
  if (!pwrite_all(fd_, rec.data(), rec.size(), offset_)) {
    int err = errno;
    (void)!::ftruncate(fd_, static_cast<off_t>(offset_));  // no torn record for the others
    throw SystemError(str_cat(describe(), ": writing a record failed: ", errno_text(err)));
  }
  offset_ += rec.size();
  if (op == kOpSet) {
    data_[key] = value;
  } else {
    data_.erase(key);
  }
}

int64_t FileStore::add_locked(const std::string& key, int64_t delta) {
  auto it = data_.find(key);
  const Bytes none;
  const Bytes& cur = it == data_.end() ? none : it->second;
  int64_t result = 0;
  switch (add_decimal(cur, delta, &result)) {
    case AddResult::kOk: break;
    case AddResult::kNotDecimal:
      throw InvalidArgument(str_cat(describe(), ": add(", key, "): the value ", preview(cur),
                                    " is not a decimal int64"));
    case AddResult::kOverflow:
      throw InvalidArgument(str_cat(describe(), ": add(", key, ", ", delta, "): ",
                                    std::string(cur.begin(), cur.end()),
                                    " + delta overflows int64"));
  }
  std::string s = std::to_string(result);
  append(kOpSet, key, Bytes(s.begin(), s.end()));
  return result;
}

void FileStore::check_key(const char* what, const std::string& key, bool writes) const {
  if (key.size() > kMaxKeyBytes)
    throw InvalidArgument(str_cat(describe(), ": ", what, ": key of ", key.size(),
                                  " bytes exceeds ", kMaxKeyBytes));
  if (writes && key == kUsersKey)
    throw InvalidArgument(str_cat(describe(), ": ", what, "(", key,
                                  "): the key is reserved by the file store"));
}

template <class Ready>
void FileStore::poll_until(const Deadline& d, Ready ready, const char* what,
                           const std::vector<std::string>& keys) {
  Millis backoff = kFirstBackoff;
  for (;;) {
    std::vector<std::string> missing;
    bool expired;
    {
      Locked lock(*this);
      refresh();
      if (ready()) return;
      expired = d.expired();
      if (expired) {
        for (const auto& k : keys)
          if (!data_.count(k)) missing.push_back(k);
      }
    }
    if (expired)
      throw TimeoutError(str_cat(describe(), ": ", what, "(", names(keys), ") timed out after ",
                                 d.timeout().count(), " ms; not set: ", names(missing),
                                 " (every rank must use the same path on a filesystem they all see)"));
    int left = d.poll_ms();
    Millis nap = left < 0 ? backoff : std::min(backoff, Millis(left));
    std::this_thread::sleep_for(nap);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

void FileStore::set(const std::string& key, const Bytes& value, Millis timeout) {
  check_key("set", key, true);
  if (value.size() > kMaxValueBytes)
    throw InvalidArgument(str_cat(describe(), ": set(", key, "): value of ", value.size(),
                                  " bytes exceeds ", kMaxValueBytes));
  Locked lock(*this, timeout);
  refresh();
  append(kOpSet, key, value);
}

Bytes FileStore::get(const std::string& key, Millis timeout) {
  check_key("get", key, false);
  Bytes out;
  poll_until(Deadline(timeout), [&] {
    auto it = data_.find(key);
    if (it == data_.end()) return false;
    out = it->second;
    return true;
  }, "get", {key});
  return out;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  check_key("add", key, true);
  Locked lock(*this);
  refresh();
  return add_locked(key, delta);
}

Bytes FileStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  check_key("compare_set", key, true);
  if (desired.size() > kMaxValueBytes)
    throw InvalidArgument(str_cat(describe(), ": compare_set(", key, "): value of ",
                                  desired.size(), " bytes exceeds ", kMaxValueBytes));
  Locked lock(*this);
  refresh();
  auto it = data_.find(key);
  bool absent = it == data_.end();
  if ((absent && expected.empty()) || (!absent && it->second == expected)) {
    append(kOpSet, key, desired);
    return desired;
  }
  return absent ? Bytes() : it->second;
}

void FileStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  for (const auto& k : keys) check_key("wait", k, false);
  poll_until(Deadline(timeout), [&] {
    for (const auto& k : keys)
      if (!data_.count(k)) return false;
    return true;
  }, "wait", keys);
}

bool FileStore::check(const std::vector<std::string>& keys, Millis timeout) {
  for (const auto& k : keys) check_key("check", k, false);
  Locked lock(*this, timeout);
  refresh();
  for (const auto& k : keys)
    if (!data_.count(k)) return false;
  return true;
}

bool FileStore::delete_key(const std::string& key) {
  check_key("delete_key", key, true);
  Locked lock(*this);
  refresh();
  if (!data_.count(key)) return false;
  append(kOpDelete, key, Bytes());
  return true;
}

int64_t FileStore::num_keys() {
  Locked lock(*this);
  refresh();
  return static_cast<int64_t>(data_.size() - data_.count(kUsersKey));
}

}  // namespace meshcoll::store
