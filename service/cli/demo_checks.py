"""The demo's own verdict on the seed's two results, and how they are shown.

The tasks return `ok` with their evidence; the CLI does not take `ok` on trust: it checks the
evidence against what the seed's demonstrations claim, computed here without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

PASS, FAIL = "[bold green]✓[/]", "[bold red]✗[/]"
DDP_RANKS = 3
SAMPLER_RANKS, SAMPLER_SAMPLES = 4, 8
MAX_PARAM_DIFF = 1e-5  # float32 rounding between DDP's bucketed all-reduce and a plain mean


@dataclass
class Verdict:
    title: str
    checks: list[tuple[str, bool]] = field(default_factory=list)
    table: Table | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(passed for _, passed in self.checks)

    def check(self, claim: str, passed: bool) -> None:
        self.checks.append((claim, passed))

    def render(self) -> RenderableType:
        head = Text.from_markup(f"{PASS if self.ok else FAIL} [bold]{self.title}[/]")
        lines = [Text.from_markup(f"  {PASS if passed else FAIL} {claim}") for claim, passed in self.checks]
        parts: list[RenderableType] = [head]
        if self.table is not None:
            parts.append(self.table)
        return Group(*parts, *lines)


def _job_checks(verdict: Verdict, job: dict[str, Any]) -> dict[str, Any]:
    state = job.get("state")
    verdict.check(f"job {job.get('id')} succeeded (state {state})", state == "succeeded")
    if state != "succeeded":
        reason = (job.get("reason") or "").strip().splitlines()
        verdict.check(f"reason: {reason[-1] if reason else 'none recorded'}", False)
    result = job.get("result")
    return result if isinstance(result, dict) else {}


def check_ddp(job: dict[str, Any]) -> Verdict:
    verdict = Verdict(f"DDP(nn.Linear(5, 5)) on {DDP_RANKS} ranks, one SGD step (lr=0.01)")
    result = _job_checks(verdict, job)
    if not result:
        return verdict
    verdict.check("the task itself says ok", result.get("ok") is True)
    verdict.check(f"{DDP_RANKS} ranks took part", result.get("world_size") == DDP_RANKS)
    verdict.check(
        "ranks started from different random parameters",
        result.get("initial_params_differed_before_ddp") is True,
    )
    verdict.check(
        "after wrapping, every rank holds rank 0's parameters",
        result.get("initial_params_match_rank0") is True,
    )
    verdict.check(
        "after the step, all ranks hold identical parameters",
        result.get("params_identical_after_step") is True,
    )
    diff = result.get("max_abs_diff")
    close = isinstance(diff, int | float) and diff <= MAX_PARAM_DIFF
    verdict.check(
        f"they equal one process's SGD step on the averaged gradient (max |diff| {_num(diff)})",
        result.get("matches_averaged_gradient_step") is True and close,
    )
    losses = result.get("loss_per_rank")
    if isinstance(losses, list) and losses:
        table = Table("rank", "loss on its own batch", show_edge=False, header_style="bold")
        for rank, loss in enumerate(losses):
            table.add_row(str(rank), _num(loss))
        verdict.table = table
        verdict.check("every rank trained on its own data (losses differ)", len(set(losses)) == len(losses))
    return verdict


def expected_shards(num_samples: int, world_size: int) -> list[list[int]]:
    """DistributedSampler(shuffle=False) with no padding needed: rank r gets r, r+W, r+2W, ..."""
    return [list(range(rank, num_samples, world_size)) for rank in range(world_size)]


def check_sampler(job: dict[str, Any]) -> Verdict:
    verdict = Verdict(
        f"DistributedSampler(shuffle=False), {SAMPLER_SAMPLES} samples, {SAMPLER_RANKS} ranks, batch size 1"
    )
    result = _job_checks(verdict, job)
    if not result:
        return verdict
    verdict.check("the task itself says ok", result.get("ok") is True)
    shards = result.get("shards")
    shards_by_rank: dict[str, Any] = shards if isinstance(shards, dict) else {}
    expected = expected_shards(SAMPLER_SAMPLES, SAMPLER_RANKS)
    got = [shards_by_rank.get(str(rank)) for rank in range(SAMPLER_RANKS)]
    table = Table("rank", "samples", "expected", "", show_edge=False, header_style="bold")
    for rank, (shard, want) in enumerate(zip(got, expected, strict=True)):
        table.add_row(str(rank), str(shard), str(want), PASS if shard == want else FAIL)
    verdict.table = table
    verdict.check(f"{SAMPLER_RANKS} ranks took part", result.get("world_size") == SAMPLER_RANKS)
    verdict.check("rank r got samples r and r+4", got == expected)
    flat = [index for shard in got if isinstance(shard, list) for index in shard]
    verdict.check("shards are disjoint", len(flat) == len(set(flat)))
    verdict.check(
        f"together they cover all {SAMPLER_SAMPLES} samples", sorted(flat) == list(range(SAMPLER_SAMPLES))
    )
    checksum = str(result.get("dataset_checksum") or "")[:12]
    verdict.check(
        f"every rank built the same seeded dataset (sha256 {checksum}…)",
        result.get("dataset_identical_on_all_ranks") is True,
    )
    verdict.check("each sample carried its own row's data", result.get("samples_match_dataset_rows") is True)
    return verdict


def _num(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, int | float) else str(value)
