// moetrain: one binary, one function per subcommand, no argument framework.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "cli/commands.h"
#include "comm/communicator.h"
#include "core/check.h"
#include "train/config.h"
#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/device.h"
#endif

namespace {

using mt::cli::Args;

// OpenMP defaults, where the user has not set them. Idle threads sleep instead of
// spinning: spinning ones ran training 2-6x slower when other processes wanted the cores.
// The ranks mpirun starts on one host share its cores: cores / ranks threads each.
// libgomp reads its environment once, in its constructor, before main (and a setenv in
// .preinit_array is undone by libc's start-up), so the process sets them and runs itself
// again: exec keeps the process id, which launchers watch.
void openmp_defaults(char** argv) {
  bool changed = false;
  if (!getenv("OMP_WAIT_POLICY")) changed = setenv("OMP_WAIT_POLICY", "passive", 1) == 0;
  const char* local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const long ranks = local ? std::atol(local) : 1;
  cpu_set_t cpus;
  if (ranks > 1 && !getenv("OMP_NUM_THREADS") && sched_getaffinity(0, sizeof cpus, &cpus) == 0) {
    const long threads = std::max(1l, std::min<long>(CPU_COUNT(&cpus), sysconf(_SC_NPROCESSORS_ONLN) / ranks));
    changed = setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1) == 0 || changed;
  }
  if (changed) execv("/proc/self/exe", argv);  // on failure, libgomp's own defaults stay
}

struct Command {
  const char* name;
  const char* summary;
  const char* usage;
  int (*run)(const Args& args);
  bool keys = false;  // --help lists the config keys after the usage
};

const Command kCommands[] = {
    {"train", "train a model from a config and overrides",
     "usage: moetrain train [--config FILE.toml] [--section.key=value ...]\n"
     "  Every key has a default, so overrides alone can describe a run. Sections:\n"
     "  [job] [model] [data] [training] [optimizer] [lr_scheduler] [parallelism]\n"
     "  [checkpoint] [metrics]. Under mpirun or srun every rank runs the same command.\n"
     "  A relative path in the config file is taken against the file's folder, one on the\n"
     "  command line against the working folder. A resume prints the keys changed since\n"
     "  its checkpoint and refuses those marked fixed on resume (docs/config.md). One run a\n"
     "  folder: job.dump_folder/moetrain.lock is held while it runs. SIGTERM, SIGINT or SIGUSR1\n"
     "  (those within 2 s of the first are one request) finishes the step, saves and exits\n"
     "  with status 75; run the same command again to resume. A signal after that exits at\n"
     "  once. mpirun kills its ranks 1 s after a SIGTERM: send it SIGUSR1, or run it with\n"
     "  --mca odls_base_sigkill_timeout 600.\n"
     "  --print-config  print the resolved config as TOML and exit\n\n"
     "keys (section.key, type, default, meaning):\n",
     mt::cli::run_train, true},
    {"eval", "mean next-token loss of a Hugging Face model or a checkpoint on a token matrix",
     "usage: moetrain eval --model DIR --tokens FILE.npy [--device cpu|cuda]\n"
     "  Prints {\"loss\": <mean cross-entropy>, \"tokens\": <B*(T-1)>} for the [B,T] int32/int64\n"
     "  matrix (inputs are columns 0..T-2, labels columns 1..T-1). DIR is a Hugging Face\n"
     "  folder, a checkpoint step folder or a run folder (its newest checkpoint that verifies).\n"
     "  A loss that is not finite is an error.\n",
     mt::cli::run_eval},
    {"encode", "encode text with a tokenizer.json, print ids as JSON",
     "usage: moetrain encode --tokenizer tokenizer.json [--text STR]\n"
     "  Encodes STR, or all of standard input when --text is absent, as Hugging Face\n"
     "  tokenizers would, and prints the ids as one JSON array.\n",
     mt::cli::run_encode},
    {"tokenize", "turn JSONL(.zst) files into packed token files",
     "usage: moetrain tokenize --tokenizer FILE --input PATH... --output DIR [--workers N]\n"
     "                         [--field text] [--strict]\n"
     "  Writes one .bin per input file: the tokens, then uint64 cumulative document ends,\n"
     "  as two consecutive .npy arrays. Reruns redo only unfinished files. Malformed lines\n"
     "  and bad files (unreadable, corrupt) are reported and skipped, a bad file making the\n"
     "  exit status 1 once the others are done; --strict stops at the first of either.\n",
     mt::cli::run_tokenize},
    {"export-hf", "write a checkpoint as a Hugging Face model folder",
     "usage: moetrain export-hf --checkpoint DIR --output DIR [--dtype bf16|fp32]\n"
     "                          [--max-shard-size 5GB] [--force]\n"
     "  The folder is written beside DIR (DIR.tmp, under the lock DIR.lock) and renamed into\n"
     "  place. A non-empty DIR needs --force, which replaces an earlier export only: a DIR\n"
     "  holding a checkpoint or files export-hf does not write is refused.\n",
     mt::cli::run_export_hf},
    {"generate", "continue a prompt with a Hugging Face model folder or a checkpoint",
     "usage: moetrain generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens 32]\n"
     "                         [--temperature 0] [--top-p 1] [--seed 0] [--device cpu|cuda]\n"
     "                         [--past-max-positions] [--offload-experts N]\n"
     "  DIR is a Hugging Face folder (export-hf's output), a checkpoint step folder or a run\n"
     "  folder (its newest checkpoint). Temperature 0 is greedy; above 0, tokens are drawn from\n"
     "  the top-p nucleus, the same ones for the same --seed. Stops at eos_token_id (of\n"
     "  generation_config.json, else config.json). Prints the prompt and its continuation\n"
     "  where DIR has a tokenizer.json, then the new ids as one JSON array on the last line.\n"
     "  It stops at config.json's max_position_embeddings unless --past-max-positions.\n"
     "  --offload-experts N keeps the routed experts in host memory and N of them on the\n"
     "  device (an LRU cache), and prints the tokens/s and the cache's hit rate on stderr.\n",
     mt::cli::run_generate},
    {"plan", "print memory per rank and the mesh for a config, before launch",
     "usage: moetrain plan [--config FILE.toml] [--section.key=value ...] [--world N]\n"
     "                     [--routing-skew S] [--routing metrics.jsonl]\n"
     "                     [--schedule [--profile metrics.jsonl] [--output schedule.svg]]\n"
     "  The mesh for N ranks and the bytes of weights, gradients, optimizer state and\n"
     "  activations each pp rank holds, from the allocation code training uses. The\n"
     "  expert rows (sized by routing) count in the total under balanced routing; a second\n"
     "  total bounds them with the hottest rank getting S times its share (default 1.5).\n"
     "  seq_len and the global batch come from data.tokens where the flags give none.\n"
     "  --schedule plays the step's schedule out on every pp rank, prints its bubble and\n"
     "  draws the timeline as SVG; --profile takes the stage times of a run trained with\n"
     "  --metrics.profile=true (its last step) and predicts the step time from them.\n"
     "  --routing takes a run's recorded expert loads (its metrics.jsonl) and prints, for\n"
     "  0, 1, 2 and 4 replica slots a rank, the busiest ep rank's rows over the mean, and\n"
     "  with a profile the step time with the expert stages slowed by it.\n"
     "  The config and its keys are train's (moetrain train --help lists them).\n",
     mt::cli::run_plan},
};

