"""An out-major int8 weight's product with a few fp32 rows, `y [rows, out] = (x [rows, in] @ weight.T) * scale`:
the pure-jnp reference (`int8_rows_reference`: XLA's fused multiply-and-sum over the int8 bytes) and a CPU kernel
(`int8_rows.cc`, called through XLA's FFI); the two are timed beside each other by
`evals/benchmarks/weight_dtypes.py` (docs/results).

The kernel is C++ compiled on the machine that runs it (`-O3 -march=native`: AVX-512BW or AVX2 where the CPU has
them), once, into a folder the caller names, under a digest of its source, the compiler, jaxlib's version and the
CPU (`build_cpu_kernel`); an unfinished build is never loaded (a temporary file, renamed when whole). Where no C++
compiler is found or the build fails, `load_cpu_kernel` says why once on stderr and products take the reference.
The kernel rounds each activation row to int16 in chunks of 256 inputs (a step per chunk), so its products differ
from the exact ones by at most that rounding (`tests/test_int8_rows_kernel.py` holds it to the bound).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("int8_rows.cc")
SYMBOL = "Int8RowsProduct"
SETTING = "AMPHISTA_CPU_KERNELS"  # "0": products take the reference (read once per process and folder)
COMPILE_SECONDS = 300


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be compiled here (no compiler, or the compiler refused it)."""


def int8_rows_reference(weight: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
    """`(x [rows, in] @ weight.T) * scale` for an int8 `weight [out, in]` and `scale [out]`, as `[rows, out]` fp32:
    one multiply and sum over `in`, which XLA:CPU fuses into one pass over the int8 weight (a `dot` would first
    write a widened fp32 copy of it)."""
    w = weight.astype(jnp.float32)
    x = x.astype(jnp.float32)
    # one row as a 2-D product: XLA:CPU runs the 3-D form's fused pass far slower at one row
    y = jnp.sum(w * x[0], axis=-1)[None] if x.shape[0] == 1 else jnp.sum(w[:, None] * x[None], axis=-1).T
    return y * scale.astype(jnp.float32)


def int8_rows_product(weight: jax.Array, x: jax.Array, scale: jax.Array, kernel: Path | None) -> jax.Array:
    """`int8_rows_reference`'s product, by the CPU kernel loaded from `kernel` (`load_cpu_kernel`'s library; the
    caller gives one only for the CPU backend), else by the reference."""
    if kernel is None:
        return int8_rows_reference(weight, x, scale)
    out = jax.ShapeDtypeStruct((x.shape[0], weight.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(_register(kernel), out)(weight, x.astype(jnp.float32), scale.astype(jnp.float32))


def _register(library: Path) -> str:
    """The FFI target of `library`'s handler, named by its file (its digest: two builds of one digest are one
    kernel), registered once per process."""
    name = f"amphista_{library.stem.replace('-', '_')}"
    if name not in _REGISTERED:
        handler = getattr(ctypes.cdll.LoadLibrary(str(library)), SYMBOL)
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
        _REGISTERED.add(name)
    return name


_REGISTERED: set[str] = set()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags (Linux), else the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def build_cpu_kernel(folder: Path) -> Path:
    """The kernel's shared library under `folder`, compiled first where this source, compiler, jaxlib and CPU have
    none there yet; a KernelBuildError names what failed."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (c++, g++ or clang++ on PATH, or CXX)")
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise KernelBuildError(f"{compiler} --version failed ({e})") from e
    parts = [SOURCE.read_text(), version, " ".join(flags), importlib.metadata.version("jaxlib"), _cpu()]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    library = Path(folder) / f"int8_rows-{digest}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".int8_rows-", suffix=".so.partial", dir=library.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *flags, str(SOURCE), "-o", partial], capture_output=True, text=True,
                                  timeout=COMPILE_SECONDS)
        except subprocess.TimeoutExpired as e:
            raise KernelBuildError(f"{compiler} took over {COMPILE_SECONDS} s on {SOURCE.name}") from e
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no message"]
            first = next((line for line in lines if "error" in line), lines[-1])
            raise KernelBuildError(f"{compiler} failed on {SOURCE.name}: {first.strip()}")
        os.replace(partial, library)
    finally:
        Path(partial).unlink(missing_ok=True)
    return library


@functools.cache
def load_cpu_kernel(folder: Path) -> Path | None:
    """`build_cpu_kernel(folder)`, loaded and registered with XLA; None where `AMPHISTA_CPU_KERNELS=0`, or where the
    build or the load failed (said once, in one `note:` line on stderr). Cached per process and folder."""
    if os.environ.get(SETTING, "1").strip() == "0":
        return None
    try:
        library = build_cpu_kernel(folder)
        _register(library)
        return library
    except (KernelBuildError, OSError, AttributeError) as e:
        print(f"note: int8 products take XLA's path, slower on this CPU: {e}; {SETTING}=0 silences this",
              file=sys.stderr)
        return None
