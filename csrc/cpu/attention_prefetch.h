// Software prefetch for paged attention: a stream that runs a fixed distance ahead of the tiles
// attend_d reads, across the end of one decode work item into the next one the same thread runs.
//
// Why: a decode item reads each of its K/V tiles once, from tiles scattered over the pool, and one
// tile's math takes about as long as its load from DRAM; the hardware prefetcher cannot guess the
// next tile's address. Prefetching only the next tile left most loads waiting (SmolLM2's 64
// sequences x 160 tokens in a bf16 cache ran at a third of the speed of the same data in L3), and
// every item's first tiles missed outright. Prefill items stream their tiles the same way (within
// the item): a 4k-token Llama-3-8B prompt, whose K/V outgrows the L3, ran 0.97-1.18x as fast as with
// the next-tile prefetches it had before (alternating runs), prompts in cache level within noise. Included by attention_impl.h inside
// the ISA namespace.
#pragma once

// Bytes kept in flight ahead of the reads: enough lines to cover DRAM latency at this core's share of
// the bandwidth, few enough that the prefetched tiles still sit in L1 when they are read. From DRAM,
// 4 to 24 KiB measured alike (Zen 5 VM, SmolLM2 and Llama-3-8B heads); with the data already in
// cache 16 KiB cost small batches up to ~20%, 4-8 KiB nothing.
constexpr int64_t kPrefetchDistanceBytes = 8 << 10;

// The tiles of one work item in the order attend_d reads them: per chunk, its K tiles, then its V
// tiles. A cursor walks them without a division per tile (the walk runs once per tile attend_d reads,
// and with the data in cache a tile's math is only a few hundred cycles).
struct ItemTiles {
  const char* key_cache = nullptr;  // null: no item
  const char* value_cache = nullptr;
  const int32_t* table = nullptr;  // the sequence's block_tables row
  TileStrides strides;
  int64_t first_block = 0, num_blocks = 0, blocks_per_chunk = 1;

  int64_t count() const { return key_cache ? 2 * num_blocks : 0; }
};

struct TileCursor {
  int64_t chunk_start = 0;  // the chunk's first block, relative to first_block
  int64_t in_chunk = 0;     // blocks in the chunk
  int64_t r = 0;            // tile within the chunk: K tiles [0, in_chunk), then V tiles

  void seek(const ItemTiles& t, int64_t tile) {
    const int64_t c = tile / (2 * t.blocks_per_chunk);
    chunk_start = c * t.blocks_per_chunk;
    in_chunk = imin(t.blocks_per_chunk, t.num_blocks - chunk_start);
    r = tile - 2 * chunk_start;
  }

  const char* address(const ItemTiles& t) const {
    const bool key = r < in_chunk;
    const int64_t b = t.first_block + chunk_start + (key ? r : r - in_chunk);
    return t.strides.at(key ? t.key_cache : t.value_cache, t.table[b]);
  }

  void advance(const ItemTiles& t) {
    if (++r < 2 * in_chunk) return;
    chunk_start += t.blocks_per_chunk, r = 0;
    in_chunk = imin(t.blocks_per_chunk, t.num_blocks - chunk_start);
  }
};

// Keeps prefetches `distance` lines ahead of the lines consumed so far, over this item's tiles and
// then the next item's.
class TilePrefetcher {
 public:
  // already_issued: this thread's previous item was the one before this and issued this item's
  // first `distance` lines.
  TilePrefetcher(const ItemTiles& current, const ItemTiles& next, bool already_issued)
      : items_{current, next}, lines_per_tile_((current.strides.tile_bytes + 63) / 64),
        distance_(imax(1, kPrefetchDistanceBytes / 64)) {
    if (already_issued) skip(imin(distance_, current.count() * lines_per_tile_));
    cursor_.seek(items_[which_], tile_);
    issue_to(distance_);
  }

  // attend_d has read one more tile.
  void consumed() {
    consumed_ += lines_per_tile_;
    issue_to(consumed_ + distance_);
  }

 private:
  void skip(int64_t lines) {
    issued_ = lines;
    tile_ = lines / lines_per_tile_, line_ = lines % lines_per_tile_;
    if (tile_ >= items_[0].count()) which_ = 1, tile_ -= items_[0].count();  // into the next item
  }

  void issue_to(int64_t target) {
    while (issued_ < target && which_ < 2 && tile_ < items_[which_].count()) {
      const char* base = cursor_.address(items_[which_]);
      const int64_t take = imin(target - issued_, lines_per_tile_ - line_);
      for (int64_t i = 0; i < take; ++i) __builtin_prefetch(base + (line_ + i) * 64, 0, 3);
      issued_ += take, line_ += take;
      if (line_ < lines_per_tile_) continue;
      line_ = 0;
      if (++tile_ < items_[which_].count()) {
        cursor_.advance(items_[which_]);
      } else if (++which_ < 2) {
        tile_ = 0, cursor_.seek(items_[which_], 0);
      }
    }
  }

  ItemTiles items_[2];
  int64_t lines_per_tile_ = 0, distance_ = 0;
  int64_t consumed_ = 0, issued_ = 0;  // lines, counted from the current item's first
  int which_ = 0;                      // cursor: item, tile, line
  int64_t tile_ = 0, line_ = 0;
  TileCursor cursor_;
};
