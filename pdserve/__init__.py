"""pdserve: a disaggregated prefill/decode LLM serving cluster."""
__version__ = "0.1.0"
