"""Client-facing errors: one type, rendered as OpenAI error JSON or as a gRPC status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.services.protocol.outputs import (
    DeadlineExceededError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    RequestError,
    UnavailableError,
)


@dataclass
class GatewayError(Exception):
    status: int  # the HTTP status; gRPC maps it (see grpc_service.py)
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None
                ) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> GatewayError:
    return GatewayError(400, f"{what} is not supported", param=param, code="unsupported")


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist.", param="model",
                        code="model_not_found")


def unauthorized() -> GatewayError:
    return GatewayError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                        type="authentication_error", code="invalid_api_key")


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"The request body is larger than the limit of {limit} bytes.",
                        code="request_too_large")


def overloaded(message: str, retry_after_s: int) -> GatewayError:
    return GatewayError(429, f"The server is overloaded: {message}", type="server_overloaded",
                        code="engine_overloaded", retry_after_s=retry_after_s)


def unavailable(message: str, retry_after_s: int) -> GatewayError:
    return GatewayError(503, f"The service is unavailable: {message}", type="server_error",
                        code="unavailable", retry_after_s=retry_after_s)


def timed_out(message: str) -> GatewayError:
    return GatewayError(504, f"The request timed out: {message}", type="timeout_error",
                        code="timeout")


def engine_failed(message: str) -> GatewayError:
    return GatewayError(500, message, type="server_error", code="engine_error")


def from_backend(exc: BaseException, retry_after_s: int) -> GatewayError | None:
    """The client-facing form of a backend exception, or None for an unexpected failure (a
    bug: the caller logs it). The backend's own faults were logged where they happened."""
    if isinstance(exc, EngineOverloadedError):
        return overloaded(str(exc), retry_after_s)
    if isinstance(exc, RequestError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError | UnavailableError):  # another worker, or a replacement
        return unavailable(str(exc), retry_after_s)
    if isinstance(exc, EngineError):
        return engine_failed(str(exc))
    if isinstance(exc, DeadlineExceededError):
        return timed_out(str(exc))
    return None
