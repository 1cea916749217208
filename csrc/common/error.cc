#include "common/error.h"

#include <cstring>

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

}  // namespace meshcoll
