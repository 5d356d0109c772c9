// Internal error type of the capture library: a C status code plus a one-line message.
// Thrown inside the library and turned into a return value at the C boundary.
#pragma once

#include <stdexcept>
#include <string>

#include "kvscope_capture.h"

namespace kvscope::capture::detail {

class Failure : public std::runtime_error {
 public:
  Failure(kvscope_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  kvscope_status status() const { return status_; }

 private:
  kvscope_status status_;
};

[[noreturn]] inline void fail(kvscope_status status, const std::string& message) {
  throw Failure(status, message);
}

}  // namespace kvscope::capture::detail
