"""Subcommands of the `mooncake-operator` CLI, one module each."""
