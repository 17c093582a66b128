"""The public fronts secured (issue 20): API keys and tenants, TLS, prefix-cache isolation, Abort scope.

Real routers (`pdserve router --api-key-file ... [--tls-cert-file ...]`) over the
session's real workers; real gRPC and HTTP clients (the `openai` package, `pdserve
generate --url`).
"""
from __future__ import annotations

import json
import os
import random
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.client import build_request
from common.protocol import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from engine.block_hash import hash_full_blocks
from engine.sampling_params import SamplingParams
from router.request_builder import effective_cache_salt
from tests.cluster.harness import assert_no_leaks, free_port, start_router
from tests.tls_certs import make_tls_files

KEYS = {"alice": "sk-alice-0123456789abcdef", "bob": "sk-bob-0123456789abcdef"}
BLOCK_SIZE = 16


def bearer(tenant: str) -> tuple:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("".join(f"{tenant}:{key}\n" for tenant, key in KEYS.items()))
    return str(path)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def keyed_router(workers, key_file):
    """Plaintext, API keys on, HTTP front on, no route metadata (the default)."""
    port = free_port()
    proc = start_router(workers["prefill"][:1], workers["decode"][:1], "--api-key-file", key_file,
                        "--http-port", str(port), route_metadata=False)
    proc.http_url = f"http://127.0.0.1:{port}"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tls_router(workers, key_file, tls_files):
    port = free_port()
    proc = start_router(workers["prefill"][:1], workers["decode"][:1], "--api-key-file", key_file,
                        "--http-port", str(port), "--tls-cert-file", tls_files.cert, "--tls-key-file", tls_files.key)
    proc.http_url = f"https://127.0.0.1:{port}"
    yield proc
    proc.stop()


def greedy(token_ids: list[int], max_tokens: int = 2, request_id: str = "r", cache_salt: str = "",
           ignore_eos: bool = False) -> generate_pb2.GenerateRequest:
    msg = build_request(request_id, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
                        token_ids=token_ids)
    msg.cache_salt = cache_salt
    return msg


def generate(stub, msg, metadata=()) -> tuple[list, object]:
    call = stub.Generate(msg, metadata=metadata, timeout=120)
    return list(call), call


def cached_tokens(stub, token_ids: list[int], metadata=(), cache_salt: str = "") -> int:
    messages, _ = generate(stub, greedy(token_ids, cache_salt=cache_salt), metadata)
    return messages[-1].complete.usage.cached_tokens


def unique_prompt(seed: int, num_blocks: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(num_blocks * BLOCK_SIZE + 3)]


