"""How an engine is reached: a worker over stdin/stdout frames, a shared worker over TCP, a Ray
actor, and prefill/decode disaggregation's KV transfer with its rendezvous."""
