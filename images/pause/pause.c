/* The pod sandbox process for scripts/cluster's node: holds the pod's namespaces open, reaps
 * zombies (it is PID 1 of the pod when the pod shares its PID namespace) and exits on SIGINT or
 * SIGTERM. Built statically here because the usual pause image would have to be pulled. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { _exit(128 + sig); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = stop};
  struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &on_stop, NULL) < 0 || sigaction(SIGTERM, &on_stop, NULL) < 0 ||
      sigaction(SIGCHLD, &on_child, NULL) < 0) {
    return 1;
  }
  for (;;) {
    pause();
  }
}
