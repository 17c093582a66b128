"""gRPC stubs of pdserve's API, generated from proto/ by setup.py at build time.

`pdserve_proto.v1.generate_pb2(_grpc)`: the public Generation service.
`pdserve_proto.v1.worker_pb2(_grpc)`: the internal worker API.
"""
