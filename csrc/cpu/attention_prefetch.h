// Software prefetch for decode attention: a stream that runs a fixed distance ahead of the tiles
// attend_d reads, across the end of one work item into the next one the same thread runs.
//
// Why: a decode item reads each of its K/V tiles once, from tiles scattered over the pool, and one
// tile's math takes about as long as its load from DRAM; the hardware prefetcher cannot guess the
// next tile's address. Prefetching only the next tile left most loads waiting (SmolLM2's 64
// sequences x 160 tokens in a bf16 cache ran at a third of the speed of the same data in L3), and
// every item's first tiles missed outright. Included by attention_impl.h inside the ISA namespace.
#pragma once

// Bytes kept in flight ahead of the reads: enough lines to cover DRAM latency at this core's share of
// the bandwidth, few enough that the prefetched tiles still sit in L1 when they are read.
constexpr int64_t kPrefetchDistanceBytes = 16 << 10;

// The tiles of one decode item in the order attend_d reads them: per chunk, its K tiles, then its V tiles.
struct ItemTiles {
  const AttentionArgs* a = nullptr;  // null: no item
  const int32_t* table = nullptr;    // the sequence's block_tables row
  int64_t kv_head = 0, first_block = 0, num_blocks = 0, blocks_per_chunk = 1;

  int64_t count() const { return a ? 2 * num_blocks : 0; }

  const char* address(int64_t t) const {
    const int64_t per_chunk = 2 * blocks_per_chunk, c = t / per_chunk, r = t % per_chunk;
    const int64_t in_chunk = imin(blocks_per_chunk, num_blocks - c * blocks_per_chunk);
    const bool key = r < in_chunk;
    const int64_t b = first_block + c * blocks_per_chunk + (key ? r : r - in_chunk);
    const int64_t offset = ((int64_t(table[b]) * a->num_kv_heads + kv_head) * a->block_size) * a->head_size;
    return static_cast<const char*>(key ? a->key_cache : a->value_cache) + offset * element_size(a->cache_dtype);
  }
};

// Keeps prefetches `distance` lines ahead of the lines consumed so far, over this item's tiles and
// then the next item's.
class TilePrefetcher {
 public:
  TilePrefetcher() = default;  // inactive: prefill keeps attend_d's own next-tile prefetches
  // already_issued: this thread's previous item was the one before this and issued this item's
  // first `distance` lines.
  TilePrefetcher(const ItemTiles& current, const ItemTiles& next, int64_t lines_per_tile, bool already_issued)
      : items_{current, next}, lines_per_tile_(lines_per_tile),
        distance_(imax(1, kPrefetchDistanceBytes / 64)) {
    if (already_issued) skip(imin(distance_, current.count() * lines_per_tile));
    issue_to(distance_);
  }

  bool active() const { return lines_per_tile_ > 0; }

  // attend_d has read one more tile.
  void consumed() {
    if (!active()) return;
    consumed_ += lines_per_tile_;
    issue_to(consumed_ + distance_);
  }

 private:
  void skip(int64_t lines) {
    issued_ = lines;
    tile_ = lines / lines_per_tile_, line_ = lines % lines_per_tile_;
    normalise();
  }

  // Moves the cursor past the end of the current item into the next one.
  void normalise() {
    if (which_ == 0 && tile_ >= items_[0].count()) which_ = 1, tile_ -= items_[0].count();
  }

  void issue_to(int64_t target) {
    while (issued_ < target && which_ < 2 && tile_ < items_[which_].count()) {
      if (line_ == 0 || base_ == nullptr) base_ = items_[which_].address(tile_);
      const int64_t take = imin(target - issued_, lines_per_tile_ - line_);
      for (int64_t i = 0; i < take; ++i) __builtin_prefetch(base_ + (line_ + i) * 64, 0, 3);
      issued_ += take, line_ += take;
      if (line_ == lines_per_tile_) {
        line_ = 0, base_ = nullptr, ++tile_;
        if (tile_ >= items_[which_].count()) ++which_, tile_ = 0;
      }
    }
  }

  ItemTiles items_[2];
  int64_t lines_per_tile_ = 0, distance_ = 0;
  int64_t consumed_ = 0, issued_ = 0;  // lines, counted from the current item's first
  int which_ = 0;                      // cursor: item, tile, line
  int64_t tile_ = 0, line_ = 0;
  const char* base_ = nullptr;
};
