"""How fast KV reaches a decode worker, and whether remote prefill still pays on that link.

A decode worker reports, in its stats, the bytes and seconds of the KV pulls of 4 MiB or more it
completed since it started (`kv_pull_bytes`, `kv_pull_seconds`: each pull from its start to its last
byte, handshake and grant included; in smaller pulls those fixed costs outweigh the wire time).
`LinkEstimate` turns the growth of the two between polls into the observed bandwidth of the links into
that worker: an exponentially weighted average over polls that saw at least `min_bytes` move (fewer
bytes time mostly the fixed per-pull cost), so it follows a link that gets slower or faster, and a
restarted worker (counters reset) starts over.

`remote_prefill_pays` is the router's decision for one prompt. Remote prefill moves the KV of the
tokens the decode worker lacks; computing them there instead takes their prefill time (the prefill
pool's learnt seconds per token: the same model on the same kind of device). Both grow with the
prompt, so the comparison is per token: when the link moves a token's KV slower than a token is
prefilled, the transfer would delay the sample's second token (the first comes straight from the
prefill worker) by more than computing the prompt takes, and the decode worker prefills it itself.
Without an estimate yet (no pull observed, or no prefill timed), remote prefill is used as before. A
link judged slow gets no pulls, so nothing would show it has recovered: one skipped prompt in
`probe_every` still goes remote and re-measures it.
"""
from __future__ import annotations


class LinkEstimate:
    """Observed KV bandwidth into one decode worker, from its cumulative pull counters."""

    def __init__(self, alpha: float = 0.3, min_bytes: int = 1 << 20, probe_every: int = 16) -> None:
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.probe_every = probe_every
        self.bytes_per_s: float | None = None
        self.skips = 0
        """Remote prefills skipped for this link."""
        self._last: tuple[int, float] | None = None

    def skip_or_probe(self) -> bool:
        """The link was judged too slow for one prompt: True to skip remote prefill, False for the one
        in `probe_every` that goes remote anyway, so the estimate can see the link recover."""
        self.skips += 1
        return self.skips % self.probe_every != 0

    def observe(self, total_bytes: int, total_seconds: float) -> None:
        """One stats poll's counters."""
        if self._last is None or total_bytes < self._last[0] or total_seconds < self._last[1]:
            self._last = (total_bytes, total_seconds)  # first poll, or the worker restarted
            return
        moved, took = total_bytes - self._last[0], total_seconds - self._last[1]
        if moved < self.min_bytes or took <= 0:
            return  # too little to time: keep accumulating from the same base
        self._last = (total_bytes, total_seconds)
        rate = moved / took
        self.bytes_per_s = rate if self.bytes_per_s is None else self.bytes_per_s + self.alpha * (
            rate - self.bytes_per_s)


def remote_prefill_pays(kv_bytes_per_token: float, link_bytes_per_s: float | None,
                        prefill_token_s: float | None) -> bool:
    """Whether moving a token's KV over the link is no slower than prefilling the token (see the module
    docstring); True while either figure is unknown."""
    if not link_bytes_per_s or not prefill_token_s or kv_bytes_per_token <= 0:
        return True
    return kv_bytes_per_token / link_bytes_per_s <= prefill_token_s
