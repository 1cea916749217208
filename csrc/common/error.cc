#include "common/error.h"

#include <cstring>

namespace meshcoll {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* s = strerror_r(err, buf, sizeof(buf));
  return str_cat(s, " (errno ", err, ")");
}

}  // namespace meshcoll
