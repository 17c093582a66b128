"""The gRPC front end: validates, tokenizes, picks workers, relays the token stream."""
