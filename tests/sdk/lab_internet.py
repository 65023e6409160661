"""A test internet for the SDK suite: a network namespace routed from the host that plays
the outside world, with a DNS server and TLS hosts that record what they receive.

Layout (N derived from the run's prefix, like the server's address pool):
- the uplink 10.215.N.252/30: `{prefix}_up` on the host (.253), `up0` in the namespace
  `{prefix}_inet` (.254);
- the hosts 198.18.N.0/26 (RFC 2544's benchmarking range: outside every private range, so
  sandboxes may reach it, and never routed on a real network): a `local` route on the
  namespace's `lo` makes each address answer, and the host routes the block through the
  uplink;
- DNS on host 1 (UDP), the name server `fastbox up --dns-upstream` is given;
- TLS hosts on port 443 of the addresses named in `tls_hosts`, each with a certificate
  from its own CA, and plain HTTP hosts on port 80 of those in `http_hosts`; each
  request's method, target and `Authorization` header go to `received-<name>.log` (out of
  band, read with `LabInternet.received`), and the answer echoes the header (`x-echo` and
  body `echo: VALUE`).

Every address lives in the namespace, so even a connection the firewall failed to stop
ends here. The names carry the server's prefix: `fastbox purge --prefix` removes them too.
Run as `python lab_internet.py serve DIR` inside the namespace (LabInternet does that).
"""

from __future__ import annotations

import datetime
import hashlib
import http.server
import ipaddress
import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class LabCa:
    """A CA and the certificates it signs (with `cryptography`, which the venv has)."""

    def __init__(self, name: str) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._x509, self._hashes, self._ec, self._oid = x509, hashes, ec, NameOID
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )  # fmt: skip

    def pem(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding

        return self.cert.public_bytes(Encoding.PEM)

    def issue(self, names: list[str]) -> tuple[bytes, bytes]:
        """A certificate for `names` and its key, both PEM."""
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
        )

        x509 = self._x509
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(self._oid.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
            )
            .sign(self.key, self._hashes.SHA256())
        )
        key_pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        return cert.public_bytes(Encoding.PEM), key_pem


