"""The cluster secret of the executor link, and the ZeroMQ CURVE keys both ends derive from it.

One file holds a random secret (`make_cluster_secret`); the scheduler and every executor
read the same file (`--cluster-secret-file`). From it each side derives two deterministic
Curve25519 key pairs, so no key ever needs distributing::

    secret ──blake2b(person="pagoda-server")──▶ server secret key ──crypto_scalarmult_base──▶ server public key
           ──blake2b(person="pagoda-client")──▶ client secret key ──crypto_scalarmult_base──▶ client public key

The scheduler is the CURVE server (it needs the server pair and the client public key, which
its ZAP handler admits, and nothing else); an executor is a CURVE client (the client pair and
the server public key). A peer without the secret knows neither public key: its handshake
fails before any message is read, so it hears nothing. CURVE also encrypts the link, with
per-connection keys (a recorded link stays secret even if the cluster secret leaks later).

Authenticated by default. Without `--cluster-secret-file`, the scheduler uses a per-user
secret in the cache directory (`<PAGODA_CACHE_DIR>/cluster.secret`, made on its first start,
mode 600), and an executor on the same host finds it there (waiting for it, if it starts
first); so `make run` and the tests run CURVE too. That file is used only if it belongs to
this user and nobody else may read or write it. An executor of a scheduler on another host
takes a copy (`--cluster-secret-file`). Plaintext only with `--insecure-executor-link`, on
both ends, logged as a warning.

A `--cluster-secret-file` is refused at start (both ends) when other users may read it (mode
bits for others, or for a group someone else is in) or when its text is weak: shorter than
MIN_SECRET_CHARS (always), a repeated pattern, or under MIN_SECRET_BITS estimated from its
characters' frequencies. `--allow-insecure-cluster-secret` (env
PAGODA_ALLOW_INSECURE_CLUSTER_SECRET) turns the last two refusals into warnings.
"""

from __future__ import annotations

import collections
import grp
import hashlib
import ipaddress
import logging
import math
import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
import tempfile
import time
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85

from pagoda import model_files
from pagoda.cli import env_name

log = logging.getLogger(__name__)

SECRET_BYTES = 32
MIN_SECRET_CHARS = 32  # 128 bits of hex
# The least a secret's characters must carry, estimated as length x the entropy of their frequencies
# (a lower estimate than the truth for random text): of 200,000 random 32-hex-digit secrets the
# lowest estimate was 91 bits (median 116); make_cluster_secret's 64 digits: 218 bits at least.
MIN_SECRET_BITS = 80
ALLOW_INSECURE_SECRET_FLAG = "--allow-insecure-cluster-secret"
ZAP_DOMAIN = "pagoda"
DEFAULT_SECRET_NAME = "cluster.secret"

MAKE_SECRET_HINT = (
    "Make one with `python -m scheduler_svc --generate-cluster-secret PATH` (or "
    "`python -c \"import secrets; print(secrets.token_hex(32))\" > PATH; chmod 600 PATH`) and pass "
    "--cluster-secret-file PATH (env PAGODA_CLUSTER_SECRET_FILE) to the scheduler and to every executor"
)


@dataclass(frozen=True, repr=False)
class LinkKeys:
    """Both key pairs, Z85-encoded as ZeroMQ's socket options take them. repr hides the secrets."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return f"LinkKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"


def make_cluster_secret(path: str | os.PathLike) -> Path:
    """Write a new random secret (hex, owner-readable only); refuses to overwrite a file (FileExistsError).

    Atomic: the file appears whole or not at all (written beside it, then linked into place),
    so a process that races to make or read the same file never sees it half written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = secrets.token_hex(SECRET_BYTES) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: exclusive create (not atomic, but never overwrites)
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(text)
    finally:
        os.unlink(tmp)
    return path


def default_secret_path() -> Path:
    """The per-user secret of the executor link when no --cluster-secret-file is given."""
    return model_files.cache_dir() / DEFAULT_SECRET_NAME


