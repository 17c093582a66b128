"""The CA and certificate the chart generates for internal TLS (issue 35): what they carry, that they
carry router -> worker gRPC and the KV links under the name routers check, that `helm upgrade` keeps
them (its `lookup`, run against a stand-in API server), and a real `pdserve serve` run with the
chart's raycluster head flags over them."""
from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.cluster_auth.tls import InternalTLSConfig
from kv_transfer.tls import KVTLSFiles
from tests.cluster.test_serve import serve_over_mutual_tls
from tests.helm.chart import CHART, by_kind, objects, template, values_args
from tests.helm.kube_api import KubeAPI

INTERNAL_NAME = "pdserve-internal"
MOUNT = "/etc/pdserve/internal-tls"


def generated_secrets(rendered: str) -> dict[str, dict[str, bytes]]:
    """Name -> decoded data of every Secret in a raw render."""
    return {s["metadata"]["name"]: {k: base64.b64decode(v) for k, v in s["data"].items()}
            for s in by_kind(objects(rendered), "Secret")}


def write_internal_tls(directory: Path) -> InternalTLSConfig:
    """The files of the Secret a default install generates, in `directory` as the pods mount them."""
    directory.mkdir(parents=True, exist_ok=True)
    data = generated_secrets(template(raw=True))["pdserve-internal-tls"]
    assert sorted(data) == ["ca.crt", "tls.crt", "tls.key"]  # the CA's key is not kept
    for key, value in data.items():
        (directory / key).write_bytes(value)
    return InternalTLSConfig(*(str(directory / f) for f in ("tls.crt", "tls.key", "ca.crt")))


def openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def test_generated_certificate_names_the_internal_name_for_both_ends(tmp_path):
    files = write_internal_tls(tmp_path)
    text = openssl("x509", "-in", files.cert_file, "-noout", "-subject", "-ext",
                   "subjectAltName,extendedKeyUsage,basicConstraints")
    assert f"subject=CN = {INTERNAL_NAME}" in text
    assert f"X509v3 Subject Alternative Name: \n    DNS:{INTERNAL_NAME}\n" in text  # that name only
    assert "TLS Web Server Authentication, TLS Web Client Authentication" in text
    assert "CA:FALSE" in text
    assert "CA:TRUE" in openssl("x509", "-in", files.ca_file, "-noout", "-ext", "basicConstraints")
    for purpose in ("sslserver", "sslclient"):
        assert openssl("verify", "-CAfile", files.ca_file, "-purpose", purpose, files.cert_file).strip().endswith("OK")
    assert "ASN1 OID: prime256v1" in openssl("pkey", "-in", files.key_file, "-noout", "-text")
    again = write_internal_tls(tmp_path / "again")  # another install: a CA of its own
    assert Path(files.ca_file).read_bytes() != Path(again.ca_file).read_bytes()


def test_generated_certificate_carries_worker_grpc_and_kv_tls_under_the_internal_name(tmp_path):
    """A gRPC server as a worker runs it (client certificate required) and a router-side channel, both with
    the chart's files; then a KV link handshake (mutual TLS 1.3) with them."""
    files = write_internal_tls(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", files.server_credentials())
    server.start()
    try:
        def check(name: str, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
            options = [("grpc.ssl_target_name_override", name)]
            with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options) as channel:
                try:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                    return grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    return exc.code()

        assert check(INTERNAL_NAME, files.channel_credentials()) == grpc.StatusCode.OK
        assert check("pdserve-other", files.channel_credentials()) == grpc.StatusCode.UNAVAILABLE
        no_client_cert = grpc.ssl_channel_credentials(Path(files.ca_file).read_bytes())
        assert check(INTERNAL_NAME, no_client_cert) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)

    kv = KVTLSFiles(files.cert_file, files.key_file, files.ca_file)
    left, right = socket.socketpair()
    with left, right:
        peer: list = []
        side = threading.Thread(target=lambda: peer.append(kv.context(True).wrap_socket(right, server_side=True)))
        side.start()
        client = kv.context(False).wrap_socket(left, server_side=False)
        side.join(10)
        assert client.version() == "TLSv1.3" and peer and peer[0].getpeercert()["subject"] == (
            (("commonName", INTERNAL_NAME),),)


def chart_with_only(tmp_path: Path, *templates: str) -> Path:
    """The chart with only `templates` (and the helpers): the stand-in API server knows Secrets only."""
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("templates", "ci", "files"))
    (chart / "templates").mkdir()
    for name in ("_helpers.tpl", *templates):
        shutil.copy(CHART / "templates" / name, chart / "templates" / name)
    return chart


@pytest.mark.parametrize("secret,source", [("pdserve-internal-tls", "internal-tls-secret.yaml"),
                                           ("pdserve-cluster-secret", "cluster-secret.yaml")])
def test_helm_upgrade_keeps_the_generated_secret(tmp_path, secret, source):
    """install -> upgrade keeps the Secret as it is in the cluster; a Secret missing a key is made anew."""
    chart = chart_with_only(tmp_path, source)
    with KubeAPI() as api:
        args, env = api.helm_args(tmp_path)

        def render() -> dict[str, str]:
            [obj] = objects(template(*args, chart=chart, raw=True, env=env))
            api.install([obj], "pdserve", "llm")
            return obj["data"]

        installed = render()
        assert f"/api/v1/namespaces/llm/secrets/{secret}" in api.asked  # the lookup reached the cluster
        assert render() == installed  # upgrade: the same CA and certificate (the same cluster secret)
        api.secrets[("llm", secret)]["data"] = dict(list(installed.items())[:-1])
        remade = render()
        assert sorted(remade) == sorted(installed) and all(remade.values()) and remade != installed


def test_serve_runs_internal_links_over_mutual_tls_with_the_charts_files(tmp_path, tiny_qwen2_dir):
    """The raycluster head's `serve` flags, with the generated Secret's files where the pods mount them:
    the router reaches the workers and a prompt is prefilled on one worker and decoded on the other."""
    files = write_internal_tls(tmp_path / "internal-tls")
    [ray] = by_kind(objects(template(*values_args("raycluster"))), "RayCluster")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0].split()
    tls_flags = [arg for flag, value in zip(head, head[1:], strict=False) if flag.startswith("--internal-tls")
                 for arg in (flag, value.replace(MOUNT, str(tmp_path / "internal-tls")))]
    assert len(tls_flags) == 8 and files.cert_file in tls_flags
    serve_over_mutual_tls(tls_flags, tmp_path, tiny_qwen2_dir)
