#include "core/errors.h"

namespace plait {

void throw_error(ErrorKind kind, const std::string& msg) {
  switch (kind) {
    case ErrorKind::invalid: throw InvalidArgument(msg);
    case ErrorKind::mismatch: throw MismatchError(msg);
    case ErrorKind::timeout: throw TimeoutError(msg);
    case ErrorKind::peer_lost: throw PeerLostError(msg);
    default: throw PlaitError(msg);
  }
}

}  // namespace plait
