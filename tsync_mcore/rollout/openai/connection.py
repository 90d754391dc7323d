"""The OpenAI endpoint's connection handling: how many connections it serves at once, and
uvicorn's protocol with a deadline on each request's headers."""

from __future__ import annotations

import asyncio


def connection_cap() -> int:
    """Connections served at once: half the open-file limit, at most 4096."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(64, min(4096, (soft if soft > 0 else 1024) // 2))


def header_deadline_protocol(timeout_s: float):
    """uvicorn's h11 protocol with a deadline for each request's headers: uvicorn closes an
    idle keep-alive connection, but one that sends a partial request line or headers
    slowly (or nothing after connecting) would hold its descriptor for ever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # still no complete request line and headers

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers (uvicorn's keep-alive timer too)

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    return HeaderDeadline
