"""API key and (mutual) TLS on the client side, against a small grpc server of the test's own
that checks what the scheduler's `--api-key` / `--ssl-*` flags check: the bearer metadata,
and a client certificate signed by the CA."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pagoda.client import Client, RetryPolicy, TLSConfig, Unauthenticated, Unavailable
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from tests.client.keyed_server import KEY, KeyedServicer
from tests.service.harness import ROOT, free_port



def _cert(name: str, issuer_key=None, issuer_name=None, ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert, key, cert.public_bytes(serialization.Encoding.PEM), pem_key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca_cert, ca_key, ca_pem, _ = _cert("pagoda-test-ca", ca=True)
    _, _, server_pem, server_key = _cert("localhost", ca_key, ca_cert.subject)
    _, _, client_pem, client_key = _cert("client", ca_key, ca_cert.subject)
    d = tmp_path_factory.mktemp("pki")
    files = {"ca": ca_pem, "server": server_pem, "server_key": server_key, "client": client_pem,
             "client_key": client_key}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return {name: str(d / f"{name}.pem") for name in files} | {"bytes": files}


@pytest.fixture(scope="module")
def mtls_server(pki):
    files = pki["bytes"]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(KeyedServicer(), server)
    creds = grpc.ssl_server_credentials([(files["server_key"], files["server"])], root_certificates=files["ca"],
                                        require_client_auth=True)
    port = server.add_secure_port(f"127.0.0.1:{free_port()}", creds)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_api_key_and_client_certificate_are_presented(pki, mtls_server):
    tls = TLSConfig.from_files(ca=pki["ca"], cert=pki["client"], key=pki["client_key"])
    with Client(mtls_server, api_key=KEY, tls=tls, timeout=10) as client:
        assert client.model_info().name == "keyed"
        assert client.generate("x", max_tokens=2).collect().text == "ok!"


def test_a_wrong_key_is_unauthenticated_and_not_retried(pki, mtls_server):
    tls = TLSConfig.from_files(ca=pki["ca"], cert=pki["client"], key=pki["client_key"])
    with Client([mtls_server, mtls_server], api_key="wrong", tls=tls, timeout=10) as client:
        with pytest.raises(Unauthenticated, match="API key"):
            client.model_info()
        stream = client.generate("x")
        with pytest.raises(Unauthenticated):
            list(stream)
        assert stream.num_attempts == 1


def test_without_a_client_certificate_the_handshake_fails(pki, mtls_server):
    tls = TLSConfig.from_files(ca=pki["ca"])
    with Client(mtls_server, api_key=KEY, tls=tls, timeout=5, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(Unavailable):
            client.model_info()


def test_tls_config_needs_cert_and_key_together(pki):
    with pytest.raises(ValueError, match="cert and key"):
        TLSConfig.from_files(ca=pki["ca"], cert=pki["client"])


def test_the_cli_takes_the_key_and_tls_flags(pki, mtls_server):
    base = [sys.executable, "-m", "pagoda", "generate", "x", "--target", mtls_server, "--ssl-ca-certs", pki["ca"],
            "--ssl-certfile", pki["client"], "--ssl-keyfile", pki["client_key"]]
    ok = subprocess.run([*base, "--api-key", KEY], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout == "ok!\n", ok.stderr
    bad = subprocess.run([*base, "--api-key", "wrong"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr
