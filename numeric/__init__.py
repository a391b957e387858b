"""Plain arithmetic shared by the gateway, the load tester and the benchmarks; it imports
nothing of ours, so `console` and `loadtest` may use it without importing `gateway`."""
