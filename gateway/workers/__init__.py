"""Handles for runtime workers (processes or Ray actors) and the per-request output buffer they
fill."""
