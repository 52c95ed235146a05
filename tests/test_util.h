// Small helpers the test programs share.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/check.h"
#include "io/file.h"
#include "io/npy.h"
#include "kernels/gemm.h"

namespace mt::test {

// The message of the mt::Error that f throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A fresh, empty folder under the test temp dir.
inline std::string temp_dir(const std::string& name) {
  std::string d = ::testing::TempDir() + "/moetrain_" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// Runs a shell command: its exit status and everything it printed (stdout and stderr).
inline std::pair<int, std::string> run_command(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

// A .npy of numpy dtype `descr` ("<i8", "<f4", ...) and `shape` holding `data`, written
// as every writer writes (io::write_file_atomic).
inline void write_npy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
                      const void* data) {
  size_t bytes = std::stoul(descr.substr(2));
  for (int64_t d : shape) bytes *= static_cast<size_t>(d);
  io::write_file_atomic(path,
                        {io::make_npy_header(descr, shape), std::string_view(static_cast<const char*>(data), bytes)});
}

// Gradients of c = op(a) @ op(b) given dc, as the models write them: gemm calls on the
// tensors' device. Either of da, db may be an empty Tensor (not computed); with
// accumulate the results are added to da/db instead of overwriting them.
inline void gemm_backward(const Tensor& a, const Tensor& b, const Tensor& dc, bool trans_a, bool trans_b,
                          const Tensor& da, const Tensor& db, bool accumulate) {
  const float beta = accumulate ? 1.0f : 0.0f;
  // With C = A B: dA = dC B^T and dB = A^T dC. Transposed operands swap the roles:
  // for A^T the stored gradient is (dC B^T)^T = B dC^T, and likewise for B.
  if (da.data != nullptr) {
    if (!trans_a)
      mt::gemm(dc, b, da, false, !trans_b, 1.0f, beta);
    else
      mt::gemm(b, dc, da, trans_b, true, 1.0f, beta);
  }
  if (db.data != nullptr) {
    if (!trans_b)
      mt::gemm(a, dc, db, !trans_a, false, 1.0f, beta);
    else
      mt::gemm(dc, a, db, true, trans_a, 1.0f, beta);
  }
}

}  // namespace mt::test
