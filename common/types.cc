#include "common/types.h"

#include "common/enum_names.h"

namespace kvcm {

std::string PoolKey::ToString() const { return absl::StrCat(agent_id, ":", TierName(tier)); }

}  // namespace kvcm
