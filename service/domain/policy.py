"""What a job may run: the entrypoint and script allow-lists and the environment a spec may set.

Checked at POST time, so a job that may not run is refused before it is stored. The rules are the
operator's (Settings.allowed_*); the worker trusts the spec it is handed.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
import subprocess
import threading
from collections.abc import Collection, Iterator
from pathlib import Path, PurePosixPath

from cachetools import LRUCache

from service.accounts import Account
from service.config import Settings
from service.errors import Forbidden, InvalidRequest
from service.programs import OutputTooLong, run_bounded

ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The rank environment is the worker's to derive; a spec that set it would break the rendezvous.
RANK_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
})  # fmt: skip
# What a spec may set without the operator's word: threading and communication tuning that loads no
# code and names no path. Named one by one rather than by prefix, because each family has members
# that do load code or write files (OMP_TOOL_LIBRARIES, OMP_TOOL_VERBOSE_INIT, MKL_VERBOSE_OUTPUT_FILE,
# NCCL_NET_PLUGIN, NCCL_DEBUG_FILE, NCCL_TOPO_FILE, TORCH_LOGS_OUT, TORCH_NCCL_DEBUG_INFO_TEMP_FILE...).
TUNING_KEYS = frozenset({
    # OpenMP and MKL threading
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_SCHEDULE", "OMP_DYNAMIC", "OMP_STACKSIZE",
    "OMP_WAIT_POLICY", "OMP_MAX_ACTIVE_LEVELS", "OMP_THREAD_LIMIT", "OMP_DISPLAY_ENV",
    "OMP_DISPLAY_AFFINITY", "MKL_NUM_THREADS", "MKL_DYNAMIC", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
    "MKL_THREADING_LAYER", "MKL_DOMAIN_NUM_THREADS",
    # NCCL transport and algorithm choices
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_NTHREADS",
    "NCCL_NSOCKS_PERTHREAD", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT", "NCCL_NET_GDR_LEVEL", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE",
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE",
    "NCCL_NTHREADS", "NCCL_CROSS_NIC", "NCCL_LAUNCH_MODE", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE",
    "NCCL_IGNORE_CPU_AFFINITY", "GLOO_SOCKET_IFNAME",
    # torch.distributed and the CUDA allocator
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_AVOID_RECORD_STREAMS", "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
})  # fmt: skip


def check_entrypoint_allowed(entrypoint: str, settings: Settings) -> None:
    module = entrypoint.partition(":")[0]
    for prefix in settings.allowed_entrypoints:
        if prefix.endswith((".", ":")):
            if entrypoint.startswith(prefix):
                return
        elif module == prefix or module.startswith(prefix + "."):  # a whole package, not a name prefix
            return
    allowed = ", ".join(settings.allowed_entrypoints) or "none"
    raise Forbidden(
        f"'{entrypoint}' is not allowed on this service (allowed module prefixes: {allowed}; "
        "the operator sets TORCHYARD_ALLOWED_ENTRYPOINTS)",
        field="entrypoint",
    )


def resolve_allowed_script(script: str, settings: Settings) -> str:
    """The script's real path, which must lie inside an allowed folder once symlinks are resolved."""
    path = Path(script)
    if not path.is_absolute():
        raise InvalidRequest("must be an absolute path", field="script")
    if ".." in path.parts:
        raise InvalidRequest("must not contain '..'", field="script")
    if not settings.allowed_script_dirs:
        raise Forbidden(
            "script jobs are not allowed on this service (the operator sets TORCHYARD_ALLOWED_SCRIPT_DIRS)",
            field="script",
        )
    try:
        real = path.resolve()  # symlinks that exist are followed: a link out of the folder is caught
    except (OSError, RuntimeError):  # a symlink loop, or unreadable
        raise InvalidRequest(f"cannot resolve {script}", field="script") from None
    # Inside an allowed folder first: outside them, the service says nothing about what exists.
    if not any(real.is_relative_to(Path(folder).resolve()) for folder in settings.allowed_script_dirs):
        allowed = ", ".join(settings.allowed_script_dirs)
        raise Forbidden(f"'{script}' is outside the folders scripts may run from ({allowed})", field="script")
    if not real.is_file():
        raise InvalidRequest(f"no such file: {script}", field="script")
    return str(real)