def ensure_default_secret() -> Path:
    """The per-user secret, made now if this is the first start (racing schedulers agree on one)."""
    path = default_secret_path()
    try:
        make_cluster_secret(path)
        log.info("made the executor link's secret %s (mode 600; executors on this host read it)", path)
    except FileExistsError:
        pass
    return path


def read_private_secret(path: str | os.PathLike) -> bytes:
    """The secret in `path`, refused (ValueError) unless this user owns it and nobody else may read or write it.

    For the default secret, which nobody named: a file someone else planted could hold a
    secret they know.
    """
    path = Path(path)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"the executor link secret {path} is not private (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):o}): remove it (a new one is made on the scheduler's next "
            f"start) or pass --cluster-secret-file"
        )
    return read_cluster_secret(path)


def read_cluster_secret(path: str | os.PathLike, allow_insecure: bool = False) -> bytes:
    """The secret in `path` (surrounding whitespace ignored). ValueError if it is too short, and,
    unless `allow_insecure` (then a warning), if other users may read it or it is weak."""
    path = Path(path)
    text = path.read_text().strip()
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(f"cluster secret {path} holds {len(text)} characters, at least {MIN_SECRET_CHARS} needed; {MAKE_SECRET_HINT}")
    problems = [p for p in (secret_exposure(path.stat()), secret_weakness(text)) if p]
    if problems and allow_insecure:
        log.warning("INSECURE: cluster secret %s is used though %s (%s)", path, "; ".join(problems),
                    ALLOW_INSECURE_SECRET_FLAG)
    elif problems:
        raise ValueError(
            f"cluster secret {path}: {'; '.join(problems)}. Make a private random one (chmod 600; {MAKE_SECRET_HINT}), "
            f"or pass {ALLOW_INSECURE_SECRET_FLAG} (env {env_name(ALLOW_INSECURE_SECRET_FLAG)}) to use it anyway"
        )
    return text.encode()


def secret_exposure(info: os.stat_result) -> str | None:
    """Why users other than the owner may read or write the file, or None. Group bits are fine for
    a group nobody else is in (Kubernetes gives a mounted secret its pod's fsGroup, mode 0440)."""
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IRWXO:
        return f"every user may read or write it (mode {mode:o})"
    if mode & stat.S_IRWXG and not _private_group(info.st_gid):
        return f"the users of group {info.st_gid} may read or write it (mode {mode:o})"
    return None


def _private_group(gid: int) -> bool:
    """True when no user but this one is in group `gid` (a member or by their primary group)."""
    try:
        me = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        me = None
    try:
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        members = set()
    members |= {user.pw_name for user in pwd.getpwall() if user.pw_gid == gid}
    return not members - {me}


def secret_weakness(text: str) -> str | None:
    """Why `text` is a weak secret (a repeated pattern, or few bits by its characters' frequencies), or None."""
    period = _smallest_period(text)
    if period <= len(text) // 2:
        return f"it repeats a pattern of {period} characters"
    counts = collections.Counter(text).values()
    bits = -sum(n * math.log2(n / len(text)) for n in counts)
    if bits < MIN_SECRET_BITS:
        return f"its characters carry about {bits:.0f} bits, fewer than {MIN_SECRET_BITS} ({len(counts)} distinct)"
    return None


def _smallest_period(text: str) -> int:
    """The least p such that text[i] == text[i + p] for every i (Knuth-Morris-Pratt's failure function)."""
    fail = [0] * len(text)
    for i in range(1, len(text)):
        k = fail[i - 1]
        while k and text[i] != text[k]:
            k = fail[k - 1]
        fail[i] = k + (text[i] == text[k])
    return len(text) - fail[-1] if text else 0


