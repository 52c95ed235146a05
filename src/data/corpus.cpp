#include "data/corpus.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/check.h"
#include "data/tokenizer.h"
#include "io/file.h"
#include "io/npy.h"

namespace mt::data {
namespace fs = std::filesystem;

void write_token_file(const std::string& path, std::span<const int32_t> tokens, std::span<const uint64_t> doc_ends,
                      int64_t vocab_size) {
  MT_CHECK(vocab_size > 0 && vocab_size <= (int64_t{1} << 32)) << path << ": vocabulary size " << vocab_size;
  MT_CHECK(doc_ends.empty() ? tokens.empty() : doc_ends.back() == tokens.size())
      << path << ": document ends must finish at the token count " << tokens.size();
  size_t width = vocab_size <= 256 ? 1 : vocab_size <= 65536 ? 2 : 4;
  std::string descr = width == 1 ? "|u1" : width == 2 ? "<u2" : "<u4";
  std::string data(tokens.size() * width, '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    MT_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size)
        << path << ": token " << tokens[i] << " at " << i << " is outside [0, " << vocab_size << ")";
    uint32_t v = static_cast<uint32_t>(tokens[i]);
    std::memcpy(&data[i * width], &v, width);  // little-endian host, as .npy '<' says
  }
  std::string h1 = io::make_npy_header(descr, {static_cast<int64_t>(tokens.size())});
  std::string h2 = io::make_npy_header("<u8", {static_cast<int64_t>(doc_ends.size())});
  std::string_view ends(reinterpret_cast<const char*>(doc_ends.data()), doc_ends.size_bytes());
  io::write_file_atomic(path, {h1, data, h2, ends});
}

namespace {

// Lines of a .jsonl or .jsonl.zst file, read in large blocks.
class LineReader {
 public:
  explicit LineReader(const std::string& path) : path_(path), zst_(path.ends_with(".zst")) {
    fd_ = ::open(path.c_str(), O_RDONLY);
    MT_CHECK(fd_ >= 0) << "cannot open " << path << ": " << std::strerror(errno);
    if (zst_) dctx_ = ZSTD_createDCtx();
  }
  ~LineReader() {
    if (dctx_) ZSTD_freeDCtx(dctx_);
    ::close(fd_);
  }
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // The next line without its '\n'; false at the end of the file.
  bool next(std::string_view& line) {
    for (;;) {
      // Search only what is new since the last refill: one long line spans many.
      size_t nl = text_.find('\n', std::max(pos_, scanned_));
      if (nl != std::string::npos) {
        line = std::string_view(text_).substr(pos_, nl - pos_);
        pos_ = nl + 1;
        return true;
      }
      scanned_ = text_.size() - pos_;
      if (pos_ > 0) {
        text_.erase(0, pos_);
        pos_ = 0;
      }
      if (!fill()) {
        if (text_.empty()) return false;
        line = text_;  // a last line without '\n'
        pos_ = text_.size();
        return true;
      }
    }
  }
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  // Appends more text; false at the end of the input.
  bool fill() {
    for (;;) {
      if (in_pos_ == in_.size() && !eof_) {
        in_.resize(1 << 20);
        ssize_t n;
        do n = ::read(fd_, in_.data(), in_.size());
        while (n < 0 && errno == EINTR);
        MT_CHECK(n >= 0) << "error reading " << path_ << ": " << std::strerror(errno);
        in_.resize(static_cast<size_t>(n));
        in_pos_ = 0;
        bytes_read_ += static_cast<uint64_t>(n);
        eof_ = n == 0;
      }
      bool input_left = in_pos_ < in_.size();
      if (!zst_) {
        if (!input_left) return false;
        text_.append(in_.data(), in_.size());
        in_pos_ = in_.size();
        return true;
      }
      if (!input_left && eof_ && frame_done_) return false;
      // With no input left this still flushes what the decoder holds back.
      size_t old = text_.size();
      text_.resize(old + ZSTD_DStreamOutSize());
      ZSTD_inBuffer in{in_.data(), in_.size(), in_pos_};
      ZSTD_outBuffer out{text_.data() + old, text_.size() - old, 0};
      size_t rc = ZSTD_decompressStream(dctx_, &out, &in);
      MT_CHECK(!ZSTD_isError(rc)) << path_ << ": zstd: " << ZSTD_getErrorName(rc) << " after byte "
                                  << bytes_read_ - in_.size() + in.pos << " (the file is corrupt from there)";
      frame_done_ = rc == 0;
      in_pos_ = in.pos;
      text_.resize(old + out.pos);
      if (out.pos > 0) return true;
      MT_CHECK(input_left || !eof_) << path_ << ": truncated zstd stream (the file ends inside a frame)";
    }
  }