def env_key_allowed(key: str, settings: Settings) -> bool:
    """A tuning key, or one the operator allows (TORCHYARD_ALLOWED_ENV_KEYS; `PREFIX*` allows a prefix)."""
    if key in TUNING_KEYS:
        return True
    return any(
        key.startswith(allowed[:-1]) if allowed.endswith("*") else key == allowed
        for allowed in settings.allowed_env_keys
    )


def check_env(env: dict[str, str], settings: Settings) -> None:
    """Every key a spec sets must be on the allow-list: a rank's environment is built, not inherited,
    and a key outside it may load code or name a path (TORCH_LOGS_OUT, NCCL_NET_PLUGIN, LD_PRELOAD...)."""
    for key in env:
        field = f"env.{key}"
        if not ENV_KEY.fullmatch(key):
            raise InvalidRequest("is not a valid environment variable name", field=field)
        if key in RANK_KEYS:
            raise Forbidden("is set by the worker for every rank; a spec cannot override it", field=field)
        if not env_key_allowed(key, settings):
            raise Forbidden(
                "is not on this service's allow-list of environment keys (threading and NCCL/torch "
                "tuning keys that load no code; the operator can allow more with "
                "TORCHYARD_ALLOWED_ENV_KEYS)",
                field=field,
            )


# ---------------------------------------------------------------- interpreters and uploaded code

JOB_MODULES = ("torch", "submitit", "pydantic")  # what the worker imports on every rank
_INTERPRETER_CHECK_S = 30.0
# What is read of the probe's stdout and of its stderr: its answer is a line, and the last line of a
# traceback is all a refusal shows. The interpreter may be the user's own (a sitecustomize that prints).
PROBE_OUTPUT_BYTES = 8192
INTERPRETERS_KEPT = 256  # answers remembered: a deployment's interpreters times the accounts using them
_MAX_LINKS = 40  # what the kernel follows before ELOOP
ProbeKey = tuple[str, float, str]  # (path, mtime, account)


# The modules each of the last INTERPRETERS_KEPT interpreters asked lacks, the least recently asked
# forgotten first: a user can name any number of them (every file of an allowed folder, every new
# mtime), which must not each be kept for ever. One file may find other packages as another account
# (files only some accounts can read, a user's own site-packages), hence the account in the key.
# Shared by admission's threads, and cachetools' caches are not thread-safe: hence the lock.
_CHECKED_INTERPRETERS: LRUCache[ProbeKey, str] = LRUCache(INTERPRETERS_KEPT)
_CHECKED_LOCK = threading.Lock()


def check_python_allowed(python: str, settings: Settings) -> str:
    """`python`, which must be an allowed interpreter: one named in TORCHYARD_ALLOWED_PYTHONS or inside
    a folder named there (default: the job Python alone). Not resolved: a venv's python is a link
    whose target would lose the venv."""
    path = Path(python)
    if not path.is_absolute():
        raise InvalidRequest("must be an absolute path", field="python")
    if ".." in path.parts:
        raise InvalidRequest("must not contain '..'", field="python")
    allowed = settings.allowed_pythons or [settings.job_interpreter()]
    if not any(path == Path(entry) or path.is_relative_to(entry) for entry in allowed):
        raise Forbidden(
            f"'{python}' is not an interpreter jobs may use here (allowed: {', '.join(allowed)}; the "
            "operator sets TORCHYARD_ALLOWED_PYTHONS)",
            field="python",
        )
    return python


