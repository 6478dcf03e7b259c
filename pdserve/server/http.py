"""uvicorn's HTTP/1.1 protocol (h11) with a header-read timeout.

uvicorn closes an idle keep-alive connection, but not one that never finishes its request
headers: a slow client (or a slow-loris attack: a byte every few seconds) holds its connection
forever. :func:`timed_h11` gives connections ``header_timeout`` seconds from their opening (and
from each response, for the next request on a kept-alive connection) to complete the request
line and headers; then the server closes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


class _TimedH11Protocol(H11Protocol):
    header_timeout = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_headers():  # a request's headers arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._waiting_for_headers():
            self._arm()  # the next request on this connection has as long

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def timed_h11(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``."""
    if not header_timeout > 0:
        raise ValueError(f"header timeout must be > 0, got {header_timeout}")
    return type("TimedH11Protocol", (_TimedH11Protocol,), {"header_timeout": header_timeout})
