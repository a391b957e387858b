"""Real third-party servers that tests start on loopback (Prometheus), with their installers."""
