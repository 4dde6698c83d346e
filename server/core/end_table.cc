#include "server/core/end_table.h"

#include <random>
#include <utility>

namespace kvcm {
namespace {

constexpr size_t kInitialSlots = 16;

uint64_t RandomSeed() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd();
}

}  // namespace

EndTable::EndTable()
    : slots_(std::make_unique<Entry[]>(kInitialSlots)),
      mask_(kInitialSlots - 1),
      seed_(RandomSeed()) {}

void EndTable::Set(const PageHash& page, RadixNode* node, RadixNode* parent) {
  if (Entry* e = FindMutable(page); e != nullptr) {
    e->node = node;
    e->parent = parent;
    return;
  }
  if (2 * (size_ + 1) > capacity()) Grow();
  size_t i = SlotOf(page);
  while (slots_[i].node != nullptr) i = (i + 1) & mask_;
  slots_[i] = Entry{page, node, parent};
  ++size_;
}

void EndTable::SetParentIf(const PageHash& page, const RadixNode* node, RadixNode* parent) {
  if (Entry* e = FindMutable(page); e != nullptr && e->node == node) e->parent = parent;
}

void EndTable::EraseIf(const PageHash& page, const RadixNode* node) {
  Entry* e = FindMutable(page);
  if (e == nullptr || e->node != node) return;
  // Backward-shift deletion: move each later entry of the run into the hole when its home
  // slot does not lie (cyclically) between the hole and where it sits.
  size_t hole = static_cast<size_t>(e - slots_.get());
  for (size_t i = (hole + 1) & mask_; slots_[i].node != nullptr; i = (i + 1) & mask_) {
    const size_t home = SlotOf(slots_[i].page);
    const bool stays = hole <= i ? (hole < home && home <= i) : (hole < home || home <= i);
    if (stays) continue;
    slots_[hole] = slots_[i];
    hole = i;
  }
  slots_[hole] = Entry{};
  --size_;
}

void EndTable::Grow() {
  const size_t old_capacity = capacity();
  std::unique_ptr<Entry[]> old = std::exchange(slots_, std::make_unique<Entry[]>(2 * old_capacity));
  mask_ = 2 * old_capacity - 1;
  for (size_t j = 0; j < old_capacity; ++j) {
    if (old[j].node == nullptr) continue;
    size_t i = SlotOf(old[j].page);
    while (slots_[i].node != nullptr) i = (i + 1) & mask_;
    slots_[i] = old[j];
  }
}

}  // namespace kvcm
