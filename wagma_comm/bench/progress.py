"""A dependency-free progress bar for benchmark sweeps that take a while.

It redraws one line in place (``\\r``) at most ``1 / min_interval_s`` times a
second, appears only once a sweep has run ``show_after_s`` (short sweeps stay
quiet), and is silent when disabled, so a log file or a pipe never fills with
carriage returns::

    with Progress(len(sizes), "allreduce", enabled=None if rank == 0 else False) as bar:
        for nb in sizes:
            ...
            bar.advance(note=human_bytes(nb))

``enabled``: ``None`` (default) shows it when the stream is a terminal; ``False``
never (non-zero ranks); ``True`` always. Under ``mpiexec`` the ranks' stdio is a
pipe to the launcher even when the user sits at a terminal (MPICH's hydra), so
``None`` stays quiet there; a caller that knows better (a ``--progress`` flag)
passes ``True`` on rank 0, the launcher forwards the ``\\r`` updates as they come.
"""

from __future__ import annotations

import shutil
import sys
import time
from types import TracebackType
from typing import Callable, TextIO

from wagma_comm.errors import InvalidArgumentError

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """65.2 -> '1:05', 3725 -> '1:02:05': compact, fixed-width enough to not
    make the line jitter."""
    s = max(0, int(round(seconds)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class Progress:
    """``count/total  percent [####----]  elapsed, ETA  note`` on one line.

    ``total``: steps in the sweep (>= 0). ``label``: what is swept. ``stream``:
    where to draw (default ``sys.stderr``, looked up at construction so test
    capture works). ``enabled``: see the module docstring. ``min_interval_s``:
    least time between redraws. ``show_after_s``: nothing is drawn before the
    sweep has run this long. ``width``: bar cells. ``clock``: monotonic seconds
    (injectable for tests).
    """

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None,
                 enabled: bool | None = None, *, min_interval_s: float = 0.1,
                 show_after_s: float = 1.0, width: int = 24,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise InvalidArgumentError("total", f"expected an int >= 0, got {total!r}")
        if enabled is not None and not isinstance(enabled, bool):
            raise InvalidArgumentError("enabled", f"expected True, False or None, got {enabled!r}")
        for name, value in (("min_interval_s", min_interval_s), ("show_after_s", show_after_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidArgumentError(name, f"expected seconds >= 0, got {value!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise InvalidArgumentError("width", f"expected an int >= 1, got {width!r}")
        self.total = total
        self.label = label
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.enabled: bool = _is_tty(self.stream) if enabled is None else enabled
        self.count = 0
        self.note = ""
        self._min_interval = float(min_interval_s)
        self._show_after = float(show_after_s)
        self._width = width
        self._clock = clock
        self._start = clock()
        self._last_draw: float | None = None  # None: nothing on screen yet
        self._drawn_len = 0
        self._closed = False

    # -------------------------------------------------------------- public

    def advance(self, n: int = 1, note: str = "") -> None:
        """Count ``n`` more steps done; ``note`` (e.g. the current size) is shown
        after the times. Redraws only if enough time has passed, or at the end."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError("n", f"expected an int >= 0, got {n!r}")
        if self._closed:
            return
        self.count += n
        if note:
            self.note = note
        if not self.enabled:
            return
        now = self._clock()
        if now - self._start < self._show_after:
            return
        finished = self.total > 0 and self.count >= self.total
        if (self._last_draw is None or finished
                or now - self._last_draw >= self._min_interval):
            self._draw(now)

    def close(self) -> None:
        """Finish the line, if one was drawn; idempotent. A sweep that ended
        before ``show_after_s`` leaves no trace."""
        if self._closed:
            return
        self._closed = True
        if self.enabled and self._last_draw is not None:
            self._draw(self._clock())
            self._write("\n")

    def clear(self) -> None:
        """Wipe the bar so the caller can print a line; the next advance
        redraws it below that line."""
        if self.enabled and self._drawn_len:
            self._write("\r" + " " * self._drawn_len + "\r")
            self._drawn_len = 0
            self._last_draw = self._start - self._min_interval  # redraw at the next advance

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------- drawing

    def render(self, now: float | None = None) -> str:
        """The bar's text at ``now`` (default: the clock), without ``\\r``."""
        elapsed = (self._clock() if now is None else now) - self._start
        head = f"{self.label}  " if self.label else ""
        if self.total > 0:
            frac = min(1.0, self.count / self.total)
            filled = int(frac * self._width)
            bar = "#" * filled + "-" * (self._width - filled)
            if self.count >= self.total:
                eta = "done"
            elif self.count > 0:
                eta = "ETA " + format_duration(elapsed / self.count * (self.total - self.count))
            else:
                eta = "ETA --:--"
            line = (f"{head}{self.count}/{self.total} {100 * frac:3.0f}% [{bar}] "
                    f"{format_duration(elapsed)} elapsed, {eta}")
        else:
            line = f"{head}{self.count} done, {format_duration(elapsed)} elapsed"
        if self.note:
            line += f"  {self.note}"
        columns = shutil.get_terminal_size((80, 24)).columns
        return line[: max(20, columns - 1)]  # a wrapped line cannot be redrawn by \r

    def _draw(self, now: float) -> None:
        line = self.render(now)
        pad = " " * max(0, self._drawn_len - len(line))  # wipe a longer previous line
        self._write("\r" + line + pad)
        self._drawn_len = len(line)
        self._last_draw = now

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: stop drawing, never fail a sweep
            self.enabled = False