def health_status(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


# ---- API keys on the gRPC front --------------------------------------------------------------
def test_grpc_front_needs_a_valid_key_and_health_does_not(keyed_router):
    with grpc.insecure_channel(keyed_router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "Bearer sk-wrong-0123456789abcdef"),),
                         (("authorization", KEYS["alice"]),)):  # no "Bearer"
            with pytest.raises(grpc.RpcError) as exc:
                generate(stub, greedy([1, 2, 3]), metadata)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            stub.Abort(generate_pb2.AbortRequest(request_id="r"), timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        messages, _ = generate(stub, greedy([1, 2, 3], max_tokens=3), bearer("alice"))
        assert messages[-1].complete.usage.completion_tokens == 3


# ---- API keys on the HTTP front --------------------------------------------------------------
def test_http_front_needs_a_valid_key_and_health_does_not(keyed_router):
    anonymous = openai.OpenAI(base_url=keyed_router.http_url + "/v1", api_key="sk-wrong-0123456789abcdef",
                              max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as exc:
        anonymous.completions.create(model="default", prompt="Hello", max_tokens=2)
    assert exc.value.status_code == 401
    assert exc.value.body["code"] == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(keyed_router.http_url + "/v1/models", timeout=10)
    assert exc.value.code == 401
    assert exc.value.headers["WWW-Authenticate"] == "Bearer"
    assert json.load(exc.value)["error"]["type"] == "invalid_request_error"
    assert urllib.request.urlopen(keyed_router.http_url + "/health", timeout=10).status == 200

    alice = openai.OpenAI(base_url=keyed_router.http_url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=120)
    assert [m.id for m in alice.models.list()] == ["default"]
    completion = alice.completions.create(model="default", prompt="Hello", max_tokens=3, temperature=0)
    assert completion.usage.completion_tokens == 3


# ---- prefix-cache isolation ---------------------------------------------------------------------
def test_tenants_share_no_cached_block_and_see_no_cached_tokens_of_each_other(keyed_router, workers):
    prompt = unique_prompt(2001)
    with grpc.insecure_channel(keyed_router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        assert cached_tokens(stub, prompt, bearer("alice")) == 0
        assert cached_tokens(stub, prompt, bearer("alice")) >= 5 * BLOCK_SIZE  # the same tenant hits
        assert cached_tokens(stub, prompt, bearer("bob")) == 0  # the other does not, though the prompt is cached
        assert cached_tokens(stub, prompt, bearer("bob"), cache_salt="x") == 0  # nor under a salt of its own
        assert cached_tokens(stub, prompt, bearer("bob")) >= 5 * BLOCK_SIZE
    # The prefill worker holds the prompt twice, under each tenant's salt, and never unsalted.
    with grpc.insecure_channel(workers["prefill"][0].address) as channel:
        held = {e.stored.block_hash for e in worker_pb2_grpc.WorkerStub(channel).GetKvSnapshot(
            worker_pb2.KvEventsRequest(), timeout=10).events}
    alice_hashes = hash_full_blocks(prompt, BLOCK_SIZE, salt=effective_cache_salt("alice", ""))
    bob_hashes = hash_full_blocks(prompt, BLOCK_SIZE, salt=effective_cache_salt("bob", ""))
    assert set(alice_hashes) <= held and set(bob_hashes) <= held
    assert not set(hash_full_blocks(prompt, BLOCK_SIZE)) & held
    assert_no_leaks(workers["prefill"][:1] + workers["decode"][:1])


def test_client_cache_salts_isolate_without_keys(router_1p1d, http_router):
    prompt = unique_prompt(2002)
    with grpc.insecure_channel(router_1p1d.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        assert cached_tokens(stub, prompt, cache_salt="team-1") == 0
        assert cached_tokens(stub, prompt, cache_salt="team-2") == 0
        assert cached_tokens(stub, prompt) == 0
        assert cached_tokens(stub, prompt, cache_salt="team-1") >= 5 * BLOCK_SIZE
    text = " ".join(f"word{i}" for i in range(120))
    client = openai.OpenAI(base_url=http_router.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def http_cached(salt: str) -> int:
        usage = client.completions.create(model="default", prompt=text, max_tokens=1, temperature=0,
                                          extra_body={"cache_salt": salt}).usage
        return usage.prompt_tokens_details.cached_tokens

    assert http_cached("h1") == 0
    assert http_cached("h2") == 0
    assert http_cached("h1") >= 5 * BLOCK_SIZE


# ---- Abort and request ids are per tenant ------------------------------------------------------
def test_a_foreign_tenants_abort_is_ignored_and_ids_do_not_collide(keyed_router, workers):
    with grpc.insecure_channel(keyed_router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(greedy([1, 2, 3, 4], max_tokens=48, request_id="shared-id", ignore_eos=True),
                             metadata=bearer("alice"), timeout=120)
        first = next(call)
        assert first.chunk.token_ids
        found = stub.Abort(generate_pb2.AbortRequest(request_id="shared-id"), metadata=bearer("bob"), timeout=10)
        assert not found.found
        # bob may use the same id at the same time: no ALREADY_EXISTS telling him alice's ids.
        messages, _ = generate(stub, greedy([5, 6, 7], request_id="shared-id"), bearer("bob"))
        assert messages[-1].HasField("complete")
        rest = list(call)
        complete = rest[-1].complete
        assert complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert len(first.chunk.token_ids) + sum(len(m.chunk.token_ids) for m in rest) == 48

        own = stub.Generate(greedy([1, 2, 3, 4], max_tokens=400, request_id="mine", ignore_eos=True),
                            metadata=bearer("alice"), timeout=120)
        next(own)
        assert stub.Abort(generate_pb2.AbortRequest(request_id="mine"), metadata=bearer("alice"), timeout=10).found
        with pytest.raises(grpc.RpcError) as exc:
            list(own)
        assert exc.value.code() == grpc.StatusCode.CANCELLED
    assert_no_leaks(workers["prefill"][:1] + workers["decode"][:1])


# ---- no worker address reaches the client -------------------------------------------------------
def test_client_visible_metadata_names_no_worker(keyed_router, workers):
    with grpc.insecure_channel(keyed_router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        _, call = generate(stub, greedy(unique_prompt(2003, 3), max_tokens=2), bearer("alice"))
        visible = [*call.initial_metadata(), *call.trailing_metadata()]
    addresses = [w.address for group in workers.values() for w in group]
    assert not [k for k, _ in visible if k.startswith("pdserve-")]
    assert not [v for _, v in visible for a in addresses if isinstance(v, str) and a in v]


# ---- TLS ------------------------------------------------------------------------------------------
def test_tls_fronts_serve_clients_trusting_the_ca_and_refuse_plaintext(tls_router, tls_files):
    with open(tls_files.ca, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(tls_router.address, credentials) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        stub = generate_pb2_grpc.GenerationStub(channel)
        messages, _ = generate(stub, greedy([1, 2, 3], max_tokens=2), bearer("bob"))
        assert messages[-1].complete.usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError) as exc:
            generate(stub, greedy([1, 2, 3]))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(tls_router.address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            generate(generate_pb2_grpc.GenerationStub(channel), greedy([1, 2, 3]), bearer("bob"))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE

    def openai_client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=tls_router.http_url + "/v1", api_key=key, max_retries=0, timeout=120,
                             http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(
                                 cafile=tls_files.ca)))

    chat = openai_client(KEYS["alice"]).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert chat.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai_client("sk-wrong-0123456789abcdef").models.list()
    with pytest.raises(openai.APIConnectionError):  # a client not trusting our CA
        openai.OpenAI(base_url=tls_router.http_url + "/v1", api_key=KEYS["alice"], max_retries=0,
                      timeout=30).models.list()
    plain_url = tls_router.http_url.replace("https://", "http://") + "/health"
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(plain_url, timeout=10)


def test_pdserve_generate_url_with_tls_and_a_key(tls_router, tls_files, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "token_ids": [1, 2, 3], "max_tokens": 2,
                                                   "temperature": 0}) + "\n")
    (tmp_path / "key").write_text(KEYS["alice"] + "\n")
    base = [sys.executable, "-m", "pdserve.cli", "generate", "--url", tls_router.address, "--tls-ca", tls_files.ca,
            "--input", str(tmp_path / "in.jsonl")]
    ok = subprocess.run([*base, "--api-key-file", str(tmp_path / "key"), "--output", str(tmp_path / "out.jsonl")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    line = json.loads((tmp_path / "out.jsonl").read_text())
    assert line["id"] == "a" and len(line["token_ids"]) == 2
    refused = subprocess.run([*base, "--output", str(tmp_path / "none.jsonl")], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0
    assert "UNAUTHENTICATED" in refused.stderr


def test_pdserve_generate_url_plaintext_with_a_key_from_the_environment(keyed_router, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "Hello", "max_tokens": 2}) + "\n")
    argv = [sys.executable, "-m", "pdserve.cli", "generate", "--url", keyed_router.address,
            "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    env = dict(os.environ, PDSERVE_API_KEY=KEYS["bob"])
    ok = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads((tmp_path / "out.jsonl").read_text())["token_ids"]) == 2
    env.pop("PDSERVE_API_KEY")
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr


def test_pdserve_loadtest_with_tls_and_a_key(tls_router, tls_files, tmp_path):
    (tmp_path / "key").write_text(KEYS["alice"] + "\n")
    argv = [sys.executable, "-m", "pdserve.cli", "loadtest", "--url", tls_router.address, "--tls-ca", tls_files.ca,
            "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2", "--no-progress",
            "--output", str(tmp_path / "result.json")]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    done = subprocess.run([*argv, "--api-key-file", str(tmp_path / "key")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (2, 0)
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert json.loads((tmp_path / "result.json").read_text())["completed"] == 0, refused.stdout
