"""Design studies: one-off measurements behind design decisions (see ../README.md)."""
