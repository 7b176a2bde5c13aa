"""A TCP proxy on loopback that makes network trouble on demand.

Placed between a client and a service (an actor and the replay, an actor and
the learner's control socket), it forwards bytes both ways and, when told:

- ``delay_s``: holds every chunk that long before forwarding it (latency, and
  a throughput cap, since each direction forwards one chunk at a time);
- ``drop()``: aborts every open connection at once (both ends see a reset;
  bytes in flight are lost);
- ``with partition():``: nothing is forwarded inside the block while the
  connections stay open (peers see silence, not a reset); on leaving, they
  are aborted and whatever was held is lost (``held_chunks``: what clients
  wrote into it; a message a client counted as sent but had not yet written
  when the partition ended is not held, and reaches the service over the
  next connection).

It counts what it did (``connections``, ``aborted``, ``refused``: a client
whose service was down), so that a test can ask the system's own counters to
account for every drop. Its asyncio loop runs in a thread of the test process;
the methods are called from the test's thread.

Usage::

    proxy = FaultProxy(upstream_port)
    actor connects to proxy.address
    proxy.delay_s = 0.2
    proxy.drop()
    with proxy.partition():
        time.sleep(4.0)
    proxy.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

#: Bytes read per chunk: a segment of the tiny model fits in a few chunks.
CHUNK_BYTES = 64 * 1024
#: How long the proxy waits for its own loop to answer a control call.
CONTROL_TIMEOUT_S = 30.0


class FaultProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.delay_s = 0.0
        self.connections = 0
        """Client connections accepted (each reconnection counts)."""
        self.aborted = 0
        """Connections the proxy aborted (``drop`` and ``cut``)."""
        self.refused = 0
        """Clients closed at once because the service did not accept."""
        self.held_chunks: list[int] = []
        """Sizes of what clients wrote into the current (or last) partition,
        one per read: lost when it ends (a frame of some size is a message,
        small ones are heartbeats and ZMTP commands)."""
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._serve, host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self.address = f"tcp://{host}:{self.port}"
        self._flowing = self._call(self._event())

    @staticmethod
    async def _event() -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    def _call(self, coroutine):  # noqa: ANN001, ANN202  (any coroutine, its result)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(CONTROL_TIMEOUT_S)

    # ------------------------------------------------------------------ faults

    def drop(self) -> int:
        """Abort every open connection; returns how many."""
        return self._call(self._abort_all())

    @contextlib.contextmanager
    def partition(self) -> Iterator[None]:
        """Forward nothing inside the block, then abort the connections (the
        bytes held are lost)."""
        self.held_chunks = []
        self._call(self._set_flowing(False))
        try:
            yield
        finally:
            self._call(self._abort_all())
            self._call(self._set_flowing(True))

    async def _set_flowing(self, flowing: bool) -> None:
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _abort_all(self) -> int:
        writers = list(self._open)
        for writer in writers:
            writer.transport.abort()
        self._open.difference_update(writers)
        self.aborted += len(writers) // 2  # two writers (both ends) per connection
        return len(writers) // 2

    def close(self) -> None:
        self._call(self._abort_all())
        self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CONTROL_TIMEOUT_S)

    # ------------------------------------------------------------------ forwarding

    async def _serve(self, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            service_reader, service_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self.refused += 1
            client_writer.transport.abort()
            return
        pair = {client_writer, service_writer}
        self._open.update(pair)
        await asyncio.gather(self._pump(client_reader, service_writer, upstream=True),
                             self._pump(service_reader, client_writer))
        for writer in pair:
            writer.transport.abort()
        self._open.difference_update(pair)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    upstream: bool = False) -> None:
        """Forward one direction until either end closes."""
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if not self._flowing.is_set():
                    # read, so that what the client wrote is seen, and dropped:
                    # the partition ends by aborting this connection anyway
                    if upstream:
                        self.held_chunks.append(len(chunk))
                    continue
                if writer.transport.is_closing():
                    return
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()  # the other direction ends too
