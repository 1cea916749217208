#include "common/error.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/config.h"

namespace meshcoll {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* s = strerror_r(err, buf, sizeof(buf));
  return str_cat(s, " (errno ", err, ")");
}

std::string message_of(const std::exception_ptr& e) {
  try {
    if (e) std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "unknown error";
}

void on_group_failure(const std::exception_ptr& e) {
  if (!config().abort_on_error) return;
  std::fprintf(stderr, "meshcoll: %s\nmeshcoll: ending the process (MESHCOLL_ON_ERROR=abort)\n",
               message_of(e).c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

std::exception_ptr same_type(std::exception_ptr e, const std::string& msg) {
  try {
    std::rethrow_exception(e);
  } catch (const MismatchError&) {
    return std::make_exception_ptr(MismatchError(msg));
  } catch (const TimeoutError&) {
    return std::make_exception_ptr(TimeoutError(msg));
  } catch (const PeerError&) {
    return std::make_exception_ptr(PeerError(msg));
  } catch (const Aborted&) {
    return std::make_exception_ptr(Aborted(msg));
  } catch (const InvalidArgument&) {
    return std::make_exception_ptr(InvalidArgument(msg));
  } catch (const TypeMismatch&) {
    return std::make_exception_ptr(TypeMismatch(msg));
  } catch (...) {
    return std::make_exception_ptr(Error(msg));
  }
}


}  // namespace meshcoll
