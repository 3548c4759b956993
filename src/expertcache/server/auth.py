"""Who may use the server: an optional API key, sent as `Authorization: Bearer KEY`.

`require_api_key` is a FastAPI dependency for every route that serves data (the /v1 API and any
data endpoint added later): `Depends(require_api_key)` on a route or on a router. It reads the key
from `app.state.api_key` (None: the server is open), compares in constant time, and answers 401 with
OpenAI's error shape otherwise. Routes that reveal nothing (/health, a static page that then asks
the user for the key) do not depend on it."""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import Request

from ..errors import ExpertCacheError
from .protocol import ApiError


def bearer_token(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme is case-insensitive), else None."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def key_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison (in the length of `expected`) of a presented token with the key."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


async def require_api_key(request: Request) -> None:
    """Pass when the app has no key, or the request's bearer token is the key; else raise 401."""
    expected = getattr(request.app.state, "api_key", None)
    if expected is None:
        return
    token = bearer_token(request)
    if token is None:
        raise ApiError("this server requires an API key: send 'Authorization: Bearer <key>'", status=401,
                       code="invalid_api_key")
    if not key_matches(token, expected):
        raise ApiError("invalid API key", status=401, code="invalid_api_key")


def read_api_key(key: str | None, key_file: str | None) -> str | None:
    """The key from `--api-key` or the first line of `--api-key-file` (not both); None when neither.
    A key must be non-empty printable ASCII without spaces, since it travels in an HTTP header."""
    if key is not None and key_file is not None:
        raise ExpertCacheError("give --api-key or --api-key-file, not both")
    source = "--api-key"
    if key_file is not None:
        source = f"--api-key-file {key_file}"
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except OSError as e:
            raise ExpertCacheError(f"cannot read --api-key-file {key_file!r}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ExpertCacheError(f"--api-key-file {key_file!r}: not valid UTF-8") from None
        lines = text.splitlines()
        key = lines[0].strip() if lines else ""
    if key is None:
        return None
    if not key or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ExpertCacheError(f"{source}: the key must be non-empty printable ASCII without spaces")
    return key
