#include "core/errors.h"

namespace plait {

namespace {
template <class E>
[[noreturn]] void raise(const std::string& msg, std::shared_ptr<const std::string> flight) {
  E e(msg);
  e.flight = std::move(flight);
  throw e;
}
}  // namespace

void throw_error(ErrorKind kind, const std::string& msg,
                 std::shared_ptr<const std::string> flight) {
  switch (kind) {
    case ErrorKind::invalid:
      raise<InvalidArgument>(msg, std::move(flight));
    case ErrorKind::mismatch:
      raise<MismatchError>(msg, std::move(flight));
    case ErrorKind::timeout:
      raise<TimeoutError>(msg, std::move(flight));
    case ErrorKind::peer_lost:
      raise<PeerLostError>(msg, std::move(flight));
    default:
      raise<PlaitError>(msg, std::move(flight));
  }
}

}  // namespace plait
