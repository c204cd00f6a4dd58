#include "moecore/train/signals.h"

#include <csignal>

namespace moecore::train {
namespace {
volatile std::sig_atomic_t g_signal = 0;
struct sigaction g_old_term, g_old_int;
extern "C" void on_exit_signal(int sig) {
  g_signal = sig;
}
}  // namespace

ExitSignalGuard::ExitSignalGuard() {
  g_signal = 0;
  struct sigaction sa = {};
  sa.sa_handler = on_exit_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGINT, &sa, &g_old_int);
}

ExitSignalGuard::~ExitSignalGuard() {
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
}

bool ExitSignalGuard::requested() {
  return g_signal != 0;
}
int ExitSignalGuard::signal() {
  return static_cast<int>(g_signal);
}

}  // namespace moecore::train
