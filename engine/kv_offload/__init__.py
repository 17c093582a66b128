"""KV cache tiers below the engine's block pool: host memory (tier 2) and a local-disk arena (tier 3).

`OffloadConfig` (config.py) needs no torch; `KVOffloader` (offloader.py) is built by the engine.
"""
