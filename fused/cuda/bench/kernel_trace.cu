#include "fused/cuda/bench/kernel_trace.h"

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>

namespace simpo::fused::cuda {
namespace {

std::mutex mutex;
std::vector<TraceRecord>* sink = nullptr;       // the live trace's device records (one trace at a time)
std::vector<TraceRecord>* host_sink = nullptr;  // and its API calls (host timestamps, the same clock)

void check(CUptiResult status, const char* what) {
  if (status != CUPTI_SUCCESS) {
    const char* message = nullptr;
    cuptiGetResultString(status, &message);
    throw std::runtime_error(std::string("CUPTI: ") + what + ": " + (message ? message : "?"));
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = std::size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

std::string demangle(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  return out;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard lock(mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (!sink) continue;
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      sink->push_back({k->start, k->end, demangle(k->name)});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      sink->push_back({m->start, m->end, "memcpy (kind " + std::to_string(m->copyKind) + ")"});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME || record->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const char* name = nullptr;
      cuptiGetCallbackName(record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                       : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      host_sink->push_back({a->start, a->end, std::string("host: ") + (name ? name : "?")});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      sink->push_back({m->start, m->end, "memset"});
    }
  }
  std::free(buffer);
}

// What a kernel computes, from the types in its name (our anonymous namespaces demangle without the file).
std::string short_name(const std::string& name) {
  // The hi/lo GEMMs' names are long enough that the demangler may give up: match what both forms spell alike.
  if (name.find("Residual") != std::string::npos) return "weight GEMM into the hi/lo pair (CUTLASS)";
  if (name.find("L2PrefetchingEpilogue") != std::string::npos)
    return "weight GEMM, the pair's last: hi alone (CUTLASS)";
  if (name.find("RowStats") != std::string::npos) return "logits GEMM with epilogue statistics (CUTLASS)";
  if (name.find("MainloopSm90TmaGmmaWarpSpecializedFP8") != std::string::npos ||
      name.find("SplitNMainloop") != std::string::npos)
    return "logits GEMM, promoted (CUTLASS)";
  const std::size_t k = name.find("_kernel");
  if (k != std::string::npos && name.compare(0, 4, "void") == 0 && name.find("cutlass::device_kernel") == std::string::npos) {
    std::size_t b = name.rfind(':', k);
    b = b == std::string::npos ? 5 : b + 1;
    return name.substr(b, k + 7 - b);
  }
  return name.substr(0, 90);
}

}  // namespace

KernelTrace::KernelTrace() {
  std::lock_guard lock(mutex);
  if (sink) throw std::runtime_error("KernelTrace: one trace at a time");
  sink = &records_;
  host_sink = &host_records_;
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime API");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "enable driver API");
}

void KernelTrace::stop() {
  if (stopped_) return;
  stopped_ = true;
  cuptiActivityFlushAll(0);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_RUNTIME);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_DRIVER);
  std::lock_guard lock(mutex);
  sink = nullptr;
  host_sink = nullptr;
  std::sort(records_.begin(), records_.end(), [](const TraceRecord& a, const TraceRecord& b) { return a.start < b.start; });
}

KernelTrace::~KernelTrace() {
  try {
    stop();
  } catch (...) {
  }
}

void KernelTrace::print(std::FILE* out, int steps) const {
  if (records_.empty()) {
    std::fprintf(out, "     kernels: no records\n");
    return;
  }
  std::map<std::string, std::pair<double, int>> by_name;  // ms, launches
  double busy = 0;
  std::map<std::pair<std::string, std::string>, double> gaps;
  for (std::size_t i = 0; i < records_.size(); ++i) {
    const TraceRecord& r = records_[i];
    const double ms = (r.end - r.start) * 1e-6;
    auto& entry = by_name[short_name(r.name)];
    entry.first += ms;
    entry.second += 1;
    busy += ms;
    if (i > 0 && r.start > records_[i - 1].end)
      gaps[{short_name(records_[i - 1].name), short_name(r.name)}] += (r.start - records_[i - 1].end) * 1e-6;
  }
  const double span = (records_.back().end - records_.front().start) * 1e-6;
  std::fprintf(out, "     kernels per step: %.2f ms busy, %.2f ms from first start to last end over %d steps "
               "(%.2f ms idle per step, the gaps between steps included)\n",
               busy / steps, span / steps, steps, (span - busy) / steps);
  std::vector<std::pair<std::string, std::pair<double, int>>> sorted(by_name.begin(), by_name.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  for (const auto& [name, v] : sorted)
    std::fprintf(out, "     %9.3f ms x%5.1f  %s\n", v.first / steps, double(v.second) / steps, name.c_str());
  std::vector<std::pair<std::pair<std::string, std::string>, double>> g(gaps.begin(), gaps.end());
  std::sort(g.begin(), g.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::fprintf(out, "     largest idle gaps per step, by the kernels around them:\n");
  for (std::size_t i = 0; i < g.size() && i < 6; ++i)
    std::fprintf(out, "     %9.3f ms  after %.50s  before %.50s\n", g[i].second / steps, g[i].first.first.c_str(),
                 g[i].first.second.c_str());
  // The host side: API calls by total time, and the longest single calls, so a slow call before the first
  // launch of a step (the device idles meanwhile) shows up by name.
  std::map<std::string, std::pair<double, int>> api;
  for (const TraceRecord& r : host_records_) {
    auto& e = api[r.name];
    e.first += (r.end - r.start) * 1e-6;
    e.second += 1;
  }
  std::vector<std::pair<std::string, std::pair<double, int>>> calls(api.begin(), api.end());
  std::sort(calls.begin(), calls.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::fprintf(out, "     host API calls per step, by time:\n");
  for (std::size_t i = 0; i < calls.size() && i < 10; ++i)
    std::fprintf(out, "     %9.3f ms x%6.1f  %s\n", calls[i].second.first / steps, double(calls[i].second.second) / steps,
                 calls[i].first.c_str());
}

}  // namespace simpo::fused::cuda
