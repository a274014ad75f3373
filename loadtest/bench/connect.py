"""The client for a target's protocol (gRPC's stubs imported only when asked for)."""

from __future__ import annotations

from tandem.loadtest.bench.clients import Client, ClientOptions, Target
from tandem.loadtest.bench.http_client import HttpClient


def make_client(target: Target, options: ClientOptions) -> Client:
    if target.protocol == "grpc":
        from tandem.loadtest.bench.grpc_client import GrpcClient

        return GrpcClient(target, options)
    return HttpClient(target, options)
