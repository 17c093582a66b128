"""The decoders (one module per family: engine/model/registry.py), their config and weight loading."""
