"""The front-hardening rules alone (issue 35, rows 6 and 8): sampling parameters finite and ranged, a
temperature below GREEDY_TEMPERATURE exactly greedy, the path of text UTF-8 cannot encode, and the HTTP
limits' config and flags."""
from __future__ import annotations

import pytest

from engine.sampling_params import GREEDY_TEMPERATURE, MAX_TEMPERATURE, InvalidParameter, SamplingParams
from pdserve.cli import build_parser
from pdserve.command_flags import router_config_from_args
from router.openai.http_limits import HttpLimits
from router.openai.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", -1e-320),
    ("temperature", MAX_TEMPERATURE * 1.01), ("temperature", True), ("top_p", float("nan")),
    ("top_p", float("inf")), ("top_p", 1.5),
])
def test_float_sampling_parameters_must_be_finite_and_in_range(field, value):
    with pytest.raises(InvalidParameter) as exc:
        SamplingParams(**{field: value})
    assert exc.value.field == field


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, GREEDY_TEMPERATURE / 2])
def test_a_temperature_below_the_greedy_threshold_is_exactly_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE).temperature == GREEDY_TEMPERATURE
    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE


@pytest.mark.parametrize("body, field", [
    (CompletionRequest(prompt="a\ud800"), "prompt"),
    (CompletionRequest(prompt=["x\udfff"]), "prompt[0]"),
    (CompletionRequest(prompt="ok", stop=["\ud800"], cache_salt="fine"), "stop[0]"),
    (CompletionRequest(prompt="ok", cache_salt="\udc00"), "cache_salt"),
    (CompletionRequest(prompt="ok", extra={"a\ud800": 1}), "extra.a\\ud800"),
    (ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                                  {"type": "text", "text": "\ud800"}]}]),
     "messages[0].content[1].text"),
])
def test_text_utf8_cannot_encode_is_named_by_its_path(body, field):
    with pytest.raises(InvalidParameter) as exc:
        body.check_text()
    assert exc.value.field == field
    str(exc.value).encode("utf-8")  # the error itself can be sent


def test_text_that_encodes_passes():
    CompletionRequest(prompt="héllo 😀 \u2028", stop=["\n"]).check_text()


def test_http_limits_are_validated_and_come_from_router_flags():
    for kwargs in ({"header_timeout_s": 0}, {"body_timeout_s": float("inf")}, {"header_timeout_s": float("nan")},
                   {"max_pending_connections": 0}):
        with pytest.raises(ValueError):
            HttpLimits(**kwargs)
    args = build_parser().parse_args(["router", "--http-header-timeout-s", "3", "--http-body-timeout-s", "4.5",
                                      "--http-max-pending-connections", "9"])
    assert router_config_from_args(args).http_limits == HttpLimits(3.0, 4.5, 9)
    defaults = router_config_from_args(build_parser().parse_args(["router"])).http_limits
    assert defaults == HttpLimits()
