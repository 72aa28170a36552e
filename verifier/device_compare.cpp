// compare() with the exact gradients on the device (device_compare.h): the name walk and the verdicts are
// compare.cpp's; only where the reductions run differs.
#include "verifier/device_compare.h"

#include "verifier/tensor_reductions.h"

#ifdef SIMPO_VERIFIER_HAVE_CUDA
#include "verifier/device_reductions.h"
#endif

#include <stdexcept>

namespace simpo::verifier {

#ifdef SIMPO_VERIFIER_HAVE_CUDA

namespace {

device::Storage storage_of(DType d) {
  switch (d) {
    case DType::BF16: return device::Storage::bf16;
    case DType::F16: return device::Storage::f16;
    case DType::F32: return device::Storage::f32;
    case DType::F64: return device::Storage::f64;
    case DType::I64: break;
  }
  throw std::logic_error("device comparison: an I64 candidate reached the reductions");
}

class DeviceReductions final : public PairReductions {
 public:
  explicit DeviceReductions(device::Pair p) : p_(p) {}
  element::ElementSums totals() const override { return device::totals(p_); }
  Rows rows(std::int64_t row_length) const override {
    const std::int64_t count = row_length > 0 ? p_.n / row_length : 0;
    std::vector<element::RowSums> sums(static_cast<std::size_t>(count));
    device::rows(p_, row_length, sums.data());
    Rows out(count);
    for (std::int64_t row = 0; row < count; ++row) out.set(row, sums[static_cast<std::size_t>(row)]);
    return out;
  }
  element::BeyondCount beyond(double atol, double rtol) const override { return device::beyond(p_, atol, rtol); }
  double exact_at(std::int64_t i) const override { return device::exact_at(p_, i); }
  double candidate_at(std::int64_t i) const override { return device::candidate_at(p_, i); }

 private:
  device::Pair p_;
};

}  // namespace

std::string device_compare_unavailable_reason() { return ""; }

Report compare(const ProblemScales& scales, const reference::DeviceOutputs& exact, const MixedOutputs& candidate,
               const Profile& profile) {
  if (profile.kind == ProfileKind::bf16_logits && !scales.logit_rounding)
    throw std::logic_error("compare: the bf16_logits profile needs ProblemScales::prepare_for first");
  std::vector<CandidateEntry> entries;
  for (const auto& [name, t] : candidate.host) entries.push_back({name, t.dtype, t.shape});
  for (const auto& [name, t] : candidate.device) {
    if (candidate.host.count(name)) throw InputError("candidate: " + name + " given twice, on the host and on the device");
    entries.push_back({name, t.dtype, t.shape});
  }
  // The candidate's device tensors may have been written on any stream of its device: wait for them once.
  bool waited = false;
  auto has_exact = [&](const std::string& name) { return exact.host.count(name) > 0 || exact.gradients.count(name) > 0; };
  auto judge = [&](const std::string& name) -> TensorReport {
    const auto dev = candidate.device.find(name);
    const auto host = candidate.host.find(name);
    const DType dtype = dev != candidate.device.end() ? dev->second.dtype : host->second.dtype;
    const std::vector<std::int64_t>& shape = dev != candidate.device.end() ? dev->second.shape : host->second.shape;
    const auto gradient = exact.gradients.find(name);
    if (gradient == exact.gradients.end()) {  // a small exact tensor on the host: the candidate's comes here too
      TensorMap one_exact{{name, exact.host.at(name)}}, one_candidate;
      if (host != candidate.host.end()) {
        one_candidate[name] = host->second;
      } else {
        TensorReport r = precheck_tensor(name, dtype, shape, exact.host.at(name).shape);
        if (r.verdict == Verdict::failed) return r;
        if (!waited) device::synchronize(dev->second.device), waited = true;
        Tensor t(dtype, shape);
        device::download(t.bytes.data(), dev->second.data, t.bytes.size(), dev->second.device);
        one_candidate[name] = std::move(t);
      }
      return compare(scales, one_exact, one_candidate, profile).tensors.at(0);
    }
    const reference::DeviceArray& e = gradient->second;
    TensorReport r = precheck_tensor(name, dtype, shape, e.shape);
    if (r.verdict == Verdict::failed) return r;
    std::shared_ptr<const void> uploaded;
    const void* data = nullptr;
    if (dev != candidate.device.end()) {
      if (dev->second.device != e.device)
        throw InputError("candidate " + name + " is on CUDA device " + std::to_string(dev->second.device) +
                         ", the reference's outputs on device " + std::to_string(e.device));
      if (!waited) device::synchronize(e.device), waited = true;
      data = dev->second.data;
    } else {
      const Tensor& t = host->second;
      if (static_cast<std::int64_t>(t.bytes.size()) != t.numel() * static_cast<std::int64_t>(dtype_size(t.dtype))) {
        r.verdict = Verdict::failed;
        r.reason = "holds " + std::to_string(t.bytes.size()) + " bytes for shape " + shape_string(t.shape);
        return r;
      }
      uploaded = device::upload(t.bytes.data(), t.bytes.size(), e.device);
      data = uploaded.get();
    }
    const device::Pair pair{e.data.get(), data, storage_of(dtype), rounding_of(dtype), e.numel(), e.device};
    return judge_tensor(scales, name, e.shape, dtype, DeviceReductions(pair), profile);
  };
  return compare_outputs(profile, entries, has_exact, judge);
}

TensorMap to_host(const reference::DeviceOutputs& exact) {
  TensorMap all = exact.host;
  for (const auto& [name, g] : exact.gradients) {
    Tensor t = Tensor::uninitialized(DType::F64, g.shape);
    device::download(t.bytes.data(), g.data.get(), t.bytes.size(), g.device);
    all[name] = std::move(t);
  }
  return all;
}

#else

TensorMap to_host(const reference::DeviceOutputs& exact) {
  if (!exact.gradients.empty()) throw InputError("exact gradients on the device: " + device_compare_unavailable_reason());
  return exact.host;
}

std::string device_compare_unavailable_reason() {
  return "this build has no CUDA (no CUDA compiler was found when it was configured, or SIMPO_ENABLE_CUDA=OFF)";
}

Report compare(const ProblemScales&, const reference::DeviceOutputs&, const MixedOutputs&, const Profile&) {
  throw InputError("comparing on the device: " + device_compare_unavailable_reason());
}

#endif

}  // namespace simpo::verifier
