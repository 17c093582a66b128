"""Router <-> worker gRPC over mutual TLS (certificates from files, made here with the openssl CLI),
real processes: the router holding a client certificate from the cluster CA serves; a caller
speaking plaintext, one without a client certificate and one whose certificate comes from another
CA are all refused at the TLS handshake; a caller with a good certificate but no cluster token is
still refused (UNAUTHENTICATED)."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from common.cluster_auth.dev_pki import make_ca, make_cert
from common.protocol import generate_pb2, worker_pb2, worker_pb2_grpc
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import generation_stub, start_router, start_worker, start_workers

PROMPT = list(range(2000, 2030))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    for name in ("worker", "router"):
        make_cert(d, "ca", name)
    make_cert(d, "other-ca", "stranger")
    return d


@pytest.fixture(scope="module")
def tls_cluster(tiny_qwen2_dir, pki, tmp_path_factory):
    from common.cluster_auth import write_secret_file
    secret = write_secret_file(str(tmp_path_factory.mktemp("secret")))
    worker_tls = ["--tls-cert", str(pki / "worker.pem"), "--tls-key", str(pki / "worker.key"),
                  "--tls-ca", str(pki / "ca.pem"), "--cluster-secret-file", secret,
                  "--model", str(tiny_qwen2_dir)]  # the channel is the point, not the tokens
    procs = []
    try:
        procs += start_workers(["prefill", "decode"], *worker_tls)
        procs.append(start_router(procs[:1], procs[1:], "--cluster-secret-file", secret,
                                  "--worker-tls-cert", str(pki / "router.pem"),
                                  "--worker-tls-key", str(pki / "router.key"), "--worker-tls-ca", str(pki / "ca.pem")))
        yield {"prefill": procs[0], "decode": procs[1], "router": procs[2]}
    finally:
        stop_all(procs)


def test_the_router_serves_over_mtls(tls_cluster):
    request = generate_pb2.GenerateRequest(request_id="tls-1", tokens=generate_pb2.TokenIds(ids=PROMPT),
                                           params=generate_pb2.SamplingParams(temperature=0.0, max_tokens=6,
                                                                              ignore_eos=True))
    out = list(generation_stub(tls_cluster["router"].address).Generate(request, timeout=120))
    assert sum(len(m.chunk.token_ids) for m in out if m.HasField("chunk")) == 6
    assert out[-1].HasField("complete")


def _get_stats(address: str, credentials: grpc.ChannelCredentials | None):
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest(), timeout=10)


def test_callers_without_a_certificate_from_the_ca_are_refused(tls_cluster, pki):
    ca = (pki / "ca.pem").read_bytes()
    callers = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        "certificate from another CA": grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=(pki / "stranger.key").read_bytes(),
            certificate_chain=(pki / "stranger.pem").read_bytes()),
    }
    for role in ("prefill", "decode"):
        for name, credentials in callers.items():
            with pytest.raises(grpc.RpcError) as info:
                _get_stats(tls_cluster[role].address, credentials)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (role, name, info.value)
        # a certificate from the CA gets through TLS, but without the cluster token still nothing
        good = grpc.ssl_channel_credentials(root_certificates=ca, private_key=(pki / "router.key").read_bytes(),
                                            certificate_chain=(pki / "router.pem").read_bytes())
        with pytest.raises(grpc.RpcError) as info:
            _get_stats(tls_cluster[role].address, good)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_pool_certificate_is_checked_by_its_name_not_the_address(pki, tmp_path):
    """One certificate for every worker names the pool (as the chart's cert-manager Certificate does),
    not the pod IPs the router dials: the router checks that name (--worker-tls-server-name)."""
    import asyncio

    from common.cluster_auth import ClusterAuthConfig, write_secret_file
    from common.cluster_auth.grpc_auth import worker_channel
    from common.cluster_auth.tls import InternalTLSConfig
    make_cert(pki, "ca", "pool", names="DNS:pdserve-internal")
    secret = write_secret_file(str(tmp_path))
    worker = start_worker("decode", "--tls-cert", str(pki / "pool.pem"), "--tls-key", str(pki / "pool.key"),
                          "--tls-ca", str(pki / "ca.pem"), "--cluster-secret-file", secret)
    key = ClusterAuthConfig(secret).load().grpc

    async def stats(server_name: str | None):
        tls = InternalTLSConfig(str(pki / "router.pem"), str(pki / "router.key"), str(pki / "ca.pem"), server_name)
        async with worker_channel(worker.address, key, tls.channel_credentials(), tls.channel_options()) as channel:
            return await worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest(), timeout=10)
    try:
        assert asyncio.run(stats("pdserve-internal")).role == "decode"
        for wrong in (None, "someone-else"):  # the address dialed (127.0.0.1) or another name: refused
            with pytest.raises(grpc.RpcError) as info:
                asyncio.run(stats(wrong))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        worker.stop()
