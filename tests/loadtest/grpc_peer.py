"""TEST PEER: a tiny real ``tandem.v1.Generation`` gRPC server for the bench's gRPC client.

Like the HTTP peer, it counts prompt tokens with the bench's tokenizer, streams ``max_tokens``
token ids in messages of one or two, puts usage on the last message and logs what it sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import grpc

from tandem.loadtest.bench.grpc_client import load_stubs
from tandem.services.engine.tokenizer import Tokenizer
from tests.loadtest.peer import PeerLog, _chunk_sizes


@contextmanager
def serve_grpc_peer(tokenizer: Tokenizer) -> Iterator[tuple[str, PeerLog]]:
    pb, pb_grpc = load_stubs()
    log = PeerLog()

    class Servicer(pb_grpc.GenerationServicer):  # type: ignore[misc,name-defined]
        def Generate(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
            log.requests += 1
            if request.WhichOneof("input") == "chat":
                messages = [{"role": m.role, "content": m.content}
                            for m in request.chat.messages]
                prompt_tokens = len(tokenizer.encode_chat(messages))
            else:
                prompt_tokens = len(tokenizer.encode(request.prompt))
            n = request.sampling.max_tokens
            sizes = _chunk_sizes(n)
            for k, size in enumerate(sizes):
                response = pb.GenerateResponse(request_id="peer", token_ids=[7] * size,
                                               text=" tok" * size)
                if k == len(sizes) - 1:
                    response.finish_reason = pb.FINISH_REASON_LENGTH
                    response.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens,
                                                     completion_tokens=n))
                    log.usages.append({"prompt_tokens": prompt_tokens, "completion_tokens": n})
                yield response

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"grpc://127.0.0.1:{port}", log
    finally:
        server.stop(grace=None).wait(10)
