"""Structured output: the grammar a sequence's output keeps to (docs/structured-output.md).

spec.py is the request's side (torch-free, the router imports it); backend.py the interface a
grammar library implements, llguidance_backend.py the one we ship; matcher.py one sequence's
matcher state; masks.py the mask rows a step verifies with (torch, the target only).
"""
