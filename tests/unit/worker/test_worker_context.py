"""JobContext in one process: progress lines, checkpoints and resume, rank 0 versus the others."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from worker.checkpoints import checkpoints_to_remove
from worker.context import JobContext
from worker.distributed import RankEnv
from worker.spec import MAX_METRIC_NAMES, CheckpointPolicy, RunSpec, parse_progress_line


def make(tmp_path: Path, rank: int = 0, **fields: object) -> JobContext:
    spec = RunSpec.model_validate({"job_id": 7, "name": "ctx", "entrypoint": "m:f", "folder": str(tmp_path),
                                   "attempt": 2, **fields})
    env = RankEnv(rank, 2, rank, 2, 0, "127.0.0.1", 20007, "local", "4242")
    return JobContext(spec, env, progress_interval_s=60)


def test_context_describes_the_rank(tmp_path: Path) -> None:
    ctx = make(tmp_path, rank=1)
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.job_id, ctx.attempt) == (1, 2, False, 7, 2)
    assert ctx.device == torch.device("cpu") and ctx.device_ids is None
    assert ctx.folder == tmp_path and ctx.scheduler_job_id == "4242"
    assert not ctx.checkpoint_dir.exists(), "only rank 0 creates checkpoints/"


def test_report_is_buffered_and_written_on_close_with_the_contract_format(tmp_path: Path) -> None:
    ctx = make(tmp_path)
    started = time.perf_counter()
    for step in range(1, 5001):
        ctx.report(step, total=5000, loss=torch.tensor(0.25).item(), epoch=1)
    assert time.perf_counter() - started < 1.0, "report() must be cheap enough for every step"
    assert not ctx.files.progress.exists()
    ctx.report(5001, loss=float("nan"))
    ctx.close()
    lines = ctx.files.progress.read_text().splitlines()
    first = json.loads(lines[0])
    assert set(first) == {"step", "total", "metrics", "time", "attempt"}
    assert first["step"] == 1 and first["total"] == 5000 and first["metrics"] == {"loss": 0.25, "epoch": 1.0}
    assert first["attempt"] == 2 and abs(first["time"] - time.time()) < 60
    assert json.loads(lines[-1]) == {**json.loads(lines[-1]), "total": None, "metrics": {"loss": None}}
    assert all(parse_progress_line(line) is not None for line in lines)


@pytest.mark.parametrize("rank", [0, 1])
def test_report_refuses_at_once_what_no_progress_line_records(tmp_path: Path, rank: int) -> None:
    ctx = make(tmp_path, rank=rank)  # every rank alike: none goes on to wait for a failed rank 0
    with pytest.raises(ValueError, match="65 metrics in one report: a progress line records at most 64"):
        ctx.report(1, None, **named("m", 65))
    with pytest.raises(ValueError, match="is longer than 100 characters"):
        ctx.report(1, None, **{"x" * 101: 1.0})
    ctx.report(1, None, **named("m", 64))
    ctx.close()


def named(prefix: str, count: int) -> dict[str, float]:
    return {f"{prefix}{i}": 1.0 for i in range(count)}


def test_report_drops_new_names_past_the_job_s_limit_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = make(tmp_path)
    for step in range(5):  # 60 new names each time: 300 in all
        ctx.report(step, None, **named(f"s{step}_", 60))
    ctx.report(5, s0_0=2.0, s4_59=2.0)  # one name it kept, one it dropped
    ctx.close()
    lines = [json.loads(line)["metrics"] for line in ctx.files.progress.read_text().splitlines()]
    names = {name for metrics in lines for name in metrics}
    assert len(names) == MAX_METRIC_NAMES and "s4_15" in names and "s4_16" not in names  # 4*60+16
    assert lines[-1] == {"s0_0": 2.0}
    assert caplog.text.count("a job records at most 256 metric names: 's4_16'") == 1


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    ctx = make(tmp_path, rank=1)
    ctx.report(1, loss=1.0)
    path = ctx.save_checkpoint({"w": torch.ones(2)}, 3)
    ctx.close()
    assert path.name == "ckpt-00000003.pt" and not path.exists()
    assert not ctx.files.progress.exists()


def test_checkpoint_is_atomic_recorded_at_once_and_resumed_from(tmp_path: Path) -> None:
    ctx = make(tmp_path)
    assert ctx.resume_from is None and ctx.load_checkpoint() is None
    ctx.report(1, loss=1.0)  # queued before the checkpoint: must land before its line
    first = ctx.save_checkpoint({"w": torch.ones(2), "epoch": 0}, 8, wait=True)  # written when it returns
    second = ctx.save_checkpoint({"w": torch.full((2,), 2.0), "epoch": 1}, 16, wait=True)
    records = [parse_progress_line(line) for line in ctx.files.progress.read_text().splitlines()]
    assert [getattr(record, "checkpoint", None) for record in records] == [None, str(first), str(second)]
    assert records[2] is not None and records[2].step == 16
    assert sorted(path.name for path in ctx.checkpoint_dir.glob("*.pt")) == [first.name, second.name]
    assert json.loads(ctx.files.checkpoint_note(second).read_text())["metrics"] == {"loss": 1.0}
    ctx.close()

    resumed = make(tmp_path)
    assert resumed.resume_from == second
    state = resumed.load_checkpoint()
    assert state is not None and state["epoch"] == 1 and torch.equal(state["w"], torch.full((2,), 2.0))

    pinned = make(tmp_path, resume_from=str(first))  # the ledger's word wins
    assert pinned.resume_from == first


def saved_names(ctx: JobContext) -> list[str]:
    return [path.name for _, path in ctx.files.saved_checkpoints()]


@pytest.mark.parametrize("wait", [True, False])
def test_keep_last_prunes_as_rank_0_saves_and_a_restart_resumes_from_the_newest(
    tmp_path: Path, wait: bool
) -> None:
    ctx = make(tmp_path, checkpoints={"keep_last": 2})
    for step in range(1, 7):
        ctx.report(step, loss=1.0 / step)
        ctx.save_checkpoint({"step": step}, step, wait=wait)
        # In the background, a save returns once the one before it is written (and pruned).
        assert len(saved_names(ctx)) == min(step if wait else step - 1, 2)
    ctx.close()
    assert saved_names(ctx) == ["ckpt-00000005.pt", "ckpt-00000006.pt"]
    notes = sorted(p.name for p in ctx.checkpoint_dir.glob("*.json"))
    assert notes == ["ckpt-00000005.json", "ckpt-00000006.json"]

    gone = str(ctx.files.checkpoint_file(3).resolve())  # what a lagging ledger may still name
    resumed = make(tmp_path, resume_from=gone, checkpoints={"keep_last": 2})
    assert resumed.resume_from == ctx.files.checkpoint_file(6).resolve()
    state = resumed.load_checkpoint()
    assert state is not None and state["step"] == 6


def test_keep_best_keeps_the_lowest_loss_besides_the_newest(tmp_path: Path) -> None:
    policy = {"keep_last": 1, "keep_best": {"metric": "loss", "goal": "min"}}
    ctx = make(tmp_path, checkpoints=policy)
    for step, loss in enumerate([0.9, 0.5, 0.2, 0.4, 0.3, 0.6], start=1):
        ctx.report(step, loss=loss, epoch=step)
        ctx.save_checkpoint({"step": step}, step)
    ctx.close()
    assert saved_names(ctx) == ["ckpt-00000003.pt", "ckpt-00000006.pt"]

    highest = make(tmp_path / "max", checkpoints={"keep_best": {"metric": "epoch", "goal": "max"}})
    for step in range(1, 4):
        highest.report(step, epoch=10 - step)
        highest.save_checkpoint({"step": step}, step)
    highest.close()
    assert saved_names(highest) == ["ckpt-00000001.pt", "ckpt-00000003.pt"]  # the best, and the newest


def test_the_policy_alone_decides_what_goes() -> None:
    saved = [Path(f"ckpt-{n}.pt") for n in range(1, 6)]
    losses = {path: {"loss": value} for path, value in zip(saved, [0.3, None, 0.1, 0.5, 0.2], strict=True)}
    assert checkpoints_to_remove(saved, {}, CheckpointPolicy()) == []
    assert checkpoints_to_remove(saved, {}, CheckpointPolicy(keep_last=5)) == []
    assert checkpoints_to_remove(saved, {}, CheckpointPolicy(keep_last=2)) == saved[:3]
    best = CheckpointPolicy.model_validate({"keep_last": 2, "keep_best": {"metric": "loss"}})
    assert checkpoints_to_remove(saved, losses, best) == saved[:2]  # 0.1 is kept with the newest two
    unknown = CheckpointPolicy.model_validate({"keep_best": {"metric": "accuracy", "goal": "max"}})
    assert checkpoints_to_remove(saved, losses, unknown) == saved[:4]  # no scores: only the newest


def test_a_script_asks_for_its_context_and_reports_through_it(tmp_path: Path) -> None:
    """Script mode in this process, one rank: the script calls current() and reports; the runner
    writes its progress before the result, and current() answers nothing once the rank is done."""
    from worker import context
    from worker.runner import run_rank

    code = tmp_path / "code"
    code.mkdir()
    (code / "report.py").write_text(
        "import os\n"
        "from worker.context import current\n"
        "ctx = current()\n"
        "ctx.report(3, total=3, loss=0.125)\n"
        "assert os.environ['TORCHYARD_CHECKPOINT_DIR'] == str(ctx.checkpoint_dir)\n"
    )
    spec = RunSpec.model_validate({"job_id": 7, "name": "s", "script": "report.py", "folder": str(tmp_path),
                                   "code": "sha256:" + "0" * 64, "rendezvous_timeout_s": 10})  # fmt: skip
    env = RankEnv(0, 1, 0, 1, 0, "127.0.0.1", 0, "local", "4242")
    saved = dict(os.environ)  # the runner sets torchrun's variables, as on a real rank
    os.environ["TORCHYARD_CHECKPOINT_DIR"] = str(spec.files.checkpoints)
    try:
        run_rank(spec, env)
    finally:
        os.environ.clear()
        os.environ.update(saved)

    lines = [parse_progress_line(line) for line in spec.files.progress.read_text().splitlines()]
    assert [(record.step, record.metrics) for record in lines] == [(3, {"loss": 0.125})]  # type: ignore[union-attr]
    assert json.loads(spec.files.result.read_text())["value"] is None
    with pytest.raises(RuntimeError, match="only inside a torchyard job's rank"):
        context.current()
