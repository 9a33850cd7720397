"""``eva0-edge top``: the dashboard's series in a terminal, for a device without a browser.

It reads a running server's ``GET /v2/models/{name}/adaptation/series`` (the whole ring first,
then ``?since=`` the newest point it has) every ``interval`` seconds and draws, with rich, one
row per series: its latest value, a sparkline of the last ``history`` points, and its bound;
then the guard's state and the latest events (trips, verdicts, changes of stream, bank hits).
``--once`` prints one frame and exits.

Behind a load balancer (a fleet's proxy) each answer comes from one replica and names it
(``replica``): the points are kept per replica, ``?since=`` is the oldest of the replicas' newest
points (a replica :data:`STALE_S` behind the newest left out), and the table shows each
replica's latest value and history side by side, the replica that answered last named.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

SPARKS = "\u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588"
EVENTS_SHOWN = 6
TIMEOUT_S = 10.0
STALE_S = 120.0  # seconds behind the newest replica's point after which a replica is stale
MIN_SPARK = 8  # the fewest points a replica's sparkline shows beside others
STATE_STYLES = {"adapting": "bold green", "dueling": "bold yellow", "paused": "bold red",
                "holding": "bold magenta", "frozen": "bold blue", "off": "bold cyan"}

# (field, label, unit, bound keys in the answer's "bounds": (lower, upper)): the page's charts
ROWS: tuple[tuple[str, str, str, tuple[str | None, str | None]], ...] = (
    ("images_per_s", "images/s", "images/s", (None, None)),
    ("latency_p50_ms", "latency p50", "ms", (None, None)),
    ("latency_p99_ms", "latency p99", "ms", (None, None)),
    ("forwards_per_sample", "forwards/sample", "since start", (None, "budget")),
    ("forwards_per_sample_interval", "forwards/sample", "this interval", (None, "budget")),
    ("budget_fill", "budget credit", "share", (None, None)),
    ("drift", "drift", "||theta - theta0||", (None, "drift_max")),
    ("entropy", "entropy", "guard window / ln K", ("entropy_min", "entropy_max")),
    ("alignment", "alignment", "to the source", (None, "alignment_max")),
    ("input_changes", "input changes", "count", (None, None)),
    ("shift_changes", "shift changes", "count", (None, None)),
    ("bank_hits", "bank hits", "count", (None, None)),
    ("trips", "guard trips", "count", (None, None)),
)


def fetch_json(url: str) -> Any:
    """GET ``url``'s JSON; ValueError naming the server's error or why it did not answer."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read()).get("error", "")
        except (ValueError, AttributeError):
            message = ""
        raise ValueError(f"{url}: HTTP {err.code} {message}".rstrip()) from None
    except (urllib.error.URLError, OSError) as err:
        raise ValueError(f"{url}: no answer ({getattr(err, 'reason', err)})") from None


