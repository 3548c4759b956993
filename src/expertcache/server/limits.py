"""Limits on what one request may ask of the server: the size of its body, read as it arrives so
that a body over the limit is refused (413) without being held in memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .protocol import ApiError

if TYPE_CHECKING:  # the CLI reads MAX_BODY_BYTES without the server extra installed
    from fastapi import Request

MAX_BODY_BYTES = 8 * 2**20  # the default of --max-body-bytes


def too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
                    status=413, code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 as soon as its declared length or the bytes received pass `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(limit)
    from starlette.requests import ClientDisconnect  # here: the CLI imports this module without starlette

    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # The client left before its body was whole: its mistake, not a server error (unhandled,
        # it would be logged as a traceback). Nobody reads the answer; 499 as nginx's.
        raise ApiError("the client disconnected before sending the whole request body", status=499,
                       code="client_disconnected") from None
    return b"".join(chunks)
