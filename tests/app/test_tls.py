"""LAN mode: HTTPS from DOCTUNE_TLS_CERTFILE/KEYFILE, served by a real uvicorn with a
self-signed certificate made here (Secure cookies, https-only Origins, no warning), and the
warning every page shows when it is reached across the network over plain http."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.accounts import service as accounts
from app.accounts.door import COOKIE
from app.db import session_scope
from app.lan import crosses_network_unencrypted
from app.launcher import answering
from app.main import create_app
from app.settings import Settings, settings
from tests.app.web import serve_app, signed_in_headers

WARNING = "This connection is not encrypted."
PASSWORD = "correct horse battery"
LAN_NAME = "doctune.test"  # in DOCTUNE_ALLOWED_HOSTS of the servers below


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "DocTune test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def https_port(app_env, certificate) -> int:
    with serve_app(app_env, "uvicorn-tls.log", tls=certificate,
                   extra_env={"DOCTUNE_ALLOWED_HOSTS": LAN_NAME}) as port:
        yield port


def _https(port: int, certificate) -> httpx.Client:
    trust = ssl.create_default_context(cafile=str(certificate[0]))  # this certificate only
    return httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=trust, timeout=20)


# Settings ------------------------------------------------------------------------------------


def test_the_tls_files_come_both_or_neither_and_must_be_readable(certificate, tmp_path):
    cert, key = certificate
    assert Settings(_env_file=None).tls is False
    both = Settings(_env_file=None, tls_certfile=str(cert), tls_keyfile=str(key))
    assert both.tls and both.tls_certfile == cert
    with pytest.raises(ValidationError, match="DOCTUNE_TLS_CERTFILE is set but "
                                              "DOCTUNE_TLS_KEYFILE is not"):
        Settings(_env_file=None, tls_certfile=str(cert))
    with pytest.raises(ValidationError, match="DOCTUNE_TLS_KEYFILE is set but "
                                              "DOCTUNE_TLS_CERTFILE is not"):
        Settings(_env_file=None, tls_keyfile=str(key))
    missing = tmp_path / "no-such.pem"
    with pytest.raises(ValidationError,
                       match=f"DOCTUNE_TLS_KEYFILE={missing} cannot be read: No such file"):
        Settings(_env_file=None, tls_certfile=str(cert), tls_keyfile=str(missing))
    with pytest.raises(ValidationError, match="DOCTUNE_TLS_CERTFILE=.* cannot be read: Is a dir"):
        Settings(_env_file=None, tls_certfile=str(tmp_path), tls_keyfile=str(key))
    assert Settings(_env_file=None, tls_certfile="", tls_keyfile="").tls is False


def test_an_old_secret_key_setting_is_ignored_and_a_lan_host_needs_none(monkeypatch):
    monkeypatch.setenv("DOCTUNE_SECRET_KEY", "left over from an old .env")
    monkeypatch.setenv("DOCTUNE_HOST", "0.0.0.0")
    loaded = Settings(_env_file=None)  # refused before: a LAN host needed a secret key
    assert loaded.host == "0.0.0.0" and not hasattr(loaded, "secret_key")


# Over HTTPS (a real uvicorn with the certificate) --------------------------------------------


def test_over_https_sign_in_cookies_are_secure_and_only_https_origins_pass(
        https_port, certificate, env):
    here = f"https://127.0.0.1:{https_port}"
    with session_scope() as session:
        token = accounts.setup_token_if_needed(session)
    assert token is not None  # no admin yet
    with _https(https_port, certificate) as client:
        plain_origin = client.post("/setup", headers={"Origin": f"http://127.0.0.1:{https_port}"},
                                   data={"token": token, "name": "Ada", "password": PASSWORD})
        assert plain_origin.status_code == 403 and COOKIE not in plain_origin.cookies
        assert "Requests from other web sites are not accepted" in plain_origin.text
        assert f"{here}/" in plain_origin.text  # the refusal names the https address
        no_origin = client.post("/signin", data={"name": "Ada", "password": PASSWORD})
        assert no_origin.status_code == 403 and f"Origin: {here}" in no_origin.text

        setup = client.post("/setup", headers={"Origin": here},
                            data={"token": token, "name": "Ada", "password": PASSWORD})
        signin = client.post("/signin", headers={"Origin": here},
                             data={"name": "Ada", "password": PASSWORD})
        for r in (setup, signin):  # the first admin's cookie, then a later sign-in's
            assert r.status_code == 303, r.text
            cookie = r.headers["set-cookie"]
            assert cookie.startswith(f"{COOKIE}=")
            attributes = {part.strip().lower() for part in cookie.split(";")}
            assert {"secure", "httponly", "samesite=lax"} <= attributes
        home = client.get("/", headers={"Cookie": f"{COOKIE}={signin.cookies[COOKIE]}"})
    assert home.status_code == 200 and "Ada" in home.text and "Accounts" in home.text
    assert WARNING not in home.text


def test_over_https_a_lan_name_gets_no_warning_and_only_its_https_origin(
        https_port, certificate, env):
    lan = f"{LAN_NAME}:{https_port}"
    with session_scope() as session:
        accounts.create_user(session, "Grace", "admin", PASSWORD)
    with _https(https_port, certificate) as client:  # to 127.0.0.1, saying it asked for lan
        page = client.get("/signin", headers={"Host": lan})
        foreign = client.post("/signin", data={"name": "Grace", "password": PASSWORD},
                              headers={"Host": lan, "Origin": f"http://{lan}"})
        ok = client.post("/signin", data={"name": "Grace", "password": PASSWORD},
                         headers={"Host": lan, "Origin": f"https://{lan}"})
    assert page.status_code == 200 and "Sign in" in page.text
    assert WARNING not in page.text and "lan-warning" not in page.text
    assert foreign.status_code == 403
    assert ok.status_code == 303 and "secure" in ok.headers["set-cookie"].lower()


def test_the_launchers_poll_reaches_the_https_app_without_checking_its_certificate(https_port):
    here = f"https://127.0.0.1:{https_port}"
    with pytest.raises(httpx.ConnectError):  # self-signed: a checking client refuses it
        httpx.get(here + "/healthz")
    assert answering(here, timeout_s=10) is True
    started = time.monotonic()
    assert answering(f"http://127.0.0.1:{https_port}", timeout_s=1) is False  # wrong scheme
    assert time.monotonic() - started < 10


# Over plain http (the app in-process) --------------------------------------------------------


def _banner(client: TestClient, host: str, path: str) -> bool:
    r = client.get(path, headers={"Host": host})
    assert r.status_code in (200, 403, 404), (path, r.status_code)
    shown = WARNING in r.text
    if shown:
        assert "DOCTUNE_TLS_CERTFILE and DOCTUNE_TLS_KEYFILE" in r.text
        assert "LAN mode" in r.text and 'class="lan-warning"' in r.text
    return shown


def test_plain_http_by_a_lan_name_warns_on_every_page_and_loopback_does_not(env):
    settings.allowed_hosts = f"{LAN_NAME}, 192.168.1.20"  # put back by the env fixture
    with session_scope() as session:
        token = accounts.setup_token_if_needed(session)
    port = settings.port
    anonymous = ["/signin", f"/setup?token={token}", "/setup?token=spent"]
    with TestClient(create_app()) as anon, \
            TestClient(create_app(), headers=signed_in_headers()) as member:
        for host in (f"{LAN_NAME}:{port}", "192.168.1.20", LAN_NAME):
            assert all(_banner(anon, host, path) for path in anonymous), host
            assert all(_banner(member, host, path) for path in ("/", "/account", "/nowhere"))
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.1"):
            assert not any(_banner(anon, host, path) for path in anonymous), host
            assert not any(_banner(member, host, path) for path in ("/", "/account"))


def test_a_wildcard_bind_reached_at_loopback_does_not_warn(env, monkeypatch):
    monkeypatch.setattr(settings, "host", "0.0.0.0")  # docker-compose, inside the container
    with TestClient(create_app()) as client:
        r = client.get("/signin", headers={"Host": f"127.0.0.1:{settings.port}"})
    assert r.status_code == 200 and WARNING not in r.text


@pytest.mark.parametrize(("scheme", "host", "warns"), [
    ("http", "doctune.lan:8000", True), ("http", "192.168.1.20", True),
    ("http", "[fe80::1]:8000", True), ("http", "localhost.evil.test", True),
    ("https", "doctune.lan:8000", False), ("http", "127.0.0.1:8000", False),
    ("http", "LOCALHOST", False), ("http", "[::1]:8000", False), ("http", "127.0.0.2", False),
])
def test_the_warning_depends_on_the_scheme_and_the_name_asked_for(scheme, host, warns):
    assert crosses_network_unencrypted(scheme, host) is warns


def test_the_warning_points_at_a_readme_section_that_exists():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "\n### LAN mode" in readme or "\n## LAN mode" in readme
