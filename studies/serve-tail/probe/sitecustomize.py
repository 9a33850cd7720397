"""The worker's operation times, for ``tail.py`` (a study's probe, never installed): with
``EVA0_PROBE_OUT`` set, Python runs this at start (``PYTHONPATH`` names this folder), wraps the
policy's serving and adaptation calls in a timer and writes every call's seconds to
``EVA0_PROBE_OUT/<pid>.json`` every 2 s."""

import json
import os
import threading
import time

if os.environ.get("EVA0_PROBE_OUT"):
    from eva0_edge.runtime import policy

    CALLS = ("step", "serve_step", "learn", "begin_pass", "_finish_pass")
    seconds: dict[str, list[float]] = {}

    def _timed(name: str) -> None:
        original = getattr(policy.Policy, name)

        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                seconds.setdefault(name, []).append(time.perf_counter() - start)

        setattr(policy.Policy, name, timed)

    for call in CALLS:
        _timed(call)

    def _write() -> None:
        path = os.path.join(os.environ["EVA0_PROBE_OUT"], f"{os.getpid()}.json")
        while True:
            time.sleep(2)
            with open(path + ".tmp", "w") as f:
                json.dump(seconds, f)
            os.replace(path + ".tmp", path)

    threading.Thread(target=_write, daemon=True).start()
