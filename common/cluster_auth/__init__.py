"""Authentication of pdserve's internal links with one shared cluster secret.

- `secret`: where the secret comes from (a file, never argv) and the per-purpose keys derived from it.
- `tokens`: per-call HMAC tokens in gRPC metadata (router -> worker), pure functions.
- `grpc_auth`: the server interceptor that checks them (UNAUTHENTICATED) and the client one that adds them.
- `handles`: the router's HMAC signature over a KV handle and the prompt it belongs to.

The KV transfer control channel has its own challenge-response (`kv_transfer.auth`), keyed by
`ClusterKeys.kv`.
"""
from common.cluster_auth import handles, tokens
from common.cluster_auth.secret import ClusterAuthConfig, ClusterKeys, write_secret_file

__all__ = ["ClusterAuthConfig", "ClusterKeys", "handles", "tokens", "write_secret_file"]
