"""Metrics, request spans, OTLP export, the live feed and its snapshots."""
