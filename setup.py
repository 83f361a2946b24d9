"""Builds kvpage._C by driving CMake (CMakeLists.txt is the one build description).

KVPAGE_CUDA=AUTO|ON|OFF chooses the CUDA kernels; MAX_JOBS caps build parallelism."""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11
        import torch.utils

        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", str(ROOT), "-G", "Ninja",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DKVPAGE_OUTPUT_DIR={output_dir}",
            f"-DKVPAGE_CUDA={os.environ.get('KVPAGE_CUDA', 'AUTO')}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        subprocess.check_call(configure, cwd=build_dir)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_dir)


setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("kvpage._C")],
    cmdclass={"build_ext": CMakeBuild},
)
