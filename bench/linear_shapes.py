"""What each linear of a step costs on this CPU, shape by shape, and which GEMM library runs it.

For the default model's four layer linears (merged QKV, O, merged gate/up, down) and the
LM head, at decode batches (1-64 rows) and prefill chunks (up to 2,048 rows): time per
call and GFLOP/s of the path `engine.model.linear.Linear` picks (a weight prepacked for
oneDNN, in float32 for a bf16 model on CPUs without bf16 GEMM, or plain `F.linear`);
beside it `F.linear` on the plain weight (the unpacked path: MKL's sgemm for float32);
and the primitive oneDNN reports (ONEDNN_VERBOSE=1, read back from this process's
stdout: "none" means the call never reached oneDNN).

  .venv/bin/python bench/linear_shapes.py --dtype bfloat16 [--rows 1 8 64 512 2048]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def measure(dtype_name: str, rows: list[int], repeats: int) -> list[dict]:
    import torch

    from engine.model.linear import Linear, bf16_gemm_supported
    from engine.model.model_config import ModelConfig
    from engine.model_files import ensure_default_model

    cfg = ModelConfig.from_dir(ensure_default_model())
    dtype = getattr(torch, dtype_name)
    hidden, inter, head = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * head, hidden), "o_proj": (hidden, cfg.num_heads * head),
              "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (cfg.vocab_size, hidden)}
    out = []
    for name, (n_out, n_in) in shapes.items():
        weight = torch.randn(n_out, n_in, dtype=dtype) * 0.02
        linear = Linear(weight)
        plain = weight.float() if linear.upcast else weight  # what F.linear would multiply (MKL for float32)
        path = ("packed" if linear.packed is not None else "plain") + (" fp32" if linear.upcast else "")
        for m in rows:
            x = torch.randn(m, n_in, dtype=dtype)
            for _ in range(3):
                linear(x)
            print(f"@@ {name} {m}", flush=True)  # marks where this shape's oneDNN lines start
            start = time.perf_counter()
            for _ in range(repeats):
                linear(x)
            ms = (time.perf_counter() - start) / repeats * 1e3
            xp = x.to(plain.dtype)
            start = time.perf_counter()
            for _ in range(repeats):
                torch.nn.functional.linear(xp, plain)
            plain_ms = (time.perf_counter() - start) / repeats * 1e3
            out.append({"linear": name, "rows": m, "out": n_out, "in": n_in, "path": path, "ms": ms,
                        "gflops": 2 * m * n_out * n_in / ms / 1e6, "plain_f_linear_ms": plain_ms})
    print(f"@@ bf16_gemm_supported={bf16_gemm_supported()} capability={torch.backends.cpu.get_cpu_capability()} "
          f"threads={torch.get_num_threads()}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 512, 2048])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "linear_shapes.json"))
    args = ap.parse_args()
    if args.child:
        print("@@JSON " + json.dumps(measure(args.dtype, args.rows, args.repeats)), flush=True)
        return 0
    # oneDNN prints its verbose lines to stdout from native code: run the measurement in a child and read them.
    cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--repeats", str(args.repeats),
           "--rows", *map(str, args.rows)]
    text = subprocess.run(cmd, env=os.environ | {"ONEDNN_VERBOSE": "1"}, capture_output=True, text=True,
                          check=True).stdout
    results = json.loads(text.split("@@JSON ", 1)[1])
    primitives: dict[tuple[str, int], set[str]] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("@@ ") and "=" not in line:
            name, m = line[3:].split()
            key = (name, int(m))
        elif key and line.startswith("onednn_verbose") and ",exec," in line:
            fields = line.split(",")
            # onednn_verbose,<v>,primitive,exec,<engine>,<kind>,<impl>,...
            kind, impl = (fields[5], fields[6]) if fields[2] == "primitive" else (fields[3], fields[4])
            primitives.setdefault(key, set()).add(f"{kind}:{impl}")
    info = re.search(r"@@ (bf16_gemm_supported=.*)", text)
    print(f"{args.dtype}; {info.group(1) if info else ''}")
    print(f"{'linear':<8} {'rows':>5} {'out x in':>12} {'path':<12} {'ms':>8} {'GFLOP/s':>8} {'F.linear ms':>12}  "
          "oneDNN primitive")
    for r in results:
        r["onednn"] = sorted(primitives.get((r["linear"], r["rows"]), [])) or ["none"]
        print(f"{r['linear']:<8} {r['rows']:>5} {r['out']:>6}x{r['in']:<5} {r['path']:<12} {r['ms']:>8.3f} "
              f"{r['gflops']:>8.1f} {r['plain_f_linear_ms']:>12.3f}  {' '.join(r['onednn'])}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"dtype": args.dtype, "info": info.group(1) if info else "",
                                             "results": results}, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
