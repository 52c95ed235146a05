// Whole-file reads, read-only maps, atomic writes, locks and checksums. Every read takes
// regular files only: a device (/dev/zero) or a folder is refused by name, not read
// without bound.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/check.h"

namespace mt::io {

std::vector<uint8_t> read_file(const std::string& path);

// A regular file mapped read-only in whole (an empty one maps to no bytes) until
// destroyed; movable. `what` names the file in the open error: "cannot open <what> <path>".
class MappedFile {
 public:
  MappedFile(const std::string& path, std::string_view what);
  std::span<const uint8_t> bytes() const { return {map_.get(), map_ ? map_.get_deleter().size : 0}; }

 private:
  struct Unmap {  // munmap needs the length
    size_t size;
    void operator()(const uint8_t* p) const;
  };
  std::unique_ptr<const uint8_t, Unmap> map_;
};

// A regular file read at offsets (pread) while a run goes on: a file cut short or
// replaced under the reader reads short, which read() reports as an error naming the
// file, the offset and its size now, where a map of it would end the process with
// SIGBUS and no word. Movable; closed when destroyed.
class PositionalFile {
 public:
  PositionalFile(const std::string& path, std::string_view what);
  PositionalFile(PositionalFile&& o) noexcept : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)) {}
  PositionalFile& operator=(PositionalFile&&) = delete;
  ~PositionalFile();
  // Bytes [offset, offset + n) into dst.
  void read(int64_t offset, size_t n, void* dst) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// A file's size and XXH3-64 checksum: what a checkpoint records of each of its files.
struct FileSum {
  uint64_t bytes = 0, xxh3 = 0;
};

// The FileSum of the file at `path` as it is now.
FileSum file_sum(const std::string& path);

// What the file at `path` holds, cheaply: its size, and the XXH3-64 of its first and last
// 64 KiB (of all of it when smaller). Ranks compare it to know that they read the same
// data without reading a corpus of terabytes whole: it tells apart files of another
// size, another header (.npy, safetensors) or another end (a corpus file's document ends).
FileSum file_fingerprint(const std::string& path);

// An exclusive lock on the file at `path` (flock), created if missing and held until
// destroyed, when the file is removed. The kernel drops it when the process dies, so a
// crash never leaves it held (only a stale file, which the next taker reuses). The
// holder writes "pid P on host H since T (what)" into the file; a second taker is
// refused at once with an error that quotes it: "<path> is held by pid P on host H ...".
// `what` names the holder's work, written for the next taker to read. A lock held by
// another throws LockHeld; a lock that cannot be taken for another reason (a read-only
// folder) throws a plain Error, so a caller can say which.
struct LockHeld : Error {
  using Error::Error;
};

class FileLock {
 public:
  FileLock(const std::string& path, std::string_view what);
  FileLock(FileLock&& o) noexcept : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)) {}
  FileLock& operator=(FileLock&&) = delete;
  ~FileLock();

 private:
  std::string path_;
  int fd_ = -1;
};

// A file grown by whole records (a metrics line, a TensorBoard event), each write
// checked: append() writes a record in full or, on any failure (a full disk, a quota),
// cuts the file back to its earlier records and returns why (errno's text), so the file
// never holds a torn record and the next append tries again. Movable; closed when
// destroyed.
class AppendFile {
 public:
  AppendFile() = default;
  // Opens `path` (created; emptied when `truncate`); an error naming it when it cannot.
  AppendFile(const std::string& path, bool truncate);
  AppendFile(AppendFile&& o) noexcept
      : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), size_(o.size_), torn_(o.torn_) {}
  AppendFile& operator=(AppendFile&& o) noexcept;
  ~AppendFile();
  // "" once the record is the file's; otherwise why not.
  std::string append(std::string_view record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;    // the bytes of whole records
  bool torn_ = false;  // a failed record's bytes may follow them
};

// Writes the pieces to path.tmp, fsyncs it, renames it over path and fsyncs the
// folder: after a crash either the old file or the complete new one is there. Returns
// the FileSum of the bytes written, hashed on the way (no second read).
FileSum write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces);

}  // namespace mt::io
