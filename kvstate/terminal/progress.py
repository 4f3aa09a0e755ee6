"""A progress bar while a checkpoint's weights load (rich, on stderr, on a terminal only).

`kvstate.models.loader.load_model(progress=...)` calls `progress(bytes_done, bytes_total)` after
each tensor; this module draws it. Written to a file or a pipe (and under --json) no bar is
drawn at all, so logs and machine-readable output stay clean.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def load_progress(console, *, enabled: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """Yield a `progress(done, total)` callback drawing a transient bar, or None where none is drawn."""
    if not enabled or not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("weights", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
