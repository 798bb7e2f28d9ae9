"""Who may call the daemon over TCP: with a web config's ``basic_auth_users``, every path needs
a user's credentials (the shared gate, ``ddpmon.web.auth``), except that job routes also accept
the daemon's bearer token.

Uncached bcrypt checks run in the event loop's executor, so they never stall other requests;
the gate bounds how many are pending (beyond, 503).
"""

from __future__ import annotations

import asyncio

from ..web.auth import AuthGate, Verdict, bearer_matches, challenge
from ..web.config import WebConfig
from .asgi import Response, json_error


class RequestAuth:
    def __init__(self, web: WebConfig | None, token: bytes, max_pending: int) -> None:
        self.gate = AuthGate(web.auth if web is not None else None, max_pending)
        self.token = token

    async def refusal(self, path: str, text: str | None) -> Response | None:
        """The response that refuses a request for ``path`` with ``Authorization: text`` (None
        when absent): 401, or 503 when too many checks are pending; None when it may go on."""
        if self.gate.auth is None:
            return None
        if path.startswith("/api/v1/jobs") and bearer_matches(text, self.token):
            return None
        decision = self.gate.decide(text)
        if decision.verdict is Verdict.PASS:
            return None
        if decision.verdict is Verdict.BUSY:
            return json_error(503, "too many authentication checks pending", retry=True)
        if decision.verdict is Verdict.CHECK:
            try:
                ok = await asyncio.get_running_loop().run_in_executor(
                    None, self.gate.check, decision
                )
            finally:
                self.gate.done()
            if ok:
                return None
        status, hdrs, body = json_error(401, "basic authentication required")
        hdrs.append((b"www-authenticate", challenge("ddpmon daemon").encode()))
        return status, hdrs, body
