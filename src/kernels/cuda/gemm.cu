// Dense matrix products through cuBLASLt: bf16 operands (or block-scaled e4m3 ones,
// gemm_fp8), f32 accumulation, bf16 or f32 output, alpha/beta on the host. Our tensors are row-major and cuBLASLt is column-major:
// a row-major X [r,c] is the column-major X^T [c,r] with the same leading dimension, so
// C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T (no copies).
#include <map>
#include <tuple>

#include "kernels/cuda/runtime.h"
#include "kernels/elementwise.h"
#include "kernels/fp8_quant.h"
#include "kernels/gemm.h"

namespace mt::cuda {

namespace {

// Largest power of two (up to 256) dividing the address: cuBLASLt assumes 256-byte
// aligned operands unless told otherwise, and views (rows of a tensor) are often not.
uint32_t alignment(const void* p) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// Everything the descriptors and the chosen algorithm depend on.
struct PlanKey {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  bool c_f32;
  uint32_t align_a, align_b, align_c;
  int fp8 = 0;  // 0: bf16 operands; e4m3 ones with b's scales 1: 1x128, 2: 128x128
  auto tie() const { return std::tie(ta, tb, m, n, k, lda, ldb, ldc, c_f32, align_a, align_b, align_c, fp8); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
};

// Descriptors and the heuristic's pick, made once per shape (the query costs far more than
// a small product), kept for the process's lifetime (runtime.cu says why) and shared by every
// stream and thread: a map's entries stay put as it grows, so a plan outlives the lock.
// An e4m3 key's scale pointers: cuBLASLt's heuristic refuses block scaling without them
// (they are set again for every call).
const Plan& plan_for(const PlanKey& key, const void* scale_a = nullptr, const void* scale_b = nullptr) {
  static auto* plans = new std::map<PlanKey, Plan>();
  auto found = plans->find(key);
  if (found != plans->end()) return found->second;

  Plan p{};
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major view (see the top of the file): A' = b, B' = a, C' = c.
  cublasOperation_t op_a = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // Stored shapes, column-major: b is [K,N] row-major (or [N,K] when transposed).
  const cudaDataType_t in = key.fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.la, in, key.tb ? key.k : key.n, key.tb ? key.n : key.k, key.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lb, in, key.ta ? key.m : key.k, key.ta ? key.k : key.m, key.lda));
  if (key.fp8) {  // A' = b (a weight's blocks, or 1x128 tiles), B' = a (1x128 tiles)
    const cublasLtMatmulMatrixScale_t sa = key.fp8 == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                        : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                                      sb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &sa, sizeof(sa)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &sb, sizeof(sb)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)));
    const int8_t fast = 0;  // block scaling has no fast-accumulation kernels on Hopper
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lc, key.c_f32 ? CUDA_R_32F : CUDA_R_16BF, key.n, key.m, key.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t workspace = kBlasltWorkspaceBytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof(workspace)));
  // A' is b and B' is a, as above.
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_b,
                                                    sizeof(uint32_t)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a,
                                                    sizeof(uint32_t)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c,
                                                    sizeof(uint32_t)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c,
                                                    sizeof(uint32_t)));
  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(blaslt(), p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &result,
                                              &found_count));
  CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  MT_CHECK(found_count > 0) << "cuBLASLt has no algorithm for a " << (key.fp8 ? "block-scaled e4m3" : "bf16")
                            << " gemm with M=" << key.m << " N=" << key.n
                            << " K=" << key.k << " ta=" << key.ta << " tb=" << key.tb << " lda=" << key.lda
                            << " ldb=" << key.ldb << " ldc=" << key.ldc << " output "
                            << (key.c_f32 ? "f32" : "bf16");
  p.algo = result.algo;
  return plans->emplace(key, p).first->second;
}

}  // namespace

