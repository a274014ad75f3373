"""Generated protobuf and gRPC stubs for proto/tandem/v1 (see services/gateway/protogen.py)."""
