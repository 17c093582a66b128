"""Per-request sampling parameters (defaults follow vLLM)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from engine.errors import InvalidParameter
from engine.structured_output.spec import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
"""Highest temperature: far past any useful one, and logits divided by it stay finite in float32."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy, set to exactly 0 (vLLM's _SAMPLING_EPS): logits divided by them overflow."""
MAX_LOGIT_BIAS = 1024
"""Most logit_bias entries of one request."""
MAX_BAD_WORDS = 64
MAX_SEED = 2**63 - 1
"""Largest seed of any sample (seeds travel as int64; sample i of n uses seed + i)."""


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Validated on construction."""

    n: int = 1
    """Number of samples returned for the prompt (they share its KV blocks)."""
    temperature: float = 1.0
    """0 means greedy (so does anything below GREEDY_TEMPERATURE); otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much mass."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 means off."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens exist."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends when one appears; it is not emitted."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (emitted, like EOS)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds, in [-2, 2] (vLLM, OpenAI)."""
    frequency_penalty: float = 0.0
    """Times each token's count in the output, subtracted from its logit, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Tokens seen in the prompt or output: positive logits divided by it, negative ones multiplied; 1 is off."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (after temperature); 0 is off."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> bias added to its logit, in [-100, 100]."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated: their last token is banned wherever the output ends with the words' other tokens."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (from the second on) and this many top alternatives at its position;
    such a request does not read the prefix cache (a cached position computes no logits)."""
    structured_output: StructuredOutput | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a grammar or a choice."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"must be a finite number in [0, {MAX_TEMPERATURE:g}]")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be >= 0 (or -1 for off)")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", "must be between 0 and max_tokens")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED - (self.n - 1)),
               "seed", f"must be an integer in [0, {MAX_SEED}] (n samples use seed .. seed + n - 1)")
        self._check_logits_processors()
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")

    def _check_logits_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, "must be in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", "must be in (0, 10]")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
        self.logit_bias = dict(self.logit_bias)
        for token_id, bias in self.logit_bias.items():
            _check(isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0, "logit_bias",
                   f"key {token_id!r} is not a token id (an integer >= 0)")
            _check(_is_number(bias) and -100.0 <= bias <= 100.0, "logit_bias",
                   f"bias of token {token_id} must be a number in [-100, 100]")
        self.bad_words = list(self.bad_words)
        _check(len(self.bad_words) <= MAX_BAD_WORDS, "bad_words", f"at most {MAX_BAD_WORDS} bad words")
        _check(all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_STRING_CHARS for w in self.bad_words),
               "bad_words", f"bad words must be non-blank strings of at most {MAX_STOP_STRING_CHARS} characters")
        _check(self.prompt_logprobs is None
               or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        _check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
               "structured_output", "must be a StructuredOutput")

    @property
    def penalized(self) -> bool:
        """Any of the three penalties is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters for one of `n` parallel samples (its own seed stream)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(field_name, message)
