"""Scenario-based fault injection: TOML scenarios played against a real triode server."""
