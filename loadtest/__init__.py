"""An SLO load generator for a pdserve cluster (`pdserve loadtest`).

datasets -> arrivals -> client (one gRPC stream per request) -> stats ->
report (table, JSON, JSONL) and plots; sweep repeats a run over request rates.
"""
