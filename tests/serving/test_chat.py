"""`tandem chat` against a server that stops answering: one clear line after --timeout, exit 1
(not a wait of minutes nor a traceback)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.cluster import static_server


def test_a_server_that_sends_nothing_ends_the_chat_after_the_timeout(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("{}")
    with static_server(tmp_path, "/health") as (url, server):
        server.send_signal(signal.SIGSTOP)  # it accepts connections (the kernel does), no more
        started = time.monotonic()
        chat = subprocess.run([sys.executable, "-m", "tandem.services.cli", "chat", "Hello?",
                               "--url", url, "--timeout", "1"], capture_output=True, text=True,
                              timeout=60)
        assert time.monotonic() - started < 30
    assert (chat.returncode, chat.stderr) == (
        1, f"tandem chat: {url} sent nothing for 1 s (--timeout)\n")
