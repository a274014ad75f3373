"""`tandem up` stops on SIGINT/SIGTERM however the signals come: its stop flag takes no lock in
the signal handler (``threading.Event.set`` there deadlocked when a second signal arrived while
the first one's ``set`` held the Event's lock: Ctrl-C sent to the process group and forwarded by
a supervisor too left `tandem up` hung)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from tandem.services.serving.up import Stop

# The main thread waits as `tandem up` does (short waits in a loop) until a signal stops it.
WAITER = """
from tandem.services.serving.up import Stop, _on_signals
stop = Stop()
_on_signals(stop)
print("ready", flush=True)
while not stop.wait(0.00001):
    pass
"""


def test_a_burst_of_signals_stops_the_waiting_main_thread() -> None:
    for _ in range(10):
        process = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE,
                                   text=True)
        try:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
            for _ in range(50):
                os.kill(process.pid, signal.SIGINT)
            # Stopped, not hung: it exits cleanly, or, when the burst outlasts it, by a signal
            # that arrived after Python restored the default handlers on its way out.
            assert process.wait(10) in (0, -signal.SIGINT)
        finally:
            process.kill()
            process.wait()


def test_stop_waits_until_set_or_the_timeout() -> None:
    stop = Stop()
    assert not stop.wait(0.01) and not stop.is_set()
    setter = threading.Timer(0.05, stop.set)
    setter.start()
    assert stop.wait(30)  # woken by the set from another thread
    assert stop.is_set() and stop.wait(0) and stop.wait()
    setter.join()
