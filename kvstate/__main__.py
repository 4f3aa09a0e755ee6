"""`python -m kvstate` is the same as the `kvstate` command."""

from kvstate.cli import main

raise SystemExit(main())
