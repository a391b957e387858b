"""Speculative decoding: proposers guess tokens, one target forward verifies them all."""
