"""Build hook: generate the gRPC stubs from proto/ into pdserve_proto/ (never hand-edited).

Runs on every build, editable installs included (`pip install -e .`). The .proto
files keep their public path pdserve/v1/*.proto; the Python modules land in the
package `pdserve_proto.v1` (PyPI's proto-plus owns the import name `proto`), so
the one import protoc writes between our own files is pointed there.
"""
from __future__ import annotations

import pathlib
import re

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "pdserve_proto" / "v1"


def generate_stubs() -> None:
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(PROTO_ROOT.glob("pdserve/v1/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with __import__("tempfile").TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *map(str, sources)]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(map(str, sources)))
        for generated in sorted(pathlib.Path(tmp, "pdserve", "v1").iterdir()):
            text = re.sub(r"^from pdserve\.v1 import", "from pdserve_proto.v1 import", generated.read_text(),
                          flags=re.MULTILINE)
            target = OUT / generated.name
            if not target.exists() or target.read_text() != text:
                target.write_text(text)


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
