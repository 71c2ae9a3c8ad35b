"""Who is calling, as far as ownership and the prefix cache are concerned.

With API keys on, each key is a tenant: the files and batches it creates are its own, and its
prompts' cached KV blocks are keyed by a salt derived from it, so that no other key can reuse or
time them. Neither the key nor anything a caller could use as a key is stored: a tenant is known
by a digest of its key.
"""

from __future__ import annotations

import hashlib
import json

from aiohttp import web

from batchstring.frontdoor.gateway.auth import ApiKeys

SHARED = ""  # the one tenant when API keys are off


def owner(request: web.Request, keys: ApiKeys) -> str:
    """The tenant of an authorised HTTP request (the auth middleware has checked its key)."""
    return tenant(request.headers.get("Authorization"), keys)


def tenant(authorization: str | None, keys: ApiKeys) -> str:
    """The tenant of an authorised `Authorization: Bearer <key>` (HTTP header or gRPC metadata)."""
    if not keys.enabled:
        return SHARED
    token = (authorization or "").partition(" ")[2].strip()
    return hashlib.blake2b(token.encode(), digest_size=16, person=b"bs-owner").hexdigest()


def cache_salt(tenant: str, requested: object = None) -> str | None:
    """The prefix-cache salt of a request: its tenant's, mixed with the request's own `cache_salt`
    (as vLLM offers, for callers that want even their own requests kept apart). None when there is
    neither, so that the unsalted cache stays shared, as without keys it is meant to be."""
    if requested is not None and not isinstance(requested, str):
        raise ValueError(f"cache_salt must be a string; got {type(requested).__name__}")
    if tenant == SHARED and not requested:
        return None
    mixed = f"{tenant}\0{requested or ''}".encode()
    return hashlib.blake2b(mixed, digest_size=16, person=b"bs-cache").hexdigest()


def salt_generate_body(body: bytes, tenant: str) -> bytes:
    """A v2 generate body carrying its tenant's prefix-cache salt, as the gRPC and /v1 routes do
    (Triton makes its top-level keys request parameters). Raises ValueError, with what to send,
    for a body that cannot carry it: forwarded unsalted, it would share another tenant's cache.
    (The v2 infer route needs no salt: Triton's HTTP infer refuses this decoupled model.)"""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the request body is not valid JSON; send a JSON object") from None
    if not isinstance(request, dict):
        raise ValueError("the request body must be a JSON object")
    request["cache_salt"] = cache_salt(tenant, request.get("cache_salt"))
    return json.dumps(request).encode()
