"""The Llama-family decoder, its config and weight loading."""
