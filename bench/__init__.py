"""Benchmarks: `python -m bench.<name>`, each a readable table and one final JSON line."""
