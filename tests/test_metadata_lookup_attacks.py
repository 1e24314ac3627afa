"""Attacks on the metadata client's bounds, third round: every request ends within its total time, the
host-name lookup included (on threads of its own, the address found kept); no lookup, address or URL
blinds a watcher for good, and every failure is a typed watcher error. Real requests to the metadata
emulator, with ``socket.getaddrinfo`` (and for one test ``socket.socket``) answering as a broken
resolver or kernel would."""
from __future__ import annotations

import errno
import socket
import threading
import time

import pytest
import test_watchers as shared

import hvd_transient.watchers.metadata_http as mh
from hvd_transient.watchers.errors import WatcherError
from hvd_transient.watchers.metadata_http import MetadataClient

pytestmark = [pytest.mark.timeout(60), pytest.mark.timed]  # bounds wall-clock times
H = {"Metadata-Flavor": "Google"}
NAME = "metadata.lookup.test"
emu = shared.emu  # the fixture


@pytest.fixture(autouse=True)
def fresh_resolver(monkeypatch):
    monkeypatch.setattr(mh, "_RESOLVER", mh._Resolver())


def _fake_dns(monkeypatch, answer):
    real = socket.getaddrinfo
    calls = []

    def getaddrinfo(host, port, *a, **k):
        if host == NAME:
            calls.append(time.monotonic())
            return answer(len(calls), port, real)
        return real(host, port, *a, **k)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


def _url(emu):
    return emu.gce_base_url("a").replace("127.0.0.1", NAME) + "instance/preempted"


def _try(client, url):
    t = time.monotonic()
    try:
        r = client.get(url, headers=H)
        return "ok", r.status_code, time.monotonic() - t
    except WatcherError as e:
        return type(e).__name__, str(e)[:90], time.monotonic() - t
    except BaseException as e:  # noqa: BLE001 - an untyped escape is itself the finding
        return "UNTYPED " + type(e).__name__, str(e)[:90], time.monotonic() - t


def test_a_lookup_raising_a_non_oserror_once_does_not_blind_for_good(emu, monkeypatch):
    """A resolver that raises something other than OSError once (a UnicodeError for a bad label,
    a RuntimeError from a patched/buggy resolver) must be retried by the next request."""
    def answer(n, port, real):
        if n == 1:
            raise RuntimeError("resolver hiccup")  # not an OSError
        return real("127.0.0.1", port, type=socket.SOCK_STREAM)
    calls = _fake_dns(monkeypatch, answer)
    client = MetadataClient(connect_timeout=0.3, total_timeout=0.6)
    results = [_try(client, _url(emu)) for _ in range(4)]
    print("results:", results, "lookups:", len(calls))
    assert results[-1][0] == "ok", f"still blind after 4 requests: {results}; lookups made {len(calls)}"


