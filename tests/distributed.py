"""The tests' process launcher is the one the comparison harness uses: ``zeroimpl.integrations.launch``."""

from zeroimpl.integrations.launch import run_distributed

__all__ = ["run_distributed"]
