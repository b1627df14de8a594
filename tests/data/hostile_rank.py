"""A job script the chaos tests submit as the hostile user: rank 0 writes into its job's folder what
issue 35 found could stop the service's loops for every user, then the job ends.

    hostile_rank.py DOING [--exit CODE]

DOING is one of the shapes below. Every one of them is what any token holder's job can do: the job
folder is its own. The service must read it bounded and cleaned, and it must cost this job alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time

SPARSE_BYTES = 1 << 30  # costs the job no disk


def folder() -> str:
    return os.environ["TORCHYARD_JOB_DIR"]


def write(name: str, content: str | bytes) -> None:
    data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
    with open(os.path.join(folder(), name), "wb") as handle:
        handle.write(data)


def progress(lines: list[str]) -> None:
    with open(os.path.join(folder(), "progress.jsonl"), "a", encoding="utf-8", errors="surrogatepass") as out:
        out.write("".join(line + "\n" for line in lines))


def superscript_rank() -> None:
    write("error-rank\u00b2.txt", "Traceback: a rank named with a superscript two\n")


def superscript_attempt() -> None:
    write("error-rank0.txt", "attempt: \u00b2\nTraceback (most recent call last):\nValueError: superscript\n")


def nul_in_error() -> None:
    write("error-rank0.txt", "attempt: 1\nTraceback (most recent call last):\nValueError: a NUL \x00 here\n")


def surrogate_checkpoint() -> None:
    progress(
        ['{"checkpoint": "/x/ckpt-\\ud800.pt", "attempt": 1}', json.dumps({"step": 1, "metrics": {"x": 1}})]
    )


def sparse_error_files() -> None:
    for rank in range(2000):  # the world is 1: every one of these is nobody's
        with open(os.path.join(folder(), f"error-rank{rank + 1}.txt"), "wb") as handle:
            handle.truncate(SPARSE_BYTES)


def metric_flood() -> None:
    """One step reported over and over, and more metric names than a job may have."""
    same_step = json.dumps({"step": 5, "metrics": {f"m{i}": float(i) for i in range(64)}})
    progress([same_step] * 5000)
    progress(
        [json.dumps({"step": 6, "metrics": {f"n{line}-{i}": 1.0 for i in range(64)}}) for line in range(20)]
    )


def renamed_pickles() -> None:
    """What recovery would read after a dispatcher died: the service's pickle renamed to an option."""
    submitit = os.path.join(folder(), "submitit")
    for name in os.listdir(submitit):
        if name.endswith("_submitted.pkl"):
            os.rename(os.path.join(submitit, name), os.path.join(submitit, "--user=alice_submitted.pkl"))
    with open(os.path.join(submitit, ".staged-" + "a" * 32 + "-\u00b2.pkl"), "wb"):
        pass


DOINGS = {
    "superscript-rank": superscript_rank,
    "superscript-attempt": superscript_attempt,
    "nul-in-error": nul_in_error,
    "surrogate-checkpoint": surrogate_checkpoint,
    "sparse-error-files": sparse_error_files,
    "metric-flood": metric_flood,
    "renamed-pickles": renamed_pickles,
    "nothing": lambda: None,  # its hostility is elsewhere (its interpreter's folder)
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("doing", choices=sorted(DOINGS))
    parser.add_argument("--exit", type=int, default=0, help="the exit code once done")
    parser.add_argument("--linger", type=float, default=3.0, help="seconds to run on after it")
    args = parser.parse_args()
    if os.environ.get("RANK", "0") == "0":
        DOINGS[args.doing]()
    time.sleep(args.linger)  # a few ticks of the service's loops read what it wrote while it runs
    raise SystemExit(args.exit)


if __name__ == "__main__":
    main()
