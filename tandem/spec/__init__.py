"""Speculative decoding structures that are pure algorithms: token trees of draft tokens."""
