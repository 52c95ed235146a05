#include "io/file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

// x86's dispatching entry points take AVX2 where the CPU has it: 3x the SSE2 default.
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

#include "core/check.h"

namespace mt::io {

std::vector<uint8_t> read_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  MT_CHECK(f != nullptr) << "cannot open " << path << ": " << std::strerror(errno);
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
  bool bad = std::ferror(f);
  std::fclose(f);
  MT_CHECK(!bad) << "error reading " << path;
  return out;
}

MappedFile::MappedFile(const std::string& path, std::string_view what) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0) << "cannot open " << what << " " << path << ": " << std::strerror(errno);
  struct stat st {};
  bool stat_ok = ::fstat(fd, &st) == 0;
  int stat_errno = errno;
  bool regular = stat_ok && S_ISREG(st.st_mode);
  size_t size = regular ? static_cast<size_t>(st.st_size) : 0;
  void* m = size > 0 ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  int map_errno = errno;
  ::close(fd);
  MT_CHECK(stat_ok) << "cannot stat " << path << ": " << std::strerror(stat_errno);
  MT_CHECK(regular) << path << " is not a regular file";
  MT_CHECK(m != MAP_FAILED) << "cannot mmap " << path << " (" << size << " bytes): " << std::strerror(map_errno);
  map_ = {static_cast<const uint8_t*>(m), Unmap{size}};
}

void MappedFile::Unmap::operator()(const uint8_t* p) const { ::munmap(const_cast<uint8_t*>(p), size); }

FileSum file_sum(const std::string& path) {
  MappedFile f(path, "file");
  return {f.bytes().size(), XXH3_64bits(f.bytes().data(), f.bytes().size())};
}

FileSum file_fingerprint(const std::string& path) {
  constexpr size_t kEdge = size_t{64} << 10;
  MappedFile f(path, "file");
  std::span<const uint8_t> b = f.bytes();
  if (b.size() <= 2 * kEdge) return {b.size(), XXH3_64bits(b.data(), b.size())};
  const uint64_t head = XXH3_64bits(b.data(), kEdge);
  return {b.size(), XXH3_64bits_withSeed(b.data() + b.size() - kEdge, kEdge, head)};
}

FileSum write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MT_CHECK(fd >= 0) << "cannot write " << tmp << ": " << std::strerror(errno);
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> hash(XXH3_createState(), XXH3_freeState);
  MT_CHECK(hash != nullptr) << "out of memory for the checksum of " << path;
  XXH3_64bits_reset(hash.get());
  FileSum sum;
  for (std::string_view p : pieces) {
    XXH3_64bits_update(hash.get(), p.data(), p.size());
    sum.bytes += p.size();
    size_t done = 0;
    while (done < p.size()) {
      ssize_t w = ::write(fd, p.data() + done, p.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        int e = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        MT_FAIL() << "writing " << tmp << ": " << std::strerror(e);
      }
      done += static_cast<size_t>(w);
    }
  }
  bool synced = ::fsync(fd) == 0;
  ::close(fd);
  MT_CHECK(synced) << "fsync of " << tmp << ": " << std::strerror(errno);
  MT_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0)
      << "renaming " << tmp << " to " << path << ": " << std::strerror(errno);
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  sum.xxh3 = XXH3_64bits_digest(hash.get());
  return sum;
}

}  // namespace mt::io
