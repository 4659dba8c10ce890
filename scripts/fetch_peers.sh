#!/usr/bin/env bash
# Download the peers' released packages and keep only their Mamba2 decode-update kernels.
#
# Writes a bundle that benchmarks/peers.py loads (never committed: third_party/ is ignored):
#
#   $DEST/VERSIONS.json        package, version, file and sha256 of every download
#   $DEST/py/flashinfer/       flashinfer-python, trimmed to flashinfer.mamba.selective_state_update
#                              and the csrc/include files its JIT build compiles
#   $DEST/py/tvm_ffi/          apache-tvm-ffi (FlashInfer's runtime; cp312 manylinux x86_64,
#                              the GPU image's Python), unpacked from its wheel
#   $DEST/py/peer_vllm/        vllm/model_executor/layers/mamba/ops/mamba_ssm.py (+ helpers)
#   $DEST/py/peer_sglang/      sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py
#   $DEST/py/peer_mamba_ssm/   mamba_ssm/ops/triton/selective_state_update.py (+ softplus.py)
#
# Each extracted file is patched only where it imports its own package (a list of exact
# replacements below, each of which must match once); everything else is byte-for-byte
# the released file. Downloads are cached in $DOWNLOADS.
#
# Prebuilt FlashInfer modules are not made here (they need nvcc and the GPU): a GPU run of
# `python3 benchmarks/peers.py --out $OUT` writes them as $OUT/<uri>.tar.xz; copy those into
# $DEST/flashinfer_aot/ and benchmarks/peers.py unpacks them (no rebuild on the GPU).
#
# Usage:  PYTHON=.venv/bin/python scripts/fetch_peers.sh [DEST] [DOWNLOADS]
#   DEST       default third_party/peers
#   DOWNLOADS  default third_party/peer-downloads (about 480 MB: the vllm wheel is 336 MB)
# PYTHON must have pip, and torch + setuptools for the mamba-ssm sdist (its setup.py imports
# torch even to report its metadata); the project's .venv has both.
set -euo pipefail

FLASHINFER_VERSION=0.7.4          # 0.7.2 does not build at head dim 80
TVM_FFI_VERSION=0.1.15.post2      # flashinfer 0.7.4 needs apache-tvm-ffi >=0.1.11,<0.2
VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
MAMBA_SSM_VERSION=2.3.2.post1

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/third_party/peers}
DOWNLOADS=${2:-$ROOT/third_party/peer-downloads}
PYTHON=${PYTHON:-python3}
mkdir -p "$DOWNLOADS"

# The GPU machine runs CPython 3.12 on x86-64 Linux: binary wheels are fetched for it.
PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)

pip_download() { "$PYTHON" -m pip download --no-deps -q -d "$DOWNLOADS" "$@"; }

pip_download "${PLATFORM_ARGS[@]}" "flashinfer-python==$FLASHINFER_VERSION"
pip_download "${PLATFORM_ARGS[@]}" "apache-tvm-ffi==$TVM_FFI_VERSION"
pip_download "${PLATFORM_ARGS[@]}" "vllm==$VLLM_VERSION"
pip_download "${PLATFORM_ARGS[@]}" "sglang==$SGLANG_VERSION"
# An sdist: pip runs its setup.py for the metadata; skip the CUDA build it would start.
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=FALSE \
  pip_download --no-binary=:all: --no-build-isolation "mamba-ssm==$MAMBA_SSM_VERSION"

rm -rf "$DEST/py" "$DEST/VERSIONS.json"  # keeps $DEST/flashinfer_aot/
mkdir -p "$DEST/py"

"$PYTHON" - "$DOWNLOADS" "$DEST" <<'EOF'
import hashlib
import json
import pathlib
import posixpath
import re
import sys
import tarfile
import zipfile

downloads, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
py = dest / "py"
HEADER = "# Written by hybridmeta scripts/fetch_peers.sh (not part of the released package).\n"


def one(pattern: str) -> pathlib.Path:
    hits = sorted(downloads.glob(pattern))
    if len(hits) != 1:
        sys.exit(f"fetch_peers: expected one {pattern} in {downloads}, found {hits}")
    return hits[0]


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def patch(text: str, edits: list[tuple[str, str]], name: str) -> str:
    for old, new in edits:
        if text.count(old) != 1:
            sys.exit(f"fetch_peers: {name}: expected exactly one {old!r}, found {text.count(old)}")
        text = text.replace(old, new)
    return text


def write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


versions: dict[str, dict[str, object]] = {}

