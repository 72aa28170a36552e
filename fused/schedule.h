// The chunk schedule every fused backend follows, and walk(), the one place its modes are spelled out. Each
// backend counts its own bytes per row (cpu: workspace_bytes_per_row below; cuda: fused/cuda/plan.h) and asks
// plan_rows for chunks of the rows that fit (capped by Options::max_chunk_rows); where the chunks fall changes
// the results by fp32 noise only (the backend suite checks it).
//
//   three_pass   chunks of whole pairs: pairs [p0, p1) are rows [p0 T, p1 T) (chosen) and [(P+p0) T, (P+p1) T)
//                (rejected), two GEMMs into one logits buffer. With both halves of every pair present, k is
//                known inside the chunk: logits -> row stats -> pair math -> dz -> grad GEMMs, one pass.
//   two_pass     when one whole pair does not fit: pass 1 over token chunks computes the row stats of all N
//                rows, then the pair math runs once on all rows, then pass 2 recomputes each chunk's logits
//                and does dz and the gradient GEMMs.
//   forward_only no gradients: pass 1 alone, with the smaller per-row footprint of logits only.
#pragma once

#include "fused/fused.h"
#include "problem/problem.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace simpo::fused {

enum class Mode { three_pass, two_pass, forward_only };
std::string mode_name(Mode);  // "three_pass", "two_pass", "forward_only"

// Token rows [begin, end) of the [N, ...] row-major inputs and outputs.
struct RowRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t rows() const { return end - begin; }
  bool operator==(const RowRange&) const = default;
};

// One chunk: one row range (token chunks) or two (a three_pass chunk: its chosen rows, then its rejected rows,
// stacked in that order in the chunk's buffers).
struct Chunk {
  RowRange parts[2];
  int part_count = 1;
  std::int64_t pair_begin = 0, pair_end = 0;  // three_pass: the pairs [pair_begin, pair_end); else 0, 0
  std::int64_t rows() const { return parts[0].rows() + (part_count > 1 ? parts[1].rows() : 0); }
};

// Bytes of workspace one token row costs while its chunk is live:
//   with gradients: V*4 (fp32 logits) + V*2 (bf16 dz) + H*4 (fp32 grad_x) + row_stats_bytes
//   forward only:   V*4 (fp32 logits) + row_stats_bytes
// row_stats_bytes covers the per-row scalars a chunk keeps (lse, z_target, rowsum, k, c, target, mask).
inline constexpr std::int64_t row_stats_bytes = 64;
std::int64_t workspace_bytes_per_row(const Shape&, bool gradients);

struct Schedule {
  Mode mode = Mode::three_pass;
  std::int64_t bytes_per_row = 0;  // workspace_bytes_per_row(shape, gradients)
  std::int64_t chunk_rows = 0;     // rows the budget (and max_chunk_rows) allows in one chunk
  std::vector<Chunk> chunks;       // in order; they cover every row exactly once
  std::int64_t max_rows() const;   // the largest chunk: what a backend allocates for
  std::string to_string() const;   // "three_pass, 3 chunks of <= 512 rows (...)" for logs and errors
};

// The plan for this shape and options. options.gradients == false gives forward_only; with gradients, three_pass
// when the chunk holds at least one whole pair (2 T rows), else two_pass; allow_three_pass = false asks for
// two_pass token chunks of the same size regardless (tests comparing the two forms; mutants whose pair math
// needs every pair at once). Throws InputError naming the budget and the bytes one row needs when the
// workspace cannot hold one row, and for a negative max_chunk_rows. Assumes a shape validate_shape accepted.
Schedule plan(const Shape&, const Options&, bool allow_three_pass = true);

// The same plan for a backend that sizes its own buffers: chunks of at most `rows_that_fit` rows (>= 1; also
// capped by options.max_chunk_rows), options.workspace_bytes unread. plan() is this with rows_that_fit =
// workspace_bytes / workspace_bytes_per_row.
Schedule plan_rows(const Shape&, std::int64_t rows_that_fit, const Options&, bool allow_three_pass = true);

// The stages of a step, as a backend implements them. walk() calls them in the order the schedule's mode asks:
//   three_pass    per chunk: forward(c, keep = true), [statistics_known() after the last], pair_math(c's pairs),
//                 backward(c)
//   two_pass      per chunk: forward(c, false); statistics_known(); pair_math(all pairs); per chunk: logits(c),
//                 backward(c)
//   forward_only  per chunk: forward(c, false); statistics_known()
struct Stages {
  // The chunk's logits and their row statistics; keep: its backward follows before the next chunk, so the chunk's
  // logits (or what dz needs of them) stay in its buffers.
  std::function<void(const Chunk&, bool keep)> forward;
  // dL/davg of pairs [pair_begin, pair_end), once their rows' statistics are known.
  std::function<void(std::int64_t pair_begin, std::int64_t pair_end)> pair_math;
  std::function<void(const Chunk&)> logits;    // two_pass: the chunk's logits again, to be kept for its backward
  std::function<void(const Chunk&)> backward;  // dz from the kept logits, the gradient GEMMs
  // Optional: called once, as soon as every row's statistics exist (the forward outputs need nothing more), while
  // the gradient work may still follow.
  std::function<void()> statistics_known = nullptr;
};
void walk(const Schedule&, const Shape&, const Stages&);

}  // namespace simpo::fused