class LabInternet:
    """The namespace, its routes and its servers; `stop()` removes all of it."""

    def __init__(self, prefix: str, workdir: Path) -> None:
        n = int(hashlib.sha256(prefix.encode()).hexdigest(), 16) % 254 + 1
        self.prefix = prefix
        self.netns = f"{prefix}_inet"
        self.uplink = f"{prefix}_up"
        self.host_end = f"10.215.{n}.253"
        self.inner_end = f"10.215.{n}.254"
        self.block = ipaddress.ip_network(f"198.18.{n}.0/26")
        self.dir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.others: list[subprocess.Popen[bytes]] = []

    def host(self, i: int) -> str:
        return str(self.block.network_address + i)

    @property
    def dns(self) -> str:
        return f"{self.host(1)}:53"

    def start(
        self,
        zone: dict[str, str],
        tls_hosts: dict[str, tuple[str, bytes, bytes]],
        http_hosts: dict[str, str],
    ) -> None:
        """`zone`: name -> address; `tls_hosts`: label -> (address, cert PEM, key PEM);
        `http_hosts`: label -> address."""
        self.dir.mkdir(parents=True, exist_ok=True)
        config = {"dns": self.host(1), "zone": zone, "tls": {}, "http": http_hosts}
        for label, (address, cert, key) in tls_hosts.items():
            (self.dir / f"{label}.crt").write_bytes(cert)
            (self.dir / f"{label}.key").write_bytes(key)
            config["tls"][label] = address
        (self.dir / "config.json").write_text(json.dumps(config))
        _run("ip", "netns", "add", self.netns)
        try:
            _run("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "up0",
                 "netns", self.netns)  # fmt: skip
            _run("ip", "addr", "add", f"{self.host_end}/30", "dev", self.uplink)
            _run("ip", "link", "set", self.uplink, "up")
            inside = ["ip", "netns", "exec", self.netns]
            _run(*inside, "ip", "addr", "add", f"{self.inner_end}/30", "dev", "up0")
            _run(*inside, "ip", "link", "set", "up0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "route", "add", "local", str(self.block), "dev", "lo")
            _run("ip", "route", "add", str(self.block), "via", self.inner_end)
            self.proc = subprocess.Popen(
                [*inside, sys.executable, str(Path(__file__).resolve()), "serve", str(self.dir)],
                stdout=open(self.dir / "servers.log", "ab"),
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + 20
            while not (self.dir / "ready").exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "the lab internet's servers did not start:\n"
                        + (self.dir / "servers.log").read_text(errors="replace")
                    )
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def run_inside(self, label: str, command: list[str]) -> None:
        """Starts `command` in the namespace (a server of the lab's own), until `stop()`; its
        output goes to `<label>.log`."""
        self.others.append(
            subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *command],
                stdout=open(self.dir / f"{label}.log", "ab"),
                stderr=subprocess.STDOUT,
            )
        )

    def received(self, label: str) -> list[str]:
        """What TLS host `label` received, a line per request (`METHOD TARGET authorization=V`)."""
        path = self.dir / f"received-{label}.log"
        return path.read_text().splitlines() if path.exists() else []

    def stop(self) -> None:
        for other in self.others:
            other.kill()
            other.wait()
        self.others = []
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        subprocess.run(["ip", "route", "del", str(self.block)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.uplink], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        # Its keys, certificates and logs (the directory was made for it).
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------- inside the namespace


def _dns_answer(query: bytes, zone: dict[str, str]) -> bytes | None:
    if len(query) < 12:
        return None
    (qid, _flags, qdcount) = struct.unpack(">HHH", query[:6])
    if qdcount != 1:
        return None
    labels, i = [], 12
    while i < len(query) and query[i] != 0:
        n = query[i]
        labels.append(query[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    i += 1
    if i + 4 > len(query):
        return None
    qtype = struct.unpack(">H", query[i : i + 2])[0]
    question = query[12 : i + 4]
    name = ".".join(labels).lower()
    address = zone.get(name)
    rcode = 0 if address else 3
    answers = b""
    if address and qtype == 1:
        answers = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 300, 4) + socket.inet_aton(address)
    ancount = 1 if answers else 0
    header = struct.pack(">HHHHHH", qid, 0x8180 | rcode, 1, ancount, 0, 0)
    return header + question + answers


def _serve_dns(address: str, zone: dict[str, str]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, 53))
    while True:
        query, peer = sock.recvfrom(4096)
        answer = _dns_answer(query, zone)
        if answer:
            sock.sendto(answer, peer)


def _recording_host(
    address: str, port: int, label: str, workdir: Path
) -> http.server.ThreadingHTTPServer:
    log = workdir / f"received-{label}.log"
    lock = threading.Lock()

    class Recording(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            auth = self.headers.get("Authorization", "")
            with lock, open(log, "a") as f:
                f.write(f"{self.command} {self.path} authorization={auth}\n")
            body = f"echo: {auth}".encode()
            self.send_response(200)
            self.send_header("x-echo", auth)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    return http.server.ThreadingHTTPServer((address, port), Recording)


def _tls_host(address: str, label: str, workdir: Path) -> http.server.ThreadingHTTPServer:
    server = _recording_host(address, 443, label, workdir)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(workdir / f"{label}.crt", workdir / f"{label}.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    return server


def serve(workdir: Path) -> None:
    config = json.loads((workdir / "config.json").read_text())
    threading.Thread(target=_serve_dns, args=(config["dns"], config["zone"]), daemon=True).start()
    servers = [_tls_host(address, label, workdir) for label, address in config["tls"].items()]
    servers += [_recording_host(a, 80, label, workdir) for label, a in config["http"].items()]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    (workdir / "ready").touch()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        os.setpgrp()
        serve(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} serve DIR")
