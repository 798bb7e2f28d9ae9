"""The basic-auth gate both servers put in front of every request when the web config names
``basic_auth_users``.

Credentials that verified before are answered from ``BasicAuth``'s cache at once; the others
need a bcrypt check (tens of ms), which each server runs off its event loop, at most
``max_pending`` at once: beyond, 503. A flood of wrong passwords thus costs a bounded amount of
CPU and never stalls other clients. The gate decides; the server only parks the request and
runs ``check`` where its loop allows (a worker thread for the endpoint, the executor for the
daemon).
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

from .config import BasicAuth

__all__ = ["AuthGate", "Verdict", "bearer_matches", "challenge"]


class Verdict(enum.Enum):
    PASS = "pass"
    """No auth configured, or credentials verified before: serve the request."""
    REFUSE = "refuse"
    """No or malformed credentials: 401."""
    BUSY = "busy"
    """Too many checks pending: 503."""
    CHECK = "check"
    """Run ``AuthGate.check`` off the loop (the gate counts it pending until ``done``)."""


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    user: bytes = b""
    password: bytes = b""


class AuthGate:
    """Who may pass, given a request's ``Authorization`` value; ``auth`` None lets all pass."""

    def __init__(self, auth: BasicAuth | None, max_pending: int) -> None:
        self.auth = auth
        self.max_pending = max_pending
        self.pending = 0

    def decide(self, authorization: str | None) -> Decision:
        """What to do with a request carrying ``authorization`` (None when absent). A CHECK
        is counted pending from here until ``done``."""
        if self.auth is None:
            return Decision(Verdict.PASS)
        creds = BasicAuth.parse_header(authorization)
        if creds is None:
            return Decision(Verdict.REFUSE)
        if self.auth.cached(*creds):
            return Decision(Verdict.PASS)
        if self.pending >= self.max_pending:
            return Decision(Verdict.BUSY)
        self.pending += 1
        return Decision(Verdict.CHECK, *creds)

    def check(self, decision: Decision) -> bool:
        """The bcrypt check of a CHECK decision; thread-safe, slow, never raises."""
        assert self.auth is not None
        try:
            return self.auth.check(decision.user, decision.password)
        except Exception:  # pragma: no cover - defensive: a failed check refuses
            return False

    def done(self) -> None:
        """A CHECK has finished (on the thread that called ``decide``)."""
        self.pending -= 1


def challenge(realm: str) -> str:
    """The ``WWW-Authenticate`` value of a 401 (RFC 7617; credentials are read as UTF-8)."""
    return f'Basic realm="{realm}", charset="UTF-8"'


def bearer_matches(authorization: str | None, token: bytes) -> bool:
    """Does ``Authorization: Bearer <token>`` carry ``token`` (compared in constant time)?"""
    if authorization is None:
        return False
    scheme, _, cred = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode(), token)
