"""`python -m worker.rank_main <spec.json>`: one rank of a run the job's supervisor started
(worker.supervisor). The RunSpec is the run's (its resume_from the newest whole checkpoint); the rank's
place comes from the scheduler's variables and the supervisor's (worker.distributed)."""

from __future__ import annotations

import sys
from pathlib import Path

from worker.launch import RankLauncher

CANCELLED_EXIT = 130  # as a shell reports SIGINT: the supervisor tells a cancel from a failure by it


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m worker.rank_main <spec.json>", file=sys.stderr)
        return 2
    launcher = RankLauncher(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        launcher()
    except KeyboardInterrupt:
        return CANCELLED_EXIT
    except BaseException:  # the launcher wrote the error file and the log already
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
