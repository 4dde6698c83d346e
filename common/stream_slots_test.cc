#include "common/stream_slots.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<const Principal> Named(std::string name) {
  auto p = std::make_shared<Principal>();
  p->name = std::move(name);
  return p;
}

TEST(StreamSlotsTest, RefusesBeyondTheCapNamingTheOptionAndFreesOnRelease) {
  std::shared_ptr<StreamSlots> slots = StreamSlots::Create(2, "max_streams_per_principal");
  const std::shared_ptr<const Principal> a = Named("tenant-a");
  const std::shared_ptr<const Principal> b = Named("tenant-b");
  absl::StatusOr<std::shared_ptr<const Principal>> a1 = slots->Hold(a, "WatchEvents");
  absl::StatusOr<std::shared_ptr<const Principal>> a2 = slots->Hold(a, "WatchEvents");
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ((*a1)->name, "tenant-a");
  EXPECT_EQ(slots->InUse("tenant-a"), 2u);

  absl::StatusOr<std::shared_ptr<const Principal>> a3 = slots->Hold(a, "WatchEvents");
  EXPECT_TRUE(absl::IsResourceExhausted(a3.status()));
  EXPECT_THAT(a3.status().message(), HasSubstr("max_streams_per_principal = 2"));
  EXPECT_THAT(a3.status().message(), HasSubstr("WatchEvents"));
  EXPECT_EQ(slots->InUse("tenant-a"), 2u);  // the refusal changed nothing

  // Another principal is not affected.
  EXPECT_TRUE(slots->Hold(b, "Commands").ok());  // released at once (temporary)
  EXPECT_EQ(slots->InUse("tenant-b"), 0u);

  // A copy keeps the slot; the last copy gives it back.
  std::shared_ptr<const Principal> copy = *a1;
  a1 = absl::CancelledError("gone");
  EXPECT_EQ(slots->InUse("tenant-a"), 2u);
  copy.reset();
  EXPECT_EQ(slots->InUse("tenant-a"), 1u);
  EXPECT_TRUE(slots->Hold(a, "WatchEvents").ok());
}

TEST(StreamSlotsTest, PassesErrorsAndTheOpenPrincipalThrough) {
  std::shared_ptr<StreamSlots> slots = StreamSlots::Create(1, "max_streams_per_principal");
  EXPECT_TRUE(absl::IsUnauthenticated(
      slots->Hold(absl::UnauthenticatedError("no token"), "Commands").status()));
  std::vector<std::shared_ptr<const Principal>> held;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<std::shared_ptr<const Principal>> p = slots->Hold(OpenPrincipal(), "Commands");
    ASSERT_TRUE(p.ok());
    held.push_back(*p);
  }
}

}  // namespace
}  // namespace kvcm
