// The fused step with the LM head split by vocabulary rows across G ranks (Megatron's vocab-parallel layout):
// rank g holds weight rows [shard.begin, shard.end) and the bias entries of the same rows, and every rank sees
// all of x and target. Per chunk of token rows the step needs three small collectives:
//   1. all-reduce of each row's (max, sum of exp) pair (the log-sum-exp merge), and of the row sum of logits;
//   2. the target logit, from the rank whose shard holds the target (a sum in which the others add 0);
//   3. all-reduce (sum) of grad_x's per-rank partial products dz_g W_g.
// grad_weight and grad_bias stay local: each rank ends with its own shard of them, and every rank with the
// full scalars and the full grad_x.
//
// The `cpu` implementation (cpu_ranks.cpp) runs the G ranks in one process and performs each collective as a
// loop over the ranks in rank order (the order a ring or tree would fix), so CI proves the sharded algebra
// against the float64 reference without a GPU. The `cuda` implementation (cuda_ranks.cu) runs each rank with the
// one-GPU cuda backend's GEMMs and row kernels, its collectives behind collectives.h: NCCL with one GPU per rank,
// or G ranks on one GPU with the reductions done in rank order by a small kernel (README.md says why both).
#pragma once

#include "fused/fused.h"

#include <cstdint>
#include <string>
#include <vector>

namespace simpo::fused::vocab_parallel {

struct VocabShard {
  std::int64_t begin = 0, end = 0;  // weight rows [begin, end)
  std::int64_t size() const { return end - begin; }
};

// V rows over G ranks in contiguous shards whose sizes differ by at most one (the first V % G ranks hold one
// more). InputError unless 1 <= G <= V.
std::vector<VocabShard> split_vocabulary(std::int64_t V, int shards);

// What one rank ends with: SPEC's scalars and per-pair outputs and grad_x (identical on every rank), and the
// rank's rows of grad_weight [shard rows, H] and grad_bias [shard rows].
struct RankOutputs {
  VocabShard shard;
  TensorMap outputs;
};

// The G ranks' outputs, computed in one process (validates first, as every implementation does). The shards keep
// fp32 logits for dz: Options::logit_distances does not apply to them.
std::vector<RankOutputs> compute_ranks(const Problem&, const Options&, int shards);

// SPEC's outputs from the ranks': the replicated tensors from rank 0 (InputError if any rank's copy differs in
// a single bit: a collective that did not reach every rank), grad_weight and grad_bias concatenated in shard
// order.
TensorMap gather(const std::vector<RankOutputs>&);

// compute_ranks, then gather: an implementation like any other.
TensorMap compute(const Problem&, const Options&, int shards);

// ---- on CUDA devices ----

// How the cuda ranks reduce: NCCL, one GPU per rank (ranks 0..G-1 on devices 0..G-1, driven from one process);
// or all G ranks on the current GPU, each with its own stream and buffers, the reductions done in rank order by
// a kernel (NCCL refuses two ranks of one communicator on one GPU: "Duplicate GPU"). `automatic`: NCCL when it
// was built and there are at least G devices, else in process.
enum class Communication { automatic, nccl, in_process };

// The form `communication` resolves to here for G ranks, with a line saying what runs where; InputError naming
// the problem when none can run (no CUDA build or device, NCCL not built or too few GPUs, G < 1).
struct CudaPlan {
  Communication communication = Communication::in_process;
  int devices = 0;          // CUDA devices visible
  std::string description;  // "3 ranks on one GPU (device 0 of 1 visible), in-process collectives"
};
CudaPlan plan_cuda(int shards, Communication = Communication::automatic);
bool nccl_built();  // this build has the cuda ranks and NCCL (found at configure time)

// The G ranks' outputs computed on CUDA devices as `plan_cuda` resolves `communication` (validates first).
std::vector<RankOutputs> compute_ranks_cuda(const Problem&, const Options&, int shards,
                                            Communication = Communication::automatic);

}  // namespace simpo::fused::vocab_parallel
