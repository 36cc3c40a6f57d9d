"""Tensors from PyTorch's own files (`torch.save`: `pytorch_model.bin`, `medusa_lm_head.pt`) and from safetensors,
as numpy arrays, and state dicts written in `torch.save`'s format (`write_torch_file`), all without torch.

A `torch.save` file (PyTorch >= 1.6) is a zip: `<name>/data.pkl` pickles the state dict, each tensor as
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` whose storage is a persistent id
`("storage", <dtype>Storage, key, location, numel)` naming the raw bytes `<name>/data/<key>`. The unpickler
below builds exactly those calls and refuses every other global, so a file cannot run code.
"""

from __future__ import annotations

import collections
import json
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from amphista_jax.infra.errors import UserError

STORAGE_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class TensorFileError(UserError, ValueError):
    """A weights file that cannot be read as tensors."""


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_: object) -> np.ndarray:
    """`torch._utils._rebuild_tensor_v2`: a strided view of the storage, copied into its own array."""
    item = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], tuple(size), tuple(s * item for s in stride))
    return np.array(view)


def _rebuild_parameter(data: np.ndarray, *_: object) -> np.ndarray:
    return data


class _StateDictUnpickler(pickle.Unpickler):
    SAFE = {("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}

    def __init__(self, archive: zipfile.ZipFile, prefix: str, path: Path) -> None:
        super().__init__(archive.open(f"{prefix}/data.pkl"))
        self.archive, self.prefix, self.path = archive, prefix, path

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in self.SAFE:
            return self.SAFE[module, name]
        if module == "torch" and name in STORAGE_DTYPES:
            return name
        raise TensorFileError(f"{self.path} holds {module}.{name}, not only tensors: re-save it as safetensors")

    def persistent_load(self, pid: tuple) -> np.ndarray:
        kind, storage, key, _location, numel = pid
        if kind != "storage" or storage not in STORAGE_DTYPES:
            raise TensorFileError(f"{self.path}: unknown storage {pid[:2]}: re-save it as safetensors")
        data = self.archive.read(f"{self.prefix}/data/{key}")
        return np.frombuffer(data, STORAGE_DTYPES[storage], count=numel)


def read_torch_file(path: str | Path) -> dict[str, np.ndarray]:
    """The state dict `torch.save` wrote to `path` (zip format), as numpy arrays."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise TensorFileError(f"{path} is not a zip-format torch file (saved by PyTorch < 1.6, or not PyTorch's): "
                              "re-save it with a recent PyTorch or as safetensors")
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise TensorFileError(f"{path} has {len(pickles)} data.pkl entries, not one")
        state = _StateDictUnpickler(archive, pickles[0].removesuffix("/data.pkl"), path).load()
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise TensorFileError(f"{path} does not hold a flat state dict of tensors")
    return dict(state)


def _op_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw  # BINUNICODE


def _op_int(n: int) -> bytes:
    if 0 <= n < 2**31:
        return b"J" + n.to_bytes(4, "little", signed=True)  # BININT
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _op_tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"  # MARK ... TUPLE


def _op_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _tensor_pickle(key: str, storage: str, x: np.ndarray) -> bytes:
    """`torch._utils._rebuild_tensor_v2(storage key, 0, shape, contiguous strides, False, OrderedDict())`."""
    strides = [int(np.prod(x.shape[i + 1:], dtype=np.int64)) for i in range(x.ndim)]
    pid = _op_tuple([_op_str("storage"), _op_global("torch", storage), _op_str(key), _op_str("cpu"), _op_int(x.size)])
    args = [pid + b"Q", _op_int(0), _op_tuple([_op_int(n) for n in x.shape]), _op_tuple([_op_int(n) for n in strides]),
            b"\x89", _op_global("collections", "OrderedDict") + b")R"]  # NEWFALSE; OrderedDict()
    return _op_global("torch._utils", "_rebuild_tensor_v2") + _op_tuple(args) + b"R"


def write_torch_file(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """`tensors` as `torch.save` writes a state dict (zip format, pickle protocol 2, each tensor's bytes in
    `archive/data/<i>`), loadable by `torch.load(weights_only=True)` and `read_torch_file`."""
    storages = {np.dtype(v): k for k, v in STORAGE_DTYPES.items()}
    entries, items = {}, []
    for i, (name, value) in enumerate(tensors.items()):
        x = np.array(value, order="C")  # 0-d stays 0-d (np.ascontiguousarray makes it 1-d)
        if x.dtype not in storages:
            raise TensorFileError(f"{name}: dtype {x.dtype} has no torch storage")
        entries[f"archive/data/{i}"] = x.astype(x.dtype.newbyteorder("<"), copy=False).tobytes()
        items.append(_op_str(name) + _tensor_pickle(str(i), storages[x.dtype], x))
    data = b"\x80\x02}(" + b"".join(items) + b"u."  # PROTO 2, EMPTY_DICT, MARK ... SETITEMS, STOP
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data)
        archive.writestr("archive/byteorder", "little")
        for name, raw in entries.items():
            archive.writestr(name, raw)
        archive.writestr("archive/version", "3\n")


SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
                      "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                      "BOOL": np.bool_}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (an 8-byte header length, a JSON header of dtype / shape / byte offsets,
    the bytes), bf16 included, as numpy arrays."""
    path = Path(path)
    data = path.read_bytes()
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8: 8 + n])
        return {name: np.frombuffer(data[8 + n + a: 8 + n + b], SAFETENSORS_DTYPES[t["dtype"]]).reshape(t["shape"])
                for name, t in header.items() if name != "__metadata__" for a, b in [t["data_offsets"]]}
    except (ValueError, KeyError, TypeError) as e:
        raise TensorFileError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a `.safetensors` file or a `torch.save` file (`.pt`, `.bin`), as numpy arrays."""
    return read_safetensors(path) if Path(path).suffix == ".safetensors" else read_torch_file(path)
