"""A deadline on request headers for uvicorn's HTTP protocol (slow-header clients, "slowloris").

uvicorn bounds the idle time between keep-alive requests but not the time a client may take to
send a request's headers: a client trickling one header byte at a time holds its connection
for ever. The protocol below closes such a connection with 408 once ``header_timeout_s`` has
passed since the connection opened or the previous response ended without a complete set of
request headers. Both of uvicorn's HTTP implementations (h11, httptools) set ``self.cycle`` when
a request's headers are complete, which is what is watched here.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger(__name__)

TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: 40\r\n\r\nrequest headers did not arrive in time.\n"
)


def header_deadline_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a ``header_timeout_s`` (seconds) deadline on request
    headers; pass it as ``uvicorn.Config(http=...)``."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")

    class HeaderDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport, *args, **kwargs) -> None:
            super().connection_made(transport, *args, **kwargs)
            self._headers_deadline: asyncio.TimerHandle | None = None
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                self._disarm_header_deadline()  # this request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()  # the next request's headers get the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._headers_deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_deadline(self) -> None:
            deadline = getattr(self, "_headers_deadline", None)
            if deadline is not None:
                deadline.cancel()
                self._headers_deadline = None

        def _headers_late(self) -> None:
            self._headers_deadline = None
            if self.transport.is_closing():
                return
            log.info("closed a connection whose request headers took over %g s",
                     header_timeout_s)
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    return HeaderDeadlineProtocol
