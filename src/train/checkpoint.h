// Canonical checkpoints: one layout whatever the mesh that wrote them.
//
//   checkpoints/step-00001000/
//     model.safetensors      fp32 master weights under their Hugging Face keys
//     optimizer.safetensors  AdamW moments: "<key>.exp_avg", "<key>.exp_avg_sq"; Muon's
//                            matrices (optimizer.name = muon) "<key>.momentum"
//       (with expert or pipeline parallelism: model-part<r>/optimizer-part<r>.safetensors,
//       one per writer, and a <stem>.safetensors.index.json naming each key's file)
//     train_state.json       step, seed, learning rate, data cursor, expert placement, the run's config
//     config.json            the model's Hugging Face config
//     tokenizer files        tokenizer.json (and tokenizer_config.json, ...) of the run's
//                            tokenizer: the corpus's, else the model's (see save_checkpoint)
//     COMPLETE               written last, the manifest: every other file's size and XXH3-64
//                            checksum, {"step": N, "files": {name: {"bytes", "xxh3"}}};
//                            a folder without it is ignored
//
// A save goes to step-N.tmp/ (every file fsynced), is renamed to step-N/ and then
// marked complete, so a crash at any point leaves the previous checkpoint usable.
// Loading first checks every file it reads against the manifest, then goes key by key,
// so any layout of the parameters can read any checkpoint.
//
// What lives elsewhere: the tensors' Hugging Face names and which rank holds each are the
// model's (Model::hf_tensors, held_by_another_rank); the sharded state reaches this file
// whole through one door, Trainer::materialize_state / commit_state / release_state, and
// each tensor's moments through AdamW::exp_avg / exp_avg_sq; safetensors files are
// io/safetensors.h's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/check.h"
#include "models/interface.h"
#include "train/config.h"
#include "train/optimizer.h"

