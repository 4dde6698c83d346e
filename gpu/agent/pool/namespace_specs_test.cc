#include "gpu/agent/pool/namespace_specs.h"

#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::Optional;

TEST(NamespaceSpecsTest, TheLastSetWins) {
  NamespaceSpecs specs;
  const NamespaceId a{"t", "a"}, b{"t", "b"};
  EXPECT_EQ(specs.Get(a), std::nullopt);
  specs.Set(a, SmallGqa());
  ModelSpec wide = SmallGqa();
  wide.num_layers = 4;
  specs.Set(b, wide);
  EXPECT_THAT(specs.Get(a), Optional(SmallGqa()));
  specs.Set(a, wide);
  EXPECT_THAT(specs.Get(a), Optional(wide));
  const absl::flat_hash_map<NamespaceId, ModelSpec> all = specs.Snapshot();
  EXPECT_EQ(all.size(), 2u);
  EXPECT_EQ(all.at(b), wide);
}

// The inventory reports the layout the pages were written in, even after a commit from a
// manager that has not heard the layout again (empty: not stated); another layout, or
// another geometry, replaces it as before.
TEST(NamespaceSpecsTest, ACommitWithoutALayoutKeepsTheRecordedOne) {
  NamespaceSpecs specs;
  const NamespaceId ns{"t", "a"};
  ModelSpec with_layout = SmallGqa();
  with_layout.kv_layout = "vllm-cpu:[kv_heads,block,2*head_dim]:bf16";
  specs.Set(ns, with_layout);
  specs.Set(ns, SmallGqa(), 60);
  EXPECT_THAT(specs.Get(ns), Optional(with_layout));
  EXPECT_EQ(specs.MaxPageAgeS(ns), 60u);

  ModelSpec other = with_layout;
  other.kv_layout = "flash-attn:[2,block,heads,dim]:bf16";
  specs.Set(ns, other);
  EXPECT_THAT(specs.Get(ns), Optional(other));

  ModelSpec wide = SmallGqa();
  wide.num_layers = 4;
  specs.Set(ns, wide);
  EXPECT_THAT(specs.Get(ns), Optional(wide));
}

TEST(NamespaceSpecsTest, SetAndSnapshotMayRunConcurrently) {
  NamespaceSpecs specs;
  std::thread writer([&] {
    for (int i = 0; i < 1000; ++i) specs.Set(NamespaceId{"t", absl::StrCat("m", i)}, SmallGqa());
  });
  size_t seen = 0;
  while (seen < 1000) {
    const size_t now = specs.Snapshot().size();
    EXPECT_GE(now, seen);  // entries are never removed
    seen = now;
  }
  writer.join();
  EXPECT_THAT(specs.Get(NamespaceId{"t", "m999"}), Optional(SmallGqa()));
}

}  // namespace
}  // namespace kvcm
