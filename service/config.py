"""One Settings object (TORCHYARD_ prefix). Nothing is read at import time: call get_settings()."""

from __future__ import annotations

import hashlib
import sys
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

BackendName = Literal["local", "slurm"]
ALL_BACKENDS: tuple[BackendName, ...] = ("local", "slurm")
CommaList = Annotated[list[str], NoDecode]  # from the environment as "a,b,c", not as JSON
CODE_BYTES_PER_USER_FACTOR = 16  # the default per-user store: this many uploads of the largest size


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TORCHYARD_", env_file=None, extra="ignore")

    database_url: str = Field("", description="SQLAlchemy URL; empty means SQLite in data_dir.")
    data_dir: Path = Field(Path(".torchyard"), description="Job folders live here (shared fs for SLURM).")
    default_backend: BackendName = "local"
    backends: Annotated[list[BackendName], NoDecode] = Field(
        default_factory=lambda: list(ALL_BACKENDS),
        description="The backends this service runs; a SLURM deployment leaves out 'local'.",
    )
    host: str = "127.0.0.1"
    port: int = Field(8321, ge=1, le=65535)

    reconcile_interval_s: float = Field(2.0, gt=0, description="Seconds between scheduler queries.")
    local_reconcile_interval_s: float = Field(0.25, gt=0, description="Local jobs are cheap to check.")
    ending_files_grace_s: float = Field(
        2.0, ge=0, description="How long an attempt the scheduler says ended waits for its ranks' files."
    )
    dispatch_interval_s: float = Field(1.0, gt=0, description="Retry period for queued jobs.")
    dispatch_batch_size: int = Field(100, ge=1)

    max_nodes: int = Field(16, ge=1)
    max_tasks_per_node: int = Field(8, ge=1)
    max_gpus_per_node: int = Field(8, ge=0)
    max_timeout_min: int = Field(60 * 24 * 7, ge=1)
    rendezvous_timeout_s: float = Field(300.0, gt=0)
    max_log_bytes: int = Field(1_000_000, ge=1, description="Most bytes one logs request returns.")

    max_tasks_per_job: int = Field(64, ge=1, description="Default per-user limit: nodes x tasks_per_node.")
    max_gpus_per_job: int = Field(64, ge=0, description="Default per-user limit: nodes x gpus_per_node.")
    max_active_jobs_per_user: int = Field(200, ge=1, description="Default per-user limit: unfinished jobs.")
    max_submissions_per_minute: int = Field(600, ge=1, description="Default per-user limit on POSTs.")
    max_sweep_trials: int = Field(1000, ge=1, description="Most trials one sweep may make.")
    max_sweep_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1,
        description="Most bytes of kwargs, args and env (JSON) one sweep's trials hold.",
    )
    min_free_disk_mb: int = Field(64, ge=0, description="Refuse new jobs when data_dir has less free.")
    keep_finished_days: float = Field(
        30.0, ge=0, description="Days a finished job's folder stays (logs apart); 0 keeps it for ever."
    )
    keep_logs_days: float | None = Field(
        None, ge=0, description="Days its logs stay: none, as long as the rest; 0 for ever; never shorter."
    )
    gc_interval_s: float = Field(3600.0, gt=0, description="Seconds between retention passes.")

    dev_mode: bool = Field(False, description="No tokens: every caller is admin 'dev'. Loopback only.")
    trusted_proxies: CommaList = Field(
        default_factory=list,
        description="Proxy addresses or networks (CIDR) whose X-Forwarded-For/-Proto, and user header, are "
        "believed; by default the peer decides.",
    )
    proxy_user_header: str = Field(
        "",
        max_length=100,
        pattern=r"^[A-Za-z0-9-]*$",
        description="The header (X-Forwarded-User) naming the user a reverse proxy signed in, believed only "
        "from TORCHYARD_TRUSTED_PROXIES (POST /api/v1/auth/proxy); empty: none.",
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Larger request bodies get 413 unread.")
    max_header_bytes: int = Field(32_768, ge=1024, description="A request line and headers longer get 431.")
    request_read_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A request must arrive whole within this long (from connecting or its first byte).",
    )
    # Longer than clients' pools keep an idle connection (httpx: 5 s), so that a client gives one up
    # before the server does: with the two equal, the server's close could cross the client's next
    # request on it, which then failed as if the server had crashed (tests/integration/test_load.py).
    keep_alive_s: int = Field(
        20, ge=1, description="An idle kept-alive connection is closed after this long."
    )
    max_long_polls: int = Field(1000, ge=1, description="Long polls held at once, in all (more get 429).")
    max_long_polls_per_user: int = Field(50, ge=1, description="Long polls one user may hold at once.")
    capture_threads: int = Field(
        4, ge=1, description="Threads that capture stacks (requests and the watchdog), owners in turn."
    )
    max_captures: int = Field(16, ge=1, description="Stacks captures asked by requests under way, in all.")
    max_captures_per_user: int = Field(
        2, ge=1, description="Stacks captures under way of one user's jobs before a request gets 429."
    )
    max_capture_waiters_per_user: int = Field(
        16, ge=1, description="Stacks requests one user may have waiting on captures at once."
    )
    token_cache_s: float = Field(2.0, ge=0, description="How long a checked token is remembered.")
    service_id: str = Field(
        "",
        max_length=100,
        pattern=r"^[A-Za-z0-9._:@/-]*$",
        description="The name MUNGE logins must be made for; empty: one derived from the database URL, "
        "the same for every replica of this install.",
    )
    login_token_hours: float = Field(168.0, gt=0, description="How long a token from a login is valid.")
    min_login_uid: int = Field(1000, ge=1, description="Accounts with a lower uid may not log in.")
    admin_groups: CommaList = Field(
        default_factory=list, description="Unix groups whose members log in as admins."
    )
    ldap_url: str = Field(
        "",
        max_length=500,
        description="The site's LDAP (ldap:// or ldaps://) the dashboard signs in with; empty: none.",
    )
    ldap_user_dn: str = Field(
        "uid={user},ou=people,dc=example,dc=org",
        max_length=500,
        pattern=r"\{user\}",
        description="The DN a user binds as; {user} is the (escaped) user name.",
    )
    ldap_search_base: str = Field(
        "",
        max_length=500,
        description="Instead of TORCHYARD_LDAP_USER_DN: where to search for the user's DN (one match), "
        "bound as TORCHYARD_LDAP_BIND_DN; empty: the DN template.",
    )
    ldap_search_filter: str = Field(
        "(uid={user})",
        max_length=500,
        pattern=r"\{user\}",
        description="The filter that finds the user under TORCHYARD_LDAP_SEARCH_BASE; {user} is escaped.",
    )
    ldap_bind_dn: str = Field(
        "", max_length=500, description="The service's own DN for the search; empty: anonymous."
    )
    ldap_bind_password: SecretStr = Field(SecretStr(""), description="TORCHYARD_LDAP_BIND_DN's password.")
    ldap_group_base: str = Field(
        "",
        max_length=500,
        description="Where the LDAP groups are (memberUid or member): their cn count as groups for "
        "TORCHYARD_ADMIN_GROUPS; empty: the host's groups only.",
    )
    ldap_timeout_s: int = Field(5, ge=1, le=60, description="Connecting to, and each answer of, LDAP.")
    max_failed_logins: int = Field(
        10, ge=1, description="Failed logins per source address, and per user, in 5 minutes (more: 429)."
    )
    opentelemetry: bool = Field(
        False, description="FastAPI's OpenTelemetry spans, metrics and logs, for a service under an OTel SDK."
    )
    allowed_entrypoints: CommaList = Field(
        default_factory=lambda: ["worker.tasks."], description="Module prefixes jobs may call."
    )
    allowed_script_dirs: CommaList = Field(
        default_factory=list, description="Folders whose scripts jobs may run (resolved, no escape)."
    )
    allowed_env_keys: CommaList = Field(
        default_factory=list,
        description="Environment keys a spec may set besides the tuning keys (a trailing * allows a prefix).",
    )

    job_accounts: Literal["owner", "service"] = Field(
        "owner", description="Run each job as its owner's Unix account (needs root), or all as the service's."
    )
    service_account_fallback: bool = Field(
        False, description="Users without a Unix account run jobs as the service's account, not refused."
    )
    job_folder_group: str | None = Field(
        None, description="A group that may read every job folder (mode 0750 instead of 0700)."
    )
    job_python: str | None = Field(None, description="The Python ranks run (local and SLURM); default: ours.")
    job_pythonpath: CommaList = Field(
        default_factory=list, description="Folders on every rank's import path after the worker."
    )
    allowed_pythons: CommaList = Field(
        default_factory=list,
        description="Interpreters a spec may name in `python` (paths, or folders they lie in); default: "
        "the job Python alone.",
    )
    max_code_bytes: int = Field(
        64 * 2**20, ge=1024, description="Largest code snapshot upload (its unpacked files: 4 times this)."
    )
    max_code_bytes_per_user: int | None = Field(
        None,
        ge=1024,
        description="Most bytes of code snapshots one user may have stored (archives and unpacked files); "
        "default: "
        f"{CODE_BYTES_PER_USER_FACTOR} times max_code_bytes.",
    )
    max_uploads_in_flight_per_user: int = Field(
        2, ge=1, description="Code uploads one user may have in flight at once (429 past it)."
    )
    max_uploads_in_flight: int = Field(
        16, ge=1, description="Code uploads in flight on a replica, all users' together (429 past it)."
    )
    code_unpack_workers: int = Field(
        2, ge=1, description="Threads that unpack code snapshots for the dispatcher (one at a time per user)."
    )
    code_unpack_timeout_s: float = Field(
        300.0, gt=0, description="Most seconds one code snapshot may take to unpack; past it its jobs fail."
    )
    code_keep_h: float = Field(
        24.0 * 7, ge=0, description="Hours a snapshot no unfinished job uses is kept before it is collected."
    )

    slurm_partition: str | None = None

    public_url: str | None = Field(
        None, description="The service's address as users reach it (webhooks link to its dashboard)."
    )
    webhook_hosts: CommaList = Field(
        default_factory=list,
        description="Hosts (or IP literals) webhooks may reach, '*.example.org' allowed; none: no webhooks.",
    )
    webhook_private_hosts: CommaList = Field(
        default_factory=list,
        description="Of those, hosts that may resolve to loopback, private or link-local addresses.",
    )
    notify_interval_s: float = Field(1.0, gt=0, description="Seconds between the notify loop's passes.")
    webhook_ports: CommaList = Field(
        default_factory=lambda: ["80", "443"],
        description="Ports webhooks may reach: numbers or ranges such as 8000-8099.",
    )
    webhook_connect_timeout_s: float = Field(5.0, gt=0, description="Connecting to a webhook's host.")
    webhook_read_timeout_s: float = Field(10.0, gt=0, description="Waiting for a webhook's answer.")
    webhook_total_timeout_s: float = Field(
        15.0, gt=0, description="The most one try of a delivery may take: connect, send and answer together."
    )
    webhook_senders: int = Field(8, ge=1, description="Deliveries one replica sends at once.")
    webhook_owner_senders: int = Field(
        2, ge=1, description="Deliveries of one user in flight at once (all replicas together)."
    )
    notify_fan_out_chunk: int = Field(
        200, ge=1, description="Subscriptions a notice is fanned out to per write transaction."
    )
    max_subscriptions_per_user: int = Field(200, ge=1, description="Webhook subscriptions one user may have.")
    max_subscriptions_per_job: int = Field(10, ge=1, description="Webhook subscriptions bound to one job.")
    keep_deliveries_days: float = Field(
        14.0, gt=0, description="Days a delivered or failed webhook delivery is kept (then pruned)."
    )
    webhook_max_attempts: int = Field(8, ge=1, description="Tries of one delivery before it fails.")
    webhook_backoff_s: float = Field(
        5.0, ge=0, description="Wait after a delivery's first failed try; doubled after each next one."
    )
    webhook_max_backoff_s: float = Field(3600.0, ge=0, description="The longest wait between tries.")

    @field_validator(
        "backends",
        "allowed_entrypoints",
        "allowed_script_dirs",
        "allowed_env_keys",
        "job_pythonpath",
        "allowed_pythons",
        "trusted_proxies",
        "admin_groups",
        "webhook_hosts",
        "webhook_private_hosts",
        "webhook_ports",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("webhook_ports")
    @classmethod
    def _ports_or_ranges(cls, value: list[str]) -> list[str]:
        for item in value:
            low, _, high = item.partition("-")
            if not (low.isdigit() and (not high or high.isdigit())):
                raise ValueError(f"{item!r} is not a port or a range of ports (such as 8000-8099)")
            if not 1 <= int(low) <= int(high or low) <= 65535:
                raise ValueError(f"{item!r} is not within 1-65535, low to high")
        return value

    @model_validator(mode="after")
    def _default_backend_is_run(self) -> Settings:
        if self.default_backend not in self.backends:
            raise ValueError(
                f"default_backend {self.default_backend!r} is not among the backends run ({self.backends})"
            )
        return self

    def job_interpreter(self) -> str:
        """The Python jobs run when their spec names none."""
        return self.job_python or sys.executable

    def code_bytes_per_user(self) -> int:
        """The bytes of code snapshots one user may have stored."""
        if self.max_code_bytes_per_user is not None:
            return self.max_code_bytes_per_user
        return CODE_BYTES_PER_USER_FACTOR * self.max_code_bytes

    def login_service_id(self) -> str:
        """The name a MUNGE login must be made for (TORCHYARD_SERVICE_ID), else one that every replica
        of this install derives alike from its ledger's address (password left out), so that a
        credential made for another torchyard on the cluster cannot log in here."""
        if self.service_id:
            return self.service_id
        from sqlalchemy.engine import make_url  # config stays light at import

        url = make_url(self.resolved_database_url()).render_as_string(hide_password=True)
        return "torchyard-" + hashlib.sha256(url.encode()).hexdigest()[:16]

    def dashboard_url(self) -> str:
        """Where users open the dashboard: the public URL, else the address the service listens on."""
        if self.public_url:
            return self.public_url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'torchyard.db').resolve()}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
