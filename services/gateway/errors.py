"""Client-facing errors: one type, rendered as OpenAI error JSON or as a gRPC status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.outputs import EngineOverloadedError, RequestError


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


def from_backend(exc: Exception, retry_after_s: int) -> GatewayError | None:
    """The client-facing form of a backend exception, or None for an internal failure."""
    if isinstance(exc, EngineOverloadedError):
        return overloaded(str(exc), retry_after_s)
    if isinstance(exc, RequestError):
        return bad_request(str(exc))
    return None
