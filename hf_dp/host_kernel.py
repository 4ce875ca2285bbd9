"""The host engine's noise in one compiled pass (`hf_dp/host_noise.c`), built at first use with the system's C compiler.

numpy and torch draw a step's noise on the CPU in about fifteen passes over memory (~20 ns an element); the C kernel
computes each tile's Philox words, Box–Muller and rounded sum in cache (8–11 ns, a third to a half of it the ten
rounds of 64-bit multiplications; on CPUs with AVX-512 it times both words engines when it loads and keeps the
faster, the same words). It gives numpy's words bit for bit, the same float64 operations, and calls the very `log`,
`cos`, `sin` and `sqrt` torch's CPU ops call (MKL VML's, found in torch's own library and checked against torch's
results when the kernel loads), so the noise is the numpy path's bit for bit; where torch does not use MKL, glibc's
libmvec (a normal within a few ulps, 5 at most in 10⁶ draws: a rounded sum may then differ by one quantum about once
in 10⁸ elements). It is built for x86-64 CPUs with AVX2 and FMA (x86-64-v3) on Linux with glibc, into a temporary
folder, once per process (a quarter of a second); elsewhere, with no C compiler, or with `HF_DP_HOST_KERNEL=0`,
`library()` is None and hf_dp/noise.py draws with numpy and torch, the same noise, about 2.5× slower.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)
__all__ = ["library", "failure", "SOURCE", "FLAGS"]

SOURCE = Path(__file__).with_name("host_noise.c")
FLAGS = ["-O3", "-funroll-loops", "-march=x86-64-v3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_CPU_FLAGS = {"avx", "avx2", "fma", "bmi1", "bmi2", "movbe", "f16c", "abm"}  # x86-64-v3
_lock = threading.Lock()
_library = None
_failure: str | None = None  # why the kernel is not used, once that is known


class HostKernel:
    """The compiled functions, called with numpy arrays (ctypes releases the GIL during each call)."""

    def __init__(self, handle: ctypes.CDLL):
        u64, i64, pointer, double = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
        for name in ("hf_dp_words", "hf_dp_normals"):
            getattr(handle, name).argtypes = [u64, u64, u64, u64, i64, pointer]
            getattr(handle, name).restype = None
        for name in ("hf_dp_add_f32", "hf_dp_add_f64"):
            getattr(handle, name).argtypes = [u64, u64, u64, u64, i64, pointer, double, double]
            getattr(handle, name).restype = None
        handle.hf_dp_use.argtypes = [pointer] * 5
        handle.hf_dp_use.restype = None
        handle.hf_dp_words_engine.argtypes = [ctypes.c_int]
        handle.hf_dp_words_engine.restype = ctypes.c_int
        self._handle = handle
        self._mkl = _torchs_mkl_functions()
        self.use_torchs_functions(True)
        self._keep_faster_words_engine()

    def use_avx512(self, use: bool) -> bool:
        """The Philox words from AVX-512 with the scalar multiplier beside it (`use=True`, where the CPU has
        AVX-512F and DQ) or from the scalar loop: the same words. Returns whether AVX-512 is now used."""
        used = bool(self._handle.hf_dp_words_engine(int(use)))
        self.words_engine = "AVX-512 + scalar" if used else "scalar"
        return used

    def _keep_faster_words_engine(self) -> None:
        """Keeps whichever words engine is faster on this CPU (timed on 2¹⁴ pairs, best of 5; about 2 ms): AVX-512
        wins by about 1.7x on an AMD EPYC (Zen 4); a CPU that runs it slowly keeps the scalar loop."""
        if not self.use_avx512(True):
            return
        out, best = np.empty((1 << 14, 4), dtype=np.uint64), {}
        for engine in (True, False, True, False):
            self.use_avx512(engine)
            for _ in range(5):
                began = time.perf_counter()
                self._handle.hf_dp_words(1, 2, 3, 0, len(out), out.ctypes.data)
                best[engine] = min(best.get(engine, float("inf")), time.perf_counter() - began)
        self.use_avx512(best[True] < best[False])

    def use_torchs_functions(self, use: bool) -> None:
        """log, cos and sin from torch's own MKL VML where torch uses it (the numpy path's values, bit for bit), or
        from glibc's libmvec (`use=False`, or where torch does not use MKL: normals within a few ulps)."""
        mkl = self._mkl if use else None
        self._handle.hf_dp_use(*(mkl or (None,) * 5))
        self.functions = "MKL VML" if mkl else "libmvec"

    def words(self, key: np.ndarray, parameter: int, first_pair: int, pairs: int) -> np.ndarray:
        """`(pairs, 4)` 53-bit words: what `np.random.Philox(key, counter=parameter·2⁶⁴ + first_pair − 1)` gives."""
        out = np.empty((pairs, 4), dtype=np.uint64)
        self._handle.hf_dp_words(int(key[0]), int(key[1]), parameter, first_pair, pairs, out.ctypes.data)
        return out

    def normals(self, key: np.ndarray, parameter: int, first: int, count: int) -> np.ndarray:
        """The float64 normals of elements [first, first + count) of a parameter."""
        out = np.empty(count)
        self._handle.hf_dp_normals(int(key[0]), int(key[1]), parameter, first, count, out.ctypes.data)
        return out

    def add(self, key: np.ndarray, parameter: int, first: int, grad: np.ndarray, std: float, quantum: float) -> None:
        """grad ← round((grad + std·normal) / quantum)·quantum in place: a contiguous float32 or float64 array."""
        function = {np.dtype(np.float32): self._handle.hf_dp_add_f32,
                    np.dtype(np.float64): self._handle.hf_dp_add_f64}[grad.dtype]
        if not grad.flags.c_contiguous:
            raise ValueError("the host noise kernel writes contiguous gradients only")
        function(int(key[0]), int(key[1]), parameter, first, grad.size, grad.ctypes.data, std, quantum)