  std::string path_;
  bool zst_;
  int fd_ = -1;
  ZSTD_DCtx* dctx_ = nullptr;
  std::vector<char> in_;
  size_t in_pos_ = 0;
  bool eof_ = false;
  bool frame_done_ = true;
  std::string text_;
  size_t pos_ = 0;      // start of the next line in text_
  size_t scanned_ = 0;  // text_[pos_, scanned_) holds no '\n'
  uint64_t bytes_read_ = 0;
};

struct Job {
  std::string input, output;
  uint64_t bytes = 0;
};

std::string stem_of(const std::string& name) {
  for (const char* ext : {".jsonl.zst", ".jsonl"})
    if (name.ends_with(ext)) return name.substr(0, name.size() - std::strlen(ext));
  return {};
}

// Every input file with the output it gets, checked for clashes.
std::vector<Job> find_jobs(const TokenizeOptions& o) {
  std::vector<Job> jobs;
  std::map<std::string, std::string> source_of;  // output -> input
  auto add = [&](const fs::path& file, const std::string& rel_stem) {
    Job j{file.string(), (fs::path(o.output) / (rel_stem + ".bin")).string(), fs::file_size(file)};
    auto [it, fresh] = source_of.emplace(j.output, j.input);
    MT_CHECK(fresh) << "inputs " << it->second << " and " << j.input << " would both be written to " << j.output
                    << "; give them different names";
    jobs.push_back(j);
  };
  MT_CHECK(!o.inputs.empty()) << "no --input given";
  for (const std::string& in : o.inputs) {
    fs::path p(in);
    MT_CHECK(fs::exists(p)) << "input " << in << " does not exist";
    if (fs::is_directory(p)) {
      std::vector<fs::path> found;
      for (const auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file() && !stem_of(e.path().filename().string()).empty()) found.push_back(e.path());
      MT_CHECK(!found.empty()) << "input folder " << in << " holds no .jsonl or .jsonl.zst files";
      std::sort(found.begin(), found.end());
      for (const fs::path& f : found) add(f, stem_of(fs::relative(f, p).string()));
    } else {
      std::string stem = stem_of(p.filename().string());
      MT_CHECK(!stem.empty()) << "input " << in << " is not a .jsonl or .jsonl.zst file";
      add(p, stem);
    }
  }
  return jobs;
}

// ---- worker side ----------------------------------------------------------------

// Messages to the parent are single lines, each written with one write() below
// PIPE_BUF bytes, so they arrive whole:
//   P <docs> <tokens> <bytes>   progress since the last P
//   M <text>                    a malformed line, reported
//   D                           the file handed out last is done
//   F <text>                    it is a bad file, skipped (see corpus.h)
//   E <text>                    a fatal error; the worker exits
void send(int fd, std::string msg) {
  std::replace(msg.begin(), msg.end(), '\n', ' ');
  if (msg.size() > 4000) msg.resize(4000);
  msg += '\n';
  ssize_t n;
  do n = ::write(fd, msg.data(), msg.size());
  while (n < 0 && errno == EINTR);
}

// A lock beside the output, held (flock) while this worker writes it: a second
// `tokenize` on the same folder stops instead of writing the same file.
int take_lock(const std::string& lock, const std::string& input) {
  int fd = ::open(lock.c_str(), O_WRONLY | O_CREAT, 0644);
  MT_CHECK(fd >= 0) << "cannot create " << lock << ": " << std::strerror(errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    MT_FAIL() << lock << " is held by another running moetrain tokenize; wait for it or stop it first";
  }
  std::string note = "unfinished: tokenizing " + input + "\n";
  MT_CHECK(::ftruncate(fd, 0) == 0 && ::write(fd, note.data(), note.size()) == static_cast<ssize_t>(note.size()) &&
           ::fsync(fd) == 0)
      << "cannot write " << lock << ": " << std::strerror(errno);
  return fd;
}

pid_t worker_parent = -1;  // the tokenize process, as a worker saw it at its start

void tokenize_file(const Job& job, Tokenizer& tok, const TokenizeOptions& o, int to_parent) {
  fs::create_directories(fs::path(job.output).parent_path());
  std::string lock = job.output + ".lock";
  int lock_fd = take_lock(lock, job.input);
  int32_t eos = tok.eos_id();
  std::vector<int32_t> tokens;
  std::vector<uint64_t> ends;
  int64_t line_no = 0, docs_sent = 0;
  size_t tokens_sent = 0;
  uint64_t bytes_read = 0, bytes_sent = 0;
  auto last = std::chrono::steady_clock::now();
  auto progress = [&] {
    send(to_parent, "P " + std::to_string(static_cast<int64_t>(ends.size()) - docs_sent) + " " +
                        std::to_string(tokens.size() - tokens_sent) + " " + std::to_string(bytes_read - bytes_sent));
    docs_sent = static_cast<int64_t>(ends.size());
    tokens_sent = tokens.size();
    bytes_sent = bytes_read;
    last = std::chrono::steady_clock::now();
  };
  auto bad = [&](const std::string& why) {
    std::string msg = job.input + ":" + std::to_string(line_no) + ": " + why;
    MT_CHECK(!o.strict) << msg << " (--strict)";
    send(to_parent, "M " + msg);
  };
  try {
    LineReader reader(job.input);
    std::string_view line;
    while (reader.next(line)) {
      ++line_no;
      bytes_read = reader.bytes_read();
      if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank lines hold no document
      nlohmann::json doc;
      try {
        doc = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        bad(std::string("not valid JSON: ") + e.what());
        continue;
      }
      auto f = doc.is_object() ? doc.find(o.field) : doc.end();
      if (!doc.is_object() || f == doc.end() || !f->is_string()) {
        bad("no string field \"" + o.field + "\"");
        continue;
      }
      try {
        tok.encode(f->get_ref<const std::string&>(), tokens);
      } catch (const Error& e) {
        MT_FAIL() << job.input << ":" << line_no << ": " << e.message;
      }
      tokens.push_back(eos);
      ends.push_back(tokens.size());
      if ((ends.size() & 63) == 0 && std::chrono::steady_clock::now() - last > std::chrono::milliseconds(200))
        progress();
    }
    bytes_read = reader.bytes_read();
  } catch (const Error& e) {
    // A parent that died (killed: the failure is our send to it) leaves the lock, so
    // that a rerun redoes the file; only a file's own fault is cleaned and reported.
    if (o.strict || ::getppid() != worker_parent) throw;
    // Take back the documents and tokens reported, then remove what an earlier killed
    // run may have left, the .bin before the lock: a .bin without one counts as done.
    send(to_parent, "P -" + std::to_string(docs_sent) + " -" + std::to_string(tokens_sent) + " 0");
    fs::remove(job.output + ".tmp");
    fs::remove(job.output);
    MT_CHECK(::unlink(lock.c_str()) == 0) << "cannot remove " << lock << ": " << std::strerror(errno);
    ::close(lock_fd);
    send(to_parent, "F " + e.message);
    return;
  }
  write_token_file(job.output, tokens, ends, tok.vocab_size());
  // The .bin is complete and durable (write_file_atomic synced it and the folder);
  // only now may the lock go.
  MT_CHECK(::unlink(lock.c_str()) == 0) << "cannot remove " << lock << ": " << std::strerror(errno);
  ::close(lock_fd);
  progress();
  send(to_parent, "D");
}

[[noreturn]] void worker_main(int from_parent, int to_parent, const std::vector<Job>& jobs, Tokenizer& tok,
                              const TokenizeOptions& o) {
  worker_parent = ::getppid();
  int code = 0;
  try {
    int32_t index;
    while (::read(from_parent, &index, sizeof index) == sizeof index) tokenize_file(jobs[index], tok, o, to_parent);
  } catch (const std::exception& e) {
    send(to_parent, std::string("E ") + e.what());
    code = 1;
  }
  ::_exit(code);  // not exit(): the parent's atexit handlers and stdio buffers are not ours
}

// ---- parent side ----------------------------------------------------------------

struct Worker {
  pid_t pid = -1;
  int to_child = -1, from_child = -1;
  int job = -1;
  std::string pending;  // a partial message line
};

std::string human(double v) {
  char b[32];
  if (v >= 1e9)
    std::snprintf(b, sizeof b, "%.2fG", v / 1e9);
  else if (v >= 1e6)
    std::snprintf(b, sizeof b, "%.2fM", v / 1e6);
  else if (v >= 1e4)
    std::snprintf(b, sizeof b, "%.1fK", v / 1e3);
  else
    std::snprintf(b, sizeof b, "%.0f", v);
  return b;
}

std::string clock_time(double s) {
  long t = static_cast<long>(s + 0.5);
  char b[32];
  std::snprintf(b, sizeof b, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  return b;
}

// The corpus keeps the tokenizer that made it (training copies it into checkpoints):
// tokenizer.json, and tokenizer_config.json where one is beside it. An output folder
// holding another tokenizer.json has files of another vocabulary: an error.
void keep_tokenizer(const std::string& tokenizer, const std::string& output) {
  const fs::path out = fs::path(output) / "tokenizer.json";
  const std::vector<uint8_t> b = io::read_file(tokenizer);
  MT_CHECK(!fs::exists(out) || io::read_file(out.string()) == b)
      << output << " holds files tokenized with another tokenizer (" << out.string() << " differs from " << tokenizer
      << "); give a new --output folder";
  auto keep = [&](const std::vector<uint8_t>& bytes, const char* name) {
    const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    io::write_file_atomic((fs::path(output) / name).string(), {text});
  };
  keep(b, "tokenizer.json");
  const fs::path config = fs::path(tokenizer).parent_path() / "tokenizer_config.json";
  if (fs::exists(config)) keep(io::read_file(config.string()), "tokenizer_config.json");
}

}  // namespace

TokenizeReport tokenize_corpus(const TokenizeOptions& o) {
  Tokenizer tok(o.tokenizer);
  tok.eos_id();  // fail now, not in every worker, when there is no end-of-document token
  std::vector<Job> jobs = find_jobs(o);
  fs::create_directories(o.output);
  keep_tokenizer(o.tokenizer, o.output);

  TokenizeReport rep;
  rep.files = static_cast<int64_t>(jobs.size());
  std::erase_if(jobs, [](const Job& j) { return fs::exists(j.output) && !fs::exists(j.output + ".lock"); });
  rep.files_skipped = rep.files - static_cast<int64_t>(jobs.size());
  uint64_t total_bytes = 0;
  for (const Job& j : jobs) total_bytes += j.bytes;
  // Largest first, so the last files to finish are small ones and workers end together.
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.bytes > b.bytes; });
  if (jobs.empty()) return rep;

