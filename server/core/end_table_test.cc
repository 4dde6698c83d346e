#include "server/core/end_table.h"

#include <map>
#include <random>

#include "gtest/gtest.h"
#include "server/core/radix_tree.h"

namespace kvcm {
namespace {

RadixNode* Fake(uintptr_t n) { return reinterpret_cast<RadixNode*>(n * 64); }

TEST(EndTableTest, FindsWhatWasSetUntilItIsErased) {
  EndTable t;
  EXPECT_EQ(t.Find({1, 1}), nullptr);
  t.Set({1, 1}, Fake(1), Fake(2));
  const EndTable::Entry* e = t.Find({1, 1});
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->node, Fake(1));
  EXPECT_EQ(e->parent, Fake(2));
  t.SetParentIf({1, 1}, Fake(9), Fake(3));  // not its node: unchanged
  EXPECT_EQ(t.Find({1, 1})->parent, Fake(2));
  t.SetParentIf({1, 1}, Fake(1), Fake(3));
  EXPECT_EQ(t.Find({1, 1})->parent, Fake(3));
  t.EraseIf({1, 1}, Fake(9));  // not its node: kept
  EXPECT_NE(t.Find({1, 1}), nullptr);
  t.EraseIf({1, 1}, Fake(1));
  EXPECT_EQ(t.Find({1, 1}), nullptr);
  EXPECT_EQ(t.size(), 0u);
}

// Random sets and erases against a std::map, with keys that share their low word (what a
// client choosing hashes could send) and keys that differ only there.
TEST(EndTableTest, AgreesWithAMapUnderChurnAndCollidingKeys) {
  for (bool colliding : {false, true}) {
    EndTable t;
    std::map<PageHash, std::pair<RadixNode*, RadixNode*>> model;
    std::mt19937_64 rng(colliding ? 7 : 8);
    for (int step = 0; step < 20000; ++step) {
      const uint64_t k = rng() % 3000;
      const PageHash page = colliding ? PageHash{42, k} : PageHash{k, 0};
      const int op = static_cast<int>(rng() % 3);
      if (op < 2) {
        RadixNode* node = Fake(1 + rng() % 100);
        RadixNode* parent = Fake(1 + rng() % 100);
        t.Set(page, node, parent);
        model[page] = {node, parent};
      } else if (auto it = model.find(page); it != model.end()) {
        t.EraseIf(page, it->second.first);
        model.erase(it);
      }
      if (step % 997 == 0 || step == 19999) {
        ASSERT_EQ(t.size(), model.size());
        ASSERT_LE(2 * t.size(), t.capacity());
        for (uint64_t q = 0; q < 3000; ++q) {
          const PageHash p = colliding ? PageHash{42, q} : PageHash{q, 0};
          const EndTable::Entry* e = t.Find(p);
          auto it = model.find(p);
          ASSERT_EQ(e != nullptr, it != model.end()) << q;
          if (e != nullptr) {
            EXPECT_EQ(e->node, it->second.first);
            EXPECT_EQ(e->parent, it->second.second);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvcm
