#include "server/core/radix_tree.h"

#include <random>
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

// Page hashes as a client makes them: each chained to all before it.
std::vector<PageHash> Chain(const std::vector<uint32_t>& tokens) {
  std::vector<PageHash> out;
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (uint32_t t : tokens) {
    h = (h ^ t) * 0xff51afd7ed558ccdULL;
    h ^= h >> 29;
    out.push_back(PageHash{h, h * 31 + 7});
  }
  return out;
}

// The walk without shortcuts: a child by its first page, then page by page.
uint32_t ReferenceWalk(RadixTree& tree, std::span<const PageHash> pages,
                       std::vector<PathStep>* path) {
  path->clear();
  RadixNode* node = tree.root();
  uint32_t pos = 0;
  while (pos < pages.size()) {
    RadixNode* child = node->children.Find(pages[pos]);
    if (child == nullptr) break;
    uint32_t k = 0;
    while (k < child->size() && pos + k < pages.size() && child->pages[k] == pages[pos + k]) ++k;
    path->push_back(PathStep{child, pos, k});
    pos += k;
    if (k < child->size()) break;
    node = child;
  }
  return pos;
}

// Inserts `pages` as CacheIndex does: split where the match ends inside a node, then add
// the rest as a child.
void InsertPrompt(RadixTree& tree, std::span<const PageHash> pages) {
  std::vector<PathStep> path;
  const uint32_t matched = tree.Walk(pages, &path);
  RadixNode* parent = tree.root();
  if (!path.empty()) {
    parent = path.back().node;
    if (path.back().matched < parent->size()) parent = tree.Split(parent, path.back().matched);
  }
  if (matched < pages.size()) tree.AddChild(parent, pages.subspan(matched));
}

TEST(RadixTreeTest, WalkShortcutAgreesWithThePageByPageWalk) {
  std::mt19937 rng(11);
  RadixTree tree(nullptr);
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<PathStep> got, want;
  int shortcuts = 0;
  for (int step = 0; step < 4000; ++step) {
    if (step % 100 == 0) ASSERT_TRUE(tree.LinksConsistent()) << "step " << step;
    const int op = rng() % 10;
    if (op < 4 || prompts.empty()) {
      // A new prompt: a prefix of an earlier one (or nothing), then fresh tokens.
      std::vector<uint32_t> t;
      if (!prompts.empty()) {
        const auto& base = prompts[rng() % prompts.size()];
        t.assign(base.begin(), base.begin() + rng() % (base.size() + 1));
      }
      for (int n = 1 + rng() % 6; n > 0; --n) t.push_back(rng() % 50);
      InsertPrompt(tree, Chain(t));
      prompts.push_back(std::move(t));
    } else if (op < 5) {
      // Drop a leaf (eviction).
      std::vector<PathStep> path;
      const std::vector<PageHash> pages = Chain(prompts[rng() % prompts.size()]);
      if (tree.Walk(pages, &path) > 0 && path.back().node->children.empty() &&
          path.back().matched == path.back().node->size()) {
        tree.Remove(path.back().node);
      }
    } else {
      // A query: an earlier prompt, cut or extended.
      std::vector<uint32_t> t = prompts[rng() % prompts.size()];
      if (rng() % 2) t.resize(1 + rng() % t.size());
      if (rng() % 3 == 0) t.push_back(rng() % 50);
      const std::vector<PageHash> pages = Chain(t);
      shortcuts += tree.NodeEndingWith(pages.back()) != nullptr;
      const uint32_t matched = tree.Walk(pages, &got);
      ASSERT_EQ(matched, ReferenceWalk(tree, pages, &want)) << "step " << step;
      ASSERT_EQ(got.size(), want.size()) << "step " << step;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].node, want[i].node);
        EXPECT_EQ(got[i].first_page, want[i].first_page);
        EXPECT_EQ(got[i].matched, want[i].matched);
      }
    }
  }
  EXPECT_GT(shortcuts, 500) << "the shortcut was hardly exercised";
  // The climb's hints (grandparents, parents by last page) survived every split, add and
  // removal.
  EXPECT_TRUE(tree.LinksConsistent());
}

TEST(RadixTreeTest, ShortcutRefusesAPromptThatIsNotTheNodesPath) {
  RadixTree tree(nullptr);
  RadixNode* a = tree.AddChild(tree.root(), Pages({1, 2}));
  tree.AddChild(a, Pages({3, 4}));
  std::vector<PathStep> path;
  // Ends with the node's last page but is not its path (a broken chain): the shortcut
  // does not take it, and the walk matches what it really shares.
  EXPECT_EQ(tree.Walk(Pages({1, 9, 3, 4}), &path), 1u);
  EXPECT_EQ(tree.Walk(Pages({4}), &path), 0u);
  EXPECT_EQ(tree.Walk(Pages({1, 2, 3, 4}), &path), 4u);
  ASSERT_EQ(path.size(), 2u);
  EXPECT_EQ(path[1].first_page, 2u);
  EXPECT_NE(tree.NodeEndingWith(Pages({4})[0]), nullptr);
  EXPECT_NE(tree.NodeEndingWith(Pages({2})[0]), nullptr);
  EXPECT_EQ(tree.NodeEndingWith(Pages({3})[0]), nullptr);
}

}  // namespace
}  // namespace kvcm