  // A worker that died must show up as a failed write, not kill the parent.
  struct IgnoreSigpipe {
    struct sigaction old {};
    IgnoreSigpipe() {
      struct sigaction ign {};
      ign.sa_handler = SIG_IGN;
      ::sigaction(SIGPIPE, &ign, &old);
    }
    ~IgnoreSigpipe() { ::sigaction(SIGPIPE, &old, nullptr); }
  } ignore_sigpipe;

  int n_workers = o.workers > 0 ? o.workers : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_workers = std::min<int>(n_workers, static_cast<int>(jobs.size()));
  std::vector<Worker> workers(static_cast<size_t>(n_workers));
  pid_t parent = ::getpid();
  std::fflush(nullptr);  // or the children would print the parent's buffered output again
  bool tty = ::isatty(STDERR_FILENO);
  auto start = std::chrono::steady_clock::now();
  auto last_print = start;
  int64_t files_done = 0;
  uint64_t bytes_done = 0;
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  auto status = [&] {
    double s = seconds(), rate = s > 0 ? static_cast<double>(rep.tokens) / s : 0;
    std::string line = "tokenize: " + std::to_string(files_done + rep.files_skipped) + "/" + std::to_string(rep.files) +
                       " files, " + std::to_string(rep.documents) + " documents, " +
                       human(static_cast<double>(rep.tokens)) + " tokens, " + human(rate) + " tokens/s";
    if (bytes_done > 0 && bytes_done < total_bytes)
      line +=
          ", ETA " + clock_time(s * static_cast<double>(total_bytes - bytes_done) / static_cast<double>(bytes_done));
    return line;
  };
  // On a terminal the progress line is redrawn in place; in a log, one line every 10 s.
  auto print_status = [&](bool force) {
    auto now = std::chrono::steady_clock::now();
    if (!force && now - last_print < std::chrono::milliseconds(tty ? 250 : 10000)) return;
    last_print = now;
    std::fprintf(stderr, tty ? "\r%s\033[K" : "%s\n", status().c_str());
  };
  auto say = [&](const std::string& text) { std::fprintf(stderr, tty ? "\r%s\033[K\n" : "%s\n", text.c_str()); };
  constexpr int kReportedMalformed = 20;
  // Whatever fails below (fork, a pipe, a worker) ends up in `failure`, so that the
  // cleanup after the loop always stops every worker.
  std::string failure;
  try {
    for (Worker& w : workers) {
      int down[2], up[2];
      MT_CHECK(::pipe2(down, O_CLOEXEC) == 0 && ::pipe2(up, O_CLOEXEC) == 0) << "pipe: " << std::strerror(errno);
      pid_t pid = ::fork();
      MT_CHECK(pid >= 0) << "fork: " << std::strerror(errno);
      if (pid == 0) {
        // A worker dies with its parent (a killed run leaves no stray writers), and
        // keeps only its own two pipe ends.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(1);
        ::signal(SIGPIPE, SIG_DFL);
        for (const Worker& other : workers)
          if (other.pid > 0) {
            ::close(other.to_child);
            ::close(other.from_child);
          }
        ::close(down[1]);
        ::close(up[0]);
        worker_main(down[0], up[1], jobs, tok, o);
      }
      ::close(down[0]);
      ::close(up[1]);
      w.pid = pid;
      w.to_child = down[1];
      w.from_child = up[0];
    }

    size_t next_job = 0;
    auto hand_out = [&](Worker& w) {
      if (next_job < jobs.size()) {
        int32_t index = static_cast<int32_t>(next_job++);
        w.job = index;
        MT_CHECK(::write(w.to_child, &index, sizeof index) == sizeof index)
            << "pipe to worker: " << std::strerror(errno);
      } else {
        w.job = -1;
        ::close(w.to_child);  // no more work: the worker reads EOF and exits
        w.to_child = -1;
      }
    };
    for (Worker& w : workers) hand_out(w);

    int alive = n_workers;
    std::vector<pollfd> fds(workers.size());  // fds[i] is workers[i]'s; poll skips the closed ones (-1)
    while (alive > 0 && failure.empty()) {
      for (size_t i = 0; i < workers.size(); ++i) fds[i] = {workers[i].from_child, POLLIN, 0};
      int rc = ::poll(fds.data(), fds.size(), 250);
      MT_CHECK(rc >= 0 || errno == EINTR) << "poll: " << std::strerror(errno);
      for (size_t i = 0; i < fds.size() && failure.empty(); ++i) {
        if (fds[i].revents == 0) continue;
        Worker& w = workers[i];
        char buf[8192];
        ssize_t n = ::read(w.from_child, buf, sizeof buf);
        if (n > 0) {
          w.pending.append(buf, static_cast<size_t>(n));
          size_t nl;
          while ((nl = w.pending.find('\n')) != std::string::npos && failure.empty()) {
            std::string msg = w.pending.substr(0, nl);
            w.pending.erase(0, nl + 1);
            char kind = msg.empty() ? '?' : msg[0];
            std::string body = msg.size() > 2 ? msg.substr(2) : "";
            if (kind == 'P') {
              long long d, t, b;
              if (std::sscanf(body.c_str(), "%lld %lld %lld", &d, &t, &b) == 3) {
                rep.documents += d;
                rep.tokens += t;
                bytes_done += static_cast<uint64_t>(b);
              }
            } else if (kind == 'M') {
              if (++rep.malformed <= kReportedMalformed)
                say("tokenize: skipped malformed line " + body);
              else if (rep.malformed == kReportedMalformed + 1)
                say("tokenize: more malformed lines; counting them only");
            } else if (kind == 'D' || kind == 'F') {
              if (kind == 'F') {
                rep.bad_files.push_back(jobs[static_cast<size_t>(w.job)].input);
                say("tokenize: skipped a bad file: " + body);
              }
              ++files_done;
              hand_out(w);
            } else if (kind == 'E') {
              failure = body;
            }
          }
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        // The worker closed its end: it has exited, or died.
        ::close(w.from_child);
        w.from_child = -1;
        --alive;
        int st = 0;
        ::waitpid(w.pid, &st, 0);
        w.pid = -1;
        if (w.job >= 0 && failure.empty()) {
          failure = "worker tokenizing " + jobs[static_cast<size_t>(w.job)].input + " " +
                    (WIFSIGNALED(st) ? "was killed by signal " + std::to_string(WTERMSIG(st))
                                     : "exited with status " + std::to_string(WEXITSTATUS(st)));
        }
      }
      print_status(false);
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  for (Worker& w : workers) {
    if (w.to_child >= 0) ::close(w.to_child);
    if (w.from_child >= 0) ::close(w.from_child);
    if (w.pid > 0) {
      ::kill(w.pid, SIGKILL);  // its file keeps its .lock and is redone next run
      ::waitpid(w.pid, nullptr, 0);
    }
  }
  if (tty) {  // finish the line redrawn in place; the caller prints the summary
    print_status(true);
    std::fputc('\n', stderr);
  }
  MT_CHECK(failure.empty()) << failure << " (unfinished files keep their .lock; rerun to resume)";
  std::sort(rep.bad_files.begin(), rep.bad_files.end());
  return rep;
}

}  // namespace mt::data
