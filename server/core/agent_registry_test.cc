#include "server/core/agent_registry.h"

#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/clock.h"

namespace kvcm {
namespace {

AgentRegistration Reg(const std::string& id, uint64_t epoch) {
  AgentRegistration r;
  r.agent_id = id;
  r.device = "host";
  r.tier = Tier::kGpu;
  r.bytes_per_block = 4096;
  r.num_blocks = 10;
  r.epoch = epoch;
  r.capacity_bytes = 1 << 20;
  return r;
}

TEST(AgentRegistryTest, HeartbeatTimeoutMarksGoneAndHeartbeatRevives) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Milliseconds(500));
  ASSERT_TRUE(registry.Register(Reg("a", 7)).ok());
  ASSERT_EQ(registry.Snapshot().size(), 1u);
  EXPECT_TRUE(registry.Snapshot()[0].alive);

  clock.Advance(absl::Milliseconds(400));
  ASSERT_TRUE(registry.Heartbeat("a", 7, {.used_bytes = 4096, .free_blocks = 3}).ok());
  clock.Advance(absl::Milliseconds(500));
  EXPECT_TRUE(registry.Snapshot()[0].alive);  // exactly the timeout: still alive
  clock.Advance(absl::Milliseconds(1));
  std::vector<AgentInfo> agents = registry.Snapshot();
  EXPECT_FALSE(agents[0].alive);
  EXPECT_EQ(agents[0].last_heartbeat_age, absl::Milliseconds(501));
  EXPECT_EQ(agents[0].usage.used_bytes, 4096u);
  EXPECT_EQ(agents[0].usage.free_blocks, 3u);
  EXPECT_EQ(agents[0].heartbeats, 1u);
  AgentCounts counts = registry.Counts();
  EXPECT_EQ(counts.alive, 0u);
  EXPECT_EQ(counts.gone, 1u);
  EXPECT_EQ(counts.heartbeats_total, 1u);

  ASSERT_TRUE(registry.Heartbeat("a", 7, {.used_bytes = 0, .free_blocks = 4}).ok());
  EXPECT_TRUE(registry.Snapshot()[0].alive);
  EXPECT_EQ(registry.Counts().alive, 1u);
}

TEST(AgentRegistryTest, StaleEpochIsAbortedAndChangesNothing) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Seconds(1));
  ASSERT_TRUE(registry.Register(Reg("a", 10)).ok());
  EXPECT_EQ(registry.CheckRegister(Reg("a", 9)).status().code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(registry.CheckRegister(Reg("a", 10))->new_epoch);
  EXPECT_TRUE(registry.CheckRegister(Reg("b", 1))->new_epoch);
  AgentRegistration old = Reg("a", 9);
  old.device = "cuda:3";
  EXPECT_EQ(registry.Register(old).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(registry.Snapshot()[0].registration.device, "host");
  EXPECT_EQ(registry.Heartbeat("a", 9, {}).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(registry.Heartbeat("a", 11, {}).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(registry.Counts().heartbeats_total, 0u);
}

TEST(AgentRegistryTest, UnknownAgentIsNotFound) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Seconds(1));
  EXPECT_EQ(registry.Heartbeat("nobody", 1, {}).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Snapshot().empty());
}

TEST(AgentRegistryTest, NewEpochReplacesAndResetsUsage) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Seconds(1));
  ASSERT_TRUE(registry.Register(Reg("b", 1)).ok());
  absl::StatusOr<RegisterOutcome> first = registry.Register(Reg("a", 1));
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->new_epoch);
  ASSERT_TRUE(registry.Heartbeat("a", 1, {.used_bytes = 100, .free_blocks = 5}).ok());
  absl::StatusOr<RegisterOutcome> refresh = registry.Register(Reg("a", 1));
  ASSERT_TRUE(refresh.ok());
  EXPECT_FALSE(refresh->new_epoch);  // same epoch: a refresh keeps usage
  EXPECT_EQ(registry.Snapshot()[0].usage.used_bytes, 100u);
  absl::StatusOr<RegisterOutcome> restarted = registry.Register(Reg("a", 2));
  ASSERT_TRUE(restarted.ok());
  EXPECT_TRUE(restarted->new_epoch);
  std::vector<AgentInfo> agents = registry.Snapshot();
  ASSERT_EQ(agents.size(), 2u);
  EXPECT_EQ(agents[0].registration.agent_id, "a");  // agent_id order
  EXPECT_EQ(agents[0].registration.epoch, 2u);
  EXPECT_EQ(agents[0].usage.used_bytes, 0u);
  EXPECT_EQ(agents[0].heartbeats, 0u);
  EXPECT_EQ(registry.Heartbeat("a", 1, {}).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(registry.Heartbeat("a", 2, {}).ok());
}

