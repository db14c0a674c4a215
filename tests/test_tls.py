"""TLS between clients and the bus, when certificates are configured: a real nats-server with
a certificate signed by a CA made here (openssl), authentication on; a client that trusts the CA
(MUSTER_TLS_CA) gets in, one that does not, or that talks plain TCP, does not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from muster.shared import auth, bus
from muster.shared.natsserver import NatsServer

pytestmark = pytest.mark.skipif(not shutil.which("openssl"), reason="openssl is needed to make certificates")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def certificates(d: Path) -> dict[str, str]:
    """A CA, and a server certificate for 127.0.0.1 signed by it."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=muster-test-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=d)  # fmt: skip
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key")}


async def test_clients_reach_the_bus_over_tls_only_when_they_trust_its_ca(tmp_path, monkeypatch):
    certs = certificates(tmp_path)
    keys = auth.AuthDir(tmp_path / "auth")
    admin = keys.ensure("root", "admin")
    tls = {"cert_file": certs["cert"], "key_file": certs["key"]}
    with NatsServer(tmp_path / "nats", auth_config=keys.server_config, tls=tls) as server:
        assert server.url.startswith("tls://")
        # No CA configured: the server's certificate is not trusted.
        monkeypatch.delenv("MUSTER_TLS_CA", raising=False)
        with pytest.raises(ConnectionError):
            await bus.connect("untrusting", server.url, connect_timeout=3, quiet=True, credentials=admin)
        # Plain TCP to a TLS server gets nowhere either.
        with pytest.raises(ConnectionError):
            await bus.connect(
                "plain",
                server.url.replace("tls://", "nats://"),
                connect_timeout=3,
                quiet=True,
                credentials=admin,
            )
        monkeypatch.setenv("MUSTER_TLS_CA", certs["ca"])
        nc = await bus.connect("trusting", server.url, connect_timeout=5, quiet=True, credentials=admin)
        try:
            js, _ = await bus.ensure_jetstream(nc)
            assert (await js.account_info()).streams >= 4
            assert nc.connected_url.scheme == "tls"
        finally:
            await nc.close()
        # TLS does not replace authentication: the CA alone gets a stranger nothing.
        with pytest.raises(ConnectionError, match=r"(?i)authorization"):
            await bus.connect("stranger", server.url, connect_timeout=3, quiet=True)


def test_cluster_routes_are_tls_and_refuse_a_server_without_the_ca(tmp_path):
    """Two servers route to each other over TLS (verify on); a third whose certificate is signed
    by another CA never joins."""
    import json
    import time
    import urllib.request

    from muster.shared.natsserver import binary, free_port

    good = certificates(tmp_path)
    (tmp_path / "other").mkdir()
    bad = certificates(tmp_path / "other")
    ports = [free_port() for _ in range(9)]
    routes = ",".join(f"nats://127.0.0.1:{ports[3 + i]}" for i in range(3))
    procs = []
    try:
        for i, certs in enumerate((good, good, bad)):
            conf = tmp_path / f"s{i}.conf"
            conf.write_text(
                f'listen: "127.0.0.1:{ports[i]}"\nhttp: "127.0.0.1:{ports[6 + i]}"\nserver_name: s{i}\n'
                f'cluster {{ name: c, listen: "127.0.0.1:{ports[3 + i]}", routes: [{routes}],\n'
                f'  tls {{ cert_file: "{certs["cert"]}", key_file: "{certs["key"]}",'
                f' ca_file: "{certs["ca"]}", verify: true, timeout: 2 }} }}\n'
            )
            log = open(tmp_path / f"s{i}.log", "wb")  # noqa: SIM115
            procs.append(subprocess.Popen([binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT))

        def routed(i: int) -> set[str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[6 + i]}/routez", timeout=2) as r:
                    return {route.get("remote_name", "") for route in json.load(r).get("routes") or []}
            except OSError:
                return set()

        deadline = time.monotonic() + 30
        while "s1" not in routed(0) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert "s1" in routed(0) and "s0" in routed(1)
        time.sleep(3)  # the stranger keeps trying: still not in
        assert "s2" not in routed(0) | routed(1) and not routed(2)
        assert "tls" in (tmp_path / "s2.log").read_text().lower()
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
