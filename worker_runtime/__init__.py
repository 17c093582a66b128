"""What prefill and decode workers share: config, the engine thread, the gRPC server."""
