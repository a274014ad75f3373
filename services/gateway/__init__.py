"""Serving front ends: OpenAI-compatible HTTP (SSE) and gRPC around a ``GenerationBackend``.

    backend = EngineBackend(AsyncEngine(LLMEngine(config)))       # or a disaggregated backend
    gateway = Gateway(backend, tokenizer, GatewayConfig())
    app = create_http_app(gateway)                                 # ASGI (uvicorn / Ray Serve)
    grpc_front = create_grpc_server(gateway, "0.0.0.0:50051")      # grpc.aio + health + reflection
    GatewayServer(gateway, http_port=8000, grpc_port=50051).start()  # both, in a thread

See docs/api.md.
"""

from tandem.services.gateway.backend import EngineBackend, GenerationBackend, MultiWorkerStats
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway, Generation
from tandem.services.gateway.errors import GatewayError
from tandem.services.gateway.grpc_service import (
    GenerateStream,
    GenerationServicer,
    GrpcFrontEnd,
    create_grpc_server,
    start_generation,
)
from tandem.services.gateway.http_app import create_http_app
from tandem.services.gateway.runner import GatewayServer, ServeAddresses

__all__ = [
    "EngineBackend",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "GatewayServer",
    "GenerateStream",
    "Generation",
    "GenerationBackend",
    "GenerationServicer",
    "GrpcFrontEnd",
    "MultiWorkerStats",
    "ServeAddresses",
    "create_grpc_server",
    "create_http_app",
    "start_generation",
]
