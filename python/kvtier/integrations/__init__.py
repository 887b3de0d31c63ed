"""Connectors into serving engines. Each subpackage imports its engine and runs in that engine's
environment (`make vllm-env`); nothing in kvtier's core imports them."""