TEST(AgentRegistryTest, FindPoolKnowsTheGeometryOfTheCurrentEpoch) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Milliseconds(500));
  AgentRegistration r = Reg("a", 7);
  r.bytes_per_block = 4096;
  r.num_blocks = 59;
  r.host_num_blocks = 100;
  ASSERT_TRUE(registry.Register(r).ok());
  std::optional<AgentPool> gpu = registry.FindPool(PoolKey{"a", r.tier});
  ASSERT_TRUE(gpu.has_value());
  EXPECT_EQ(gpu->epoch, 7u);
  EXPECT_EQ(gpu->num_blocks, 59u);
  EXPECT_EQ(gpu->bytes_per_block, 4096u);
  EXPECT_EQ(registry.FindPool(PoolKey{"a", Tier::kHost})->num_blocks, 100u);
  EXPECT_FALSE(registry.FindPool(PoolKey{"a", Tier::kDisk}).has_value());
  EXPECT_FALSE(registry.FindPool(PoolKey{"b", r.tier}).has_value());
}

TEST(AgentRegistryTest, TakeGoneDropsTheEpochOnce) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Milliseconds(500));
  ASSERT_TRUE(registry.Register(Reg("a", 3)).ok());
  ASSERT_TRUE(registry.Register(Reg("b", 1)).ok());
  EXPECT_TRUE(registry.TakeGone().empty());

  clock.Advance(absl::Milliseconds(400));
  ASSERT_TRUE(registry.Heartbeat("b", 1, {}).ok());
  clock.Advance(absl::Milliseconds(101));  // a: 501 ms silent, b: 101 ms
  std::vector<AgentRegistration> gone = registry.TakeGone();
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].agent_id, "a");
  EXPECT_EQ(gone[0].epoch, 3u);
  EXPECT_TRUE(registry.TakeGone().empty());  // taken once

  // Its heartbeats are NOT_FOUND: it registers again, with the same epoch when it kept its
  // blocks, and that counts as new (the index dropped its pages; its inventory restores them).
  absl::Status beat = registry.Heartbeat("a", 3, {});
  EXPECT_EQ(beat.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(beat.message().find("register again"), absl::string_view::npos) << beat;
  EXPECT_FALSE(registry.FindPool(PoolKey{"a", Tier::kGpu}).has_value());
  EXPECT_FALSE(registry.Snapshot()[0].alive);
  EXPECT_EQ(registry.Counts().gone, 1u);

  absl::StatusOr<RegisterOutcome> back = registry.Register(Reg("a", 3));
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->new_epoch);
  EXPECT_TRUE(registry.Snapshot()[0].alive);
  EXPECT_TRUE(registry.Heartbeat("a", 3, {}).ok());
  // Registering the same epoch again while alive is a refresh, not a new epoch.
  back = registry.Register(Reg("a", 3));
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->new_epoch);
  EXPECT_TRUE(registry.Register(Reg("a", 4))->new_epoch);
}