# ---------------------------------------------------------------- FlashInfer
whl = one("flashinfer_python-*.whl")
z = zipfile.ZipFile(whl)
names = set(z.namelist())
# The modules `import flashinfer.mamba.selective_state_update` loads once the three
# package __init__ files below are trimmed (found by tracing sys.modules).
modules = [
    "_build_meta.py", "api_logging.py", "compilation_context.py", "utils.py", "version.py",
    "jit/_cuda_architecture.py", "jit/core.py", "jit/cpp_ext.py", "jit/env.py", "jit/spdlog.py",
    "jit/utils.py", "jit/mamba/__init__.py", "jit/mamba/selective_state_update.py",
    "jit/mamba/seq_chunk_cumsum.py", "mamba/selective_state_update.py",
    "trace/__init__.py", "trace/solution.py", "trace/template.py",
    "trace/templates/__init__.py", "trace/templates/mamba.py",
    "trace/templates/_init_helpers.py",
]
kept = []
for m in modules:
    name = f"flashinfer/{m}"
    if name not in names:
        if m.endswith("_init_helpers.py"):
            continue  # only imported lazily, absent in some releases
        sys.exit(f"fetch_peers: {whl.name} lacks {name}")
    z.extract(name, py)
    kept.append(name)
# Package __init__ files that would import all of FlashInfer (cutlass-dsl, cudnn, ...).
write(py / "flashinfer/__init__.py", HEADER + (
    "from .version import __version__ as __version__\n"
    "from .version import __git_commit__ as __git_commit__\n"))
write(py / "flashinfer/jit/__init__.py", HEADER + (
    "from . import env as env\n"
    "from .core import JitSpec as JitSpec\n"
    "from .core import gen_jit_spec as gen_jit_spec\n"))
write(py / "flashinfer/mamba/__init__.py", HEADER + (
    "from .selective_state_update import selective_state_update\n\n"
    "__all__ = [\"selective_state_update\"]\n"))
# JIT sources: the three .cu files and the config template that
# flashinfer/jit/mamba/selective_state_update.py copies, and every header they reach.
data = "flashinfer/data/"
seeds = ["csrc/selective_state_update.cu", "csrc/selective_state_update_kernel_inst.cu",
         "csrc/flashinfer_mamba_binding.cu"]
inc = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
seen: set[str] = set()
todo = list(seeds)
while todo:
    rel = todo.pop()
    if rel in seen:
        continue
    seen.add(rel)
    parent = rel.rsplit("/", 1)[0]
    for inc_name in inc.findall(z.read(data + rel).decode("utf-8", "replace")):
        for cand in (posixpath.normpath(f"{parent}/{inc_name}"), f"include/{inc_name}",
                     f"csrc/{inc_name}"):
            if data + cand in names:
                todo.append(cand)
                break  # else: a CUDA / C++ / tvm-ffi header, or the generated config.inc
for rel in sorted(seen | {"csrc/selective_state_update_customize_config.jinja"}):
    z.extract(data + rel, py)
    kept.append(data + rel)
for lic in sorted(n for n in names if re.search(r"\.dist-info/(licenses/)?LICENSE", n)):
    write(py / "flashinfer" / "LICENSES" / pathlib.Path(lic).name, z.read(lic).decode())
versions["flashinfer"] = {"package": "flashinfer-python", "version": whl.name.split("-")[1],
                          "file": whl.name, "sha256": sha256(whl), "kept": kept}

whl = one("apache_tvm_ffi-*cp312*.whl")
zipfile.ZipFile(whl).extractall(py)
versions["tvm_ffi"] = {"package": "apache-tvm-ffi", "version": whl.name.split("-")[1],
                       "file": whl.name, "sha256": sha256(whl), "kept": ["(whole wheel)"]}

# ---------------------------------------------------------------- vLLM
whl = one("vllm-*.whl")
z = zipfile.ZipFile(whl)
ops = "vllm/model_executor/layers/mamba/ops/"
pkg = py / "peer_vllm"
null_block = re.search(r"^NULL_BLOCK_ID\s*=\s*(-?\d+)", z.read(
    "vllm/v1/attention/backends/utils.py").decode(), re.M)
if null_block is None:
    sys.exit("fetch_peers: NULL_BLOCK_ID not found in vllm/v1/attention/backends/utils.py")
src = z.read(ops + "mamba_ssm.py").decode()
write(pkg / "mamba_ssm.py", patch(src, [
    ("import vllm.envs as envs\n"
     "from vllm import _custom_ops as ops\n"
     "from vllm.logger import init_logger\n"
     "from vllm.model_executor.layers.mamba.ops.triton_helpers import fast_exp\n"
     "from vllm.platforms import current_platform\n"
     "from vllm.triton_utils import HAS_TRITON, tl, triton\n"
     "from vllm.utils.platform_utils import get_device_name_as_file_name\n"
     "from vllm.v1.attention.backends.utils import NULL_BLOCK_ID\n",
     "from ._shim import (HAS_TRITON, NULL_BLOCK_ID, current_platform, envs,  # hybridmeta\n"
     "                    get_device_name_as_file_name, init_logger, ops, tl, triton)\n"
     "from .triton_helpers import fast_exp  # hybridmeta: was vllm.model_executor...\n"),
    ("from vllm.platforms import current_platform  # noqa: E402",
     "from ._shim import current_platform  # noqa: E402  # hybridmeta"),
], "vllm mamba_ssm.py"))
src = z.read(ops + "triton_helpers.py").decode()
write(pkg / "triton_helpers.py", patch(src, [
    ("from vllm.triton_utils import tl, triton\n",
     "import triton  # hybridmeta: was vllm.triton_utils\nimport triton.language as tl\n"),
], "vllm triton_helpers.py"))
cfg = ops + "configs/selective_state_update/"
for n in sorted(n for n in z.namelist() if n.startswith(cfg) and n.endswith(".json")):
    write(pkg / "configs/selective_state_update" / n[len(cfg):], z.read(n).decode())
