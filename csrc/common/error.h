// Typed exceptions. Python maps each class 1:1 (csrc/python/bind_errors.cc):
//   Error -> MeshcollError, InvalidArgument -> ValueError, TypeMismatch -> TypeError,
//   TimeoutError -> meshcoll.TimeoutError, PeerError -> meshcoll.PeerError,
//   MismatchError -> meshcoll.MismatchError, Aborted -> meshcoll.AbortedError,
//   ConcurrentCall -> meshcoll.ConcurrentCallError.
// Messages name the rank, the operation, the peer and what to do; see docs in README.
#pragma once

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

namespace meshcoll {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class InvalidArgument : public Error {
 public:
  using Error::Error;
};
class TypeMismatch : public Error {  // unsupported dtype x op pairs and the like
 public:
  using Error::Error;
};
class TimeoutError : public Error {
 public:
  using Error::Error;
};
class PeerError : public Error {  // a peer closed its connection or died
 public:
  using Error::Error;
};
class MismatchError : public Error {  // ranks disagree on the collective they called
 public:
  using Error::Error;
};
class Aborted : public Error {  // the communicator was aborted earlier and is unusable
 public:
  using Error::Error;
};
class ConcurrentCall : public Error {  // two threads issued calls on one group at once
 public:
  using Error::Error;
};
class SystemError : public Error {  // a syscall failed (errno text included)
 public:
  using Error::Error;
};

// Builds a message from stream-able parts: MC_MSG("rank ", r, " peer ", p).
template <class... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// errno text for SystemError messages.
std::string errno_text(int err);

// The message of a caught exception (what() of a std::exception; "unknown error" otherwise,
// or for a null pointer).
std::string message_of(const std::exception_ptr& e);

// An exception of the same type as `e` (one of the classes above), with the message `msg`.
std::exception_ptr same_type(std::exception_ptr e, const std::string& msg);

// Called where a group fails (the CPU communicator, the NCCL watchdog): with
// MESHCOLL_ON_ERROR=abort, prints the failure to stderr and ends the process with exit code
// 1, as torch.distributed's watchdog does, instead of leaving it to the next call to raise.
void on_group_failure(const std::exception_ptr& e);

}  // namespace meshcoll
