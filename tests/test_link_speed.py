"""A decode worker's learnt KV pull cost: fixed part from short pulls, per-byte part from long ones."""
from worker_runtime.link_speed import LONG_BYTES, PullSpeed


def test_pull_speed_learns_a_fixed_and_a_per_byte_cost():
    speed = PullSpeed()
    assert speed.seconds(100 << 20) == 0.0  # nothing seen: no constraint
    speed.observe(10_000, 0.002)  # short: the fixed part
    speed.observe(100_000_000, 0.802)  # long: 0.8 s over the fixed 2 ms -> 8 ns a byte (1 Gbit/s)
    assert abs(speed.fixed_s - 0.002) < 1e-9 and abs(speed.s_per_byte - 8e-9) < 1e-12
    assert abs(speed.seconds(50_000_000) - 0.402) < 1e-6
    for _ in range(40):  # the link gets ten times slower: the estimate follows
        speed.observe(100_000_000, 8.002)
    assert abs(speed.s_per_byte - 8e-8) < 1e-9
    speed.observe(0, 1.0)
    speed.observe(LONG_BYTES, -1.0)  # nonsense is ignored
    assert abs(speed.s_per_byte - 8e-8) < 1e-9