def _torchs_mkl_functions() -> tuple[int, ...] | None:
    """The addresses of MKL VML's vdLn, vdCos, vdSin and vdSqrt and of MKL_Set_Num_Threads_Local in torch's CPU
    library, where torch's float64 log, cos, sin and sqrt give exactly their values (on a probe of tiny, ordinary
    and large arguments); else None."""
    import torch

    try:
        library_ = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        functions = [getattr(library_, name) for name in ("vdLn", "vdCos", "vdSin", "vdSqrt")]
        threads = library_.MKL_Set_Num_Threads_Local  # C binding (the lower-case names are Fortran's)
    except (OSError, AttributeError):
        return None
    rng = np.random.default_rng(0)
    uniforms = np.concatenate([rng.random(2048), rng.random(1024) * 2.0**-100, rng.random(1024) * 2.0**-150])
    angles, squares = rng.random(4096) * (2 * np.pi), rng.random(4096) * 700
    for function, values, reference in zip(functions, (uniforms, angles, angles, squares),
                                           (torch.log, torch.cos, torch.sin, torch.sqrt)):
        function.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        function.restype = None
        out = np.empty_like(values)
        function(len(values), values.ctypes.data, out.ctypes.data)
        if not np.array_equal(out, reference(torch.from_numpy(values)).numpy()):
            return None
    return tuple(ctypes.cast(function, ctypes.c_void_p).value for function in (*functions, threads))


def library() -> HostKernel | None:
    """The compiled kernel, built on the first call; None where it cannot run (`failure()` says why)."""
    global _library, _failure
    if os.environ.get("HF_DP_HOST_KERNEL", "1") == "0":
        return None
    if _library is not None or _failure is not None:
        return _library
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = HostKernel(_build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _failure = str(error).splitlines()[0] if str(error) else type(error).__name__
                log = logger.info if isinstance(error, _Unsupported) else logger.warning
                log("The compiled host noise kernel is not used (%s): the noise is drawn with numpy and torch, the "
                    "same noise at about 2.5x the time.", _failure)
    return _library


def failure() -> str | None:
    """Why `library()` is None (after a first call), or None."""
    if os.environ.get("HF_DP_HOST_KERNEL", "1") == "0":
        return "HF_DP_HOST_KERNEL=0"
    return _failure


class _Unsupported(RuntimeError):
    """A machine the kernel is not built for (not a fault to report loudly)."""


def _build() -> ctypes.CDLL:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise _Unsupported(f"built for Linux on x86-64 only, not {platform.system()} on {platform.machine()}")
    missing = _CPU_FLAGS - _cpu_flags()
    if missing:
        raise _Unsupported(f"the CPU lacks {', '.join(sorted(missing))} (x86-64-v3)")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    folder = tempfile.mkdtemp(prefix="hf_dp-host-noise-")
    try:
        built = Path(folder) / "host_noise.so"
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lmvec", "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(result.stderr or result.stdout).strip()[:300]}")
        return ctypes.CDLL(str(built))  # the library stays mapped once its file is removed
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())
