"""Which requests run each step: the request record, the checks at its admission, continuous
batching under a token budget, and the plain data handed to execution."""
