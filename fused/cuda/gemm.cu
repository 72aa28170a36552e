#include "fused/cuda/gemm.h"

#include "fused/cuda/cuda_check.h"

#include <algorithm>
#include <climits>

namespace simpo::fused::cuda {
namespace {

// The largest power of two (up to 256) dividing the address: what cuBLASLt's heuristic must be told the
// operand's alignment is, since a chunk's operands start inside a larger buffer.
int alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  int alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// RAII for the descriptor objects of one cuBLASLt call.
struct MatmulDescriptors {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~MatmulDescriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (operation) cublasLtMatmulDescDestroy(operation);
  }
};

int as_int(std::int64_t value, const char* what) {
  if (value > INT_MAX) throw CudaError(std::string("cuBLAS fallback: ") + what + " exceeds INT_MAX");
  return static_cast<int>(value);
}

template <class T> constexpr cudaDataType cuda_type();
template <> constexpr cudaDataType cuda_type<__nv_bfloat16>() { return CUDA_R_16BF; }
template <> constexpr cudaDataType cuda_type<__half>() { return CUDA_R_16F; }
template <> constexpr cudaDataType cuda_type<float>() { return CUDA_R_32F; }

}  // namespace

Gemms::Gemms(cudaStream_t stream, void* workspace, std::size_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  SIMPO_CUBLAS_CHECK(cublasLtCreate(&lt_));
  SIMPO_CUBLAS_CHECK(cublasCreate(&blas_));
}

void Gemms::set_workspace(void* workspace, std::size_t workspace_bytes) {
  if (workspace_bytes != workspace_bytes_) choices_.clear();
  workspace_ = workspace;
  workspace_bytes_ = workspace_bytes;  // the fallback's cuBLAS handle takes it at each call (gemm)
}

Gemms::~Gemms() {
  if (blas_) cublasDestroy(blas_);
  if (lt_) cublasLtDestroy(lt_);
}

