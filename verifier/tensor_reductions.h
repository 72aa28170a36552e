// What the comparison needs of one (exact, candidate) tensor pair: its elementwise reductions and two single
// elements. compare.cpp turns them into a TensorReport (the bounds, the verdict) the same way wherever they were
// computed: by loops over host memory (compare.cpp) or by kernels over device memory (device_compare.cu), so the
// float64 gradients of a large problem never leave the device.
#pragma once

#include "verifier/element_error.h"
#include "verifier/error_model.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace simpo::verifier {

element::Rounding rounding_of(DType candidate_dtype);

class PairReductions {
 public:
  virtual ~PairReductions() = default;
  virtual element::ElementSums totals() const = 0;
  // Per row of `row_length` consecutive elements (grad_x's token rows): sums of err^2, floor^2 and exact^2.
  struct Rows {
    std::vector<double> err_sq, floor_sq, exact_sq;
    explicit Rows(std::int64_t count)
        : err_sq(static_cast<std::size_t>(count)), floor_sq(err_sq.size()), exact_sq(err_sq.size()) {}
    void set(std::int64_t row, const element::RowSums& s) {
      const auto i = static_cast<std::size_t>(row);
      err_sq[i] = s.err_sq, floor_sq[i] = s.floor_sq, exact_sq[i] = s.exact_sq;
    }
  };
  virtual Rows rows(std::int64_t row_length) const = 0;
  virtual element::BeyondCount beyond(double atol, double rtol) const = 0;
  virtual double exact_at(std::int64_t i) const = 0;
  virtual double candidate_at(std::int64_t i) const = 0;
};

// The measurements and verdict of tensor `name` (the candidate's dtype and shape already checked against the
// exact tensor's) from its reductions, under `profile`, including SPEC's rule on gradient dtypes under strict.
TensorReport judge_tensor(const ProblemScales&, const std::string& name, const std::vector<std::int64_t>& shape,
                          DType candidate_dtype, const PairReductions&, const Profile&);

// What compare checks before any reduction: a floating-point dtype and the exact tensor's shape. Fills the
// report's name, dtype, shape and numel; a failed report where the candidate cannot be measured.
TensorReport precheck_tensor(const std::string& name, DType candidate_dtype, const std::vector<std::int64_t>& candidate_shape,
                             const std::vector<std::int64_t>& exact_shape);

// compare's walk over SPEC's output names: a tensor in `exact` but not the candidate is not checked, one in the
// candidate but not `exact` fails as unexpected, a name SPEC does not know fails; `judge` measures each name
// present in both.
struct CandidateEntry {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
};
Report compare_outputs(const Profile&, const std::vector<CandidateEntry>& candidate,
                       const std::function<bool(const std::string&)>& has_exact,
                       const std::function<TensorReport(const std::string&)>& judge);

}  // namespace simpo::verifier
