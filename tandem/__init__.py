"""tandem: speculative-decoding LLM serving split into gRPC services (shared core)."""

__version__ = "0.1.0"
