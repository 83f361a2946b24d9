"""Builds kvpage's CUDA backend (csrc/cuda: kernels and op glue, unmodified) as a CPU extension
run by the emulator in runtime/ (see runtime/cuda_emu.h for what it models).

The sources are copied into a build directory and two CUDA-only constructs rewritten on the way:
`kernel<<<grid, block, smem, stream>>>(args)` becomes `::emu::launch(kernel, grid, block, smem,
stream)(args)`, and each `__shared__` declaration a thread_local static (a block's fibers share
one OS thread; blocks run on several) the emulator refills with 0xFF bytes at every block start
(`extern __shared__` arrays: the block's dynamic shared memory). Everything
else compiles as it is, with g++ and CUDA's own headers for the types (cuda_fp16.h & co. work in
host code). Needs the CUDA toolkit's headers (CUDA_HOME or /usr/local/cuda) and x86-64.

    python tests/cuda_emu/build_emu.py      # builds (or finds) it and prints where
"""
import hashlib
import os
import platform
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
RUNTIME = HERE / "runtime"
# The argument checks the CUDA ops share with the CPU backend (csrc/checks.h).
CHECKS = [CSRC / name for name in ("checks.cpp", "attention_checks.cpp", "cache_op_checks.cpp")]
NAME = "kvpage_cuda_emu"

LAUNCH = re.compile(r"\b([A-Za-z_]\w*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(")
EXTERN_SHARED = re.compile(r"^(\s*)extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(.+?)\s*\b(\w+)\s*\[\s*\]\s*;")
SHARED = re.compile(r"^(\s*)__shared__\s+(.*);\s*(//.*)?$")


def cuda_include_dir():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    return None


def unavailable_reason():
    """Why the emulator cannot be built here, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the emulator's fiber switch is x86-64 only (this is {platform.machine()})"
    if cuda_include_dir() is None:
        return "the CUDA toolkit's headers (cuda_runtime.h) were not found (set CUDA_HOME)"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja; the [test] extra has it)"
    return None


def _split_declarators(text):
    """'float a[2][3], b[4]' -> ['float a[2][3]', 'b[4]'] (commas inside brackets stay)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[(<"
        depth -= ch in "])>"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def _declared_name(declarator):
    match = re.match(r"^(.*?)(\w+)\s*((?:\[[^\]]*\]\s*)*)$", declarator)
    if match is None:
        raise ValueError(f"cannot parse __shared__ declarator {declarator!r}")
    return match.group(2)


def rewrite_shared(line):
    match = EXTERN_SHARED.match(line)
    if match:
        indent, type_, name = match.groups()
        return f"{indent}{type_}* {name} = static_cast<{type_}*>(::emu::dynamic_smem());\n"
    match = SHARED.match(line)
    if match is None:
        return line
    indent, declaration, _ = match.groups()
    names = [_declared_name(d) for d in _split_declarators(declaration)]
    registrations = " ".join(f"::emu::shared_decl(&{n}, sizeof({n}));" for n in names)
    return f"{indent}static thread_local {declaration}; {registrations}\n"


def rewrite_device_source(text):
    text = LAUNCH.sub(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)})(", text)
    return "".join(rewrite_shared(line) for line in text.splitlines(keepends=True))


def _write_if_changed(path, text):
    """Keeps the file (and its mtime) when the text is the same, so ninja rebuilds nothing."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def stage_sources(src_dir):
    """Copies csrc into src_dir (rewritten); returns the translation units to compile."""
    units = []
    (src_dir / "cuda").mkdir(parents=True, exist_ok=True)
    for path in [*CSRC.glob("*.h"), *CHECKS]:
        _write_if_changed(src_dir / path.name, path.read_text())
    units += [src_dir / path.name for path in CHECKS]
    for path in sorted((CSRC / "cuda").iterdir()):
        text = path.read_text()
        if path.suffix in (".cu", ".cuh"):
            text = '#include "cuda_emu.h"\n' + rewrite_device_source(text)
            target = src_dir / "cuda" / (path.stem + "_cu.cpp" if path.suffix == ".cu" else path.name)
        elif path.name.startswith("ops_"):
            text = '#include "emu_host.h"\n' + text
            target = src_dir / "cuda" / path.name
        elif path.name == "glue.cpp":
            continue  # runtime/emu_glue.cpp stands in for it
        else:
            target = src_dir / "cuda" / path.name
        _write_if_changed(target, text)
        if target.suffix == ".cpp":
            units.append(target)
    units += [RUNTIME / name for name in ("emu_runtime.cpp", "emu_collectives.cpp", "emu_cuda_api.cpp",
                                           "emu_probes.cpp", "emu_glue.cpp", "emu_bindings.cpp")]
    return units


def source_digest():
    h = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.h"), *CHECKS, *(CSRC / "cuda").iterdir(),
                        *RUNTIME.rglob("*"), Path(__file__)]):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build_dir(asan=False):
    base = Path(os.environ.get("KVPAGE_CUDA_EMU_BUILD", Path.home() / ".cache" / "kvpage" / "cuda_emu"))
    return base / (source_digest() + ("-asan" if asan else ""))


def asan_runtime():
    """The compiler's AddressSanitizer runtime, which a process must preload to import an asan=True
    build (python itself is not instrumented)."""
    import subprocess

    compiler = shutil.which("g++") or "c++"
    path = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def load(verbose=False, asan=False):
    """Builds (once per source state) and imports the emulator extension. asan=True instruments
    kernels and glue with AddressSanitizer (a separate build: import it only in a process started
    with LD_PRELOAD=asan_runtime())."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"kvpage CUDA emulator unavailable: {reason}")
    from torch.utils import cpp_extension

    out = build_dir(asan)
    units = stage_sources(out / "src")
    cuda_include = cuda_include_dir()
    flags = ["-O2", "-DKVPAGE_WITH_CUDA", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
             # CUDA's headers declare __host__ __device__ functions that g++ sees as plain ones.
             "-Wno-attributes"]
    # -O1 under ASan: half the compile time, and ASan's checks do not need more.
    sanitize = ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1"] if asan else []
    # A launch spreads its blocks over OpenMP threads: torch's own runtime where the wheel bundles
    # one (one thread pool in the process, sized by torch.set_num_threads).
    torch_gomp = sorted((Path(cpp_extension.TORCH_LIB_PATH)).glob("libgomp*.so*"))
    openmp = [str(torch_gomp[0])] if torch_gomp else ["-fopenmp"]
    # The compiler must not inherit an ASan preload (it would run on ASan's slow allocator).
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        return cpp_extension.load(
            name=NAME + ("_asan" if asan else ""), sources=[str(u) for u in units], build_directory=str(out),
            verbose=verbose, extra_cflags=flags + sanitize + ["-fopenmp"], extra_ldflags=sanitize + openmp,
            extra_include_paths=[str(RUNTIME / "fake_include"), str(RUNTIME), str(out / "src" / "cuda"),
                                 str(out / "src"), str(cuda_include)])
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload


if __name__ == "__main__":
    module = load(verbose="-v" in sys.argv, asan="--asan" in sys.argv)
    print(module.__file__)
