"""Who may call the daemon over TCP: with a web config's ``basic_auth_users``, every path needs
a user's credentials, except that job routes also accept the daemon's bearer token.

Uncached bcrypt checks run off the event loop, at most ``max_pending`` at once (beyond, 503):
a flood of wrong passwords costs a bounded amount of CPU and never stalls other requests.
"""

from __future__ import annotations

import asyncio
import hmac

from ..export.webconfig import WebConfig
from .asgi import Response, header, json_error


class RequestAuth:
    def __init__(self, web: WebConfig | None, token: bytes, max_pending: int) -> None:
        self.auth = web.auth if web is not None else None
        self.token = token
        self.max_pending = max_pending
        self._pending = 0

    async def refusal(self, path: str, headers: list[tuple[bytes, bytes]]) -> Response | None:
        """The response that refuses this request (401, or 503 when too many checks are
        pending), or None when it may go on."""
        if self.auth is None:
            return None
        value = header(headers, b"authorization")
        if path.startswith("/api/v1/jobs") and value is not None:
            scheme, _, cred = value.decode("latin-1").strip().partition(" ")
            given = cred.strip().encode()
            if scheme.lower() == "bearer" and hmac.compare_digest(given, self.token):
                return None
        parsed = self.auth.parse_header(value.decode("latin-1") if value is not None else None)
        if parsed is not None:
            if self.auth.cached(*parsed):
                return None
            if self._pending >= self.max_pending:
                return json_error(503, "too many authentication checks pending", retry=True)
            self._pending += 1
            try:
                ok = await asyncio.get_running_loop().run_in_executor(
                    None, self.auth.check, *parsed
                )
            finally:
                self._pending -= 1
            if ok:
                return None
        status, hdrs, body = json_error(401, "basic authentication required")
        hdrs.append((b"www-authenticate", b'Basic realm="ddpmon daemon"'))
        return status, hdrs, body
