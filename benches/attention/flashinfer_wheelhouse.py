"""Build a wheelhouse of FlashInfer for a device without internet, <= 40 MiB to carry.

``flashinfer-python`` 0.7.4 is one 101 MB py3-none-any wheel: Python plus the CUDA sources its
JIT compiles. This keeps every ``.py`` file (``import flashinfer`` imports most of them), the
headers (``data/include``, ``data/cutlass``, ``data/cccl``, ``data/spdlog``) and the top-level
sources of ``data/csrc`` (decode, prefill, MLA, page kernels) plus the small subfolders they
include (``nv_internal``, ``xqa``, ``fmha_v2``, ``generated``), and drops the ``.cu`` files of
other ops (MoE, sampling, GDN, Blackwell kernels, ``cake_*`` backends) and the unimported
``moe_ep`` package; RECORD is rewritten with the new hashes. Then the dependencies a torch
install lacks for ``import flashinfer`` (found by importing it from an empty target:
apache-tvm-ffi, nvidia-ml-py; ninja (the JIT runs it), requests, tqdm, packaging, ml_dtypes
where absent).

    python benches/attention/flashinfer_wheelhouse.py .whl            # on a machine with PyPI
    bash benches/attention/install_flashinfer.sh .whl /tmp/fi        # on the device, no network

An op whose sources were dropped fails at its JIT with a missing file; bench_grid records that.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.7.4"
KEEP_CSRC_SUB = {"nv_internal", "xqa", "fmha_v2", "generated"}
DEPS = ["apache-tvm-ffi>=0.1.11,<0.2", "nvidia-ml-py", "ninja", "tqdm", "packaging", "requests",
        "certifi", "charset-normalizer", "idna", "urllib3", "ml_dtypes"]  # fmt: skip
TARGET = ["--python-version", "3.12", "--only-binary=:all:"] + [
    f"--platform={p}"
    for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
]


def keep(name: str, dist: str) -> bool:
    if name.startswith(dist + "/"):
        return True
    if name.startswith("flashinfer/data/csrc/"):
        rest = name[len("flashinfer/data/csrc/") :]
        return "/" not in rest or rest.split("/")[0] in KEEP_CSRC_SUB
    if name.startswith("flashinfer/data/"):
        return True
    return not name.endswith(".cu") and not name.startswith("flashinfer/moe_ep/")


def slim(src: Path, dst: Path) -> None:
    zin = zipfile.ZipFile(src)
    dist = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD")).rsplit("/", 1)[0]
    records = []
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename == f"{dist}/RECORD" or not keep(info.filename, dist):
                continue
            data = zin.read(info.filename)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            records.append(f"{info.filename},sha256={digest.decode()},{len(data)}")
        records.append(f"{dist}/RECORD,,")
        zout.writestr(f"{dist}/RECORD", "\n".join(records) + "\n")


def main(out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", *TARGET]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "-d", tmp, f"flashinfer-python=={VERSION}"], check=True)
        (whl,) = Path(tmp).glob("flashinfer_python-*.whl")
        slim(whl, out_dir / whl.name)
    subprocess.run([*pip, "-d", str(out_dir), *DEPS], check=True)
    total = sum(p.stat().st_size for p in out_dir.glob("*.whl"))
    print(f"{out_dir}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".whl")
