"""Bearer-token auth for `tenax serve --token-file`: a server interceptor and its token file.

Why an interceptor: one check in front of every method (including reflection and any method
added later) instead of one per handler. Health checks (`grpc.health.v1.Health`) are exempt on
purpose: load balancers and Kubernetes gRPC probes cannot send metadata, and health reveals
nothing but SERVING/NOT_SERVING. Tokens are compared with `hmac.compare_digest` against every
configured token (no early exit), so timing does not reveal how much of a guess was right.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any, Callable

import grpc

from tenax.orchestrator.service.limits import ANONYMOUS, Identity

logger = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED_DETAILS = "missing or invalid token: send metadata 'authorization: Bearer <token>'"


def read_identities(path: str) -> dict[str, Identity]:
    """token -> Identity from a token file: lines `token [name [max_priority]]`.

    A bare token (the older one-per-line form; several allow rotation) is named after its
    line, `token-<line>`, and may use any priority. Blank lines are ignored."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--token-file {path}: {getattr(err, 'strerror', None) or err}") from None
    out: dict[str, Identity] = {}
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words:
            continue
        where = f"--token-file {path} line {number}"
        if len(words) > 3:
            raise ValueError(f"{where}: expected 'token [name [max_priority]]', "
                             f"got {len(words)} words")
        if words[0] in out:
            raise ValueError(f"{where}: this token is already on an earlier line")
        top = words[2] if len(words) == 3 else None
        if top is not None and not top.lstrip("-").isdigit():
            raise ValueError(f"{where}: max_priority {top[:20]!r} is not a whole number")
        out[words[0]] = Identity(words[1] if len(words) > 1 else f"token-{number}",
                                 None if top is None else int(top))
    if not out:
        raise ValueError(f"--token-file {path}: no token in the file")
    return out


def read_tokens(path: str) -> list[str]:
    """The tokens of a token file (see `read_identities`), in file order."""
    return list(read_identities(path))


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


class TokenAuth(grpc.ServerInterceptor):
    """`authorization: Bearer <token>` on every call but health checks; else UNAUTHENTICATED.

    `tokens`: a list (each its own identity, named after its place) or token -> Identity."""

    def __init__(self, tokens: list[str] | dict[str, Identity]) -> None:
        if not tokens:
            raise ValueError("TokenAuth needs at least one token")
        if not isinstance(tokens, dict):
            tokens = {t: Identity(f"token-{i}") for i, t in enumerate(tokens, 1)}
        self._tokens = [(t.encode(), who) for t, who in tokens.items()]

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES) or \
                self.allowed(details.invocation_metadata):
            return handler
        logger.info("refused %s: no valid bearer token", details.method)
        return _refusing(handler)

    def allowed(self, metadata: Any) -> bool:
        return self.identify(metadata) is not None

    def identify(self, metadata: Any) -> Identity | None:
        """The identity of the call's bearer token; None when it has no valid one."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(values) != 1 or not isinstance(values[0], str):
            return None
        scheme, _, token = values[0].strip().partition(" ")
        given = token.strip().encode()
        found = None
        for expected, who in self._tokens:  # no early exit: constant time over the tokens
            if hmac.compare_digest(given, expected):
                found = who
        return found if scheme.lower() == "bearer" else None


def caller_of(auth: TokenAuth | None, metadata: Any) -> Identity:
    """Who made a call that passed the interceptor (ANONYMOUS on a server without tokens)."""
    if auth is None:
        return ANONYMOUS
    return auth.identify(metadata) or ANONYMOUS


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

    kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler,
             "unary_stream": grpc.unary_stream_rpc_method_handler,
             "stream_unary": grpc.stream_unary_rpc_method_handler,
             "stream_stream": grpc.stream_stream_rpc_method_handler}
    for attr, make in kinds.items():
        if getattr(handler, attr) is not None:
            return make(refuse, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    raise ValueError(f"unknown gRPC handler kind: {handler!r}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, has_tokens: bool, insecure: bool) -> None:
    """Refuse to serve an open API beyond this machine unless the operator said so.

    Why: without tokens, anyone who can reach the port can submit, scale and cancel jobs that
    run with the server's credentials and storage access; on loopback only local users can."""
    if is_loopback(host) or has_tokens:
        return
    if not insecure:
        raise ValueError(f"--host {host} is reachable from other machines and no "
                         f"--token-file was given: refusing to serve without authentication "
                         f"(add --token-file FILE, or --insecure to accept the risk)")
    logger.warning("serving on %s WITHOUT authentication (--insecure): anyone who can reach "
                   "it can submit and cancel jobs", host)
