"""A job script the isolation tests submit as alice or bob: it reports what a rank sees and can do.

    probe_rank.py [--plant PATH ...]

Every rank writes `report-rank<R>.json` into its job's folder (TORCHYARD_JOB_DIR): who it runs as,
its working directory, its whole environment, sys.path, where `torch` was imported from, and for
each --plant PATH whether it could write a `torch.py`-style file there (what a hostile job tries, to
shadow modules for later jobs or to overwrite another job's or the service's files).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys

PAYLOAD = "raise SystemExit('planted by another job')\n"


def try_write(path: str) -> str:
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(PAYLOAD)
    except OSError as error:
        return f"refused: {error.strerror}"
    return "written"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plant", action="append", default=[], help="a path to try to write")
    args = parser.parse_args()
    import torch  # after the plants: a job planting in its own folder must not shadow its own import

    report = {
        "user": pwd.getpwuid(os.geteuid()).pw_name,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "sys_path": list(sys.path),
        "torch_file": torch.__file__,
        "writes": {path: try_write(path) for path in args.plant},
    }
    rank = os.environ.get("RANK", "0")
    folder = os.environ["TORCHYARD_JOB_DIR"]
    with open(os.path.join(folder, f"report-rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
