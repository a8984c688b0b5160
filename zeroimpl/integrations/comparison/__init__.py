"""The side-by-side comparison: harness (runs), verdict (correctness), report (outputs), compare (all of it)."""