def check_python_runs_jobs(python: str, run_as: str) -> None:
    """The interpreter exists, no account but root, the service's and `run_as` (the job's) can change
    it, and it has what every rank imports. It is asked as `run_as`, as the ranks will run it: a
    project's environment is its users' to write, and run as the service it would run their code
    with the service's rights. Asked once per interpreter and account (again when it changes)."""
    account = Account.named(run_as)
    _check_changeable_only_by(python, {0, os.geteuid(), account.uid})
    try:
        mtime = os.stat(python).st_mtime
    except OSError:
        raise InvalidRequest(f"no interpreter at {python}", field="python") from None
    key = (python, mtime, account.name)
    with _CHECKED_LOCK:
        lacking = _CHECKED_INTERPRETERS.get(key)
    if lacking is None:
        lacking = _modules_lacking(python, account)
        with _CHECKED_LOCK:
            _CHECKED_INTERPRETERS[key] = lacking
    if lacking:
        raise InvalidRequest(
            f"the interpreter {python} lacks {lacking}: a job's interpreter needs "
            f"{', '.join(JOB_MODULES)} (the worker itself comes from the service)",
            field="python",
        )


def _check_changeable_only_by(python: str, uids: set[int]) -> None:
    """Whoever can change the interpreter, a link on the way to it or a folder above either runs code
    as every job that names it, so each must be owned by one of `uids` and writable by no group or
    others. A sticky folder (/tmp) may be: there only an entry's owner can replace it."""
    try:
        for entry in _entries_on_the_way(python):
            info = os.lstat(entry)
            mode = info.st_mode
            sticky_folder = stat.S_ISDIR(mode) and mode & stat.S_ISVTX
            if info.st_uid not in uids:
                problem = f"is owned by uid {info.st_uid}"
            elif mode & 0o022 and not stat.S_ISLNK(mode) and not sticky_folder:
                problem = "is writable by its group or others"
            else:
                continue
            raise Forbidden(
                f"{entry} {problem}: a job's interpreter, the links to it and the folders above them "
                "must be changeable only by root, the service's account or the job's",
                field="python",
            )
    except OSError:
        raise InvalidRequest(f"no interpreter at {python}", field="python") from None


def _entries_on_the_way(path: str) -> Iterator[str]:
    """Every folder, link and file the kernel passes through to open `path`, links followed."""
    pending = list(reversed(PurePosixPath(path).parts))  # ("/", "a", "b") for "/a/b"
    current, links = "/", 0
    while pending:
        part = pending.pop()
        current = os.path.dirname(current) if part == ".." else os.path.join(current, part)
        yield current
        if os.path.islink(current):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, "too many links", path)
            target = os.readlink(current)
            current = os.path.dirname(current)  # a relative target starts from the link's folder
            pending.extend(reversed(PurePosixPath(target).parts))


def _modules_lacking(python: str, account: Account) -> str:
    probe = (
        f"import importlib.util as u\nprint(', '.join(m for m in {JOB_MODULES!r} if u.find_spec(m) is None))"
    )
    try:
        done = run_bounded(
            [*account.command_prefix(), python, "-I", "-c", probe],
            timeout_s=_INTERPRETER_CHECK_S,
            most_bytes=PROBE_OUTPUT_BYTES,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            cwd="/",  # the service's own folder may be closed to the job's account
        )
    except OutputTooLong as error:
        raise InvalidRequest(
            f"{python} printed more than {error.most_bytes} bytes on {error.stream} when asked which "
            "modules it has, and was stopped: a job's interpreter must start without printing (a "
            "sitecustomize or .pth file that does?)",
            field="python",
        ) from None
    except (OSError, subprocess.TimeoutExpired) as error:
        raise InvalidRequest(f"cannot run {python}: {error}", field="python") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InvalidRequest(f"{python} does not run Python code: {last}", field="python")
    return done.stdout.strip()


def check_code_target(entrypoint: str | None, script: str | None, paths: Collection[str],
                      settings: Settings) -> None:  # fmt: skip
    """With a snapshot, an entrypoint whose top package is in it needs no allow-list, and a relative
    script must be one of its files; anything else is judged as without one."""
    if entrypoint is not None:
        top = entrypoint.partition(":")[0].split(".")[0]
        if f"{top}.py" not in paths and not any(path.startswith(f"{top}/") for path in paths):
            check_entrypoint_allowed(entrypoint, settings)
    if script is not None and not Path(script).is_absolute():
        name = posixpath.normpath(script)
        if name.startswith("../") or name == ".." or name not in paths:
            raise InvalidRequest(f"'{script}' is not a file of the job's code snapshot", field="script")
