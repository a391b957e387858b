"""Structured outputs: a grammar per request (JSON schema, regex, choices, Lark/GBNF), compiled
in the background by llguidance, applied as a token mask in the batched sampler, checked
against speculative proposals, and used to append forced tokens without sampling them
(jump-forward). spec.py checks a request's spec; compiler.py compiles and caches; matcher.py is
one request's grammar state; masks.py makes and applies token bitmasks; manager.py is what the
engine calls."""
