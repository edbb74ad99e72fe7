"""A TCP proxy on loopback that breaks the link to a real server (moto's S3 server, Postgres) on
command, for tests of what a broken link does. Nothing of ours is mocked: the bytes that pass are
the real server's and the client's.

Faults: a byte budget, in either direction, after which every connection is cut mid-stream and
new ones refused (``arm``); a delay on every piece forwarded (``delay``); every open connection
reset with an RST (``reset``); and ``heal``, after which it forwards again.

Written by hand because what the tests need is small and no test library offers these on a loopback
proxy."""

from __future__ import annotations

import socket
import struct
import threading
import time


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (host, port)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._budget: int | None = None  # bytes left before the cut; None: unlimited
        self._requests_count = False  # whether the budget counts requests (to the target) too
        self._delay = 0.0
        self._cut = False
        self._socks: list[socket.socket] = []
        self.connections = 0  # accepted since the start
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, budget: int, requests: bool = False) -> None:
        """From now on let ``budget`` more bytes of responses (with ``requests``, of both directions)
        through, then cut every connection and refuse new ones."""
        with self._lock:
            self._budget, self._requests_count = budget, requests

    def delay(self, seconds: float) -> None:
        """Hold every piece forwarded, either way, for ``seconds`` (0: none)."""
        self._delay = seconds

    def reset(self) -> None:
        """Reset every open connection (an RST, as a crashed or restarted server's peer sees);
        new ones are still taken."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # wakes the pipe thread blocked in recv on it: until that returns, close() would
                # leave the connection open, and its peer waiting for bytes that never come
                s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            s.close()

    def cut(self) -> None:
        """Close every connection mid-stream and refuse new ones until ``heal``."""
        with self._lock:
            self._cut = True
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def heal(self) -> None:
        """Forward again, without budget or delay."""
        with self._lock:
            self._cut, self._budget, self._delay = False, None, 0.0

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                try:
                    upstream = socket.create_connection(self.target)
                except OSError:
                    client.close()
                    continue
                self._socks += [client, upstream]
                self.connections += 1
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        try:
            while data := src.recv(65536):
                if self._delay:
                    time.sleep(self._delay)
                counted = response or self._requests_count
                with self._lock:
                    if counted and self._budget is not None:
                        data = data[: max(self._budget, 0)]
                        self._budget -= len(data)
                    spent = counted and self._budget is not None and self._budget <= 0
                if data:
                    dst.sendall(data)
                if spent:
                    self.cut()
                    return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


CutProxy = FaultProxy  # the name the first tests of broken downloads use


def assert_whole(env: dict, fam: dict, versions: dict[str, str], tmp_path) -> None:
    """After a fault: every version of family "fam" (name -> member of ``fam``) pulls byte for byte
    through ``env``, and `check --read-data` finds every byte they need."""
    import filecmp

    from tests.cli_run import mfsreg, mfsreg_json

    for name, member in versions.items():
        out = tmp_path / f"whole-{name}.out"
        mfsreg("pull", "fam", name, "-o", out, env=env)
        assert filecmp.cmp(out, fam[member], shallow=False), name
        out.unlink()
    checked = mfsreg_json("check", "--read-data", env=env)
    assert checked["ok"], checked