void Gemms::gemm(cudaDataType type, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n,
                 std::int64_t k, const void* A, std::int64_t lda, const void* B, std::int64_t ldb, float beta, float* C,
                 std::int64_t ldc, float alpha) {
  if (m == 0 || n == 0) return;
  cudaStream_t stream = stream_;
  const cublasOperation_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // Stored (pre-op) shapes: A is m x k, or k x m when transposed; B is k x n, or n x k.
  const std::uint64_t a_rows = transpose_a ? k : m, a_cols = transpose_a ? m : k;
  const std::uint64_t b_rows = transpose_b ? n : k, b_cols = transpose_b ? k : n;

  MatmulDescriptors d;
  SIMPO_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  SIMPO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.operation, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  SIMPO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.operation, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  SIMPO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, type, a_rows, a_cols, lda));
  SIMPO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, type, b_rows, b_cols, ldb));
  SIMPO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, CUDA_R_32F, m, n, ldc));

  const int align_a = alignment_of(A), align_b = alignment_of(B), align_c = alignment_of(C);
  const Key key{static_cast<int>(type), transpose_a, transpose_b, m, n, k, lda, ldb, ldc, align_a, align_b, align_c};
  auto found = choices_.find(key);
  if (found == choices_.end()) {
    Choice choice;
    SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.preference));
    SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_)));
    const std::uint32_t a_bytes = align_a, b_bytes = align_b, c_bytes = align_c;
    SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a_bytes, sizeof(a_bytes)));
    SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b_bytes, sizeof(b_bytes)));
    SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c_bytes, sizeof(c_bytes)));
    SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &c_bytes, sizeof(c_bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(lt_, d.operation, d.a, d.b, d.c, d.c, d.preference, 1, &result, &returned);
    // NOT_SUPPORTED (no algorithm for this shape) is an answer, not a failure: the fallback takes it.
    if (status != CUBLAS_STATUS_NOT_SUPPORTED) SIMPO_CUBLAS_CHECK(status);
    if (status == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
      choice.found = true;
      choice.algo = result.algo;
    }
    found = choices_.emplace(key, choice).first;
  }

  if (found->second.found) {
    SIMPO_CUBLAS_CHECK(cublasLtMatmul(lt_, d.operation, &alpha, A, d.a, B, d.b, &beta, C, d.c, C, d.c,
                                      &found->second.algo, workspace_, workspace_bytes_, stream));
    return;
  }
  ++fallback_calls_;
  // The cuBLAS handle serves only this fallback: each call binds it to the stream and then to the scratch
  // (cublasSetStream puts the handle back on cuBLAS's own workspace pool, outside the budget).
  SIMPO_CUBLAS_CHECK(cublasSetStream(blas_, stream));
  SIMPO_CUBLAS_CHECK(cublasSetWorkspace(blas_, workspace_, workspace_bytes_));
  SIMPO_CUBLAS_CHECK(cublasGemmEx(blas_, op_a, op_b, as_int(m, "m"), as_int(n, "n"), as_int(k, "k"), &alpha, A,
                                  type, as_int(lda, "lda"), B, type, as_int(ldb, "ldb"), &beta, C,
                                  CUDA_R_32F, as_int(ldc, "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Row-major logits[rows, V] = x W^T is column-major logits^T[V, rows] = (W as col-major [ld_h, V])^T x^T,
// with x^T the col-major [ld_h, rows] view of row-major x.
template <class T>
void Gemms::logits(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const T* x, const T* weight, float* logits,
                   std::int64_t ld_logits, int k_splits) {
  // Slices of whole 8-element groups, so every slice's operands stay 16-byte aligned.
  const std::int64_t slice = (ld_h + 8 * k_splits - 1) / (8 * k_splits) * 8;
  for (std::int64_t k0 = 0; k0 < ld_h; k0 += slice) {
    const std::int64_t k = std::min(slice, ld_h - k0);
    gemm(cuda_type<T>(), /*transpose_a=*/true, /*transpose_b=*/false, V, rows, k, weight + k0, ld_h, x + k0, ld_h,
         k0 == 0 ? 0.0f : 1.0f, logits, ld_logits);
  }
}

// Row-major grad_x[rows, ld_h] = dz W is column-major grad_x^T[ld_h, rows] = W^T(col-major [ld_h, V]) dz^T.
template <class T>
void Gemms::grad_x(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const T* dz, std::int64_t ld_dz,
                   const T* weight, float* grad_x, bool accumulate, float alpha) {
  gemm(cuda_type<T>(), false, false, ld_h, rows, V, weight, ld_h, dz, ld_dz, accumulate ? 1.0f : 0.0f, grad_x, ld_h,
       alpha);
}

// Row-major grad_W[V, ld_h] += dz^T x is column-major grad_W^T[ld_h, V] += x^T(col-major [ld_h, rows]) dz
// (dz^T is col-major [V, rows], transposed to [rows, V]).
template <class T>
void Gemms::accumulate_grad_weight(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const T* dz,
                                   std::int64_t ld_dz, const T* x, float* grad_weight, bool overwrite, float alpha) {
  if (rows == 0) return;
  gemm(cuda_type<T>(), false, true, ld_h, V, rows, x, ld_h, dz, ld_dz, overwrite ? 0.0f : 1.0f, grad_weight, ld_h,
       alpha);
}

#define SIMPO_GEMMS_FOR(T)                                                                                    \
  template void Gemms::logits<T>(std::int64_t, std::int64_t, std::int64_t, const T*, const T*, float*, std::int64_t, \
                                 int);                                                                            \
  template void Gemms::grad_x<T>(std::int64_t, std::int64_t, std::int64_t, const T*, std::int64_t, const T*, float*, \
                                 bool, float);                                                                    \
  template void Gemms::accumulate_grad_weight<T>(std::int64_t, std::int64_t, std::int64_t, const T*, std::int64_t,   \
                                                 const T*, float*, bool, float);
SIMPO_GEMMS_FOR(__nv_bfloat16)
SIMPO_GEMMS_FOR(__half)
SIMPO_GEMMS_FOR(float)
#undef SIMPO_GEMMS_FOR

}  // namespace simpo::fused::cuda
