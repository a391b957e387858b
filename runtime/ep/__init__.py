"""Expert parallelism's load balancing: where each MoE layer's experts live on N workers
(`placement.py`), which replica computes each token (`replica.py`), the per-expert token
counts the balancer plans from (`load_window.py`) and a simulator of DeepSeek-V3's published
deployments (`sim.py`, run by `python -m runtime.ep_sim`)."""
