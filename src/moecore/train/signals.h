// Graceful stop on SIGTERM / SIGINT: while a guard lives, the signals only set a flag that the training loop
// polls after each step (it then saves a checkpoint and returns). The previous handlers come back when the
// guard is destroyed. A second signal while the flag is set still only sets the flag.
#pragma once

namespace moecore::train {

class ExitSignalGuard {
 public:
  ExitSignalGuard();
  ~ExitSignalGuard();
  ExitSignalGuard(const ExitSignalGuard&) = delete;
  ExitSignalGuard& operator=(const ExitSignalGuard&) = delete;
  static bool requested();  // a SIGTERM or SIGINT arrived since the guard was made
  static int signal();      // which one (0 if none)
};

}  // namespace moecore::train