def derive_link_keys(secret: bytes) -> LinkKeys:
    """The two Curve25519 key pairs of `secret` (a keyed hash gives each secret key; libsodium the public one)."""
    pairs = []
    for role in (b"server", b"client"):
        secret_key = hashlib.blake2b(secret, digest_size=32, person=b"pagoda-" + role).digest()
        z85_secret = z85.encode(secret_key)
        pairs.append((zmq.curve_public(z85_secret), z85_secret))
    (server_public, server_secret), (client_public, client_secret) = pairs
    return LinkKeys(server_public, server_secret, client_public, client_secret)


def load_link_keys(secret_file: str | os.PathLike | None, allow_insecure: bool = False) -> LinkKeys | None:
    return derive_link_keys(read_cluster_secret(secret_file, allow_insecure)) if secret_file else None


def scheduler_link_keys(
    secret_file: str | None, insecure: bool, bind: str, allow_insecure_secret: bool = False
) -> LinkKeys | None:
    """The scheduler's keys: `--cluster-secret-file`, else the per-user secret (made on first start).

    None (plaintext) only with `insecure` (--insecure-executor-link), with a warning.
    Raises OSError or ValueError naming the file when it cannot be used.
    """
    if secret_file:
        if insecure:
            log.warning("--insecure-executor-link has no effect: the link uses --cluster-secret-file %s", secret_file)
        return load_link_keys(secret_file, allow_insecure_secret)
    if insecure:
        reach = "on this host" if is_loopback_endpoint(bind) else "that reaches it"
        log.warning(
            "INSECURE: executor link %s is plaintext (--insecure-executor-link): any process %s can register "
            "as an executor, read every prompt and write any tokens",
            bind, reach,
        )
        return None
    path = ensure_default_secret()
    keys = derive_link_keys(read_private_secret(path))
    log.info(
        "executor link %s: CURVE with the per-user secret %s (executors on this host find it; "
        "give others a copy with --cluster-secret-file)", bind, path,
    )
    return keys


def executor_link_keys(
    secret_file: str | None, insecure: bool, endpoint: str, wait_s: float = 600.0, poll_s: float = 0.5,
    allow_insecure_secret: bool = False,
) -> LinkKeys | None:
    """An executor's keys: `--cluster-secret-file`, else the per-user secret of a scheduler on this host.

    For a loopback `endpoint` the per-user secret is waited for (up to `wait_s`): the scheduler
    makes it on its first start, which may come after ours. None (plaintext) only with
    `insecure`. Raises ValueError saying which flag to pass when there is no secret to use.
    """
    if secret_file:
        return load_link_keys(secret_file, allow_insecure_secret)
    if insecure:
        log.warning("INSECURE: the link to %s is plaintext (--insecure-executor-link)", endpoint)
        return None
    path = default_secret_path()
    if not path.exists() and not is_loopback_endpoint(endpoint):
        raise ValueError(
            f"no secret for the executor link to {endpoint}: pass --cluster-secret-file with a copy of the "
            f"scheduler's (its host's {DEFAULT_SECRET_NAME} in the cache directory, or its --cluster-secret-file), "
            f"or --insecure-executor-link if the scheduler runs with it"
        )
    deadline = time.monotonic() + wait_s
    if not path.exists():
        log.info("waiting for the scheduler to make the executor link's secret %s", path)
    while not path.exists():
        if time.monotonic() > deadline:
            raise ValueError(f"no scheduler made the executor link's secret {path} in {wait_s:g} s (--cluster-secret-file)")
        time.sleep(poll_s)
    return derive_link_keys(read_private_secret(path))


def configure_server(sock: zmq.Socket, keys: LinkKeys) -> None:
    """Make `sock` (before it binds) a CURVE server; the ZAP handler decides who gets in."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def configure_client(sock: zmq.Socket, keys: LinkKeys | None) -> None:
    """Make `sock` (before it connects) a CURVE client of the scheduler; plaintext when `keys` is None."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def is_loopback_endpoint(endpoint: str) -> bool:
    """True when only processes on this host can reach `endpoint` (tcp on a loopback address, ipc, inproc)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(f"//{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: not provably loopback
        return False
