"""Builds kvpage._C by driving CMake (CMakeLists.txt is the one build description).

KVPAGE_CUDA=AUTO|ON|OFF chooses the CUDA kernels; MAX_JOBS caps build parallelism.

An install whose inputs (the C++/CUDA sources, CMakeLists.txt, torch, Python, the CUDA choice) are
those of the extension already built in place is not compiled again (KVPAGE_FORCE_BUILD=1 forces it): pip runs
the build in a fresh isolated environment each time, whose torch headers carry new paths and times, so a
CMake/ninja build directory alone could not tell that nothing changed. Where torch is not in such a throw-away
environment (pip --no-build-isolation), the CMake build directory persists under build/, keyed by Python and
torch, so a changed source recompiles only itself."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
STAMP = ROOT / "build" / "kvpage_C.stamp.json"


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def _build_inputs(torch) -> dict:
    """Everything the compiled extension depends on, as a fingerprint (sources by content, not time)."""
    digest = hashlib.sha256()
    sources = [ROOT / "CMakeLists.txt"] + sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file())
    for path in sources:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"sources": digest.hexdigest(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "python": sysconfig.get_config_var("EXT_SUFFIX"), "kvpage_cuda": os.environ.get("KVPAGE_CUDA", "AUTO"),
            "nvcc": shutil.which("nvcc")}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _up_to_date(built: Path, inputs: dict) -> bool:
    """The extension at built is the one this setup.py last compiled, from these inputs."""
    if os.environ.get("KVPAGE_FORCE_BUILD") == "1" or not built.is_file() or not STAMP.is_file():
        return False
    try:
        stamp = json.loads(STAMP.read_text())
    except ValueError:
        return False
    return stamp == {"inputs": inputs, "sha256": _sha256(built)}


def _build_dir(torch, build_temp: str) -> Path:
    """A persistent CMake directory, unless torch lives in pip's throw-away build environment (its cached
    paths would point at a deleted directory next time)."""
    torch_dir = Path(torch.__file__).resolve().parent
    if "pip-build-env" in str(torch_dir):
        return Path(build_temp).resolve() / "cmake"
    key = hashlib.sha256(f"{sys.executable}|{torch_dir}|{torch.__version__}".encode()).hexdigest()[:12]
    return ROOT / "build" / f"cmake-py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}-{key}"


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11
        import torch.utils

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        inputs = _build_inputs(torch)
        installed = self._installed_copy(ext, target)
        if _up_to_date(installed, inputs):
            print(f"kvpage: {target.name} is up to date with its sources and torch {torch.__version__}: not"
                  f" compiled again (KVPAGE_FORCE_BUILD=1 forces a build)", flush=True)
            if installed != target:  # setuptools copies target back over the in-place copy
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(installed, target)
            return
        build_dir = _build_dir(torch, self.build_temp)
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", str(ROOT), "-G", "Ninja",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DKVPAGE_OUTPUT_DIR={target.parent}",
            f"-DKVPAGE_CUDA={os.environ.get('KVPAGE_CUDA', 'AUTO')}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        print(f"kvpage: compiling the C++ extension in {build_dir} (a few minutes on 2 cores; once per source"
              f" change)", flush=True)
        subprocess.check_call(configure, cwd=build_dir)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_dir)
        if target.is_file():
            STAMP.parent.mkdir(parents=True, exist_ok=True)
            STAMP.write_text(json.dumps({"inputs": inputs, "sha256": _sha256(target)}))

    def _installed_copy(self, ext, target: Path) -> Path:
        """Where the extension an import finds lives: pip install -e builds into a fresh temporary directory
        and setuptools copies the result into the source tree, python/kvpage/."""
        if not getattr(self, "editable_mode", False):
            return target
        inplace, _ = self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)
        return (ROOT / inplace).resolve()


setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("kvpage._C")],
    cmdclass={"build_ext": CMakeBuild},
)
