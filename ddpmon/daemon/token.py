"""The bearer token that authorises job mutations: generated once, kept in a 0600 file."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


class TokenFileError(RuntimeError):
    """The token file is unusable (readable by others, empty)."""


def load_or_create(path: str | Path) -> str:
    """Read the token at ``path``; create it (mode 0600, exclusive create) when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise TokenFileError(
                f"{path} is accessible by other users (mode {mode:o}); run: chmod 600 {path}"
            ) from None
        token = path.read_text().strip()
        if not token:
            raise TokenFileError(f"{path} is empty; delete it to generate a new token") from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def read(path: str | Path) -> str:
    return Path(path).read_text().strip()
