// simpo_verify._core: the project's C++ libraries as seen from Python. Thin on purpose: every rule (dtypes, shapes,
// hyperparameters, validation, error model, sweep) is the C++ one; this file only moves tensors across and maps
// InputError to simpo_verify.InputError. The Python layer (simpo_verify/*.py) turns framework arrays into the
// (dtype name, shape, contiguous host buffer) triples used here and back.
#include "fused/fused.h"
#include "problem/problem_io.h"
#include "reference/reference.h"
#include "verifier/device_compare.h"
#include "verifier/error_model.h"
#include "verifier/implementation.h"
#include "verifier/properties.h"


#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <memory>

namespace nb = nanobind;
using namespace nb::literals;
using simpo::DType;
using simpo::InputError;
using simpo::Problem;
using simpo::Tensor;
using simpo::TensorMap;
namespace sv = simpo::verifier;

namespace {

using HostArray = nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>;

// (dtype name, shape, contiguous host array holding exactly the tensor's bytes) -> Tensor (a copy).
Tensor tensor_from(const std::string& name, const std::string& dtype, const std::vector<std::int64_t>& shape,
                   const HostArray& data) {
  Tensor t(simpo::dtype_from_name(dtype), shape);
  const std::size_t have = data.nbytes();
  if (have != t.bytes.size())
    throw InputError(name + ": " + std::to_string(have) + " bytes of data for " + dtype + " " +
                     simpo::shape_string(shape) + ", which needs " + std::to_string(t.bytes.size()));
  if (have) std::memcpy(t.bytes.data(), data.data(), have);
  return t;
}

using WireTensor = std::tuple<std::string, std::vector<std::int64_t>, HostArray>;

TensorMap tensors_from(const std::map<std::string, WireTensor>& wire) {
  TensorMap out;
  for (const auto& [name, w] : wire) out[name] = tensor_from(name, std::get<0>(w), std::get<1>(w), std::get<2>(w));
  return out;
}

// A Tensor -> (dtype name, shape, numpy array over a heap copy of its bytes: uint16 for BF16 and F16, float32,
// float64, int64). The Python layer views the uint16 as bfloat16 or float16.
template <class T> nb::object numpy_of(const Tensor& t) {
  using Bytes = decltype(Tensor::bytes);  // a vector of bytes (its allocator is problem/tensor.h's business)
  auto* copy = new Bytes(t.bytes);
  nb::capsule owner(copy, [](void* p) noexcept { delete static_cast<Bytes*>(p); });
  const std::size_t n = static_cast<std::size_t>(t.numel());
  size_t shape[1] = {n};
  return nb::cast(nb::ndarray<nb::numpy, T>(copy->data(), 1, shape, owner));
}

nb::tuple wire_of(const Tensor& t) {
  nb::object array;
  switch (t.dtype) {
    case DType::BF16:
    case DType::F16: array = numpy_of<std::uint16_t>(t); break;
    case DType::F32: array = numpy_of<float>(t); break;
    case DType::F64: array = numpy_of<double>(t); break;
    case DType::I64: array = numpy_of<std::int64_t>(t); break;
  }
  return nb::make_tuple(simpo::dtype_name(t.dtype), t.shape, array);
}

nb::dict wire_of(const TensorMap& m) {
  nb::dict d;
  for (const auto& [name, t] : m) d[name.c_str()] = wire_of(t);
  return d;
}

Problem problem_from(const std::map<std::string, WireTensor>& tensors, const std::map<std::string, std::string>& metadata,
                     const std::string& source) {
  simpo::SafetensorsFile f;
  f.tensors = tensors_from(tensors);
  f.metadata = metadata;
  return simpo::problem_from_file(f, source);
}

sv::Profile profile_from(const std::string& name, double rtol, double atol) {
  if (name == "user") return sv::user_profile(rtol, atol);
  return sv::profile_from_name(name);
}

nb::dict report_of(const sv::Report& r) {
  nb::list rows;
  for (const auto& t : r.tensors) {
    nb::dict row;
    row["name"] = t.name;
    row["verdict"] = sv::verdict_name(t.verdict);
    row["reason"] = t.reason;
    row["dtype"] = t.dtype;
    row["shape"] = t.shape;
    row["rel_frob"] = t.rel_frob;
    row["max_abs"] = t.max_abs;
    row["max_abs_at"] = t.max_abs_at;
    row["floor"] = t.floor;
    row["ratio"] = t.ratio;
    row["rtol"] = t.rtol;
    row["atol"] = t.atol;
    row["frob_bound"] = t.frob_bound;
    row["beyond"] = t.beyond;
    row["non_finite"] = t.non_finite;
    row["margin"] = t.margin;
    rows.append(row);
  }
  nb::dict d;
  d["profile"] = r.profile;
  d["passed"] = r.passed();
  d["tensors"] = rows;
  d["table"] = sv::format_table(r);
  d["json"] = sv::format_json(r);
  d["worst_margin"] = r.worst_margin();
  return d;
}

// ---- sweep against a Python callable ----

// The callable gets (tensors, metadata, gradients) in the wire form and returns a dict of wire tensors; any
// Python exception is the implementation refusing its inputs (an InputError carrying the exception's text).
sv::Implementation python_implementation(nb::callable fn, const std::string& name) {
  sv::Implementation impl;
  impl.name = name;
  impl.compute = [fn, name](const Problem& problem, const sv::RunOptions& run) -> TensorMap {
    nb::gil_scoped_acquire gil;
    const simpo::SafetensorsFile f = simpo::problem_to_file(problem);
    nb::dict tensors;
    for (const auto& [n, t] : f.tensors) tensors[n.c_str()] = wire_of(t);
    nb::dict metadata;
    for (const auto& [k, v] : f.metadata) metadata[k.c_str()] = v;
    nb::object result;
    try {
      result = fn(tensors, metadata, run.gradients);
    } catch (nb::python_error& e) {
      throw InputError(e.what());
    }
    TensorMap out;
    try {
      out = simpo::outputs_from_file(
          simpo::SafetensorsFile{tensors_from(nb::cast<std::map<std::string, WireTensor>>(result)), {}}, name);
    } catch (const nb::cast_error&) {
      throw InputError(name + " returned something other than a dict of SPEC outputs");
    }
    return out;
  };
  return impl;
}

nb::dict case_of(const sv::Case& c) {
  nb::dict d;
  d["description"] = c.to_string();
  d["B"] = c.spec.shape.B;
  d["T"] = c.spec.shape.T;
  d["H"] = c.spec.shape.H;
  d["V"] = c.spec.shape.V;
  d["seed"] = c.spec.seed;
  return d;
}

std::string file_part(const std::string& name) {
  std::string out;
  for (char ch : name) out += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return out.substr(0, 60);
}

// The sweep: SPEC's properties on `cases` random cases, matches_reference under `profile`. Unlike the CLI's
// sweep, only the first failure of each property is shrunk (a peer that fails most cases would otherwise spend
// the run shrinking); every other failure is counted and listed unshrunk. `also_judge`: further profiles under
// which matches_reference also judges each case's outputs, in the sweep (SweepOptions::also_profiles: the same
// reference outputs, no second run; the smallest failing case is written).
nb::dict sweep(nb::callable fn, const std::string& name, std::uint64_t seed, std::int64_t cases, double time_budget_s,
               bool shrink, const std::string& counterexample_dir, bool stop_at_first_failure,
               const std::string& profile_name, const std::vector<std::string>& also_judge, int shrink_attempts,
               double shrink_seconds, const std::vector<std::array<std::int64_t, 4>>& shapes,
               int hyperparameter_sets, const std::string& capabilities_json, const std::vector<std::string>& dtypes) {
  const sv::Profile profile = sv::profile_from_name(profile_name);
  const std::string profile_flags = profile.kind == sv::ProfileKind::strict ? "" : " --profile " + profile.name();
  sv::Implementation impl = python_implementation(std::move(fn), name);
  if (!capabilities_json.empty())  // InputError naming the key for a malformed declaration
    impl.capabilities = [declared = sv::capabilities_from_json(capabilities_json, "sweep(capabilities=...)")] { return declared; };
  sv::SweepOptions options;
  options.seed = seed;
  options.max_cases = cases;
  options.time_budget_s = time_budget_s;
  options.shrink = false;
  options.profile = profile;
  options.stop_at_first_failure = stop_at_first_failure;
  for (const std::string& pname : also_judge) options.also_profiles.push_back(sv::profile_from_name(pname));
  for (const auto& [B, T, H, V] : shapes) {  // named before any case runs, not as a refusal of every case
    const simpo::Shape shape{B, T, H, V};
    simpo::validate_shape(shape);
    options.distribution.shapes.push_back(shape);
  }
  if (hyperparameter_sets < 0)
    throw InputError("hyperparameter_sets = " + std::to_string(hyperparameter_sets) + ": expected 0 (drawn per case) or more");
  options.distribution.hyperparameter_sets = hyperparameter_sets;
  for (const std::string& dtype : dtypes) {
    try {
      options.distribution.dtypes.push_back(simpo::input_dtype_from_name(dtype));
    } catch (const InputError& e) {
      throw InputError(std::string("dtypes: ") + e.what());
    }
  }
  nb::dict d;
  nb::list failures;
  nb::dict profiles;
  {
    nb::gil_scoped_release release;  // the callable takes it back for each case
    sv::SweepResult r = sv::run_sweep(impl, options);
    std::map<std::string, bool> shrunk_one;
    nb::gil_scoped_acquire gil;
    d["cases"] = r.cases;
    d["seconds"] = r.seconds;
    d["passed"] = r.passed;
    d["failed"] = r.failed;
    d["worst_margin"] = r.worst_margin;
    d["declared"] = r.declared.to_json();
    d["excluded"] = r.excluded;
    nb::dict spread;
    for (const auto& [tensor, f] : r.spread) {
      nb::dict s;
      s["cases_compared"] = f.cases_compared;
      s["cases_differing"] = f.cases_differing;
      s["max_elements_differing"] = f.max_elements_differing;
      s["max_abs"] = f.max_abs;
      s["max_rel"] = f.max_rel;
      spread[tensor.c_str()] = s;
    }
    d["spread"] = spread;
    // matches_reference under the other profiles: counts and the smallest failing case (its inputs file written).
    for (const std::string& pname : also_judge) {
      const sv::ProfileTally& tally = r.by_profile[sv::profile_from_name(pname).name()];
      nb::dict pd;
      pd["passed"] = tally.passed;
      pd["failed"] = tally.failed;
      pd["smallest_failure"] = nb::none();
      for (const auto& ce : tally.smallest_failure) {
        nb::dict f;
        f["description"] = ce.original.spec.description;
        f["detail"] = ce.outcome.detail;
        f["inputs_path"] = "";
        if (!counterexample_dir.empty()) {
          const std::string path = counterexample_dir + "/" + file_part(name) + "-" + pname + "-smallest.inputs.safetensors";
          {
            nb::gil_scoped_release again;
            std::filesystem::create_directories(counterexample_dir);
            simpo::save_problem(path, simpo::generate(ce.original.spec));
          }
          f["inputs_path"] = path;
        }
        pd["smallest_failure"] = f;
      }
      profiles[pname.c_str()] = pd;
    }
    for (auto& ce : r.failures) {
      nb::dict f;
      f["case_index"] = ce.case_index;
      f["property"] = ce.outcome.property;
      f["detail"] = ce.outcome.detail;
      f["original"] = case_of(ce.original);
      bool shrunk = false;
      if (!shrunk_one[ce.outcome.property]) {
        shrunk_one[ce.outcome.property] = true;
        {
          nb::gil_scoped_release again;
          if (shrink) {
            ce.shrunk = sv::shrink(ce.original, impl, ce.outcome.property, shrink_attempts, shrink_seconds, profile);
            const auto outcome = sv::check_case(ce.shrunk, impl, {ce.outcome.property}, false, profile);
            if (!outcome.empty() && !outcome.back().passed) ce.outcome = outcome.back();
            shrunk = true;
          }
          if (!counterexample_dir.empty()) {
            ce.inputs_path = counterexample_dir + "/" + file_part(name) + "-" + ce.outcome.property + "-case" +
                             std::to_string(ce.case_index) + ".inputs.safetensors";
            ce.replay = sv::write_counterexample(ce.shrunk, name, ce.inputs_path, profile_flags);
          } else {
            ce.replay = "  " + ce.shrunk.case_command(name);
          }
        }
        f["detail"] = ce.outcome.detail;
      } else {
        ce.replay = "  " + ce.original.case_command(name);
      }
      f["shrunk"] = shrunk ? nb::object(case_of(ce.shrunk)) : nb::none();
      f["inputs_path"] = ce.inputs_path;
      f["replay"] = ce.replay;
      failures.append(f);
    }
  }
  d["implementation"] = name;
  d["failures"] = failures;
  nb::list properties;
  for (const auto& p : sv::all_properties()) properties.append(nb::make_tuple(p.name, p.claim));
  d["properties"] = properties;

  d["profiles"] = profiles;
  return d;
}

// A candidate tensor on a CUDA device, as DLPack hands it over (torch, JAX, CuPy): read in place.
using DeviceArray = nb::ndarray<nb::ro, nb::device::cuda, nb::c_contig>;

DType dtype_of(const std::string& name, const DeviceArray& a) {
  const nb::dlpack::dtype d = a.dtype();
  if (d.lanes == 1) {
    if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) return DType::BF16;
    if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
      if (d.bits == 16) return DType::F16;
      if (d.bits == 32) return DType::F32;
      if (d.bits == 64) return DType::F64;
    }
  }
  throw InputError(name + ": a device array of DLPack dtype code " + std::to_string(d.code) + ", " + std::to_string(d.bits) +
                   " bits; SPEC's outputs are bfloat16, float16, float32 or float64");
}

