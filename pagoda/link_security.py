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
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

SECRET_BYTES = 32
MIN_SECRET_CHARS = 32  # 128 bits of hex
ZAP_DOMAIN = "pagoda"

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
    """Write a new random secret (hex, owner-readable only); refuses to overwrite a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path


def read_cluster_secret(path: str | os.PathLike) -> bytes:
    """The secret in `path` (surrounding whitespace ignored); ValueError if it is too short."""
    path = Path(path)
    text = path.read_text().strip()
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(f"cluster secret {path} holds {len(text)} characters, at least {MIN_SECRET_CHARS} needed; {MAKE_SECRET_HINT}")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("cluster secret %s is readable by other users (mode %o): chmod 600 it", path, stat.S_IMODE(mode))
    return text.encode()


def derive_link_keys(secret: bytes) -> LinkKeys:
    """The two Curve25519 key pairs of `secret` (a keyed hash gives each secret key; libsodium the public one)."""
    pairs = []
    for role in (b"server", b"client"):
        secret_key = hashlib.blake2b(secret, digest_size=32, person=b"pagoda-" + role).digest()
        z85_secret = z85.encode(secret_key)
        pairs.append((zmq.curve_public(z85_secret), z85_secret))
    (server_public, server_secret), (client_public, client_secret) = pairs
    return LinkKeys(server_public, server_secret, client_public, client_secret)


def load_link_keys(secret_file: str | os.PathLike | None) -> LinkKeys | None:
    return derive_link_keys(read_cluster_secret(secret_file)) if secret_file else None


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


class InsecureLinkError(RuntimeError):
    pass


def check_link_policy(bind: str, keys: LinkKeys | None, insecure: bool) -> None:
    """Refuse a plaintext link that other hosts can reach unless `insecure` (--insecure-executor-link) says so."""
    if keys is not None:
        if insecure:
            log.warning("--insecure-executor-link has no effect: the link uses the cluster secret")
        return
    if is_loopback_endpoint(bind):
        log.info("executor link %s is plaintext (loopback only; pass --cluster-secret-file to authenticate it)", bind)
        return
    if not insecure:
        raise InsecureLinkError(
            f"--executor-bind {bind} is reachable from other hosts but no cluster secret is given: anyone who "
            f"can reach it could register as an executor, read every prompt and write any tokens. "
            f"{MAKE_SECRET_HINT}. (--insecure-executor-link starts anyway, unauthenticated.)"
        )
    log.warning(
        "INSECURE: executor link %s accepts any peer without authentication or encryption "
        "(--insecure-executor-link); any host that reaches it can read prompts and forge tokens",
        bind,
    )
