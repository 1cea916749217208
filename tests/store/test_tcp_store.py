"""The TCP store: every call, timeouts, the job token, malformed input, server death."""

import socket
import struct
import threading
import time

import pytest

import meshcoll
from conftest import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    s = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token="secret")
    yield s
    del s


def client(server, token="secret", timeout=10):
    return meshcoll.TCPStore("127.0.0.1", server.port, timeout=timeout, token=token)


def test_set_get_add_delete(server):
    c = client(server)
    c.set("a", b"\x00\x01binary")
    assert server.get("a") == b"\x00\x01binary"
    c.set("s", "text")
    assert c.get("s") == b"text"
    assert c.add("n", 5) == 5
    assert server.add("n", -2) == 3
    assert c.num_keys() == 3
    assert c.delete_key("a") is True
    assert c.delete_key("a") is False
    assert c.num_keys() == 2
    assert c.check(["s", "n"]) and not c.check(["s", "missing"])


def test_add_on_a_non_number_is_a_clear_error_and_keeps_the_connection(server):
    c = client(server)
    for value in (b"abc", b"12abc", b"99999999999999999999"):
        c.set("v", value)
        with pytest.raises(ValueError, match=r"add\(v\).*not a decimal int64"):
            c.add("v", 1)
        assert c.get("v") == value  # unchanged
    c.set("big", str(2**63 - 1))
    with pytest.raises(ValueError, match="overflows"):
        c.add("big", 1)
    assert c.add("n", 2) == 2  # the same connection still works


def test_compare_set(server):
    c = client(server)
    assert c.compare_set("k", b"", b"first") == b"first"      # absent + empty expected: set
    assert c.compare_set("k", b"wrong", b"x") == b"first"     # mismatch: unchanged
    assert c.compare_set("k", b"first", b"second") == b"second"


def test_get_waits_for_a_later_set(server):
    c = client(server)
    threading.Timer(0.3, lambda: server.set("late", b"v")).start()
    assert c.get("late", timeout=5) == b"v"
    c.wait(["late"], timeout=1)


def test_wait_times_out_naming_the_key(server):
    c = client(server)
    t0 = time.monotonic()
    with pytest.raises(meshcoll.TimeoutError, match="never"):
        c.wait(["never"], timeout=0.3)
    with pytest.raises(meshcoll.TimeoutError):
        c.get("never", timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_wrong_token_is_refused(server):
    with pytest.raises(meshcoll.PeerError, match="token"):
        client(server, token="not-the-secret")
    with pytest.raises(meshcoll.PeerError, match="token"):
        client(server, token="")
    client(server).set("still", b"works")


def test_prefix_store_namespaces(server):
    c = client(server)
    p = meshcoll.PrefixStore("group1", c)
    p.set("x", b"1")
    assert c.get("group1/x") == b"1"
    assert p.get("x") == b"1"


def test_server_survives_malformed_bytes(server):
    for payload in [b"garbage" * 100, struct.pack("<IHHI", 0x5453434D, 2, 6, 0) + b"secret" + b"\xff" * 64,
                    struct.pack("<IHHI", 0x5453434D, 2, 6, 0) + b"secret" + b"\x01" + struct.pack("<I", 2**31),
                    struct.pack("<IHHI", 0x5453434D, 99, 0, 0), b""]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(payload)
            time.sleep(0.05)
    c = client(server)
    c.set("ok", b"1")
    assert c.get("ok") == b"1"


def test_client_sees_server_death():
    srv = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=5)
    c = meshcoll.TCPStore("127.0.0.1", srv.port, timeout=5)
    c.set("a", b"1")
    del srv
    with pytest.raises((meshcoll.PeerError, meshcoll.TimeoutError)):
        c.get("a")
        c.set("b", b"2")


def test_port_in_use_is_a_clear_error(server):
    with pytest.raises(meshcoll.MeshcollError, match="in use|another process"):
        meshcoll.TCPStore("127.0.0.1", server.port, is_server=True, timeout=2)


def test_unreachable_master_times_out():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(meshcoll.TimeoutError, match="could not connect"):
        meshcoll.TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - t0 < 10


def test_a_client_meets_only_the_store_of_its_own_generation():
    # Note [Generations] in csrc/store/tcp_store.h: a process's n-th init talks only to a store
    # made by the host's n-th init.
    host = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=5, generation=1)
    try:
        with pytest.raises(meshcoll.PeerError, match="meshcoll.init number 1, the store's host "
                                                      "at number 2"):
            meshcoll.TCPStore("127.0.0.1", host.port, timeout=2, generation=0)
        t0 = time.monotonic()
        with pytest.raises((meshcoll.PeerError, meshcoll.TimeoutError)):
            meshcoll.TCPStore("127.0.0.1", host.port, timeout=1, generation=2)
        assert time.monotonic() - t0 >= 0.9  # it kept trying: the next store may come
        same = meshcoll.TCPStore("127.0.0.1", host.port, timeout=2, generation=1)
        same.set("k", b"v")
        assert host.get("k") == b"v"
        same.close()
    finally:
        host.close(timeout=1)


@pytest.mark.parametrize("answer", [b"HTTP/1.0 200 OK\r\n\r\nhello", b"\x00\xff\xff"])
def test_a_foreign_server_on_the_port_is_a_clear_error_at_once(answer):
    # Another program holds the master port (a web server, a stale job of another tool):
    # its answer to our hello is no store reply, and the client says so at once instead of
    # waiting its whole timeout for bytes that will never come.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)

    def serve():
        conn, _ = lsock.accept()
        conn.sendall(answer)
        time.sleep(30)  # keeps the connection open, as a live program would
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(meshcoll.PeerError, match=r"not a meshcoll store.*another program"):
        meshcoll.TCPStore("127.0.0.1", lsock.getsockname()[1], timeout=20)
    assert time.monotonic() - t0 < 5
    lsock.close()