struct Judge {
  Problem problem;  // kept for the bf16_logits profile's logit pass (ProblemScales::prepare_for)
  TensorMap exact;  // every exact output, or where they are on the device every one but the gradients
  std::optional<simpo::reference::DeviceOutputs> device_exact;  // the exact gradients on the device
  mutable sv::ProblemScales scales;
  Judge(const Problem& p, const std::map<std::string, WireTensor>& exact_wire) : problem(p), exact(tensors_from(exact_wire)) {
    nb::gil_scoped_release release;
    scales = sv::ProblemScales::of(p, &exact);
  }
  // The reference computed here (--reference auto), its dz pass handing the error model each row's off-target
  // softmax: the scales then cost O(N) instead of recomputing fp32 logits (O(N H V)), as CaseRun does. Where the
  // reference runs on the GPU (and judges gradients of bf16 inputs), its gradients stay there and candidates are
  // compared there (verifier/device_compare.h): the gradients never cross to the host.
  Judge(const Problem& p, bool gradients) : problem(p) {
    nb::gil_scoped_release release;
    namespace ref = simpo::reference;
    ref::Options o;
    o.gradients = gradients;
    o.device = ref::Device::automatic;
    ref::OffTargetSoftmax off_target;
    o.off_target = &off_target;
    const bool on_device = gradients && ref::resolve(ref::Device::automatic, p.shape) == ref::Device::cuda &&
                           p.input_dtype() == DType::BF16 && sv::device_compare_unavailable_reason().empty();
    if (on_device) {
      device_exact = ref::compute_on_device(p, o);
      exact = device_exact->host;
      scales = sv::ProblemScales::of_forward(p, exact, true, &off_target);
      return;
    }
    exact = ref::compute(p, o);
    scales = gradients ? sv::ProblemScales::of(p, &exact, &off_target) : sv::ProblemScales::of(p, &exact);
  }
  bool on_device() const { return device_exact.has_value(); }
  // The exact outputs on the host (the gradients downloaded where they are on the device: 4.2 GB at the published B = 2).
  nb::dict exact_wire() const {
    if (!device_exact) return wire_of(exact);
    TensorMap all;
    {
      nb::gil_scoped_release release;
      all = sv::to_host(*device_exact);
    }
    return wire_of(all);
  }
  // The bf16_logits profile's scales cost O(N H V) on the host: measured once, here or at the first check under it.
  void prepare(const std::string& profile) const {
    nb::gil_scoped_release release;
    scales.prepare_for(sv::profile_from_name(profile), problem, exact);
  }
  nb::dict check(const std::map<std::string, WireTensor>& candidate, const std::map<std::string, DeviceArray>& device_candidate,
                 const std::string& profile, double rtol, double atol) const {
    sv::MixedOutputs c;
    c.host = simpo::outputs_from_file(simpo::SafetensorsFile{tensors_from(candidate), {}}, "candidate");
    for (const auto& [name, a] : device_candidate) {
      if (c.host.count(name)) throw InputError("candidate: " + name + " given twice");
      if (std::find(simpo::all_output_names().begin(), simpo::all_output_names().end(), name) == simpo::all_output_names().end())
        throw InputError("candidate: unknown output tensor \"" + name + "\" (SPEC's outputs: loss, nll_loss, ...)");
      sv::DeviceTensorView v;
      v.dtype = dtype_of(name, a);
      for (std::size_t i = 0; i < a.ndim(); ++i) v.shape.push_back(static_cast<std::int64_t>(a.shape(i)));
      v.data = a.data();
      v.device = a.device_id();
      c.device[name] = v;
    }
    if (!device_exact && !c.device.empty())
      throw InputError("candidate tensors on a CUDA device, but this judge's reference outputs are on the host");
    sv::Report r;
    {
      nb::gil_scoped_release release;
      const sv::Profile judged = profile_from(profile, rtol, atol);
      scales.prepare_for(judged, problem, exact);
      r = device_exact ? sv::compare(scales, *device_exact, c, judged) : sv::compare(scales, exact, c.host, judged);
    }
    return report_of(r);
  }
};

