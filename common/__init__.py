"""The foundation every other package builds on: protocol conversion, gRPC helpers, cluster auth, metrics
HTTP, the Redis client and keys, and the client library with its request/result types.

It imports only engine/'s torch-free core types, kv_transfer/ and the generated stubs (pdserve_proto/);
nothing above it (tests/test_import_layers.py holds the rule).
"""
