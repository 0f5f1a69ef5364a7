// plait's exception hierarchy; each class maps one-to-one onto a Python exception in plait._errors.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>

namespace plait {

enum class ErrorKind : uint32_t { none = 0, generic, invalid, mismatch, timeout, peer_lost };

class PlaitError : public std::runtime_error {
 public:
  explicit PlaitError(const std::string& msg, ErrorKind kind = ErrorKind::generic)
      : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  // The flight recorder's report (JSON) for errors that come with one (core/flight.h).
  std::shared_ptr<const std::string> flight;

 private:
  ErrorKind kind_;
};

struct InvalidArgument : PlaitError {
  explicit InvalidArgument(const std::string& m) : PlaitError(m, ErrorKind::invalid) {}
};
struct MismatchError : PlaitError {
  explicit MismatchError(const std::string& m) : PlaitError(m, ErrorKind::mismatch) {}
};
struct TimeoutError : PlaitError {
  explicit TimeoutError(const std::string& m) : PlaitError(m, ErrorKind::timeout) {}
};
struct PeerLostError : PlaitError {
  explicit PeerLostError(const std::string& m) : PlaitError(m, ErrorKind::peer_lost) {}
};

// Rethrows a stored (kind, message[, flight report]) as the matching class.
[[noreturn]] void throw_error(ErrorKind kind, const std::string& msg,
                              std::shared_ptr<const std::string> flight = nullptr);

}  // namespace plait