void gemm_fp8(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, bool b_blocks,
              const Tensor& c, float alpha, float beta) {
  MT_CHECK(a.ndim() == 2 && b.ndim() == 2 && a.dim(1) == b.dim(1))
      << "gemm_fp8 wants a [M, K] and b [N, K], got " << a.str() << " and " << b.str();
  const int64_t m = a.dim(0), n = b.dim(0), k = a.dim(1);
  check_arg(a, "gemm_fp8 a", {DType::f8e4m3}, a.shape);
  check_arg(b, "gemm_fp8 b", {DType::f8e4m3}, b.shape);
  check_arg(a_scale, "gemm_fp8 a_scale", {DType::f32}, {fp8::tiles(k), m});
  check_arg(b_scale, "gemm_fp8 b_scale", {DType::f32},
            b_blocks ? Shape{fp8::tiles(n), fp8::block_scale_cols(k)} : Shape{fp8::tiles(k), n});
  check_arg(c, "gemm_fp8 c", {DType::bf16, DType::f32}, {m, n});
  MT_CHECK(k % 16 == 0) << "gemm_fp8: K " << k << " must be a multiple of 16 (e4m3 rows 16-byte aligned)";
  // cuBLASLt's FP8 kernels take 16-byte output rows only (otherwise it says only
  // NOT_SUPPORTED): N = 20 failed on an H100, N = 200 passes (test_cuda_fp8).
  MT_CHECK(n % 8 == 0) << "gemm_fp8: N " << n << " (the output width, c " << c.str()
                       << ") must be a multiple of 8 for cuBLASLt's FP8 product";
  if (m == 0 || n == 0) return;
  PlanKey key{false, true, m, n, k, k, k, n, c.dtype == DType::f32, alignment(a.data), alignment(b.data),
              alignment(c.data), b_blocks ? 2 : 1};
  const Plan& p = plan_for(key, b_scale.data, a_scale.data);
  // The scale pointers belong to this call: set on the shared plan just before its launch.
  const void *sa = b_scale.data, *sb = a_scale.data;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  CUBLAS_CHECK(cublasLtMatmul(blaslt(), p.desc, &alpha, b.data, p.la, a.data, p.lb, &beta, c.data, p.lc, c.data, p.lc,
                              &p.algo, blaslt_workspace(), kBlasltWorkspaceBytes, stream()));
}

// Row-major c[m,n] = alpha op(a) op(b) + beta c, a and b bf16 with row widths a.dim(1) and
// b.dim(1), c f32 or bf16. beta = 0 never reads c (it may hold NaN).
void gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b, float alpha, float beta) {
  MT_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2)
      << "gemm wants 2-D tensors, got a " << a.str() << ", b " << b.str() << ", gemm c " << c.str();
  const int64_t m = trans_a ? a.dim(1) : a.dim(0), n = trans_b ? b.dim(0) : b.dim(1), k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0);
  MT_CHECK(kb == k && c.dim(0) == m && c.dim(1) == n)
      << "gemm shapes disagree: op(a) " << m << "x" << k << " (a " << a.str() << (trans_a ? "^T" : "")
      << "), op(b) " << kb << "x" << n << " (b " << b.str() << (trans_b ? "^T" : "") << "), gemm c " << c.str();
  check_arg(a, "gemm a", {DType::bf16}, a.shape);
  check_arg(b, "gemm b", {DType::bf16}, b.shape);
  check_arg(c, "gemm c", {DType::bf16, DType::f32}, c.shape);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // An empty sum: cuBLASLt rejects k = 0, and c = beta c is the whole answer.
    if (beta == 0.0f)
      cuda::fill(c, 0.0f);
    else
      cuda::scale(c, beta);
    return;
  }
  PlanKey key{trans_a, trans_b, m, n, k, a.dim(1), b.dim(1), n, c.dtype == DType::f32, alignment(a.data),
              alignment(b.data), alignment(c.data)};
  const Plan& p = plan_for(key);
  // The workspace is the current stream's, so products on two streams never share one.
  CUBLAS_CHECK(cublasLtMatmul(blaslt(), p.desc, &alpha, b.data, p.la, a.data, p.lb, &beta, c.data, p.lc, c.data, p.lc,
                              &p.algo, blaslt_workspace(), kBlasltWorkspaceBytes, stream()));
}

}  // namespace mt::cuda
