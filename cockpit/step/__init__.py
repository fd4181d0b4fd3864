"""One tracked step: its plan, run, routing, ledger, recorder and step features."""
