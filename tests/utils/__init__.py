"""Shared test helpers: small problems, training loops and brute-force references."""