// A gone agent is remembered for gone_memory after TakeGone dropped it, then forgotten once;
// one that comes back within the memory is not forgotten.
TEST(AgentRegistryTest, GoneAgentsAreForgottenAfterTheMemory) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Milliseconds(500), absl::Minutes(5), absl::Minutes(10));
  ASSERT_TRUE(registry.Register(Reg("a", 3)).ok());
  ASSERT_TRUE(registry.Register(Reg("b", 1)).ok());
  clock.Advance(absl::Seconds(1));
  ASSERT_EQ(registry.TakeGone().size(), 2u);
  ASSERT_TRUE(registry.Register(Reg("b", 1)).ok());  // b comes back (kept its blocks)
  clock.Advance(absl::Minutes(10) - absl::Milliseconds(1));
  EXPECT_TRUE(registry.TakeForgotten().empty());
  EXPECT_EQ(registry.Counts().gone, 2u) << "a, and b silent again since";

  clock.Advance(absl::Milliseconds(1));
  std::vector<AgentRegistration> forgotten = registry.TakeForgotten();
  ASSERT_EQ(forgotten.size(), 1u);
  EXPECT_EQ(forgotten[0].agent_id, "a");
  EXPECT_TRUE(registry.TakeForgotten().empty()) << "once";
  ASSERT_EQ(registry.Snapshot().size(), 1u);
  EXPECT_EQ(registry.Snapshot()[0].registration.agent_id, "b");
  EXPECT_EQ(registry.Heartbeat("a", 3, {}).code(), absl::StatusCode::kNotFound);
}

// An agent that leaves is forgotten at once; a stale epoch or an unknown id changes nothing.
TEST(AgentRegistryTest, ForgetTakesTheRegisteredEpochOnly) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Milliseconds(500));
  ASSERT_TRUE(registry.Register(Reg("a", 3)).ok());
  EXPECT_EQ(registry.Forget("a", 2).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(registry.Forget("z", 3).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Counts().alive, 1u);
  absl::StatusOr<AgentRegistration> left = registry.Forget("a", 3);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->agent_id, "a");
  EXPECT_TRUE(registry.Snapshot().empty());
  EXPECT_EQ(registry.Counts().alive + registry.Counts().gone, 0u);
  EXPECT_FALSE(registry.FindPool(PoolKey{"a", Tier::kGpu}).has_value());
}

// An operator forgets a gone agent at once, whether or not TakeGone dropped it yet; a live
// one only with force; each refusal changes nothing.
TEST(AgentRegistryTest, ForgetNowTakesAGoneAgentOrALiveOneWithForce) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Milliseconds(500));
  ASSERT_TRUE(registry.Register(Reg("a", 3)).ok());
  ASSERT_TRUE(registry.Register(Reg("b", 4)).ok());
  ASSERT_TRUE(registry.Register(Reg("c", 5)).ok());
  EXPECT_EQ(registry.ForgetNow("z", false).status().code(), absl::StatusCode::kNotFound);
  const absl::Status live = registry.ForgetNow("a", false).status();
  EXPECT_EQ(live.code(), absl::StatusCode::kFailedPrecondition) << live;
  EXPECT_THAT(std::string(live.message()), ::testing::HasSubstr("force"));
  EXPECT_EQ(registry.Counts().alive, 3u);
  EXPECT_TRUE(registry.Heartbeat("a", 3, {}).ok());

  absl::StatusOr<AgentInfo> forced = registry.ForgetNow("a", true);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_TRUE(forced->alive);
  EXPECT_EQ(forced->registration.epoch, 3u);
  EXPECT_EQ(registry.Heartbeat("a", 3, {}).code(), absl::StatusCode::kNotFound);

  // c is gone and dropped (TakeGone); b is gone too, but not dropped yet.
  clock.Advance(absl::Seconds(1));
  ASSERT_EQ(registry.TakeGone().size(), 2u);
  ASSERT_TRUE(registry.Register(Reg("b", 6)).ok());
  clock.Advance(absl::Seconds(1));
  for (const char* id : {"b", "c"}) {
    absl::StatusOr<AgentInfo> gone = registry.ForgetNow(id, false);
    ASSERT_TRUE(gone.ok()) << id << ": " << gone.status();
    EXPECT_FALSE(gone->alive);
  }
  EXPECT_TRUE(registry.Snapshot().empty());
  EXPECT_EQ(registry.ForgetNow("c", true).status().code(), absl::StatusCode::kNotFound);
}

