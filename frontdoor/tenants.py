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

from batchstring.frontdoor.auth import ApiKeys

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


HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe's binary extension: JSON header, then tensors


def salt_http_body(path: str, headers: dict[str, str], body: bytes, tenant: str) -> tuple[bytes, dict[str, str]]:
    """A v2 inference body (generate, generate_stream or infer) carrying its tenant's prefix-cache
    salt, as the gRPC and /v1 routes do; a body Triton could not read either passes unchanged."""
    length = int(headers.get(HEADER_LENGTH, len(body)))
    try:
        head = json.loads(body[:length])
        generate = path.endswith(("/generate", "/generate_stream"))
        target = head if generate else head.setdefault("parameters", {})
        target["cache_salt"] = cache_salt(tenant, target.get("cache_salt"))
    except (ValueError, TypeError, AttributeError):
        return body, headers
    salted = json.dumps(head).encode()
    if HEADER_LENGTH in headers:
        headers = {**headers, HEADER_LENGTH: str(len(salted))}
    return salted + body[length:], headers