namespace mt {

namespace comm {
class DeviceMesh;
}
class Trainer;

struct TrainState {
  int64_t step = 0;
  int64_t seed = 0;
  double lr = 0;
  std::string data_cursor = "null";  // JSON, owned by the data source
  // JSON: the expert replicas' placement and the loads' average (Trainer::expert_placement)
  std::string expert_placement = "null";
  // JSON: the routers' expert biases (training.expert_bias_update_rate; Trainer::expert_bias)
  std::string expert_bias = "null";
  std::string config_toml;           // the run's config (TOML): a resume compares its own with it
  // The checkpoint.load this run's line of checkpoints started from (its absolute path),
  // carried by every later save; "" for a run that started afresh.
  std::string origin;
  // JSON: the files the run reads again on resume (input_identity), compared at resume.
  std::string inputs = "null";
};

// Saves step `st.step` under `checkpoints_dir` and keeps the newest `keep` complete
// checkpoints. Returns the checkpoint's folder. The tokenizer files found in
// `tokenizer_dir` are copied in (none: nothing is copied). With expert or pipeline parallelism every
// rank of `writers` (the pp x ep ranks of one replica) calls it: each writes model-part<r>
// and optimizer-part<r> with its experts, and with its layers' dense weights where
// `write_dense` (the first of each ep group); rank 0 adds the indices and the rest,
// renames and marks the folder.
std::string save_checkpoint(const std::string& checkpoints_dir, Model& model, const Optimizer& opt, const TrainState& st,
                            const std::string& model_config_path, const std::string& tokenizer_dir, int64_t keep,
                            comm::Communicator* writers = nullptr, bool write_dense = true);

// A checkpoint whose files are not as saved: one missing, truncated or of another
// checksum, or a train_state.json that does not read. Auto-resume falls back to an
// earlier checkpoint on this error and on no other. `why` names the file and what is
// wrong; the message adds what to do.
struct DamagedCheckpoint : Error {
  DamagedCheckpoint(const std::string& dir, const std::string& why);
  std::string why;
};

// The complete checkpoint folders under `checkpoints_dir`, newest first.
std::vector<std::string> complete_checkpoints(const std::string& checkpoints_dir);

// What a user names as "a checkpoint", whose model files verify (verify_checkpoint): a
// step folder (complete; else a DamagedCheckpoint), a checkpoints folder or a run folder
// (job.dump_folder: its checkpoints/), whose newest complete step that verifies is taken,
// each damaged newer one named on stderr. An error saying where it looked when none is.
std::string find_checkpoint(const std::string& path);

// For readers of a folder a run may be saving into: `read` runs on the checkpoint that
// find_checkpoint(path) names, and when it fails because that checkpoint was rotated away
// under it (checkpoint.keep removed it meanwhile), the newest is found and read again,
// once; a second such loss is an error that says so. Other failures pass through.
void read_checkpoint(const std::string& path, const std::function<void(const std::string& dir)>& read);

// A run's checkpoints, as train/run.cpp takes and makes them.
// choose_resume: where a run starts. checkpoint.load applies to a run folder's first
// start: once the folder holds checkpoints of its own, the same command resumes from its
// newest (so a requeue after exit 75 continues). The exception is a branch: a
// checkpoint.load inside the run folder whose later checkpoints are not its own line
// (their origin differs) starts from it, and those later checkpoints and metrics lines
// move to branches/from-step-N/ (set_branch_aside, rank 0, before anything is read);
// the branch's own checkpoints then carry it as their origin, so its requeue continues
// it. `tries` lists the checkpoints to try, newest first (none: a fresh start), `note`
// what the choice was, where it was not the plain one.
struct ResumeChoice {
  std::vector<std::string> tries;
  std::string note;
  std::string origin;                 // the origin the run's saves carry, when it starts from tries[0]
  std::vector<std::string> set_aside;  // a branch's later checkpoints, moved to branch_dir
  std::vector<std::string> incomplete;  // step folders without COMPLETE (interrupted saves), skipped
  std::string branch_dir;
  int64_t branch_step = -1;
};
ResumeChoice choose_resume(const Config& cfg);
void set_branch_aside(const Config& cfg, const ResumeChoice& choice);
// resume_run loads the first of `tries` that verifies: each damaged one is named on
// stderr (by rank 0, `print`) and skipped for the one before it (one that checkpoint.load
// names must load); the config is compared (compare_with_checkpoint); weights and moments
// are read whole and cut into the trainer's shards, and the step, data cursor, expert
// placement and biases set. Returns the folder and its state. save_run saves the
// trainer's step `state.step`: weights are replicated over dp and cp, so the pp x ep
// ranks of the first replica write (save_checkpoint), each its own experts and (ep rank
// 0) its layers' dense weights, after the sharded moments (and ZeRO-3's layers) are
// gathered, which every rank takes part in. Returns the folder on rank 0, else "".
std::pair<std::string, TrainState> resume_run(const Config& cfg, const std::vector<std::string>& tries, Model& model,
                                              Trainer& trainer, comm::Communicator& world, bool print);
std::string save_run(const Config& cfg, Model& model, Trainer& trainer, comm::DeviceMesh& mesh, const TrainState& state,
                     const std::string& config_json);

// A checkpoint's expert biases (TrainState::expert_bias, JSON) for `model`: one row of
// num_experts() a MoE layer of the whole model, or none for "null"; an error names what
// does not fit. apply_expert_bias gives each MoE layer `held` says the model has its row.
std::vector<std::vector<float>> parse_expert_bias(const Model& model, const std::string& json);
// The expert biases checkpoint `dir` saved ("null": none, or no train_state.json).
std::string saved_expert_bias(const std::string& dir);
void apply_expert_bias(Model& model, const std::vector<std::vector<float>>& bias,
                       const std::function<bool(int64_t)>& held);

// Whether a folder's weights (a Hugging Face folder's or a checkpoint's) have multi-token
// prediction depths: models of it build them only then (ModelOptions::mtp). A run with
// training.mtp_loss_weight = 0 saves none; transformers saves DeepSeek-V3 without them
// though its config.json keeps num_nextn_predict_layers.
bool has_mtp_weights(const std::string& folder);

// The model of a Hugging Face folder, or of a checkpoint found, verified and read through
// read_checkpoint, built with `options` (a checkpoint's expert biases applied); `read`
// gets the folder read.
std::unique_ptr<Model> load_model_folder(const std::string& path, const ModelOptions& options,
                                         std::string* read = nullptr);

// A complete checkpoint's train_state.json (step, seed, lr, data cursor, config), checked
// against the manifest (DamagedCheckpoint).
TrainState read_train_state(const std::string& dir);

// Every file of checkpoint `dir` that a load reads (the optimizer's only with
// `optimizer`) must be there with the size and checksum that its manifest records;
// otherwise a DamagedCheckpoint, on every rank of `ranks` alike (they share the hashing:
// each hashes every size()-th file). A checkpoint saved before manifests existed cannot be
// checked: a note on stderr says so, and it loads as it is.
void verify_checkpoint(const std::string& dir, bool optimizer, comm::Communicator* ranks = nullptr);

// Reads a checkpoint into the model and (when given) the optimizer, once
// verify_checkpoint passes. Every key the model has must be there with its shape and no
// other key may be; errors name the file, the key and the shapes.
TrainState load_checkpoint(const std::string& dir, Model& model, Optimizer* opt, comm::Communicator* ranks = nullptr);

}  // namespace mt
