"""One progress line per pass (rows done, rows/s, ETA) in a terminal and in a log alike: Ray Data's per-operator
output is reduced to it unless `-v`; passes that feed actors directly report the same line themselves."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("wbrag_ray.progress")

INTERVAL_S = 10.0
RAY_PROGRESS_LOGGER = "ray.data._internal.progress.logging_progress"  # Ray Data's non-tty progress (Ray 2.60)
_TOTAL = re.compile(r"^Total Progress: (\d+)/(\d+|\?)")

_current: list[PassProgress] = []  # the pass the driver runs now (passes run one after another)


def _format_s(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class PassProgress:
    """Rows done of a pass, reported as one line at most every `interval_s` seconds and once at the end."""

    def __init__(self, name: str, total: int | None = None, interval_s: float = INTERVAL_S):
        self.name, self.total, self.interval_s = name, total, interval_s
        self.done = 0
        self.start = time.perf_counter()
        self._last = self.start
        self._logged: tuple | None = None  # (done, total) of the last line

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total:,}" if self.total else ""
        text = f"{self.name}: {self.done:,}{of} rows, {rate:,.1f} rows/s, {_format_s(elapsed)}"
        if self.total and rate > 0 and self.done < self.total:
            text += f", ETA {_format_s((self.total - self.done) / rate)}"
        return text

    def update(self, done: int, total: int | None = None) -> None:
        """Set the rows done so far (and the total, once known); logs when `interval_s` has passed."""
        self.done = done
        if total:
            self.total = total
        self.tick()

    def tick(self) -> None:
        """Log the line if none was logged for `interval_s`: also called by a timer while no rows come in (a
        pass whose first batch takes minutes still shows that it runs)."""
        now = time.perf_counter()
        if now - self._last >= self.interval_s:
            self._last = now
            self._log()

    def advance(self, rows: int) -> None:
        self.update(self.done + rows)

    def finish(self) -> None:
        if self._logged != (self.done, self.total):  # the last line already said it
            self._log()

    def _log(self) -> None:
        self._logged = (self.done, self.total)
        log.info("%s", self.line())


@contextlib.contextmanager
def running(name: str, total: int | None = None, interval_s: float = INTERVAL_S) -> Iterator[PassProgress]:
    """The pass `name` runs in this block: Ray Data's progress is reported under it, with one closing line."""
    progress = PassProgress(name, total, interval_s)
    _current.append(progress)
    stop = threading.Event()
    timer = threading.Thread(target=_tick_until, args=(progress, stop), name=f"progress {name}", daemon=True)
    timer.start()
    try:
        yield progress
    finally:
        stop.set()
        timer.join()
        _current.remove(progress)
        progress.finish()


def _tick_until(progress: PassProgress, stop: threading.Event) -> None:
    while not stop.wait(progress.interval_s / 4):
        progress.tick()


class RayProgressFilter(logging.Filter):
    """Turns Ray Data's non-interactive progress dump into the running pass's one line (see the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        match = _TOTAL.match(record.getMessage())
        if match and _current:
            done, total = int(match.group(1)), match.group(2)
            _current[-1].update(done, None if total == "?" else int(total))
        return False


def configure(verbose: bool) -> None:
    """Once per process running wbrag commands: Ray's operator bars and non-tty dump only with `verbose`."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_operator_progress_bars = verbose
    ray_logger = logging.getLogger(RAY_PROGRESS_LOGGER)
    for f in [f for f in ray_logger.filters if isinstance(f, RayProgressFilter)]:
        ray_logger.removeFilter(f)
    if not verbose:
        ray_logger.addFilter(RayProgressFilter())
    ray_logger.setLevel(logging.INFO)  # read by the filter whatever the level of ray.data above it
    # Ray Data's per-dataset notes repeat what the pass lines say
    for name, quiet in QUIET_RAY_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else quiet)


QUIET_RAY_LOGGERS = {
    "ray.data._internal.progress": logging.ERROR,
    "ray.data._internal.execution.streaming_executor": logging.WARNING,
    "ray.data._internal.datasource.parquet_datasource": logging.WARNING,
    "ray.data.dataset": logging.WARNING,
    # a failed task's traceback: the command reports it itself (-v shows these too)
    "ray.data._internal.execution.streaming_executor_state": logging.CRITICAL,
    "ray.data.exceptions": logging.CRITICAL,
}
