"""Build and install tpamp, with the CUDA extension tpamp._C when it can be built.

The extension (csrc/, the fused multi-tensor kernels registered as torch.ops.tpamp.*) is built
when torch is importable at build time, torch is a CUDA build and nvcc is found; a GPU is not
needed. Otherwise tpamp installs without it and uses its PyTorch code paths. Environment:

    TPAMP_BUILD_CUDA=1      build the extension or fail with the reason; =0 never build it
    CUDA_HOME               the CUDA toolkit (default /usr/local/cuda when it exists)
    TORCH_CUDA_ARCH_LIST    GPU architectures (default "8.0;9.0")
    MAX_JOBS                parallel compile jobs (each takes up to ~2 GB of memory)

torch must be importable by setup.py, so install with the build environment that has it:

    pip install --no-build-isolation -e .
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
SOURCES = [
    "csrc/tpamp_ops.cpp",
    "csrc/grad_stats.cu",
    "csrc/scale_and_copy.cu",
    "csrc/dynamic_scaler.cu",
]
DEFAULT_CUDA_HOME = "/usr/local/cuda"
DEFAULT_ARCH_LIST = "8.0;9.0"


def _say(msg):
    print(f"tpamp setup: {msg}", file=sys.stderr, flush=True)


def _version():
    with open(os.path.join(ROOT, "tpamp", "__init__.py"), encoding="utf-8") as f:
        m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    if m is None:
        raise RuntimeError("tpamp/__init__.py has no __version__ = '...' line")
    return m.group(1)


def _nvcc_major(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"{nvcc} --version failed: {e}"
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m is None:
        return None, f"cannot read the CUDA version from `{nvcc} --version`"
    return int(m.group(1)), f"{m.group(1)}.{m.group(2)}"


def _cuda_build_problem():
    """None when the extension can be built here, else why not (a sentence)."""
    try:
        import torch
    except ImportError as e:
        return (
            f"torch is not importable at build time ({e}); install torch first and use "
            "`pip install --no-build-isolation`"
        )
    if not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build"
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        if os.path.isdir(DEFAULT_CUDA_HOME):
            os.environ["CUDA_HOME"] = DEFAULT_CUDA_HOME
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        where = f"no {nvcc}" if cuda_home else "CUDA_HOME unset and no nvcc on PATH"
        return f"nvcc not found ({where}); set CUDA_HOME to a CUDA {torch.version.cuda} toolkit"
    major, version = _nvcc_major(nvcc)
    if major is None:
        return version
    torch_major = int(torch.version.cuda.split(".")[0])
    if major != torch_major:
        return (
            f"nvcc {nvcc} is CUDA {version} but torch {torch.__version__} was built with CUDA "
            f"{torch.version.cuda}; the major versions must match"
        )
    os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
    return None


def _extension_and_cmdclass():
    flag = os.environ.get("TPAMP_BUILD_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        raise SystemExit(f"tpamp setup: TPAMP_BUILD_CUDA must be 0 or 1, got {flag!r}")
    if flag == "0":
        _say("TPAMP_BUILD_CUDA=0: installing without the CUDA extension tpamp._C "
             "(PyTorch code paths only)")
        return [], {}
    problem = _cuda_build_problem()
    if problem is not None:
        if flag == "1":
            raise SystemExit(f"tpamp setup: TPAMP_BUILD_CUDA=1 but the CUDA extension cannot be "
                             f"built: {problem}")
        _say(f"installing without the CUDA extension tpamp._C: {problem} "
             "(PyTorch code paths only; TPAMP_BUILD_CUDA=1 makes this an error)")
        return [], {}

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    # Imported only now: torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    _say(
        f"building the CUDA extension tpamp._C (CUDA_HOME={os.environ['CUDA_HOME']}, "
        f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']!r})"
    )
    ext = CUDAExtension(
        name="tpamp._C",
        sources=SOURCES,
        include_dirs=[os.path.join(ROOT, CSRC)],
        extra_compile_args={
            "cxx": ["-O3"],
            # No fast math: found_inf and the NaN-propagating max need IEEE comparisons.
            "nvcc": ["-O3", "-lineinfo"],
        },
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extension_and_cmdclass()

setup(
    name="tpamp",
    version=_version(),
    description="Megatron-style mixed-precision training for model-parallel PyTorch",
    packages=find_packages(include=["tpamp*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.13", "numpy"],
    extras_require={
        "tb": ["tensorboard"],
        "progress": ["tqdm"],
        "plot": ["matplotlib"],
        "test": ["pytest"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
