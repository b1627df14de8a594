"""A job script whose rank ignores SIGURG (a job may set its own signal handling) and then sleeps for
ever: a capture of its stacks waits the whole time a capture may wait, and the watchdog finds it
stalled with nothing new to show. The noisy-neighbour test's hostile user runs it."""

from __future__ import annotations

import signal
import time


def main() -> None:
    signal.signal(signal.SIGURG, signal.SIG_IGN)  # the service's "append your stacks" goes unheard
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
