"""The router's OpenAI-compatible HTTP API (docs/openai.md)."""
