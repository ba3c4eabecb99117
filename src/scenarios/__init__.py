"""Scenario-based fault injection behind ``triode scenario``: the TOML files in ``scenarios/``
played against real triode servers (clients, faults, judged against an undisturbed reference).
A tool beside the runtime: it drives servers as a user would, through their command line, HTTP
and signals, and imports nothing of the runtime; none of the runtime imports it but the command
line, which registers its subcommands."""