void print_help() {
  std::printf(
      "moetrain %s: train Mixture-of-Experts language models (C++20/CUDA)\n\n"
      "usage: moetrain <command> [options] [--verbose]\n       moetrain --version\n\ncommands:\n",
      MOETRAIN_VERSION);
  for (const Command& c : kCommands) std::printf("  %-10s %s\n", c.name, c.summary);
  std::printf("\n'moetrain <command> --help' describes one command. --verbose adds to an error\n"
              "where in the source it was raised.\n");
}

int print_version() {
  std::printf("moetrain %s\n", MOETRAIN_VERSION);
#ifdef MOETRAIN_WITH_CUDA
  std::printf("cuda: built in (sm_90a)\n");
  mt::cuda::DeviceInfo d = mt::cuda::query_device();
  if (d.count == 0)
    std::printf("cuda devices: none: no usable GPU here%s%s%s\n", d.error.empty() ? "" : " (the CUDA runtime says: ",
                d.error.c_str(), d.error.empty() ? "" : ")");
  else
    std::printf("cuda devices: %d, device 0: %s, sm_%d%d, %.1f GiB, probe kernel %s\n", d.count, d.name.c_str(),
                d.sm_major, d.sm_minor, static_cast<double>(d.memory_bytes) / (1ull << 30),
                d.kernels_run ? "ran" : "failed: no usable GPU (moetrain's kernels are for sm_90a, Hopper)");
#else
  std::printf("cuda: not built in (CPU backend only)\n");
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  openmp_defaults(argv);
  if (argc < 2) {
    print_help();
    return 2;
  }
  std::string_view cmd = argv[1];
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    print_help();
    return 0;
  }
  if (cmd == "--version") return print_version();
  Args args(argv + 2, argv + argc);
  const bool verbose = std::erase(args, "--verbose") > 0;
  for (const Command& c : kCommands) {
    if (cmd != c.name) continue;
    if (std::any_of(args.begin(), args.end(), [](std::string_view a) { return a == "--help" || a == "-h"; })) {
      std::fputs(c.usage, stdout);
      if (c.keys) std::fputs(mt::config_reference(false).c_str(), stdout);
      return 0;
    }
    try {
      return c.run(args);
    } catch (const std::exception& e) {
      // The message says what was wrong and how to fix it; where in the source it was
      // raised is for --verbose (an internal error's message includes it).
      const auto* m = dynamic_cast<const mt::Error*>(&e);
      std::string rank = mt::comm::world().size() > 1 ? " on rank " + std::to_string(mt::comm::world().rank()) : "";
      std::fprintf(stderr, "moetrain %s: error%s: %s\n", c.name, rank.c_str(), m ? m->message.c_str() : e.what());
      if (verbose && m && !m->where.empty()) std::fprintf(stderr, "  (%s)\n", m->where.c_str());
      // The other ranks may be waiting in a collective for this one: end them all.
      if (mt::comm::world().size() > 1) mt::comm::world().abort(1);
      return 1;
    }
  }
  std::fprintf(stderr, "moetrain: unknown command '%s' (expected one of:", argv[1]);
  for (const Command& c : kCommands) std::fprintf(stderr, " %s", c.name);
  std::fprintf(stderr, "; see moetrain --help)\n");
  return 2;
}
