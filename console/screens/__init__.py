"""Screens pushed over the dashboard: help, span waterfall, fleet size."""
