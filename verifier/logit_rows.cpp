// The bf16_logits profile's per-row pass (logit_rows.h). The formulas and their derivation are
// ProblemScales::add_logit_rounding's (error_bounds.cpp) and verifier/README.md's; the device pass
// (device_logit_rows.cu) runs the same ones.
#include "verifier/logit_rows.h"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>

namespace simpo::verifier {

namespace {

// Where the host pass's O(N H V) float64 products outweigh starting the device pass (a cuBLAS handle, the inputs
// uploaded and widened): about a second of this machine's Eigen against a fraction of that.
constexpr double device_min_products = 0x1.0p31;

bool has_target(const Problem& p, std::int64_t target) {
  return target != p.hp.ignore_index && target >= 0 && target < p.shape.V;
}

}  // namespace

std::vector<LogitRow> logit_rows_on_host(const Problem& p, bool gradients) {
  const Shape& sh = p.shape;
  const double u = 0x1.0p-8, sigma = u / std::sqrt(3.0);
  std::vector<LogitRow> out(static_cast<std::size_t>(sh.N()));
  using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  // The logits in float64: the bound is derived from the problem's exact logits (fp32 ones would move the terms of
  // a peaked row by their own rounding, and the device pass by a different one).
  MatrixD wd(sh.V, sh.H);
  for (std::int64_t i = 0; i < sh.V * sh.H; ++i) wd.data()[i] = p.weight.value(static_cast<std::size_t>(i));
  Eigen::VectorXd w_sq;
  if (gradients) w_sq = wd.rowwise().squaredNorm();
  const std::int64_t rows = std::max<std::int64_t>(1, std::min<std::int64_t>(sh.N(), (std::int64_t{32} << 20) / (8 * sh.V)));
  std::vector<double> row(static_cast<std::size_t>(sh.V));
  for (std::int64_t r0 = 0; r0 < sh.N(); r0 += rows) {
    const std::int64_t m = std::min(rows, sh.N() - r0);
    MatrixD x(m, sh.H);
    for (std::int64_t i = 0; i < m * sh.H; ++i) x.data()[i] = p.x.value(static_cast<std::size_t>(r0 * sh.H + i));
    const MatrixD z = x * wd.transpose();
    // Rows with a target: the softmax with its peak's entry p_m - 1 (so that P W = g - w_m, small where p_m ~ 1,
    // without cancelling), and (p_v z_v)^2.
    MatrixD probs = MatrixD::Zero(gradients ? m : 0, gradients ? sh.V : 0);
    MatrixD pz_sq = MatrixD::Zero(gradients ? m : 0, gradients ? sh.V : 0);
    std::vector<double> nonlinear_of(static_cast<std::size_t>(m), 1.0);
    std::vector<std::int64_t> peak(static_cast<std::size_t>(m), -1);
    for (std::int64_t i = 0; i < m; ++i) {
      LogitRow& o = out[static_cast<std::size_t>(r0 + i)];
      double zmax = -INFINITY, zabs_max = 0;
      std::int64_t argmax = 0;
      for (std::int64_t v = 0; v < sh.V; ++v) {
        const double zv = z(i, v) + (p.bias ? p.bias->value(static_cast<std::size_t>(v)) : 0.0);
        row[static_cast<std::size_t>(v)] = zv;
        if (zv > zmax) {
          zmax = zv;
          argmax = v;
        }
        zabs_max = std::max(zabs_max, std::fabs(zv));
        o.abs_sum += std::fabs(zv);
        o.sq_sum += zv * zv;
      }
      const std::int64_t target = p.target[static_cast<std::size_t>(r0 + i)];
      if (!has_target(p, target)) continue;
      double sum = 0;
      for (double zv : row) sum += std::exp(zv - zmax);
      const double lse = zmax + std::log(sum);
      // B^2 = sum_v p_v^2 z_v^2 (1 - p_v)^2 + sum_v p_v^2 (a_sq - q_v), q_v = p_v^2 z_v^2, a_sq = sum_v q_v: the peak m's
      // second term as p_m^2 sum_{v != m} q_v and its 1 - p_m from expm1, so that a peaked row does not cancel.
      double off_abs = 0, off_sq = 0, a_sq = 0, a_off = 0, p_off = 0, own = 0, own4_off = 0, p_peak = 0;
      for (std::int64_t v = 0; v < sh.V; ++v) {
        const double zv = row[static_cast<std::size_t>(v)], pv = std::exp(zv - lse);
        const double q = pv * pv * zv * zv, gap = v == argmax ? -std::expm1(zv - lse) : 1 - pv;
        a_sq += q;
        own += q * gap * gap;
        if (v == argmax) {
          p_peak = pv;
        } else {
          a_off += q;
          p_off += pv * pv;
          own4_off += q * pv * pv;
        }
        if (gradients) {
          probs(i, v) = v == argmax ? std::expm1(zv - lse) : pv;
          pz_sq(i, v) = q;
        }
        if (v == target) continue;
        off_abs += pv * std::fabs(zv);
        off_sq += q;
      }
      peak[static_cast<std::size_t>(i)] = argmax;
      const double zt = row[static_cast<std::size_t>(target)], gt = -std::expm1(zt - lse);  // 1 - p_t
      o.target_gap = gt;
      const double D = 2 * u * zabs_max;
      const double nonlinear = D > 0 ? std::expm1(D) / D : 1.0;
      nonlinear_of[static_cast<std::size_t>(i)] = nonlinear;
      o.worst_l = nonlinear * u * (std::fabs(zt) * gt + off_abs);
      o.var_l = nonlinear * nonlinear * sigma * sigma * (zt * zt * gt * gt + off_sq);
      o.b_row = nonlinear * std::sqrt(std::max(0.0, own + p_off * a_sq - own4_off + p_peak * p_peak * a_off));
    }
    if (gradients) {  // C^2 = sum_v (p_v z_v)^2 ||w_v - g||^2, g = P W: two products of the chunk
      const MatrixD d = probs * wd;  // m x H: g - w_m
      MatrixD g = d;
      for (std::int64_t i = 0; i < m; ++i)
        if (peak[static_cast<std::size_t>(i)] >= 0) g.row(i) += wd.row(peak[static_cast<std::size_t>(i)]);
      const MatrixD wg = g * wd.transpose();  // m x V: w_v . g
      const Eigen::VectorXd g_sq = g.rowwise().squaredNorm(), d_sq = d.rowwise().squaredNorm();
      for (std::int64_t i = 0; i < m; ++i) {
        double c_sq = 0, c_max = 0;
        for (std::int64_t v = 0; v < sh.V; ++v)
          if (pz_sq(i, v) > 0) {
            // ||w_v - g||^2 = ||w_v||^2 - 2 w_v.g + ||g||^2, which cancels only where g ~ w_v, i.e. at the peak.
            const double gap = v == peak[static_cast<std::size_t>(i)] ? d_sq(i) : std::max(0.0, w_sq(v) - 2 * wg(i, v) + g_sq(i));
            const double term = pz_sq(i, v) * gap;
            c_sq += term;
            c_max = std::max(c_max, term);
          }
        // The rms sigma C is the estimate where many roundings share the row; where one token carries it (a softmax
        // peaked on a wrong token of large |z|) the row's error is that one rounding's, up to u p_v |z_v| |w_v - g|:
        // the row keeps the larger (in units of sigma, so that row_grad_x = sigma k c_row still holds).
        out[static_cast<std::size_t>(r0 + i)].c_row =
            nonlinear_of[static_cast<std::size_t>(i)] * std::max(std::sqrt(c_sq), std::sqrt(3.0) * std::sqrt(c_max));
      }
    }
  }
  return out;
}

std::optional<std::vector<LogitRow>> logit_rows_on_device(const Problem& p, bool gradients, int device) {
#ifdef SIMPO_VERIFIER_HAVE_CUDA
  device::LogitRowsInput in;
  p.x.visit([&](const auto& v) {
    in.x = v.data();
    in.element_bytes = static_cast<int>(sizeof(v[0]));
  });
  p.weight.visit([&](const auto& v) { in.weight = v.data(); });
  if (p.bias) p.bias->visit([&](const auto& v) { in.bias = v.data(); });
  in.f16 = p.x.dtype() == DType::F16;
  in.target = p.target.data();
  in.N = p.shape.N();
  in.H = p.shape.H;
  in.V = p.shape.V;
  in.ignore_index = p.hp.ignore_index;
  in.gradients = gradients;
  in.device = device;
  std::vector<LogitRow> out(static_cast<std::size_t>(in.N));
  if (device::logit_rows(in, out.data())) return out;
#else
  (void)p, (void)gradients, (void)device;
#endif
  return std::nullopt;
}

std::vector<LogitRow> logit_rows(const Problem& p, bool gradients) {
  const Shape& sh = p.shape;
  const double products = static_cast<double>(sh.N()) * static_cast<double>(sh.H) * static_cast<double>(sh.V);
  if (products >= device_min_products)
    if (auto rows = logit_rows_on_device(p, gradients)) return std::move(*rows);
  return logit_rows_on_host(p, gradients);
}

}  // namespace simpo::verifier
