"""What every command-line front end shares: argument types, number lists, the engine's options,
rich consoles, progress bars and `--plot` paths.

`kvstate.commands` (the CLI's subcommands) and the applications that carry their own argument
parsers (`kvstate.bench`, `kvstate.recall`) all import these; nothing here imports them back."""
