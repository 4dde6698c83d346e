#include "server/core/clock.h"

namespace kvcm {

Clock* RealClock::Get() {
  static RealClock* const clock = new RealClock();
  return clock;
}

}  // namespace kvcm
