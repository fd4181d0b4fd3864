"""Utilities: track schedules and ready-made quantity configurations."""