// An epoch is a start time in microseconds since the Unix epoch: one too far ahead of the
// clock would lock the agent id's real process out (its restarts could never pass it).
TEST(AgentRegistryTest, AnEpochFarAheadOfTheClockIsOutOfRangeAndChangesNothing) {
  FakeClock clock;
  AgentRegistry registry(&clock, absl::Seconds(10), absl::Minutes(5));
  const uint64_t now_us = static_cast<uint64_t>(absl::ToUnixMicros(clock.Now()));
  const uint64_t limit_us = now_us + 300'000'000;
  ASSERT_TRUE(registry.Register(Reg("a", now_us)).ok());
  ASSERT_TRUE(registry.Heartbeat("a", now_us, {.used_bytes = 4096}).ok());

  for (uint64_t ahead : {limit_us + 1, std::numeric_limits<uint64_t>::max()}) {
    for (const char* id : {"a", "b"}) {
      AgentRegistration impostor = Reg(id, ahead);
      impostor.block_agent_address = "evil:1";
      absl::Status s = registry.CheckRegister(impostor).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
      s = registry.Register(impostor).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
      EXPECT_THAT(std::string(s.message()),
                  ::testing::StartsWith(absl::StrCat("epoch ", ahead, " of agent ", id)));
      EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("5m ahead"));
    }
  }
  // Nothing changed: "a" keeps its epoch, address and usage; "b" was never added.
  std::vector<AgentInfo> agents = registry.Snapshot();
  ASSERT_EQ(agents.size(), 1u);
  EXPECT_EQ(agents[0].registration.epoch, now_us);
  EXPECT_EQ(agents[0].registration.block_agent_address, "");
  EXPECT_EQ(agents[0].usage.used_bytes, 4096u);
  EXPECT_EQ(agents[0].heartbeats, 1u);
  EXPECT_TRUE(registry.Heartbeat("a", now_us, {}).ok());

  // A restarted agent (a later start time) registers; the bound itself is allowed.
  clock.Advance(absl::Seconds(30));
  EXPECT_TRUE(registry.Register(Reg("a", now_us + 30'000'000))->new_epoch);
  EXPECT_TRUE(registry.Register(Reg("a", limit_us + 30'000'000))->new_epoch);
  // Time makes a refused epoch acceptable: skew only delays, it never locks out.
  EXPECT_EQ(registry.Register(Reg("b", limit_us + 60'000'000)).status().code(),
            absl::StatusCode::kOutOfRange);
  clock.Advance(absl::Seconds(30));
  EXPECT_TRUE(registry.Register(Reg("b", limit_us + 60'000'000)).ok());
}

// A restarted manager has no history; the bound needs none, and an agent's epoch (its start,
// in the past) registers again as it was.
TEST(AgentRegistryTest, AFreshRegistryTakesAnAgentsOldEpoch) {
  FakeClock clock;
  const uint64_t started_us =
      static_cast<uint64_t>(absl::ToUnixMicros(clock.Now() - absl::Hours(24 * 30)));
  AgentRegistry restarted(&clock, absl::Seconds(10));
  EXPECT_TRUE(restarted.Register(Reg("a", started_us))->new_epoch);
  EXPECT_TRUE(restarted.Heartbeat("a", started_us, {}).ok());
}

}  // namespace
}  // namespace kvcm
