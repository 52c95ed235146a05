#include "io/file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

// x86's dispatching entry points take AVX2 where the CPU has it: 3x the SSE2 default.
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

namespace mt::io {

namespace {

// What a path that is not a regular file is, for the refusal.
std::string kind_of(mode_t m) {
  return S_ISDIR(m) ? "a folder" : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device"
         : S_ISFIFO(m) ? "a pipe" : S_ISSOCK(m) ? "a socket" : "not a regular file";
}

// `path` opened read-only ("cannot open <what> <path>" where it cannot be) and refused
// unless it is a regular file; its size into *size.
int open_regular(const std::string& path, std::string_view what, size_t* size = nullptr) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0) << "cannot open " << what << (what.empty() ? "" : " ") << path << ": " << std::strerror(errno);
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  const int stat_errno = errno;
  if (!stat_ok || !S_ISREG(st.st_mode)) ::close(fd);
  MT_CHECK(stat_ok) << "cannot stat " << path << ": " << std::strerror(stat_errno);
  MT_CHECK(S_ISREG(st.st_mode)) << path << " is " << kind_of(st.st_mode) << ", where a regular file was expected";
  if (size != nullptr) *size = static_cast<size_t>(st.st_size);
  return fd;
}

// Calls op(done), a read or write of bytes [done, n), until all n are done, again after
// EINTR. Returns 1 then, else op's first other result <= 0 (errno set where < 0).
template <typename Op>
ssize_t transfer(size_t n, Op op) {
  for (size_t done = 0; done < n;) {
    const ssize_t got = op(done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got;
    done += static_cast<size_t>(got);
  }
  return 1;
}

}  // namespace

std::vector<uint8_t> read_file(const std::string& path) {
  const int fd = open_regular(path, "");
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) != 0) {
    if (n > 0) out.insert(out.end(), buf, buf + n);
    else if (errno != EINTR) break;
  }
  ::close(fd);
  MT_CHECK(n == 0) << "error reading " << path;
  return out;
}

MappedFile::MappedFile(const std::string& path, std::string_view what) {
  size_t size = 0;
  const int fd = open_regular(path, what, &size);
  void* m = size > 0 ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  const int map_errno = errno;
  ::close(fd);
  MT_CHECK(m != MAP_FAILED) << "cannot mmap " << path << " (" << size << " bytes): " << std::strerror(map_errno);
  map_ = {static_cast<const uint8_t*>(m), Unmap{size}};
}

void MappedFile::Unmap::operator()(const uint8_t* p) const { ::munmap(const_cast<uint8_t*>(p), size); }

PositionalFile::PositionalFile(const std::string& path, std::string_view what)
    : path_(path), fd_(open_regular(path, what)) {}

PositionalFile::~PositionalFile() {
  if (fd_ >= 0) ::close(fd_);
}

void PositionalFile::read(int64_t offset, size_t n, void* dst) const {
  char* p = static_cast<char*>(dst);
  const ssize_t got =
      transfer(n, [&](size_t done) { return ::pread(fd_, p + done, n - done, offset + static_cast<int64_t>(done)); });
  if (got > 0) return;
  struct stat st {};
  const std::string now = ::fstat(fd_, &st) == 0 ? std::to_string(st.st_size) + " bytes" : "unknown size";
  MT_FAIL() << path_ << ": cannot read " << n << " bytes at offset " << offset << " ("
            << (got < 0 ? std::string(std::strerror(errno)) : "the file ends first: it holds " + now + " now")
            << "); it was cut short or rewritten while the run read it. A file a run reads must stay as it was: "
            << "write a changed corpus to a new folder";
}

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

FileLock::FileLock(const std::string& path, std::string_view what) : path_(path) {
  // A file another taker removed between our open and our lock is not the lock any more:
  // lock again whatever the path names now.
  for (int attempt = 0; attempt < 100; ++attempt) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    MT_CHECK(fd_ >= 0) << "cannot open the lock file " << path << ": " << std::strerror(errno);
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      char text[512] = {};
      ssize_t n = 0;
      // A holder that has just taken it writes its name right after: a moment for that.
      for (int wait = 0; wait < 20 && (n = ::pread(fd_, text, sizeof text - 1, 0)) <= 0; ++wait) ::usleep(10000);
      ::close(fd_);
      fd_ = -1;
      std::string holder(text, n > 0 ? static_cast<size_t>(n) : 0);
      holder.erase(holder.find_last_not_of("\n ") + 1);
      MT_CHECK(e == EWOULDBLOCK) << "cannot lock " << path << ": " << std::strerror(e);
      throw LockHeld(path + " is held by " + (holder.empty() ? std::string("another process") : holder), "");
    }
    struct stat mine {}, now {};
    if (::fstat(fd_, &mine) == 0 && ::stat(path.c_str(), &now) == 0 && mine.st_ino == now.st_ino &&
        mine.st_dev == now.st_dev)
      break;
    ::close(fd_);
    fd_ = -1;
  }
  MT_CHECK(fd_ >= 0) << "cannot lock " << path << ": it is removed and made again faster than it can be locked";
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const std::time_t t = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  const std::string text = "pid " + std::to_string(::getpid()) + " on host " + host + " since " + when + " (" +
                           std::string(what) + ")\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
    std::fprintf(stderr, "moetrain: warning: cannot write the holder into %s: %s\n", path.c_str(), std::strerror(errno));
}

FileLock::~FileLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // while held: a taker that opened it finds it gone and locks anew
  ::close(fd_);
}

AppendFile::AppendFile(const std::string& path, bool truncate) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
  MT_CHECK(fd_ >= 0) << "cannot open " << path << " for writing: " << std::strerror(errno);
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  MT_CHECK(end >= 0) << "cannot seek in " << path << ": " << std::strerror(errno);
  size_ = end;
}

AppendFile& AppendFile::operator=(AppendFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    size_ = o.size_;
    torn_ = o.torn_;
  }
  return *this;
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string AppendFile::append(std::string_view record) {
  if (fd_ < 0) return "not open";
  // At the end of the whole records: a record cut off before is written over.
  const ssize_t n = transfer(record.size(), [&](size_t done) {
    return ::pwrite(fd_, record.data() + done, record.size() - done, size_ + static_cast<int64_t>(done));
  });
  if (n <= 0) {
    const std::string why = n < 0 ? std::strerror(errno) : "no bytes written";
    // The part written is cut off again; where that fails too, the next record that
    // is written whole cuts it (it starts where this one did).
    torn_ = ::ftruncate(fd_, size_) != 0;
    return why;
  }
  size_ += static_cast<int64_t>(record.size());
  if (torn_) torn_ = ::ftruncate(fd_, size_) != 0;
  return "";
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
    if (transfer(p.size(), [&](size_t done) { return ::write(fd, p.data() + done, p.size() - done); }) <= 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      MT_FAIL() << "writing " << tmp << ": " << std::strerror(e);
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
