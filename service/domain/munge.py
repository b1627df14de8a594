"""MUNGE credentials: what `unmunge` says a credential proves (who made it, when, for how long, and
its payload), or why it proves nothing.

MUNGE is the cluster's own authentication (SLURM's): a credential made by `munge` on any host that
shares the cluster's key is decoded by the local munged, which vouches for the uid and gid of the
process that made it. `unmunge` is the service's own program (service.programs: absolute path, no
shell); the credential is its input, bounded in size, and its answer is bounded by the credential.
munged refuses a credential it decoded before (replayed), one past its time-to-live (expired) and
one not made with the cluster's key (forged), each with its own exit status.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from service.errors import Unauthenticated, Unavailable
from service.programs import OutputTooLong, ProgramMissing, program, run_bounded
from worker.spec import ascii_int

MAX_CREDENTIAL_CHARS = 4096  # a credential carrying a nonce and a service id is a few hundred
DECODE_TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 16384  # metadata and the payload, which is smaller than its credential
KEYS = "STATUS,UID,GID,ENCODE_TIME,TTL"

# unmunge's exit status is libmunge's error number (munge_err_t)
_SOCKET, _TIMEOUT = 6, 7
_EXPIRED, _REWOUND, _REPLAYED, _UNAUTHORIZED = 15, 16, 17, 18
_REFUSALS = {
    _EXPIRED: "the MUNGE credential has expired: run `torchyard login` again",
    _REWOUND: "the MUNGE credential was made in the future: its host's clock and the service's disagree",
    _REPLAYED: "the MUNGE credential was used before (a replay): each login makes a new one",
    _UNAUTHORIZED: "the MUNGE credential may not be decoded by the service's account",
}
_FORGED = "the MUNGE credential is not valid (forged, damaged, or made with another cluster's key)"


class MungeUnavailable(Unavailable):
    """The service cannot decode credentials now (no unmunge, munged not answering): not the
    caller's fault, so not a 401."""


@dataclass(frozen=True)
class Decoded:
    """What a valid credential proves."""

    uid: int
    gid: int
    encode_time: int  # seconds since the epoch, by the clock of the host that made it
    ttl_s: int
    payload: bytes


def decode(credential: str) -> Decoded:
    """Decode with unmunge: Unauthenticated when the credential proves nothing, MungeUnavailable when
    munged cannot be asked."""
    text = credential.strip()
    if not text or len(text) > MAX_CREDENTIAL_CHARS or not text.isascii():
        raise Unauthenticated(_FORGED, field="credential")
    try:
        done = run_bounded(
            [program("unmunge"), "--numeric", f"--keys={KEYS}"],
            timeout_s=DECODE_TIMEOUT_S,
            most_bytes=MAX_ANSWER_BYTES,
            env={},
            cwd="/",
            input_bytes=text.encode() + b"\n",
        )
    except ProgramMissing:
        raise MungeUnavailable(
            "this service cannot decode MUNGE credentials: unmunge is not installed"
        ) from None
    except (subprocess.TimeoutExpired, OSError, OutputTooLong) as error:
        raise MungeUnavailable(f"unmunge did not answer ({type(error).__name__}): try again") from None
    if done.returncode in (_SOCKET, _TIMEOUT):
        raise MungeUnavailable("munged, which decodes MUNGE credentials, is not answering: try again shortly")
    if done.returncode != 0:
        raise Unauthenticated(_REFUSALS.get(done.returncode, _FORGED), field="credential")
    return parse_answer(done.stdout.encode())


def parse_answer(answer: bytes) -> Decoded:
    """unmunge's answer: `KEY: value` lines, an empty line, then the payload."""
    head, _, payload = answer.partition(b"\n\n")
    values: dict[str, int] = {}
    for line in head.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(":")
        number = ascii_int(value.strip())
        if number is not None:
            values[key.strip()] = number
    if values.get("STATUS") != 0 or not {"UID", "GID", "ENCODE_TIME", "TTL"} <= values.keys():
        raise Unauthenticated(_FORGED, field="credential")
    return Decoded(values["UID"], values["GID"], values["ENCODE_TIME"], values["TTL"], payload)