// The verifier's one translation of run options into fused options (verifier/implementation.h).
simpo::fused::Options fused_options(const std::string& impl, bool gradients, bool grad_f32, bool validate,
                                    std::int64_t workspace_bytes, std::int64_t max_chunk_rows) {
  sv::RunOptions run;
  run.gradients = gradients;
  run.grad_f32 = grad_f32;
  run.validate = validate;
  run.workspace_bytes = workspace_bytes;
  run.max_chunk_rows = max_chunk_rows;
  sv::validate(run);
  return sv::fused_options(simpo::fused::backend_from_name(impl), run);
}

// A device call from the Python layer's dict (simpo_verify/_device.py: compute).
simpo::fused::DeviceCall device_call_from(const nb::dict& args) {
  simpo::fused::DeviceCall c;
  c.shape = {nb::cast<std::int64_t>(args["B"]), nb::cast<std::int64_t>(args["T"]), nb::cast<std::int64_t>(args["H"]),
             nb::cast<std::int64_t>(args["V"])};
  c.hp = simpo::hyperparameters_from_metadata(nb::cast<std::map<std::string, std::string>>(args["metadata"]));
  c.input_dtype = simpo::input_dtype_from_name(nb::cast<std::string>(args["dtype"]));
  c.device = nb::cast<int>(args["device"]);
  c.stream = nb::cast<std::uintptr_t>(args["stream"]);
  c.x = nb::cast<std::uintptr_t>(args["x"]);
  c.weight = nb::cast<std::uintptr_t>(args["weight"]);
  c.bias = nb::cast<std::uintptr_t>(args["bias"]);
  c.target = nb::cast<std::uintptr_t>(args["target"]);
  c.grad_x = nb::cast<std::uintptr_t>(args["grad_x"]);
  c.grad_weight = nb::cast<std::uintptr_t>(args["grad_weight"]);
  c.grad_bias = nb::cast<std::uintptr_t>(args["grad_bias"]);
  c.grad_x_lo = nb::cast<std::uintptr_t>(args["grad_x_lo"]);
  c.grad_weight_lo = nb::cast<std::uintptr_t>(args["grad_weight_lo"]);
  c.grad_bias_lo = nb::cast<std::uintptr_t>(args["grad_bias_lo"]);
  c.options = fused_options("cuda", nb::cast<bool>(args["gradients"]), nb::cast<bool>(args["grad_f32"]),
                            nb::cast<bool>(args["validate"]), nb::cast<std::int64_t>(args["workspace_bytes"]),
                            nb::cast<std::int64_t>(args["max_chunk_rows"]));
  c.options.grad_x = nb::cast<bool>(args["want_grad_x"]);
  c.options.grad_weight = nb::cast<bool>(args["want_grad_weight"]);
  c.keep_workspace = true;  // the torch module calls once per step
  c.workspace = nb::cast<std::uintptr_t>(args["workspace"]);
  c.workspace_size = nb::cast<std::int64_t>(args["workspace_size"]);
  c.defer_weight_finish = nb::cast<bool>(args["defer_weight_finish"]);
  // The forward on the device names its eight forward output buffers.
  c.forward_on_device = nb::cast<bool>(args["forward_on_device"]);
  if (c.forward_on_device) {
    const auto out = nb::cast<std::vector<std::uintptr_t>>(args["forward_out"]);
    if (out.size() != c.forward_out.size())
      throw InputError("compute_device: forward_out needs " + std::to_string(c.forward_out.size()) + " buffers, got " +
                       std::to_string(out.size()));
    std::copy(out.begin(), out.end(), c.forward_out.begin());
  }
  return c;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "simpo_verify's C++ core (problem, reference, fused, verifier); use the simpo_verify package";
  nb::exception<InputError>(m, "InputError", PyExc_ValueError);

  nb::class_<Problem>(m, "Problem")
      .def_prop_ro("shape", [](const Problem& p) {
        return nb::make_tuple(p.shape.B, p.shape.T, p.shape.H, p.shape.V);
      })
      .def_prop_ro("has_bias", &Problem::has_bias)
      .def("validate", [](const Problem& p) { simpo::validate(p); })
      .def("tensors", [](const Problem& p) {
        const simpo::SafetensorsFile f = simpo::problem_to_file(p);
        nb::dict tensors;
        for (const auto& [n, t] : f.tensors) tensors[n.c_str()] = wire_of(t);
        return nb::make_tuple(tensors, f.metadata);
      })
      .def("save", [](const Problem& p, const std::string& path) { simpo::save_problem(path, p); });

  m.def("problem", &problem_from, "tensors"_a, "metadata"_a, "source"_a,
        "A Problem from wire tensors and string metadata (SPEC's inputs file, in memory)");
  m.def("load_problem", &simpo::load_problem, "path"_a);
  m.def("generate", [](std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t V, std::uint64_t seed, bool bias,
                       double logit_scale, const std::string& ignore) {
    simpo::CaseSpec spec;
    spec.shape = {B, T, H, V};
    spec.seed = seed;
    spec.bias = bias;
    spec.logit_scale = logit_scale;
    spec.ignore = simpo::ignore_pattern_from_name(ignore);
    return simpo::generate(spec);
  }, "B"_a, "T"_a, "H"_a, "V"_a, "seed"_a = 0, "bias"_a = false, "logit_scale"_a = 2.0, "ignore"_a = "prompt_prefix");
  m.def("load_outputs", [](const std::string& path) { return wire_of(simpo::load_outputs(path)); }, "path"_a);
  m.def("save_outputs", [](const std::string& path, const std::map<std::string, WireTensor>& outputs) {
    simpo::save_outputs(path, simpo::outputs_from_file(simpo::SafetensorsFile{tensors_from(outputs), {}}, path), {});
  }, "path"_a, "outputs"_a);
  m.def("check_outputs", [](const std::map<std::string, WireTensor>& outputs, const std::string& source) {
    return wire_of(simpo::outputs_from_file(simpo::SafetensorsFile{tensors_from(outputs), {}}, source));
  }, "outputs"_a, "source"_a);

  m.def("cuda_available", &simpo::fused::cuda_available);
  m.def("has_device_entry", [] { return simpo::fused::cuda_built(); });

  // Host inputs: reference, cpu, cuda (uploads and downloads), auto.
  m.def("compute", [](const Problem& p, const std::string& impl, bool gradients, bool grad_f32, bool validate,
                      std::int64_t workspace_bytes, std::int64_t max_chunk_rows) {
    TensorMap out;
    {
      nb::gil_scoped_release release;
      if (impl == "reference") {
        simpo::reference::Options o;
        o.gradients = gradients;
        o.device = simpo::reference::Device::automatic;  // SPEC's --reference auto
        o.chunk_rows = max_chunk_rows;
        out = simpo::reference::compute(p, o);
      } else {
        out = simpo::fused::compute(p, fused_options(impl, gradients, grad_f32, validate, workspace_bytes, max_chunk_rows));
      }
    }
    return wire_of(out);
  }, "problem"_a, "impl"_a, "gradients"_a, "grad_f32"_a, "validate"_a, "workspace_bytes"_a, "max_chunk_rows"_a);

  // Inputs on a CUDA device (pointers from DLPack / torch): outputs written to caller-allocated device buffers
  // (gradients; with forward_on_device the forward outputs too) and returned on the host (scalars, per-pair tensors;
  // a forward_on_device call returns none). fused::compute_on_device (fused/fused.h) says what it checks.
  m.def("compute_device", [](const nb::dict& args) {
    const simpo::fused::DeviceCall c = device_call_from(args);
    simpo::fused::DeviceResult r;
    {
      nb::gil_scoped_release release;
      r = simpo::fused::compute_on_device(c);
    }
    nb::dict d;
    d["outputs"] = wire_of(r.forward);
    d["workspace_bytes"] = r.workspace_bytes;
    d["extra_device_bytes"] = r.extra_device_bytes;
    d["plan"] = r.plan;
    d["pending"] = r.pending.waiting() ? nb::cast(std::move(r.pending)) : nb::none();
    return d;
  }, "args"_a);

  // The scratch a device call needs in a caller-owned workspace, and whether its grad_weight can be deferred
  // (fused::device_workspace): {"bytes", "defers_weight_finish"}.
  m.def("device_workspace", [](const nb::dict& args) {
    const simpo::fused::DeviceCall c = device_call_from(args);
    const simpo::fused::DeviceWorkspace w = simpo::fused::device_workspace(c);
    nb::dict d;
    d["bytes"] = w.bytes;
    d["defers_weight_finish"] = w.defers_weight_finish;
    return d;
  }, "args"_a);

  // A deferred call's last weight GEMM (fused::PendingWeightGradient), finished once with the loss scale.
  nb::class_<simpo::fused::PendingWeightGradient>(m, "PendingWeightGradient")
      .def_prop_ro("waiting", &simpo::fused::PendingWeightGradient::waiting);

  // A device gradient and its rounding residue scaled with one rounding (fused::scale_gradient_on_device).
  m.def("scale_gradient", [](const std::string& dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n,
                             double scale, std::uintptr_t out, int device, std::uintptr_t stream) {
    nb::gil_scoped_release release;
    simpo::fused::scale_gradient_on_device(simpo::input_dtype_from_name(dtype), hi, lo, n, scale, out, device, stream);
  }, "dtype"_a, "hi"_a, "lo"_a, "n"_a, "scale"_a, "out"_a, "device"_a, "stream"_a);

  // The scale a float32 on the device (its address): autograd's grad_output, never read by the host.
  m.def("finish_weight_gradient_by", [](const simpo::fused::PendingWeightGradient& pending, std::uintptr_t scale,
                                        std::uintptr_t stream) {
    nb::gil_scoped_release release;
    simpo::fused::finish_weight_gradient_on_device(pending, simpo::fused::DeviceScalar{scale}, stream);
  }, "pending"_a, "scale"_a, "stream"_a);
  m.def("scale_gradient_by", [](const std::string& dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n,
                                std::uintptr_t scale, std::uintptr_t out, int device, std::uintptr_t stream) {
    nb::gil_scoped_release release;
    simpo::fused::scale_gradient_on_device(simpo::input_dtype_from_name(dtype), hi, lo, n,
                                           simpo::fused::DeviceScalar{scale}, out, device, stream);
  }, "dtype"_a, "hi"_a, "lo"_a, "n"_a, "scale"_a, "out"_a, "device"_a, "stream"_a);

  m.def("reference", [](const Problem& p, bool gradients) {
    simpo::reference::Options o;
    o.gradients = gradients;
    o.device = simpo::reference::Device::automatic;  // SPEC's --reference auto
    TensorMap out;
    {
      nb::gil_scoped_release release;
      out = simpo::reference::compute(p, o);
    }
    return wire_of(out);
  }, "problem"_a, "gradients"_a = true);

  m.def("check", [](const Problem& p, const std::map<std::string, WireTensor>& exact,
                    const std::map<std::string, WireTensor>& candidate, const std::string& profile, double rtol,
                    double atol) {
    const TensorMap e = tensors_from(exact);
    const TensorMap c = simpo::outputs_from_file(simpo::SafetensorsFile{tensors_from(candidate), {}}, "candidate");
    sv::Report r;
    {
      nb::gil_scoped_release release;
      r = sv::compare(p, e, c, profile_from(profile, rtol, atol));
    }
    return report_of(r);
  }, "problem"_a, "exact"_a, "candidate"_a, "profile"_a, "rtol"_a = 0.0, "atol"_a = 0.0);

  // The reference's outputs and the error model's per-problem scales, measured once and reused for every candidate
  // of the same inputs: what check() and the peers' published case use.
  nb::class_<Judge>(m, "Judge")
      .def(nb::init<const Problem&, const std::map<std::string, WireTensor>&>(), "problem"_a, "exact"_a)
      .def(nb::init<const Problem&, bool>(), "problem"_a, "gradients"_a)
      .def("exact", &Judge::exact_wire)
      .def("on_device", &Judge::on_device)
      .def("prepare", &Judge::prepare, "profile"_a)
      .def("check", &Judge::check, "candidate"_a, "device_candidate"_a, "profile"_a, "rtol"_a = 0.0, "atol"_a = 0.0);

  m.def("sweep", &sweep, "fn"_a, "name"_a, "seed"_a, "cases"_a, "time_budget_s"_a, "shrink"_a,
        "counterexample_dir"_a, "stop_at_first_failure"_a, "profile"_a, "also_judge"_a, "shrink_attempts"_a, "shrink_seconds"_a,
        "shapes"_a, "hyperparameter_sets"_a, "capabilities"_a = "", "dtypes"_a = std::vector<std::string>{});
}