write(pkg / "_shim.py", HEADER + f'''"""The few vllm helpers that mamba_ssm.py imports, without importing vllm."""
import logging
import os
import re

import torch
import triton
import triton.language as tl

HAS_TRITON = True
NULL_BLOCK_ID = {null_block.group(1)}  # vllm/v1/attention/backends/utils.py of this release


class _Envs:
    VLLM_TUNED_CONFIG_FOLDER = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")


envs = _Envs()


class _NoOps:
    """vllm._custom_ops (compiled); only selective_scan_fn, the prefill op, needs it."""

    def __getattr__(self, name):
        raise RuntimeError(f"vllm._custom_ops.{{name}} is not part of the peers bundle")


ops = _NoOps()


class _Logger(logging.LoggerAdapter):
    _said: set = set()

    def _once(self, level, msg, *args, **kwargs):
        if (level, msg) not in self._said:
            self._said.add((level, msg))
            self.log(level, msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args)


def init_logger(name):
    return _Logger(logging.getLogger(name), {{}})


class _Platform:
    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id)


current_platform = _Platform()


def get_device_name_as_file_name(device_id=0):
    return re.sub(r"[\\s/]+", "_", current_platform.get_device_name(device_id))
''')
write(pkg / "__init__.py", HEADER + "from .mamba_ssm import selective_state_update\n")
for lic in sorted(n for n in z.namelist() if re.search(r"\.dist-info/(licenses/)?LICENSE", n)):
    write(pkg / "LICENSES" / pathlib.Path(lic).name, z.read(lic).decode())
versions["vllm"] = {"package": "vllm", "version": whl.name.split("-")[1], "file": whl.name,
                    "sha256": sha256(whl), "null_block_id": int(null_block.group(1)),
                    "kept": [ops + "mamba_ssm.py", ops + "triton_helpers.py", cfg + "*.json"]}

# ---------------------------------------------------------------- sglang
whl = one("sglang-*.whl")
z = zipfile.ZipFile(whl)
name = "sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py"
pkg = py / "peer_sglang"
write(pkg / "mamba_ssm.py", patch(z.read(name).decode(), [
    ("from sglang.kernels.jit.utils import is_arch_support_pdl\n",
     "from ._shim import is_arch_support_pdl  # hybridmeta: was sglang.kernels.jit.utils\n"),
], "sglang mamba_ssm.py"))
write(pkg / "_shim.py", HEADER + '''"""sglang.kernels.jit.utils.is_arch_support_pdl without importing sglang."""
import functools

import torch


@functools.cache
def is_arch_support_pdl():
    # sglang: CUDA (not HIP/MUSA) and the JIT target's major version >= 9
    return torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
''')
write(pkg / "__init__.py", HEADER + "from .mamba_ssm import PAD_SLOT_ID, selective_state_update\n")
for lic in sorted(n for n in z.namelist() if re.search(r"\.dist-info/(licenses/)?LICENSE", n)):
    write(pkg / "LICENSES" / pathlib.Path(lic).name, z.read(lic).decode())
versions["sglang"] = {"package": "sglang", "version": whl.name.split("-")[1], "file": whl.name,
                      "sha256": sha256(whl), "kept": [name]}

# ---------------------------------------------------------------- mamba_ssm
sdist = one("mamba_ssm-*.tar.gz")
t = tarfile.open(sdist)
top = sdist.name[: -len(".tar.gz")]
pkg = py / "peer_mamba_ssm"
for n in ("selective_state_update.py", "softplus.py"):
    src = t.extractfile(f"{top}/mamba_ssm/ops/triton/{n}").read().decode()
    if n == "selective_state_update.py":
        src = patch(src, [("from mamba_ssm.ops.triton.softplus import softplus",
                           "from .softplus import softplus  # hybridmeta: was mamba_ssm.ops...")],
                    "mamba_ssm selective_state_update.py")
    write(pkg / n, src)
write(pkg / "__init__.py", HEADER + "from .selective_state_update import selective_state_update\n")
write(pkg / "LICENSES" / "LICENSE", t.extractfile(f"{top}/LICENSE").read().decode())
versions["mamba_ssm"] = {"package": "mamba-ssm", "version": top.split("-", 1)[1],
                         "file": sdist.name, "sha256": sha256(sdist),
                         "kept": ["mamba_ssm/ops/triton/selective_state_update.py",
                                  "mamba_ssm/ops/triton/softplus.py"]}

write(dest / "VERSIONS.json", json.dumps(versions, indent=1) + "\n")
for peer, v in versions.items():
    print(f"fetch_peers: {peer:10s} {v['package']}=={v['version']}")
EOF
echo "fetch_peers: bundle in $DEST ($(du -sh "$DEST" | cut -f1))"
