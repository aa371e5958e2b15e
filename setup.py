"""Build tpamp's kernels: the extension modules tpamp._C*. The package's metadata (name,
version, dependencies, extras, license) is in pyproject.toml; this file holds only what
pyproject.toml cannot say, the extension build.

Kernel sources are csrc/ (csrc/README.md): one math (csrc/kernels/), two launchers.

* tpamp._C: the op schemas (csrc/tpamp_ops.cpp) plus, when torch is a CUDA build and nvcc is
  found, the CUDA kernels (every csrc/cuda/*.cu and csrc/cuda/*.cpp); a GPU is not needed.
* tpamp._C_cpu_<capability>: the CPU kernels (every csrc/cpu/*.cpp), compiled once per CPU
  capability of at::vec (x86-64: default, avx2, avx512; elsewhere: default), each with its own
  CPU_CAPABILITY macro and -m flags; tpamp/_ext.py loads the one torch reports for this CPU
  (torch.backends.cpu.get_cpu_capability()), so a build runs correctly on any machine.

* tpamp._C_simt (only with TPAMP_BUILD_SIMT=1; test infrastructure): the CUDA launchers
  (every csrc/cuda/*.cu, and csrc/simt/*.cu) compiled by the C++ compiler under the SIMT emulator
  of csrc/simt/, registered as torch.ops.tpamp_simt.* for CPU tensors; CPU torch is enough.
  TPAMP_SIMT_SANITIZE=thread|address also builds tpamp._C_simt_thread / _C_simt_address with
  ThreadSanitizer / AddressSanitizer (csrc/README.md says how to run them).

They are built on any machine with a C++ compiler where torch is importable at build time.
When that is impossible tpamp installs without them, says why, and uses its PyTorch code paths.
Environment:

    TPAMP_BUILD_EXT=1       build the kernels or fail with the reason; =0 never build them
    TPAMP_BUILD_CUDA=1      build the CUDA kernels or fail with the reason; =0 CPU kernels only
    TPAMP_CPU_CAPABILITIES  comma list of CPU capabilities to build (default: all for the arch)
    TPAMP_BUILD_SIMT=1      also build tpamp._C_simt (the emulated CUDA launchers; fails loudly)
    TPAMP_SIMT_SANITIZE     thread or address: also build that sanitizer variant of it
    CUDA_HOME               the CUDA toolkit (default /usr/local/cuda when it exists)
    TORCH_CUDA_ARCH_LIST    GPU architectures (default "8.0;9.0+PTX", plus 10.0 and 12.0 with
                            CUDA >= 12.8)
    MAX_JOBS                parallel compile jobs (a .cu takes up to ~2 GB of memory)

torch must be importable by setup.py, so install with the build environment that has it:

    pip install --no-build-isolation -e .
"""

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import time

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
DEFAULT_CUDA_HOME = "/usr/local/cuda"

# at::vec capabilities: the macros of ATen's DispatchStub builds and the ISA flags for them.
CPU_CAPABILITY_FLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


SKIP_NOTE = os.path.join(ROOT, "tpamp", "_kernels_not_built.txt")


def _say(msg):
    print(f"tpamp setup: {msg}", file=sys.stderr, flush=True)


class BuildProgress:
    """The progress lines of the kernel build (one compile of a capability module takes
    minutes): what is built, then each extension module's start and end with its time and the
    time since the build began. Only the text; ``clock`` returns seconds (time.monotonic)."""

    def __init__(self, names, clock=time.monotonic):
        self.names = list(names)
        self.clock = clock
        self.began = clock()
        self.started = {}

    def _tag(self, name):
        return f"[{self.names.index(name) + 1}/{len(self.names)}] {name}"

    def begin(self, jobs=None):
        return (f"building {len(self.names)} extension modules ({', '.join(self.names)}) with "
                f"{jobs or 'the default number of'} parallel compile jobs (MAX_JOBS); each "
                "takes up to a few minutes")

    def start(self, name, num_sources):
        self.started[name] = self.clock()
        files = "file" if num_sources == 1 else "files"
        return f"{self._tag(name)}: compiling {num_sources} source {files}"

    def end(self, name, ok=True):
        now = self.clock()
        what = "built" if ok else "FAILED"
        return (f"{self._tag(name)}: {what} in {now - self.started[name]:.0f} s "
                f"({now - self.began:.0f} s since the build began)")

    def finish(self, failed=()):
        done = len(self.names) - len(failed)
        return f"built {done} of {len(self.names)} extension modules in {self.clock() - self.began:.0f} s"


