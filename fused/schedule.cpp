#include "fused/schedule.h"

#include <algorithm>

namespace simpo::fused {

std::string mode_name(Mode mode) {
  switch (mode) {
    case Mode::three_pass: return "three_pass";
    case Mode::two_pass: return "two_pass";
    case Mode::forward_only: return "forward_only";
  }
  return "?";
}

std::int64_t workspace_bytes_per_row(const Shape& shape, bool gradients) {
  const std::int64_t logits = shape.V * 4;
  if (!gradients) return logits + row_stats_bytes;
  return logits + shape.V * 2 + shape.H * 4 + row_stats_bytes;
}

std::int64_t Schedule::max_rows() const {
  std::int64_t most = 0;
  for (const auto& c : chunks) most = std::max(most, c.rows());
  return most;
}

std::string Schedule::to_string() const {
  return mode_name(mode) + ", " + std::to_string(chunks.size()) + " chunk" + (chunks.size() == 1 ? "" : "s") +
         " of <= " + std::to_string(max_rows()) + " rows (" + std::to_string(bytes_per_row) + " bytes per row)";
}

// Token chunks: [0, rows), [rows, 2 rows), ..., the last one possibly shorter.
static std::vector<Chunk> token_chunks(std::int64_t N, std::int64_t rows) {
  std::vector<Chunk> chunks;
  for (std::int64_t begin = 0; begin < N; begin += rows) {
    Chunk c;
    c.parts[0] = {begin, std::min(N, begin + rows)};
    chunks.push_back(c);
  }
  return chunks;
}

// Pair chunks: `pairs` pairs at a time, each chunk holding its chosen rows then its rejected rows.
static std::vector<Chunk> pair_chunks(const Shape& shape, std::int64_t pairs) {
  const std::int64_t P = shape.P(), T = shape.T;
  std::vector<Chunk> chunks;
  for (std::int64_t p0 = 0; p0 < P; p0 += pairs) {
    const std::int64_t p1 = std::min(P, p0 + pairs);
    Chunk c;
    c.parts[0] = {p0 * T, p1 * T};
    c.parts[1] = {(P + p0) * T, (P + p1) * T};
    c.part_count = 2;
    c.pair_begin = p0;
    c.pair_end = p1;
    chunks.push_back(c);
  }
  return chunks;
}

Schedule plan(const Shape& shape, const Options& options, bool allow_three_pass) {
  const std::int64_t bytes_per_row = workspace_bytes_per_row(shape, options.gradients);
  const std::int64_t fit = options.workspace_bytes > 0 ? options.workspace_bytes / bytes_per_row : 0;
  if (fit < 1)
    throw InputError("fused workspace of " + std::to_string(options.workspace_bytes) +
                     " bytes cannot hold one token row of " + shape.to_string() + ": one row needs " +
                     std::to_string(bytes_per_row) + " bytes");
  return plan_rows(shape, fit, options, allow_three_pass);
}

Schedule plan_rows(const Shape& shape, std::int64_t rows_that_fit, const Options& options, bool allow_three_pass) {
  if (options.max_chunk_rows < 0)
    throw InputError("max_chunk_rows must be >= 0 (0 lets the workspace decide), got " +
                     std::to_string(options.max_chunk_rows));
  if (rows_that_fit < 1)
    throw InputError("fused plan for " + shape.to_string() + ": chunks of " + std::to_string(rows_that_fit) +
                     " rows (at least 1 needed)");
  Schedule s;
  s.bytes_per_row = workspace_bytes_per_row(shape, options.gradients);
  const std::int64_t N = shape.N();
  std::int64_t rows = std::min(rows_that_fit, N);
  if (options.max_chunk_rows > 0) rows = std::min(rows, options.max_chunk_rows);
  s.chunk_rows = rows;

  if (!options.gradients) {
    s.mode = Mode::forward_only;
    s.chunks = token_chunks(N, rows);
  } else if (allow_three_pass && rows >= 2 * shape.T) {
    s.mode = Mode::three_pass;
    s.chunks = pair_chunks(shape, rows / (2 * shape.T));
  } else {
    s.mode = Mode::two_pass;
    s.chunks = token_chunks(N, rows);
  }
  return s;
}

void walk(const Schedule& schedule, const Shape& shape, const Stages& stages) {
  const auto statistics_known = [&] {
    if (stages.statistics_known) stages.statistics_known();
  };
  switch (schedule.mode) {
    case Mode::three_pass:
      for (const Chunk& c : schedule.chunks) {
        stages.forward(c, /*keep=*/true);
        if (&c == &schedule.chunks.back()) statistics_known();
        stages.pair_math(c.pair_begin, c.pair_end);
        stages.backward(c);
      }
      return;
    case Mode::two_pass:
      for (const Chunk& c : schedule.chunks) stages.forward(c, /*keep=*/false);
      statistics_known();
      stages.pair_math(0, shape.P());
      for (const Chunk& c : schedule.chunks) {
        stages.logits(c);  // recomputed: the budget could not keep a whole pair's logits
        stages.backward(c);
      }
      return;
    case Mode::forward_only:
      for (const Chunk& c : schedule.chunks) stages.forward(c, /*keep=*/false);
      statistics_known();
      return;
  }
}

}  // namespace simpo::fused
