"""safetensors files of a Hugging Face checkpoint: read by slice, written in shards with an index.

Reading goes through ``safetensors.safe_open(..., framework="numpy").get_slice(name)[index]``,
which reads only the bytes of that slice (``ml_dtypes`` is imported first so bfloat16 tensors
come back as ``ml_dtypes.bfloat16`` arrays). Every read adds its bytes to a per-process counter
(``bytes_read``), so tests can check that each process read only its own shards.

Only safetensors are read: pickled ``pytorch_model.bin`` files are refused (unpickling runs
arbitrary code), with the command that converts them.
"""

import glob
import json
import os
from collections.abc import Callable, Iterable

import numpy as np

from ringsplash._internal.optional import require

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: transformers' default ``max_shard_size`` of ``save_pretrained`` is "5GB" in decimal units
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9

_bytes_read = 0


def bytes_read() -> int:
    """Bytes of tensor data this process has read from safetensors files (all calls so far)."""
    return _bytes_read


def reset_bytes_read() -> None:
    global _bytes_read
    _bytes_read = 0


def _safetensors():
    """The safetensors package, or an ImportError saying how to install it."""
    require("safetensors.numpy", extra="hf", needed_for="reading or writing Hugging Face weights")
    import safetensors

    return safetensors


def _safe_open(file: str):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)

    return _safetensors().safe_open(file, framework="numpy")


_PICKLE_HELP = (
    "only safetensors files are read: unpickling a PyTorch .bin checkpoint can run arbitrary code, so it is never "
    "loaded here. Convert it once, where you trust the file: python -c \"from transformers import "
    "AutoModelForCausalLM as M; M.from_pretrained('{path}').save_pretrained('{path}-safetensors')\" "
    "(safe_serialization is the default), then load that directory"
)


class Checkpoint:
    """The safetensors tensors of a checkpoint directory: ``model.safetensors``, or the shards
    listed by ``model.safetensors.index.json``. Use as a context manager (closes the files)."""

    def __init__(self, path: str):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"path={path!r} is not a directory (a checkpoint directory as written by "
                                    f"save_pretrained is needed)")
        self.path = path
        index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map (tensor name -> file)")
            self.file_of = {name: os.path.join(path, file) for name, file in weight_map.items()}
            missing = sorted({f for f in self.file_of.values() if not os.path.isfile(f)})
            if missing:
                raise FileNotFoundError(f"{index} lists files that are not in {path!r}: {missing}")
        elif os.path.isfile(single):
            self.file_of = None
        else:
            pickles = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.bin")))
            if pickles:
                raise ValueError(f"{path!r} holds pickled PyTorch weights {pickles} but no safetensors: "
                                 + _PICKLE_HELP.format(path=path))
            raise FileNotFoundError(f"{path!r} holds no weights: expected {SINGLE_FILE} or {INDEX_FILE} with its "
                                    f"shards (config_from_hf reads the config alone)")
        self._handles: dict[str, object] = {}
        if self.file_of is None:
            self.file_of = {name: single for name in self._handle(single).keys()}  # noqa: SIM118 (no __iter__)

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = _safe_open(file)
        return self._handles[file]

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()  # safe_open handles close when collected

    def names(self) -> set[str]:
        return set(self.file_of)

    def _file(self, name: str) -> str:
        if name not in self.file_of:
            raise KeyError(name)
        return self.file_of[name]

    def _slice(self, name: str):
        return self._handle(self._file(name)).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype tag (``"F32"``, ``"BF16"``, ...)."""
        return self._slice(name).get_dtype()

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """``tensor[index]`` (a tuple of slices / ints), reading only those bytes.

        Through a handle of its own, dropped on return: ``safe_open`` maps the whole file, and the
        pages a read touches count in this process's RSS for as long as the map lives (a column slice
        of a row-major tensor touches every row's pages), so a map kept open across tensors would
        add the touched part of the file to the peak."""
        global _bytes_read
        sl = _safe_open(self._file(name)).get_slice(name)
        x = np.array(sl[index] if index else sl[:])  # a copy: nothing refers to the map after return
        _bytes_read += x.nbytes
        return x


def plan_shards(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Tensor names (in order) grouped into files of at most ``max_shard_size`` bytes each (a
    larger tensor gets a file of its own), as transformers groups them."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if groups[-1] and used + size > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def shard_file_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_checkpoint(path: str, sizes: dict[str, int], produce: Callable[[Iterable[str]], Iterable[tuple]],
                     *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, write: bool = True) -> list[str]:
    """Write the tensors ``sizes`` names (bytes each) into safetensors shards of at most
    ``max_shard_size`` bytes under ``path`` (one ``model.safetensors``, or numbered shards plus
    ``model.safetensors.index.json``). ``produce(names)`` yields ``(name, numpy array)`` for those
    names, one file's worth at a time; with ``write=False`` (processes other than 0) it is still
    called (it may run collectives) but nothing is written. Returns the file names."""
    save_file = _safetensors().numpy.save_file
    groups = plan_shards(sizes, max_shard_size)
    files = shard_file_names(len(groups))
    weight_map = {}
    for group, file in zip(groups, files):
        tensors = {}
        for name, x in produce(group):
            tensors[name] = np.ascontiguousarray(x)
            weight_map[name] = file
        if write:
            save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        del tensors
    if write and len(files) > 1:
        index = {"metadata": {"total_size": int(sum(sizes.values()))}, "weight_map": weight_map}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return files


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "INDEX_FILE", "SINGLE_FILE", "Checkpoint", "bytes_read", "plan_shards",
           "reset_bytes_read", "shard_file_names", "write_checkpoint"]