def check_url(url: str) -> str:
    """The server's base URL without a trailing slash; ValueError unless http(s)://HOST[:PORT]."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be http://HOST:PORT (the server's), got {url!r}")
    return url.rstrip("/")


def served_model(base: str) -> str:
    """The name of the model the server serves (Triton's statistics list it)."""
    return str(fetch_json(f"{base}/v2/models/stats")["model_stats"][0]["name"])


def sparkline(values: list[float | None]) -> str:
    """One block character per value, scaled to the values' range (a space for None)."""
    numbers = [v for v in values if v is not None and math.isfinite(v)]
    if not numbers:
        return " " * len(values)
    low, high = min(numbers), max(numbers)
    span = high - low
    return "".join(
        " " if v is None or not math.isfinite(v) else
        SPARKS[0 if span == 0 else min(len(SPARKS) - 1, int((v - low) / span * len(SPARKS)))]
        for v in values
    )


def fmt(value: Any) -> str:
    """A number as the terminal shows it (4 significant digits), '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


class SeriesView:
    """The points read so far, per replica (None: a lone server; the last ``history`` of each
    field) and the events."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.replicas: dict[str | None, dict[str, deque]] = {}
        self.last_t: dict[str | None, float] = {}  # each replica's newest point
        self.events: deque[tuple[str | None, dict[str, Any]]] = deque(maxlen=EVENTS_SHOWN)
        self.answer: dict[str, Any] = {}
        self.answered: str | None = None  # the replica that answered last
        self.error: str | None = None  # why the last read failed (the view goes on polling)

    def merge(self, answer: dict[str, Any]) -> None:
        """The answer's points and events into its replica's, past those it holds."""
        self.answer = answer
        name = answer.get("replica")
        columns = self.replicas.setdefault(name, {})
        after = self.last_t.get(name)
        times = answer["points"]["t"]
        start = next((i for i, t in enumerate(times) if after is None or t > after), len(times))
        for field, values in answer["points"].items():
            columns.setdefault(field, deque(maxlen=self.history)).extend(values[start:])
        self.events.extend((name, e) for e in answer["events"] if after is None or e["t"] > after)
        if columns["t"]:
            self.last_t[name] = columns["t"][-1]
        self.answered = name

    def since(self) -> float | None:
        """The oldest of the replicas' newest points (stale replicas left out): ``?since=``."""
        if not self.last_t:
            return None
        newest = max(self.last_t.values())
        return min(t for t in self.last_t.values() if t >= newest - STALE_S)

    def latest(self, field: str, replica: str | None) -> Any:
        """``field``'s newest value of ``replica``."""
        column = self.replicas.get(replica, {}).get(field)
        return column[-1] if column else None

    def _names(self) -> list[str | None]:
        return sorted(self.replicas, key=lambda name: (name is not None, name or ""))

    def _replica_line(self, names: list[str | None]) -> Text:
        """Every replica seen with its guard state, a stale one marked."""
        newest = max(self.last_t.values(), default=0.0)
        line = Text("replicas:")
        for name in names:
            state = self.latest("guard_state", name) or "-"
            stale = self.last_t.get(name, newest) < newest - STALE_S
            line.append(f" {name} ")
            line.append(state, STATE_STYLES.get(state, ""))
            line.append(" (stale)" if stale else "")
        return line

    def frame(self) -> Group:
        """The frame: a header line, the table of series, the latest events."""
        answer = self.answer
        names = self._names()
        many = len(names) > 1
        state = self.latest("guard_state", self.answered) or "-"
        points = sum(len(columns.get("t", ())) for columns in self.replicas.values())
        header = Text.assemble(
            ("eva0-edge top ", "bold"), (str(answer.get("model", "")), ""),
            *(() if self.answered is None else ("  replica: ", (self.answered, "bold"))),
            "  guard: ", (state, STATE_STYLES.get(state, "")),
            f"  ({fmt(self.latest('samples', self.answered))} samples, {points} points of "
            f"{answer.get('interval_s', 0):g} s)",
        )
        table = Table(box=None, pad_edge=False, header_style="bold")
        table.add_column("series", no_wrap=True)
        table.add_column("unit", no_wrap=True)
        for name in names:
            label = str(name) if many else ""
            table.add_column(f"{label} latest".strip(), justify="right", no_wrap=True)
            table.add_column(f"{label} history".strip(), no_wrap=True)
        table.add_column("bound", no_wrap=True)
        shown = max(MIN_SPARK, self.history // len(names)) if many else self.history
        bounds = answer.get("bounds", {})
        for field, label, unit, (low, high) in ROWS:
            limits = [f">= {fmt(bounds.get(low))}" if low and bounds.get(low) is not None
                      else "", f"<= {fmt(bounds.get(high))}" if high and
                      bounds.get(high) is not None else ""]
            cells: list[str] = []
            for name in names:
                column = list(self.replicas[name].get(field, ()))
                cells += [fmt(column[-1] if column else None), sparkline(column[-shown:])]
            table.add_row(label, unit, *cells, " ".join(x for x in limits if x))
        events = Text()
        for name, event in reversed(self.events):
            when = time.strftime("%H:%M:%S", time.localtime(event["t"]))
            style = "bold red" if event["kind"] == "trip" else ""
            who = f" {name}" if many else ""
            events.append(f"{when}{who} {event['kind']}: {event['detail']}\n", style=style)
        parts: list[Text | Table] = [header, table, Text("latest events", style="bold"), events]
        if many:
            parts.insert(1, self._replica_line(names))
        if self.error:
            parts.insert(1, Text(f"no answer: {self.error}", style="bold red"))
        return Group(*parts)


def run_top(url: str, model: str | None = None, interval_s: float = 1.0, once: bool = False,
            history: int = 60, console: Console | None = None) -> None:
    """Poll ``url``'s series of ``model`` (default: the one it serves) every ``interval_s``
    seconds and draw it; ``once``: print one frame and return."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"--interval must be a number of seconds > 0, got {interval_s!r}")
    if history < 1:
        raise ValueError(f"--history must be >= 1 points, got {history}")
    base = check_url(url)
    name = model or served_model(base)
    endpoint = f"{base}/v2/models/{urllib.parse.quote(name, safe='')}/adaptation/series"
    view = SeriesView(history)
    view.merge(fetch_json(endpoint))
    console = console or Console()
    if once:
        console.print(view.frame())
        return
    try:
        with Live(view.frame(), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval_s)
                after = view.since()
                since = "" if after is None else f"?since={after!r}"
                try:
                    view.merge(fetch_json(endpoint + since))
                    view.error = None
                except ValueError as err:  # the server restarts, say: keep trying
                    view.error = str(err)
                live.update(view.frame())
    except KeyboardInterrupt:
        return