def test_a_blackholed_first_address_does_not_blind_for_good(emu, monkeypatch):
    """The lookup returns a blackholed address first (an IPv6 route that drops SYNs), then a good one.
    connect_timeout is per address: the good one must be reached within the total."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    bh_port = srv.getsockname()[1]
    held = []
    for _ in range(4):  # fill the accept queue: later SYNs are dropped (a blackhole)
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", bh_port))
        except BlockingIOError:
            pass
        held.append(c)
    time.sleep(0.1)

    def answer(n, port, real):
        bh = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", bh_port))
        return [bh] + real("127.0.0.1", port, type=socket.SOCK_STREAM)
    _fake_dns(monkeypatch, answer)
    client = MetadataClient(connect_timeout=0.3, total_timeout=2.0)
    try:
        results = [_try(client, _url(emu)) for _ in range(3)]
    finally:
        for c in held:
            c.close()
        srv.close()
    print("results:", results)
    assert any(r[0] == "ok" for r in results), f"never reached the second address: {results}"


def test_an_address_family_the_kernel_lacks_first_does_not_blind_for_good(emu, monkeypatch):
    """A kernel booted without IPv6 (socket(AF_INET6) -> EAFNOSUPPORT) while the lookup gives ::1 first
    (e.g. GCE_METADATA_HOST=localhost). The IPv4 address after it must be used."""
    real_socket = socket.socket

    def make_socket(family=socket.AF_INET, *a, **k):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *a, **k)

    def answer(n, port, real):
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))
        return [v6] + real("127.0.0.1", port, type=socket.SOCK_STREAM)
    _fake_dns(monkeypatch, answer)
    monkeypatch.setattr(mh.socket, "socket", make_socket)
    client = MetadataClient(connect_timeout=0.3, total_timeout=1.0)
    results = [_try(client, _url(emu)) for _ in range(3)]
    print("results:", results)
    assert any(r[0] == "ok" for r in results), f"never tried the IPv4 address: {results}"


def test_a_lookup_that_hung_once_does_not_blind_for_good(emu, monkeypatch):
    """The first getaddrinfo hangs (a stuck resolver thread, e.g. a hung NSS module); the resolver
    recovers for every later call. Requests must see the server again."""
    release = threading.Event()

    def answer(n, port, real):
        if n == 1:
            release.wait(30)
        return real("127.0.0.1", port, type=socket.SOCK_STREAM)
    calls = _fake_dns(monkeypatch, answer)
    client = MetadataClient(connect_timeout=0.3, total_timeout=0.5)
    try:
        results = [_try(client, _url(emu)) for _ in range(8)]  # 4 s of requests
    finally:
        release.set()
    print("results:", [r[0] for r in results], "lookups:", len(calls))
    assert results[-1][0] == "ok", f"blind for {len(results)} requests; lookups tried {len(calls)}"


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/computeMetadata/v1/instance/preempted",
                                 "http://127.0.0.1:8o/computeMetadata/v1/instance/preempted",
                                 "http://[::1/computeMetadata/v1/instance/preempted"])
def test_a_bad_url_is_a_typed_config_error(url):
    """GCE_METADATA_HOST / an endpoint env var with a bad port: the poll must raise a typed error."""
    r = _try(MetadataClient(connect_timeout=0.3, total_timeout=0.5), url)
    print(r)
    assert not r[0].startswith("UNTYPED"), r


def test_a_bad_port_from_gce_metadata_host_does_not_escape_a_poll_untyped(monkeypatch):
    from hvd_transient.watchers import GceWatcher
    from hvd_transient.watchers.gce import _KeyPoller, _preempted_reason
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:99999")
    try:
        w = GceWatcher(window=30)
    except WatcherError as e:
        print("refused at construction:", e)
        return
    p = _KeyPoller(w, "instance/preempted", _preempted_reason)
    try:
        p.poll()
    except WatcherError as e:
        print("typed:", type(e).__name__)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"untyped {type(e).__name__} escaped a poll: {e}")


def test_literal_ipv6_host_and_https_plain_server_are_typed(emu):
    v6 = socket.socket(socket.AF_INET6)
    v6.bind(("::1", 0))
    v6.listen(1)
    port = v6.getsockname()[1]
    srv_done = threading.Event()

    def serve():
        c, _ = v6.accept()
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nContent-Length: 5\r\n\r\nFALSE")
        c.close()
        srv_done.set()
    threading.Thread(target=serve, daemon=True).start()
    client = MetadataClient(connect_timeout=0.3, total_timeout=1.0)
    r = _try(client, f"http://[::1]:{port}/x")
    print("v6", r)
    assert r[0] == "ok", r
    r = _try(client, emu.gce_base_url("a").replace("http://", "https://") + "instance/preempted")
    print("https->plain", r)
    assert not r[0].startswith("UNTYPED") and r[2] < 1.5, r
    v6.close()


def test_concurrent_requests_while_the_lookup_fails_then_recovers(emu, monkeypatch):
    def answer(n, port, real):
        time.sleep(0.2)
        if n <= 2:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real("127.0.0.1", port, type=socket.SOCK_STREAM)
    calls = _fake_dns(monkeypatch, answer)
    client = MetadataClient(connect_timeout=0.3, total_timeout=0.6)
    out = {}

    def worker(i):
        out[i] = [_try(client, _url(emu)) for _ in range(5)]
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    print({i: [r[0] for r in v] for i, v in out.items()}, "lookups", len(calls))
    for v in out.values():
        assert all(not r[0].startswith("UNTYPED") and r[2] < 1.0 for r in v), v
        assert v[-1][0] == "ok", v


def test_ipv6_first_that_refuses_then_ipv4(emu, monkeypatch):
    def answer(n, port, real):
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))  # nothing listens on ::1
        return [v6] + real("127.0.0.1", port, type=socket.SOCK_STREAM)
    _fake_dns(monkeypatch, answer)
    r = _try(MetadataClient(connect_timeout=0.3, total_timeout=1.0), _url(emu))
    print(r)
    assert r[0] == "ok", r


def test_real_over_long_label_is_typed_and_retried(monkeypatch):
    """A 64-character label: the real getaddrinfo raises UnicodeError (a ValueError) on the lookup thread."""
    url = "http://" + "m" * 64 + ".internal/computeMetadata/v1/instance/preempted"
    client = MetadataClient(connect_timeout=0.2, total_timeout=0.4)
    rs = [_try(client, url) for _ in range(2)]
    print(rs, [t.name for t in __import__("threading").enumerate() if "lookup" in t.name])
    assert rs[0][0] in ("WatcherConfigError", "MetadataServerError") and rs[0][2] < 0.1, rs
