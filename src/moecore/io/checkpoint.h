// Crash-safe checkpoint directories: named safetensors files + state.json + a COMMIT manifest written
// last, Megatron's tracker file, keep-last-N retention, discovery of the newest committed iteration, and
// a verifying loader. Generic: which tensors go in which file is the trainer's business, not this file's.
// One job writes a root: a single process, or the ranks of one job through the staging functions below.
// Not here: resharding (the trainer's business); asynchronous saves run the staging functions below from a background
// writer (io/checkpoint_worker.h, driven by train/async_save.h) and commit as any multi-rank save does.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/core/tensor.h"
#include "moecore/io/safetensors.h"

namespace moecore::io {

// ---- Layout ---------------------------------------------------------------------------------------
//   <root>/latest_checkpointed_iteration.txt   the iteration number as text, no newline (Megatron's tracker)
//   <root>/iter_0000200/model.safetensors       one file per CheckpointWriteRequest::files entry
//   <root>/iter_0000200/optimizer.safetensors
//   <root>/iter_0000200/state.json              the caller's JSON text
//   <root>/iter_0000200/COMMIT                  manifest; its presence is what makes the directory valid
// COMMIT is JSON: {"format":"moecore-checkpoint","version":1,"iteration":200,
//                  "files":{"<name>":{"bytes":<size>,"crc32c":"<8 hex digits>"},...}}  (state.json included)
//
// ---- Save protocol (checkpoint_save) ---------------------------------------------------------------
//   1. write every data file (direct I/O where the filesystem takes it) and state.json into
//      <root>/iter_NNNNNNN.tmp-<pid>/, fsync each, fsync the dir;
//   2. rename the staging dir to iter_NNNNNNN (an existing one of that iteration is first renamed aside
//      to iter_NNNNNNN.old-<pid> and removed after), fsync <root>;
//   3. write COMMIT (temporary file COMMIT.tmp.<pid>, fsync, rename, fsync dir)  <- the commit point;
//   4. rewrite the tracker atomically (temporary file, fsync, rename);
//   5. retention (keep_last), then removal of what no load can use: staging dirs (*.tmp-*, *.old-*),
//      iteration directories without a COMMIT file and COMMIT.tmp.* / tracker *.tmp.* leftovers.
// A crash at any point leaves for that iteration: nothing (only a staging dir, which discovery never
// looks at), a directory without COMMIT (refused by checkpoint_load, skipped by discovery because the
// tracker still names the previous iteration), or a complete committed directory. Data files are durable
// before COMMIT exists; COMMIT before the tracker.
// A failed save (ENOSPC, EIO: Error naming the file, the byte offset and strerror; see the fault hook in
// io/file_util.h) removes its staging directory, or the uncommitted directory when COMMIT could not be
// written, and leaves the tracker naming the previous iteration, which stays the one discovery returns.
//
// ---- Discovery (checkpoint_find_latest) -------------------------------------------------------------
// "The newest checkpoint" is Megatron's: the iteration the tracker names (this honours runs rewound to an
// older iteration: newer directories are reported on stderr and ignored), or, without a tracker, the
// highest-numbered iter_N directory; `step` (--ckpt-step) names one instead. It is never silently replaced
// by an older one: when it is damaged (COMMIT missing, unparsable, of another format/version/iteration,
// a tracker that is unreadable or names a missing directory), discovery throws an Error naming the file and
// the reason and listing the committed checkpoints that remain, with how to pick one (--ckpt-step N).
// A root that is absent, or holds no tracker and no iter_N directory (staging dirs do not count), has no
// checkpoint: nullopt (a first launch trains from scratch). Discovery validates COMMIT but reads no data:
// checksums are verified by checkpoint_load, whose errors carry the same list of alternatives.

struct CheckpointWriteRequest {
  int64_t iteration = 0;  // >= 0; names the directory iter_%07d
  // file name -> tensors (CPU), e.g. "model.safetensors", "optimizer.safetensors",
  // "model-rank00003.safetensors"
  std::map<std::string, std::map<std::string, Tensor>> files;
  std::string state_json = "{}";  // free-form JSON text, stored as state.json
  // Retention removes an older committed checkpoint, and a save replaces a committed one of its own iteration, only
  // when this says it is the same model's (given its state.json text; a state.json that cannot be read is not).
  // Unset: every checkpoint is.
  std::function<bool(const std::string& state_json)> same_model;
};

struct LoadedCheckpoint {
  int64_t iteration = 0;
  std::map<std::string, SafetensorsFile> files;  // every data file of the request, verified
  std::string state_json;
  std::string dir;
};

inline constexpr const char* kCheckpointTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr const char* kCheckpointCommitFile = "COMMIT";
inline constexpr const char* kCheckpointStateFile = "state.json";
inline constexpr int kCheckpointFormatVersion = 1;

// Saves, commits, updates the tracker, then keeps the `keep_last` committed iterations of the same model
// (request.same_model) with the largest numbers (0 = keep all) and removes unfinished saves (step 5 above). Never
// deletes the iteration just written, another model's checkpoint, nor a directory with a damaged COMMIT file (left
// for inspection).
// File names must be plain names (no '/'), not "COMMIT" or "state.json". Throws Error on bad input or I/O.
void checkpoint_save(const std::string& root, const CheckpointWriteRequest& request, int keep_last);

// ---- Multi-rank saves (the ranks of one job on a filesystem they all see) -------------------------
// Each rank writes its own files into one shared staging directory; one rank (the committer) then
// publishes and commits them with the protocol above. The caller orders the steps with barriers:
//   committer: checkpoint_staging_begin(root, it, token)                    -> barrier
//   writers:   checkpoint_staging_write(dir, name, tensors) -> info (gathered to the committer) -> barrier
//   committer: checkpoint_staging_commit(root, request, token, infos of the others' files, keep_last)
// The token (e.g. the committer's pid) names the staging directory <root>/iter_N.tmp-<token>; a crash
// before the commit leaves only that directory, which discovery ignores and the next save removes.
struct CheckpointFileInfo {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};
// Byte size and CRC32C of a file, streamed (for files written into a staging directory by other means).
CheckpointFileInfo checkpoint_file_info(const std::string& path);
std::string checkpoint_staging_begin(const std::string& root, int64_t iteration, const std::string& token);
CheckpointFileInfo checkpoint_staging_write(const std::string& staging_dir, const std::string& name,
                                            const std::map<std::string, Tensor>& tensors);
// The committer's own files come in `request` (written here), the others' are listed with their infos (files the
// committer wrote into the staging directory itself beforehand, as an asynchronous save does, are listed there too).
void checkpoint_staging_commit(const std::string& root, const CheckpointWriteRequest& request, const std::string& token,
                               const std::map<std::string, CheckpointFileInfo>& written_by_others, int keep_last);
// A file already serialized (an asynchronous save's snapshot) written into the staging directory and fsync'd, as
// checkpoint_staging_write does; thread-safe (a background writer calls it). Throws Error naming the file, the byte
// offset and the errno's text (the fault hook of io/file_util.h applies).
CheckpointFileInfo checkpoint_staging_write_bytes(const std::string& staging_dir, const std::string& name,
                                                  std::string_view bytes);
// After a save that failed on some rank, once no rank writes into it any more: removes <root>/iter_N.tmp-<token>
// (discovery ignores it anyway; this leaves no trace of the failed save).
void checkpoint_staging_remove(const std::string& root, int64_t iteration, const std::string& token);

// FOR TESTS (crash simulation): steps 1-2 of checkpoint_save only, leaving <root>/iter_NNNNNNN without
// COMMIT and the tracker untouched, as a crash just before the commit point would. Returns the directory.
std::string checkpoint_write_uncommitted(const std::string& root, const CheckpointWriteRequest& request);

// The directory to resume from, per the discovery rule above: the newest checkpoint, or iteration `step`
// (--ckpt-step) when given. nullopt when the root has none (absent, or no tracker and no iter_N directory;
// with `step` that is an Error too). Throws Error (file, reason, the committed alternatives) when the
// chosen one is damaged. If `root` is itself an iteration directory (named iter_N or holding a COMMIT), it
// is returned unchanged (with `step`, only if it is that iteration) so that checkpoint_load reports any
// problem with it.
std::optional<std::string> checkpoint_find_latest(const std::string& root, std::optional<int64_t> step = std::nullopt);

// Reads COMMIT, checks every listed file's existence, byte size and CRC32C, then parses the files.
// Throws Error naming the directory, each failing file and the reason: missing COMMIT marker, bad
// magic/version, missing file, size mismatch (truncated), checksum mismatch (flipped byte); the message ends
// with checkpoint_recovery_hint(dir).
LoadedCheckpoint checkpoint_load(const std::string& dir);
// The same checks, streaming (no file is held in memory), and no parse: the data files' names and state.json.
struct VerifiedCheckpoint {
  int64_t iteration = 0;
  std::vector<std::string> files;  // data files (state.json excluded), sorted
  std::string state_json;
  std::string dir;
};
VerifiedCheckpoint checkpoint_verify(const std::string& dir);

// Helpers for trainers and tools.
std::string checkpoint_iteration_dir(const std::string& root, int64_t iteration);  // <root>/iter_%07d
std::optional<int64_t> checkpoint_read_tracker(const std::string& root);           // nullopt if absent/unparsable
// The iteration of a checkpoint directory (as checkpoint_find_latest returns): from its name iter_N, else from its
// COMMIT. Throws Error naming the directory when neither tells.
int64_t checkpoint_iteration_of(const std::string& dir);
// Iterations under root whose COMMIT is valid, ascending. Quiet (no warnings); reads no data files.
std::vector<int64_t> checkpoint_list_committed(const std::string& root);
// One sentence for an error about the damaged checkpoint `dir` (<root>/iter_N): the other committed
// iterations under <root> and how to load one (--load <root> --ckpt-step N), or that there is none.
std::string checkpoint_recovery_hint(const std::string& dir);

// ---- The COMMIT manifest, parsed (for tools and the fuzz harness) -------------------------------------
struct CheckpointManifest {
  int64_t iteration = 0;
  std::map<std::string, CheckpointFileInfo> files;  // every file, state.json included
};
// Validates `text` as a COMMIT manifest (magic, version, iteration = `expect_iteration` when given, plain
// file names, sizes, 8-hex-digit CRCs, state.json listed). Throws Error naming `path` and the reason.
CheckpointManifest checkpoint_parse_manifest(std::string_view text, const std::string& path,
                                             std::optional<int64_t> expect_iteration);

}  // namespace moecore::io
