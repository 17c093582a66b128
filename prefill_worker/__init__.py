"""The engine in prefill role: prompts to their first token, KV kept under a lease for decode."""
