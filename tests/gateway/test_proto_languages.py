"""The gRPC API as other languages' developers meet it: `buf lint` passes on the proto module
(proto/buf.yaml, buf's STANDARD rules, with its written exceptions), and Java stubs generated
from it (Debian's protoc and protobuf-java, set up by .ci/setup-test) compile and talk to the
real server: a request built in Java is served, and Java reads the streamed replies back."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import engine_tokens

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
BUF = ROOT / ".ci" / "tools" / "node_modules" / ".bin" / "buf"
PROTOBUF_JAR = Path("/usr/share/java/protobuf.jar")
PROMPT, MAX_TOKENS = "The capital of France is", 6

CLIENT = """
import ai.tandem.v1.*;

public class Client {
    public static void main(String[] args) throws Exception {
        if (args[0].equals("request")) {
            GenerateRequest.newBuilder()
                .setPrompt(args[1])
                .setSampling(SamplingOptions.newBuilder().setMaxTokens(Integer.parseInt(args[2]))
                    .setTemperature(0f).setIgnoreEos(true))
                .build().writeTo(System.out);
            System.out.flush();
            return;
        }
        StringBuilder text = new StringBuilder();
        FinishReason finish = FinishReason.FINISH_REASON_UNSPECIFIED;
        int tokens = 0;
        GenerateResponse reply;
        while ((reply = GenerateResponse.parseDelimitedFrom(System.in)) != null) {
            text.append(reply.getText());
            tokens += reply.getTokenIdsCount();
            if (reply.getFinishReason() != FinishReason.FINISH_REASON_UNSPECIFIED) {
                finish = reply.getFinishReason();
            }
        }
        System.out.print(finish + "\\t" + tokens + "\\t" + text);
    }
}
"""


def _tool(path: Path | str, setup: str) -> str:
    found = shutil.which(str(path)) if isinstance(path, str) else (
        str(path) if path.exists() else None)
    if found is None:
        pytest.fail(f"{path} is missing: run bash .ci/setup-test ({setup})")
    return found


def _run(*argv: str, stdin: bytes | None = None, cwd: Path | None = None) -> bytes:
    done = subprocess.run(argv, input=stdin, capture_output=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout


def test_buf_lint_passes_and_would_catch_a_violation(tmp_path: Path) -> None:
    buf = _tool(BUF, "npm's @bufbuild/buf")
    _run(buf, "lint", cwd=PROTO)
    # The same module with one exception comment taken out fails on that rule.
    copy = tmp_path / "proto"
    shutil.copytree(PROTO, copy)
    proto = copy / "tandem" / "v1" / "generation.proto"
    proto.write_text(proto.read_text().replace("// buf:lint:ignore SERVICE_SUFFIX\n", ""))
    failed = subprocess.run([buf, "lint"], cwd=copy, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0
    assert 'Service name "Generation" should be suffixed with "Service"' in failed.stdout


def _delimited(message: bytes) -> bytes:
    """``message`` after its length as a varint (protobuf's delimited form)."""
    length, prefix = len(message), bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        prefix.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(prefix) + message


def test_java_stubs_compile_and_talk_to_the_server(tmp_path: Path, server: ServeAddresses,
                                                   gateway: Gateway,
                                                   async_engine: AsyncEngine) -> None:
    protoc, javac, java = (_tool(name, "protobuf-compiler, default-jdk-headless")
                           for name in ("protoc", "javac", "java"))
    _tool(PROTOBUF_JAR, "libprotobuf-java")
    sources, classes = tmp_path / "src", tmp_path / "classes"
    sources.mkdir()
    _run(protoc, f"--proto_path={PROTO}", f"--java_out={sources}",
         str(PROTO / "tandem" / "v1" / "generation.proto"))
    (sources / "Client.java").write_text(CLIENT)
    _run(javac, "-nowarn", "-d", str(classes), "-cp", str(PROTOBUF_JAR),
         *map(str, sorted(sources.rglob("*.java"))))
    classpath = f"{classes}:{PROTOBUF_JAR}"

    request = _run(java, "-cp", classpath, "Client", "request", PROMPT, str(MAX_TOKENS))
    assert pb.GenerateRequest.FromString(request).prompt == PROMPT  # Java's bytes, read here
    with grpc.insecure_channel(f"{server.host}:{server.grpc_port}") as channel:
        generate = channel.unary_stream("/tandem.v1.Generation/Generate")  # bytes both ways
        replies = list(generate(request, timeout=120))
    read_back = _run(java, "-cp", classpath, "Client", "read",
                     stdin=b"".join(_delimited(reply) for reply in replies)).decode()
    expected = engine_tokens(async_engine, gateway.tokenizer.encode(PROMPT), MAX_TOKENS,
                             ignore_eos=True)
    assert read_back == (f"FINISH_REASON_LENGTH\t{MAX_TOKENS}\t"
                         f"{gateway.tokenizer.decode(expected)}")
