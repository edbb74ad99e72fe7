"""A TCP proxy on loopback that can break the connection to a real server, for tests of what a
broken link does (an S3 endpoint that dies mid-response). Nothing of ours is mocked: the bytes
that pass are the real server's.

Written by hand because what the tests need is small (forward bytes, then stop at a budget) and no
test library offers a byte budget on a loopback proxy."""

from __future__ import annotations

import socket
import threading


class CutProxy:
    """Forwards 127.0.0.1:<port> to ``target`` (host, port) until ``budget`` bytes of responses
    have passed after ``arm()``; then it closes every connection mid-stream and refuses new ones."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._budget: int | None = None  # None: unlimited
        self._cut = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, budget: int) -> None:
        """From now on let ``budget`` more response bytes through, then cut."""
        with self._lock:
            self._budget = budget

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
                upstream = socket.create_connection(self.target)
                self._socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        try:
            while data := src.recv(65536):
                if response:
                    with self._lock:
                        if self._budget is not None:
                            data = data[: max(self._budget, 0)]
                            self._budget -= len(data)
                    if data:
                        dst.sendall(data)
                    if self._budget is not None and self._budget <= 0:
                        self.cut()
                        return
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.cut()
        self._listener.close()
