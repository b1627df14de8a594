"""What a job may run: the entrypoint and script allow-lists and the environment a spec may set.

Checked at POST time, so a job that may not run is refused before it is stored. The rules are the
operator's (Settings.allowed_*); the worker trusts the spec it is handed.
"""

from __future__ import annotations

import re
from pathlib import Path

from service.config import Settings
from service.errors import Forbidden, InvalidRequest

ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The rank environment is the worker's to derive; a spec that set it would break the rendezvous.
RANK_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
})  # fmt: skip
# Keys that change which code a process loads or how a shell behaves: code injection by another name.
LOADER_KEYS = frozenset({
    "PATH", "HOME", "SHELL", "IFS", "BASH_ENV", "ENV", "PS4", "PROMPT_COMMAND", "NODE_OPTIONS",
    "GCONV_PATH", "GLIBC_TUNABLES", "HOSTALIASES", "RESOLV_HOST_CONF", "OPENSSL_CONF",
})  # fmt: skip
RESERVED_PREFIXES = (
    "SLURM_", "SUBMITIT_", "TORCHYARD_", "TORCHELASTIC_", "PMI_", "OMPI_",
    "LD_", "DYLD_", "PYTHON", "PERL", "RUBY", "MALLOC_",
)  # fmt: skip


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


def check_env(env: dict[str, str], settings: Settings) -> None:
    allowed = set(settings.allowed_env_keys)
    for key in env:
        field = f"env.{key}"
        if not ENV_KEY.fullmatch(key):
            raise InvalidRequest("is not a valid environment variable name", field=field)
        if key in allowed:
            continue
        if key in RANK_KEYS:
            raise Forbidden("is set by the worker for every rank; a spec cannot override it", field=field)
        if key in LOADER_KEYS or key.startswith(RESERVED_PREFIXES):
            raise Forbidden(
                "is reserved: it changes what code runs or how the job is launched "
                "(the operator can allow it with TORCHYARD_ALLOWED_ENV_KEYS)",
                field=field,
            )
