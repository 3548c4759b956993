"""Subcommands of the `expertcache` command, one module each with `register(subparsers)`."""
