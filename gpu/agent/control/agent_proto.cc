#include "gpu/agent/control/agent_proto.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "proto/core_types.h"

namespace kvcm {
void PoolGeometryToProto(const PoolGeometry& geometry, v1::PoolGeometry* out) {
  ModelSpecToProto(geometry.spec, out->mutable_spec());
  out->set_bytes_per_block(geometry.bytes_per_block());
  out->set_num_blocks(geometry.num_blocks);
}

}  // namespace kvcm