def _note_skipped(reason):
    """pip hides setup.py's output: the reason is also kept next to the package, where
    tpamp/_ext.py puts it into its one warning."""
    _say(reason)
    try:
        with open(SKIP_NOTE, "a", encoding="utf-8") as f:
            f.write(reason.rstrip() + "\n")
    except OSError:
        pass


def _sources(pattern):
    """Repository-relative paths matching a glob under csrc/, sorted (a new kernel file needs no
    edit here)."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, CSRC, pattern)))


def _flag(name):
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise SystemExit(f"tpamp setup: {name} must be 0 or 1, got {value!r}")
    return value


def _process_libstdcxx():
    """The libstdc++.so.6 this process (with torch imported) has mapped, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def _libstdcxx_link_args():
    """Link arguments that keep one C++ runtime in the process.

    A toolchain that links libstdc++ statically into a shared library (a GCC built without the
    shared libstdc++, or with -static-libstdc++ in its specs) gives each tpamp module a second
    copy of the C++ runtime beside the one torch loaded, and the two copies' iostream and
    locale state disagree: formatting a number in an error message then crashes the process
    (seen on a GPU machine whose CXX was such a GCC, 2026-11-27: a segfault inside
    std::ostream in tpamp._C, reached from every TORCH_CHECK that names an index). A test link
    of a one-line library says whether this compiler does that; if so, every module is linked
    against the shared libstdc++ that torch's libraries use (named by its path, before the
    compiler's own), so the static archive supplies at most the symbols that library lacks."""
    if not sys.platform.startswith("linux"):
        return []
    import shlex
    import tempfile

    cxx = shlex.split(os.environ.get("CXX", "c++"))
    readelf = shutil.which("readelf")
    if readelf is None or shutil.which(cxx[0]) is None:
        return []
    src = "#include <sstream>\nstd::string tpamp_probe(unsigned long v) { std::ostringstream s; s << v; return s.str(); }\n"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "probe.so")
        try:
            subprocess.run(cxx + ["-shared", "-fPIC", "-x", "c++", "-", "-o", out], input=src,
                           capture_output=True, text=True, check=True, timeout=120)
            dyn = subprocess.run([readelf, "-d", out], capture_output=True, text=True, check=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            _say(f"could not test-link with {' '.join(cxx)} ({e}); linking as it does by default")
            return []
    if "libstdc++.so" in dyn:
        return []
    lib = _process_libstdcxx()
    if lib is None:
        _say(f"WARNING: {' '.join(cxx)} links libstdc++ statically and no shared libstdc++ is "
             "loaded here to link instead: error messages of the kernels may crash the process")
        return []
    _say(f"{' '.join(cxx)} links libstdc++ statically into shared libraries: linking {lib} "
         "instead, so the modules share torch's C++ runtime")
    return [lib]


def _nvcc_version(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"{nvcc} --version failed: {e}"
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m is None:
        return None, f"cannot read the CUDA version from `{nvcc} --version`"
    return (int(m.group(1)), int(m.group(2))), f"{m.group(1)}.{m.group(2)}"


def _ext_build_problem():
    """None when the extension modules can be built here, else why not (a sentence)."""
    try:
        import torch
    except ImportError as e:
        return (
            f"torch is not importable at build time ({e}); install torch first and use "
            "`pip install --no-build-isolation`"
        )
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found on PATH; set CXX)"
    del torch
    return None


def _cuda_build_problem():
    """(None, nvcc version) when the CUDA kernels can be built here, else (why not, None)."""
    import torch

    if not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build", None
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        if os.path.isdir(DEFAULT_CUDA_HOME):
            os.environ["CUDA_HOME"] = DEFAULT_CUDA_HOME
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        where = f"no {nvcc}" if cuda_home else "CUDA_HOME unset and no nvcc on PATH"
        return f"nvcc not found ({where}); set CUDA_HOME to a CUDA {torch.version.cuda} toolkit", None
    version, text = _nvcc_version(nvcc)
    if version is None:
        return text, None
    torch_major = int(torch.version.cuda.split(".")[0])
    if version[0] != torch_major:
        return (
            f"nvcc {nvcc} is CUDA {text} but torch {torch.__version__} was built with CUDA "
            f"{torch.version.cuda}; the major versions must match"
        ), None
    os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
    return None, version


def _default_arch_list(nvcc_version):
    """Ampere and Hopper SASS, plus Blackwell where nvcc knows it, and PTX of the newest, so a
    newer GPU JIT-compiles it instead of finding no kernel image."""
    archs = ["8.0", "9.0"]
    if nvcc_version >= (12, 8):
        archs += ["10.0", "12.0"]
    return ";".join(archs) + "+PTX"


def _cpu_capabilities():
    machine = platform.machine().lower()
    x86 = machine in ("x86_64", "amd64", "i686", "i386")
    available = ["default", "avx2", "avx512"] if x86 else ["default"]
    wanted = os.environ.get("TPAMP_CPU_CAPABILITIES", "").strip()
    if not wanted:
        return available
    caps = [c.strip().lower() for c in wanted.split(",") if c.strip()]
    bad = [c for c in caps if c not in available]
    if bad:
        raise SystemExit(
            f"tpamp setup: TPAMP_CPU_CAPABILITIES has {bad}; on {machine} the choices are "
            f"{available}"
        )
    return caps


SIMT_SANITIZERS = {
    # variant -> (compile flags, link flags); -g so reports name lines
    "thread": (["-fsanitize=thread", "-O1", "-g"], ["-fsanitize=thread"]),
    "address": (["-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"],
                ["-fsanitize=address"]),
}


def _simt_extensions(include_dirs, CppExtension):
    """tpamp._C_simt (and a sanitizer variant): csrc/cuda/*.cu and csrc/simt/*.cu compiled as
    C++ under the emulator. Each .cu gets a generated one-line .cpp that includes it (the compiler
    driver would hand a .cu to nvcc), so every kernel keeps its one source."""
    if _flag("TPAMP_BUILD_SIMT") != "1":
        return []
    sanitize = os.environ.get("TPAMP_SIMT_SANITIZE", "").strip().lower()
    if sanitize and sanitize not in SIMT_SANITIZERS:
        raise SystemExit(f"tpamp setup: TPAMP_SIMT_SANITIZE must be one of "
                         f"{sorted(SIMT_SANITIZERS)}, got {sanitize!r}")
    gen_dir = os.path.join(ROOT, "build", "simt_sources")
    os.makedirs(gen_dir, exist_ok=True)
    sources = []
    for cu in _sources("cuda/*.cu") + _sources("simt/*.cu"):
        stem = os.path.relpath(cu, CSRC).replace(os.sep, "_")[: -len(".cu")]
        wrapper = os.path.join(gen_dir, f"{stem}.cpp")
        text = f'// generated by setup.py: {cu} under the SIMT emulator\n#include "{os.path.join(ROOT, cu)}"\n'
        if not os.path.exists(wrapper) or open(wrapper, encoding="utf-8").read() != text:
            with open(wrapper, "w", encoding="utf-8") as f:
                f.write(text)
        sources.append(os.path.relpath(wrapper, ROOT))
    sources += _sources("cuda/*.cpp") + _sources("simt/*.cpp")
    simt_includes = [os.path.join(ROOT, CSRC, "simt", "include")] + include_dirs
    base = ["-O2", "-g0", "-fvisibility=hidden", "-Wno-unknown-pragmas", "-ffp-contract=off",
            "-DTPAMP_SIMT"]
    exts = []
    for variant in [""] + ([sanitize] if sanitize else []):
        module = "_C_simt" + (f"_{variant}" if variant else "")
        cflags, lflags = SIMT_SANITIZERS.get(variant, ([], []))
        _say(f"building tpamp.{module}: the CUDA launchers under the SIMT emulator"
             + (f" with -fsanitize={variant}" if variant else ""))
        exts.append(
            CppExtension(
                name=f"tpamp.{module}",
                sources=sources,
                include_dirs=simt_includes,
                define_macros=[("TPAMP_SIMT_MODULE", module)],
                extra_compile_args={"cxx": base + cflags},
                extra_link_args=lflags,
            )
        )
    return exts


def _extension_and_cmdclass():
    build_ext_flag = _flag("TPAMP_BUILD_EXT")
    cuda_flag = _flag("TPAMP_BUILD_CUDA")
    if os.path.exists(SKIP_NOTE):
        os.remove(SKIP_NOTE)
    if build_ext_flag == "0":
        _note_skipped("TPAMP_BUILD_EXT=0 at install: installed without the kernels tpamp._C* "
                      "(PyTorch code paths only)")
        return [], {}
    problem = _ext_build_problem()
    if problem is not None:
        if build_ext_flag == "1" or cuda_flag == "1":
            raise SystemExit(f"tpamp setup: the kernels tpamp._C* cannot be built: {problem}")
        _note_skipped(f"installed WITHOUT the kernels tpamp._C*: {problem}. tpamp uses its slower "
                      "PyTorch code paths (TPAMP_BUILD_EXT=1 makes this an error)")
        return [], {}

    with_cuda, cuda_problem, nvcc_version = False, None, None
    if cuda_flag == "0":
        cuda_problem = "TPAMP_BUILD_CUDA=0"
    else:
        cuda_problem, nvcc_version = _cuda_build_problem()
        if cuda_problem is not None and cuda_flag == "1":
            raise SystemExit(f"tpamp setup: TPAMP_BUILD_CUDA=1 but the CUDA kernels cannot be "
                             f"built: {cuda_problem}")
        with_cuda = cuda_problem is None
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list(nvcc_version))

    # Imported only now: torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    include_dirs = [os.path.join(ROOT, CSRC)]
    # No fast math anywhere: found_inf and the NaN-propagating max need IEEE comparisons.
    cxx_flags = ["-O3", "-g0", "-fvisibility=hidden"]
    if with_cuda:
        _say(
            f"building tpamp._C with the CUDA kernels (CUDA_HOME={os.environ['CUDA_HOME']}, "
            f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']!r})"
        )
        frontend = CUDAExtension(
            name="tpamp._C",
            sources=_sources("tpamp_ops.cpp") + _sources("cuda/*.cpp") + _sources("cuda/*.cu"),
            include_dirs=include_dirs,
            define_macros=[("TPAMP_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
        )
    else:
        _say(f"building tpamp._C without CUDA kernels ({cuda_problem})")
        frontend = CppExtension(
            name="tpamp._C",
            sources=_sources("tpamp_ops.cpp"),
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
        )
    exts = [frontend]
    cpu_sources = _sources("cpu/*.cpp")
    # at::parallel_for is inline: with torch's OpenMP backend it runs in parallel only in code
    # compiled with -fopenmp (libgomp.so.1 then resolves to the copy torch has already loaded).
    import torch

    omp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    caps = _cpu_capabilities()
    _say(f"building the CPU kernels for the CPU capabilities {caps}")
    for cap in caps:
        module = f"_C_cpu_{cap}"
        exts.append(
            CppExtension(
                name=f"tpamp.{module}",
                sources=cpu_sources,
                include_dirs=include_dirs,
                define_macros=[
                    ("CPU_CAPABILITY", cap.upper()),
                    (f"CPU_CAPABILITY_{cap.upper()}", None),
                    ("TPAMP_CPU_MODULE", module),
                ],
                extra_compile_args={"cxx": cxx_flags + omp + CPU_CAPABILITY_FLAGS[cap]},
                extra_link_args=omp,
            )
        )

    exts.extend(_simt_extensions(include_dirs, CppExtension))
    stdcxx = _libstdcxx_link_args()
    for ext in exts:
        ext.extra_link_args = list(ext.extra_link_args or []) + stdcxx

    class BuildEachInOwnDir(BuildExtension):
        """Objects of each extension in their own build directory: the capability modules
        compile the same csrc/cpu/*.cpp with different flags, so they must not share objects."""

        failed = []
        progress = None

        def build_extensions(self):
            self.progress = BuildProgress([e.name for e in self.extensions])
            _say(self.progress.begin(os.environ.get("MAX_JOBS")))
            try:
                super().build_extensions()
            except Exception as e:  # e.g. the compiler does not run: install without kernels
                if build_ext_flag == "1" or cuda_flag == "1":
                    raise
                _note_skipped(f"building the kernels tpamp._C* FAILED ({type(e).__name__}: {e}); "
                              "installed without them (TPAMP_BUILD_EXT=1 makes this an error)")
                self.failed.extend(self.extensions)
            _say(self.progress.finish([e.name for e in self.failed]))
            # what failed is not installed (nor copied into the source tree)
            self.extensions = [e for e in self.extensions if e not in self.failed]

        def build_extension(self, ext):
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name)
            progress = self.progress if self.progress and ext.name in self.progress.names else None
            if progress:
                _say(progress.start(ext.name, len(ext.sources)))
            ok = False
            try:
                super().build_extension(ext)
                ok = True
            except Exception as e:  # a compiler error: install without this module
                if (build_ext_flag == "1" or (cuda_flag == "1" and ext.name == "tpamp._C")
                        or ext.name.startswith("tpamp._C_simt")):
                    raise
                _note_skipped(f"building {ext.name} FAILED ({type(e).__name__}: {e}); installed "
                              "without it (TPAMP_BUILD_EXT=1 makes this an error; the compiler "
                              "output is in `pip install -v`)")
                self.failed.append(ext)
            finally:
                self.build_temp = base
                if progress:
                    _say(progress.end(ext.name, ok))

    return exts, {"build_ext": BuildEachInOwnDir}


if __name__ == "__main__":  # as pip's build backend and `python setup.py ...` run it
    ext_modules, cmdclass = _extension_and_cmdclass()
    # Everything else (name, version, dependencies, extras, packages, license) is in
    # pyproject.toml.
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
