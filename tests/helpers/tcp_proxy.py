"""A real TCP (layer 4) proxy on 127.0.0.1 for tests: each accepted connection goes to the next upstream in turn
and stays there for its whole life, as a Kubernetes Service (kube-proxy) balances: a client that keeps its HTTP
connection alive (keep-alive) talks to one pod only. `paused` makes it refuse new connections (a pod unreachable
for a while) without stopping the upstream.
"""

from __future__ import annotations

import asyncio
import itertools
import threading


class TcpRoundRobin:
    """Round-robin per connection over `upstreams` ((host, port) pairs), in a thread with its own event loop.

    Attributes:
        url: http://127.0.0.1:PORT of the proxy.
        connections: connections accepted (and forwarded) so far.
        paused: while True, new connections are closed at once and existing ones are cut.
    """

    def __init__(self, upstreams: list[tuple[str, int]]) -> None:
        self._turn = itertools.cycle(upstreams)
        self.connections = 0
        self.paused = False
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the TCP proxy did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.paused:
            writer.close()
            return
        host, port = next(self._turn)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._open.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    if self.paused:
                        break
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._open.difference_update((writer, up_writer))

    def pause(self, paused: bool = True) -> None:
        """Refuse (True) or accept again (False) connections; pausing also cuts the open ones."""
        self.paused = paused
        if paused:
            for w in list(self._open):
                self._loop.call_soon_threadsafe(w.close)

    def close(self) -> None:
        """Stop listening and end the loop's thread."""
        async def stop() -> None:
            self._server.close()
            for w in list(self._open):
                w.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
