"""pdserve's SLO planner: sizes the prefill and decode pools from live TTFT/ITL (README.md)."""
