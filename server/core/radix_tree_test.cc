#include "server/core/radix_tree.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

std::vector<PageHash> Pages(std::initializer_list<uint64_t> ids) {
  std::vector<PageHash> out;
  for (uint64_t id : ids) out.push_back(PageHash{id, ~id});
  return out;
}

TEST(RadixTreeTest, WalkFindsLongestPrefixAcrossNodes) {
  RadixTree tree(nullptr);
  std::vector<PageHash> a = Pages({1, 2, 3}), b = Pages({4, 5});
  RadixNode* n1 = tree.AddChild(tree.root(), a);
  tree.AddChild(n1, b);
  std::vector<PathStep> path;
  EXPECT_EQ(tree.Walk(Pages({1, 2, 3, 4, 5, 6}), &path), 5u);
  ASSERT_EQ(path.size(), 2u);
  EXPECT_EQ(path[0].matched, 3u);
  EXPECT_EQ(path[1].first_page, 3u);
  EXPECT_EQ(path[1].matched, 2u);
  EXPECT_EQ(tree.Walk(Pages({1, 2, 9}), &path), 2u);
  ASSERT_EQ(path.size(), 1u);
  EXPECT_EQ(path[0].matched, 2u);  // ends inside n1
  EXPECT_EQ(tree.Walk(Pages({7}), &path), 0u);
  EXPECT_TRUE(path.empty());
  EXPECT_EQ(tree.nodes(), 2u);
  EXPECT_EQ(tree.pages(), 5u);
}

TEST(RadixTreeTest, SplitKeepsChildrenAndBlockIds) {
  RadixTree tree(nullptr);
  RadixNode* n = tree.AddChild(tree.root(), Pages({1, 2, 3, 4}));
  n->replicas.push_back(Replica{.pool = 7, .block_ids = {10, 11, 12, 13}});
  n->pin_count = 2;
  n->last_access = 99;
  RadixNode* child = tree.AddChild(n, Pages({5}));

  RadixNode* head = tree.Split(n, 1);
  EXPECT_EQ(head->pages, Pages({1}));
  EXPECT_EQ(n->pages, Pages({2, 3, 4}));
  EXPECT_EQ(head->replicas[0].block_ids, (std::vector<BlockId>{10}));
  EXPECT_EQ(head->replicas[0].child_refs, 1u);
  EXPECT_EQ(n->replicas[0].block_ids, (std::vector<BlockId>{11, 12, 13}));
  EXPECT_EQ(head->pin_count, 2u);
  EXPECT_EQ(head->last_access, 99u);
  EXPECT_EQ(n->parent, head);
  EXPECT_EQ(child->parent, n);
  EXPECT_EQ(tree.nodes(), 3u);
  EXPECT_EQ(tree.pages(), 5u);

  std::vector<PathStep> path;
  EXPECT_EQ(tree.Walk(Pages({1, 2, 3, 4, 5}), &path), 5u);
  EXPECT_EQ(path.size(), 3u);
}

TEST(RadixTreeTest, RemoveLeaf) {
  RadixTree tree(nullptr);
  RadixNode* n = tree.AddChild(tree.root(), Pages({1, 2}));
  RadixNode* leaf = tree.AddChild(n, Pages({3}));
  tree.Remove(leaf);
  std::vector<PathStep> path;
  EXPECT_EQ(tree.Walk(Pages({1, 2, 3}), &path), 2u);
  EXPECT_EQ(tree.nodes(), 1u);
  EXPECT_EQ(tree.pages(), 2u);
}

}  // namespace
}  // namespace kvcm
