"""CLI subcommands, one module each (see tokenmill/cli.py)."""
