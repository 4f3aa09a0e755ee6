"""The rich consoles the commands print with.

To a terminal: its width, as rich measures it. To a file or a pipe (`kvstate bench ... | cat`,
`kvstate memory > out.txt`): rich would assume 80 columns and squeeze every table into them,
cutting names to `gat…`; there a table is as wide as its content instead, so every name stays
whole and rows can still be told apart.
"""

from __future__ import annotations

import sys

# Width when not writing to a terminal: wide enough never to squeeze a table. Tables are not
# expanded to the console width, so they take only the columns their content needs.
PIPE_WIDTH = 10_000


def make_console(*, stderr: bool = False):
    """A rich Console on stdout (or stderr) that cuts no table cell when it is not a terminal."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits with code 1 here; a reader that went away (`| head -1`) is not an error:
            # let kvstate.cli end quietly with 0, as it does for every other write.
            self.quiet = True
            raise BrokenPipeError

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return _Console(stderr=stderr, highlight=False)
    return _Console(stderr=stderr, width=PIPE_WIDTH, highlight=False)
