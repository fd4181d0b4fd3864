"""Overhead benchmarks for cockpit (run ``python -m benchmarks.run``)."""
