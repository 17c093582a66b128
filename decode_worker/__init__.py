"""The engine in decode role: pulls a prompt's KV from prefill, then continuous-batches its tokens."""
