"""API keys: optional, and when set, required on every port's inference routes.

Keys come from the environment (`BATCHSTRING_API_KEYS`, comma-separated) or a file (one per line),
never from the command line, where any local user could read them. Health routes stay open, so
that probes need no secret.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

ENV = "BATCHSTRING_API_KEYS"


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def load(cls, path: Path | None = None) -> ApiKeys:
        keys = [k.strip() for k in os.environ.get(ENV, "").split(",")]
        if path is not None:
            keys += [line.strip() for line in path.read_text().splitlines()]
        return cls([k for k in keys if k and not k.startswith("#")])

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """True when keys are off, or `authorization` is `Bearer <one of the keys>`."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode()
        return any(hmac.compare_digest(given, key) for key in self._keys)  # constant time

    REFUSAL = ("this server requires an API key: send the header `Authorization: Bearer <key>` "
               f"(keys are set by the operator in {ENV} or a key file)")
