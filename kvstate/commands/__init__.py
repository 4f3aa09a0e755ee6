"""Subcommands of the `kvstate` CLI: one module each, with configure(parser) and run(args)."""
