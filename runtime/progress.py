"""Progress of long commands: tqdm's bar on a terminal; elsewhere (CI logs, ``nohup``, a pipe)
a plain line every :data:`PERIOD_S` seconds and one at the end, instead of silence or a log of
carriage returns."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

PERIOD_S = 30.0


class LineWriter:
    """A stream for tqdm off a terminal: each refresh of the bar becomes one line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(
    iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
    unit: str = "it", quiet: bool = False, leave: bool = True, stream: TextIO | None = None,
) -> tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand): off with ``quiet``; on a terminal
    the usual bar; otherwise one line per :data:`PERIOD_S` seconds on ``stream`` (stderr)."""
    stream = sys.stderr if stream is None else stream
    if quiet:
        return tqdm(iterable, total=total, disable=True)
    if stream.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=stream)
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=LineWriter(stream),
                mininterval=PERIOD_S, maxinterval=2 * PERIOD_S, ascii=True, ncols=100,
                dynamic_ncols=False)


@contextmanager
def heartbeat(desc: str, quiet: bool = False, stream: TextIO | None = None) -> Iterator[None]:
    """Show that one opaque call (an ONNX export) is running: its seconds so far, as a bar on a
    terminal or a line per :data:`PERIOD_S` seconds elsewhere."""
    bar = progress_bar(total=None, desc=desc, unit="s", quiet=quiet, stream=stream)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.update(1)

    thread = threading.Thread(target=tick, name="eva0-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.close()
