"""Every example in README.md is run, so the README cannot rot.

Each fenced block carries a tag after its language:
- `test=serve`: the command that starts the service; the live test starts it so (on a free port).
- `test=cli`: shell commands run one by one against that service; a trailing `# exit N` expects N.
- `test=python`: exec'd against it. `test=module:PATH`: written to ~/code/PATH (the README's serve
  command puts ~/code on the ranks' import path).
- `file=PATH`: must equal that file, which must be a valid job spec (or sweep or pipeline spec).
- `test=skip  # why`: run elsewhere (the comment says where); the file it names must exist.
- `test=tree`: the source layout; it names every Python module of service/ and worker/, and nothing else.
The tables (job spec fields, settings, REST endpoints) are checked against the code they describe.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.app import create_app
from service.cli.specs import load_spec
from service.client import TorchyardClient
from service.code_pack import pack
from service.config import Settings
from service.ledger.models.jobs import JobCreate
from service.ledger.models.pipelines import PipelineCreate
from service.ledger.models.sweeps import SweepCreate
from service.states import TERMINAL_STATE_NAMES
from tests.cli_service import clean_env, serving
from tests.serving import free_port
from tests.support import ROOT
from worker.spec import Resources

README = ROOT / "README.md"
DOC_PORT = "8321"  # the port the README's examples use; the live test swaps in a free one


@dataclass
class Block:
    lang: str
    tag: str
    body: str
    line: int

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang} {self.tag})"


def blocks() -> list[Block]:
    found, lines, index = [], README.read_text().splitlines(keepends=True), 0
    while index < len(lines):
        opening = re.match(r"^```(\w+)[ \t]*(\S*)", lines[index])
        if opening is None:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        found.append(Block(opening.group(1), opening.group(2), "".join(lines[index + 1 : end]), index + 1))
        index = end + 1
    return found


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def first_cells(markdown: str) -> list[str]:
    """The backticked first cell of each table row."""
    return re.findall(r"^\| `([^`]+)` \|", markdown, re.M)


def commands(block: Block) -> list[str]:
    """One shell command per line; a trailing backslash continues it on the next."""
    joined = re.sub(r"\\\n\s*", " ", block.body)
    return [
        line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def expected_exit(command: str) -> int:
    found = re.search(r"#\s*exit (\d+)\s*$", command)
    return int(found.group(1)) if found else 0


def on_port(command: str, port: int) -> str:
    return command.replace(f"127.0.0.1:{DOC_PORT}", f"127.0.0.1:{port}").replace(
        f"--port {DOC_PORT}", f"--port {port}"
    )


# ---------------------------------------------------------------- checks that need no service


def test_every_block_says_how_it_is_tested() -> None:
    for block in blocks():
        kind = block.tag.split("=", 1)
        assert len(kind) == 2 and kind[0] in ("test", "file"), f"{block}: tag it test=... or file=..."
        if kind[0] == "test":
            assert kind[1] in ("serve", "cli", "python", "skip", "tree") or kind[1].startswith("module:"), (
                str(block)
            )
    assert sum(block.tag == "test=serve" for block in blocks()) == 1


def test_skipped_blocks_name_scripts_that_exist() -> None:
    for block in blocks():
        if block.tag == "test=skip":
            for command in commands(block):
                script = command.split()[1]
                assert (ROOT / script).is_file(), f"{block}: {script} does not exist"


def tree_paths(block: Block) -> tuple[set[str], set[str]]:
    """What a `test=tree` block names: (every path, the folders shown whole). Lines are `top/ a.py sub/`,
    or indented `sub/ b.py` inside the last top-level folder; a folder among the names is shown whole."""
    named: set[str] = set()
    whole: set[str] = set()
    top = ""
    for line in block.body.splitlines():
        first, *names = line.split()
        folder = top + first if line.startswith(" ") else first
        if not line.startswith(" "):
            top = first
        named |= {folder.rstrip("/")} | {folder + name.rstrip("/") for name in names}
        whole |= {folder + name.rstrip("/") for name in names if name.endswith("/")}
    return named, whole


def test_the_layout_tree_is_the_source_tree() -> None:
    (block,) = [block for block in blocks() if block.tag == "test=tree"]
    named, whole = tree_paths(block)
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{block} names what does not exist: {missing}"
    modules = {
        str(path.relative_to(ROOT))
        for top in ("service", "worker")
        for path in (ROOT / top).rglob("*.py")
        if path.name != "__init__.py"
    }
    unnamed = sorted(m for m in modules if m not in named and not any(m.startswith(f"{w}/") for w in whole))
    assert not unnamed, f"{block} does not show: {unnamed}"


def test_file_blocks_are_the_files_and_valid_specs() -> None:
    shown = [block for block in blocks() if block.tag.startswith("file=")]
    assert shown
    for block in shown:
        path = ROOT / block.tag.removeprefix("file=")
        assert block.body == path.read_text(), f"{block} differs from {path}"
        spec = load_spec(path)
        if "code" in spec:  # a folder, which `torchyard submit` packs and names by its id
            spec["code"] = pack(Path(spec["code"])).id
        if "stages" in spec:  # a pipeline: its own shape, and each stage's job a valid job spec
            for stage in PipelineCreate.model_validate(spec).stages:
                JobCreate.model_validate({"name": stage.name, **(stage.job or {})})
            continue
        (SweepCreate if "grid" in spec or "zip" in spec else JobCreate).model_validate(spec)


def test_spec_reference_lists_every_field() -> None:
    documented = set(first_cells(section("Job specs")))
    fields = {name for name in JobCreate.model_fields if name != "resources"}
    fields |= {f"resources.{name}" for name in Resources.model_fields}
    assert documented == fields


def test_configuration_lists_every_setting() -> None:
    documented = set(first_cells(section("Configuration")))
    assert documented == {f"TORCHYARD_{name.upper()}" for name in Settings.model_fields}


def test_rest_table_is_the_apps_api() -> None:
    rows = set(re.findall(r"^\| `(GET|POST|PUT|PATCH|DELETE)` \| `([^`]+)` \|", section("REST API"), re.M))
    schema = create_app(Settings()).openapi()["paths"]
    assert rows == {(method.upper(), path) for path, ops in schema.items() for method in ops}


# ---------------------------------------------------------------- the examples, for real


@pytest.mark.integration
def test_examples_run_against_a_live_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    home = tmp_path / "home"
    user_code = home / "code"
    # Jobs run as the README says: each user's own account, as a real service runs them. As root,
    # `$(id -un)` is root, which no job is switched to: they share the service's account, as they did.
    env = clean_env(
        os.geteuid() != 0,
        TORCHYARD_URL=f"http://127.0.0.1:{port}",
        TORCHYARD_DATA_DIR=str(tmp_path / "data"),
        HOME=str(home),  # `token create --save` writes ~/.config/torchyard/token here
        XDG_CONFIG_HOME=str(home / ".config"),
        NO_COLOR="1",
    )
    for block in blocks():
        if block.tag.startswith("test=module:"):
            module = user_code / block.tag.removeprefix("test=module:")
            module.parent.mkdir(parents=True, exist_ok=True)
            module.write_text(block.body)
    (serve,) = [block for block in blocks() if block.tag == "test=serve"]
    (serve_command,) = commands(serve)
    for name in ("TORCHYARD_URL", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(name, env[name])  # for the Python examples, exec'd in this process
    # `exec env`: the service gets Ctrl-C itself, and the command may begin with VAR=value settings
    with serving(["bash", "-c", "exec env " + on_port(serve_command, port)], env, tmp_path / "serve.log"):
        for block in blocks():
            if block.tag == "test=cli":
                for command in commands(block):
                    run_command(on_port(command, port), env, block)
            elif block.tag == "test=python":
                exec(compile(block.body, str(block), "exec"), {"__name__": "readme_example"})
        with TorchyardClient(env["TORCHYARD_URL"]) as client:  # the token the README saved
            left = [job for job in client.iter_jobs() if job["state"] not in TERMINAL_STATE_NAMES]
    assert not left, f"README examples left jobs running: {[(j['id'], j['state']) for j in left]}"


def run_command(command: str, env: dict[str, str], block: Block) -> None:
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    said = f"{block}: `{command}` exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == expected_exit(command), said
    if (command.startswith("curl") and "/logs" not in command) or "--json" in command:
        json.loads(done.stdout)  # what the README shows as JSON is JSON (logs are plain text)
