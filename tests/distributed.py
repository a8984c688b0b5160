"""The tests' process launcher is the one the comparison harness uses: ``integrations.launch``."""

from integrations.launch import run_distributed

__all__ = ["run_distributed"]
