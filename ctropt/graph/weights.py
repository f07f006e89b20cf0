"""Large tensors outside the model proto while passes run (issue 48: gigabyte embedding tables).

A `WeightStore` is a work folder with one data file that holds a model's large tensors: the input's (copied in
once, file to file by the kernel where they were external data, so no table passes through memory; tables of one
width one after the other in the order the graph reads them) and those the passes make (each written once). The
file is mapped once: every model and session that reads the same bytes reads the same pages. While one is active the
model protos the passes exchange reference those files instead of carrying the bytes, so exporting a graph,
shape inference, the checker, hashing and verification sessions cost what the graph costs, not the tables:

- `to_graph` gives each stored tensor a `MappedValues`: its values are a read-only `np.memmap` of the file, read
  only where a rule reads them (and then only the pages it reads);
- `export_graph` writes a stored tensor back as its reference, and a new array of `THRESHOLD` bytes or more (a
  joined table) into the store, once;
- onnxruntime sessions take the stored tensors from the same mapped arrays (`attach`: no copy, pages read once
  for all sessions), OpenVINO and onnx's checker read a proto saved in the folder (`path_for`);
- `save` writes the result with its tensors in `OUT.data` (names unchanged), `inline` puts them back in the proto.

Only the main graph's initializers are stored (tables are there); subgraph tensors stay in the proto.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

THRESHOLD = 1 << 20  # bytes: a tensor this large lives in the store
ALIGN = 1 << 16  # the offsets the store writes at (onnxruntime maps external data at its allocation granularity)
MADE = "ctropt-weights.data"
PREFIX = ".ctropt-work-"
_ACTIVE: list["WeightStore"] = []


def active() -> "WeightStore | None":
    """The store the running optimization keeps its large tensors in, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def external_ref(t: onnx.TensorProto) -> tuple[str, int, int] | None:
    """(location, offset, length) of a tensor kept in external data; None for one inline."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    length = int(info.get("length", int(np.prod(t.dims, dtype=np.int64)) * dtype.itemsize))
    return info["location"], int(info.get("offset", 0)), length


def stored(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The main graph's initializers kept in external data."""
    return [t for t in model.graph.initializer if external_ref(t) is not None]


def nbytes(t: onnx.TensorProto) -> int:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    return int(np.prod(t.dims, dtype=np.int64)) * dtype.itemsize


class MappedValues(LazyValues):
    """A stored tensor's values, loaded as a read-only memory map of the store's file."""

    def __init__(self, tensor: onnx.TensorProto, store: "WeightStore"):
        super().__init__(tensor)
        self.store = store

    def load(self) -> np.ndarray:
        return self.store.array(self.tensor)


class WeightStore:
    """A work folder holding a model's large tensors (see the module docstring). Use `WeightStore.opened(near)`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._files: dict[str, np.memmap] = {}  # location: the file, mapped once
        self._maps: dict[tuple, np.ndarray] = {}  # (location, offset, length): the tensor's view, made once
        self._refs: dict[tuple, onnx.TensorProto] = {}  # where a tensor's view lies (`_where`) → its reference
        self._written: dict[int, onnx.TensorProto] = {}  # id(array written) → its reference, while it lives
        self._end = 0
        self._count = itertools.count()

    @classmethod
    @contextlib.contextmanager
    def opened(cls, near: Path | None = None) -> Iterator["WeightStore"]:
        """A store in a new folder `.ctropt-work-PID-*` (in `near`, else the temporary directory), active until the
        block ends, then removed with everything in it, also on SIGTERM; the folders of runs that were killed
        (their PID gone) are removed when the next one opens there."""
        near = Path(near or tempfile.gettempdir())
        _remove_orphans(near)
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=near))
        store = cls(folder)
        _ACTIVE.append(store)
        try:
            with _exit_on_sigterm():
                yield store
        finally:
            _ACTIVE.remove(store)
            store.close()

    def close(self) -> None:
        self._files.clear()
        self._maps.clear()
        self._refs.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    # ------------------------------------------------------------------------------------------- taking tensors in

    def adopt(self, model: onnx.ModelProto, base: Path | None = None) -> onnx.ModelProto:
        """The model (changed in place) with its large main-graph initializers in the store's file, copied in
        once (external data file to file by the kernel, relative to `base`; inline bytes written). Tables of one
        width are laid out one after the other in the order the graph reads them, so that joining them
        (fuse-parallel-embeddings) is a view of what is there: one copy of the bytes serves the model before and
        after. External data of subgraphs is read into the proto."""
        big = [t for t in model.graph.initializer if t.data_type != onnx.TensorProto.STRING and
               (external_ref(t) is not None or nbytes(t) >= THRESHOLD)]
        out = os.open(self.folder / MADE, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            last = None
            for t in _lookup_order(model.graph, big):
                kind = (t.data_type, tuple(t.dims[1:]))
                at = self._end if kind == last else -(-self._end // ALIGN) * ALIGN  # one width: packed
                ref = external_ref(t)
                if ref is not None:
                    _copy_range(Path(base or ".") / ref[0], ref[1], ref[2], out, at)
                else:
                    _write_at(out, np.ascontiguousarray(numpy_helper.to_array(t)), at)
                t.CopyFrom(self._reference(t.name, t.data_type, list(t.dims), at, nbytes(t)))
                self._end, last = at + nbytes(t), kind
        finally:
            os.close(out)
        for g in _subgraphs(model.graph):
            for t in g.initializer:
                if external_ref(t) is not None:
                    onnx.external_data_helper.load_external_data_for_tensor(t, str(base or "."))
                    t.data_location = onnx.TensorProto.DEFAULT
                    del t.external_data[:]
        return model

    def _reference(self, name: str, data_type: int, dims: list, offset: int, length: int) -> onnx.TensorProto:
        ref = onnx.TensorProto(name=name, data_type=data_type, dims=dims, data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", MADE), ("offset", str(offset)), ("length", str(length))):
            ref.external_data.add(key=key, value=value)
        return ref

    def write(self, array: np.ndarray, name: str) -> onnx.TensorProto:
        """A reference to `array` written into the store's file (once per array object while it lives)."""
        done = self._written.get(id(array))
        if done is not None:
            return _renamed(done, name)
        data = np.ascontiguousarray(array)
        offset = -(-self._end // ALIGN) * ALIGN
        out = os.open(self.folder / MADE, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            _write_at(out, data, offset)
        finally:
            os.close(out)
        self._end = offset + data.nbytes
        ref = self._reference(name, onnx.helper.np_dtype_to_tensor_dtype(data.dtype), list(data.shape), offset,
                              data.nbytes)
        self._written[id(array)] = ref
        weakref.finalize(array, self._written.pop, id(array), None)
        return ref

    def join(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The arrays (one dtype, equal trailing dims) concatenated on axis 0: a view of the store's file where
        they lie there one after the other (as `adopt` lays tables out), else written into it once (a stored one
        copied file to file, never read into memory); the result is read like a stored tensor."""
        refs = [self.reference(a) for a in arrays]
        spans = [external_ref(r) if r is not None else None for r in refs]
        rows = sum(a.shape[0] for a in arrays)
        shape = [rows, *arrays[0].shape[1:]]
        length = rows * int(np.prod(shape[1:], dtype=np.int64)) * arrays[0].dtype.itemsize
        data_type = onnx.helper.np_dtype_to_tensor_dtype(arrays[0].dtype)
        if all(s is not None for s in spans) and all(b[1] == a[1] + a[2] for a, b in zip(spans, spans[1:])):
            return self.array(self._reference("joined", data_type, shape, spans[0][1], length))
        offset = at = -(-self._end // ALIGN) * ALIGN
        out = os.open(self.folder / MADE, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for a, span in zip(arrays, spans):
                if span is None:
                    _write_at(out, np.ascontiguousarray(a), at)
                else:
                    _copy_range(self.folder / MADE, span[1], span[2], out, at)
                at += a.nbytes
        finally:
            os.close(out)
        self._end = offset + length
        return self.array(self._reference("joined", data_type, shape, offset, length))

    # ------------------------------------------------------------------------------------------------ reading

    def array(self, t: onnx.TensorProto) -> np.ndarray:
        """A stored tensor's values: a read-only view of the store's file, mapped once (so every model that reads
        the same bytes reads the same pages), one array per tensor."""
        location, offset, length = external_ref(t)
        key = (location, offset, length)
        if key not in self._maps:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
            shape = tuple(int(d) for d in t.dims)
            if not length:
                values = np.zeros(shape, dtype)
            else:
                values = self._file(location, offset + length)[offset:offset + length].view(dtype).reshape(shape)
            self._maps[key] = values
            self._refs[_where(values)] = _renamed(t, t.name)
        return self._maps[key]

    def _file(self, location: str, end: int) -> np.ndarray:
        """The whole file as bytes, mapped once (again when it has grown past `end`)."""
        mapped = self._files.get(location)
        if mapped is None or len(mapped) < end:
            mapped = np.memmap(self.folder / location, dtype=np.uint8, mode="r")
            mapped._mmap.madvise(mmap.MADV_RANDOM)  # lookups read scattered rows: no read-ahead around each
            self._files[location] = mapped
        return mapped

    def reference(self, values) -> onnx.TensorProto | None:
        """The reference of an array the store mapped (`array`) or wrote (`write`), else None."""
        if isinstance(values, np.ndarray) and values.flags.c_contiguous:
            known = self._refs.get(_where(values))  # also a view of one (np.ascontiguousarray makes one)
            if known is not None:
                return known
        return self._written.get(id(values))

    def initializers(self, model: onnx.ModelProto) -> dict[str, np.ndarray]:
        """{name: mapped values} of the model's stored initializers (for onnxruntime's external initializers)."""
        return {t.name: self.array(t) for t in stored(model)}

    def path_for(self, model: onnx.ModelProto) -> Path:
        """The model saved in the folder, its references resolving there (OpenVINO and onnx's checker read it)."""
        path = self.folder / f"model-{next(self._count)}.onnx"
        onnx.save_model(model, str(path))
        return path

    # ------------------------------------------------------------------------------------------------ writing out

    def inline(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of the model with its stored tensors' bytes in the proto."""
        out = onnx.ModelProto()
        out.CopyFrom(model)
        for t in stored(out):
            t.CopyFrom(numpy_helper.from_array(np.asarray(self.array(t)), t.name))
        return out

    def save(self, model: onnx.ModelProto, path: Path) -> None:
        """`model` to `path` with its stored tensors in `path.name + '.data'` (each written once, same names)."""
        out = onnx.ModelProto()
        out.CopyFrom(model)
        data, end = Path(str(path) + ".data"), 0
        with open(data, "wb") as f:
            for t in stored(out):
                location, start, length = external_ref(t)
                end = -(-end // ALIGN) * ALIGN
                del t.external_data[:]
                for key, value in (("location", data.name), ("offset", str(end)), ("length", str(length))):
                    t.external_data.add(key=key, value=value)
                with open(self.folder / location, "rb") as source:
                    while length:  # file to file in the kernel: no table passes through this process
                        done = os.copy_file_range(source.fileno(), f.fileno(), length, start, end)
                        start, length, end = start + done, length - done, end + done
        onnx.save_model(out, str(path))


def _remove_orphans(near: Path) -> None:
    """The work folders in `near` of runs whose process is gone (killed: no `finally` ran)."""
    for folder in near.glob(f"{PREFIX}*-*"):
        pid = folder.name[len(PREFIX):].split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM (a kill, a timeout) exits through Python, so that `finally` blocks remove what they made."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _lookup_order(graph: onnx.GraphProto, tensors: list[onnx.TensorProto]) -> list[onnx.TensorProto]:
    """The tensors grouped by kind (dtype and trailing dims), the tables of a kind in the order the graph's Gathers
    read them, the kinds in the order they are first read; tensors no Gather reads last."""
    first: dict[str, int] = {}
    for i, n in enumerate(graph.node):
        if n.op_type == "Gather" and n.input:
            first.setdefault(n.input[0], i)
    kinds: dict[tuple, int] = {}
    for t in sorted((t for t in tensors if t.name in first), key=lambda t: first[t.name]):
        kinds.setdefault((t.data_type, tuple(t.dims[1:])), len(kinds))
    never = len(graph.node) + len(kinds)
    return sorted(tensors, key=lambda t: (kinds.get((t.data_type, tuple(t.dims[1:])), never) if t.name in first
                                          else never + 1, first.get(t.name, never)))


def _where(values: np.ndarray) -> tuple:
    """An array's memory, type and shape: the same for every view of the same bytes as the same tensor."""
    return values.__array_interface__["data"][0], values.dtype.str, values.shape


def _write_at(fd: int, data: np.ndarray, at: int) -> None:
    view = memoryview(data.reshape(-1).view(np.uint8))
    while view:
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done


def _copy_range(source: Path, start: int, length: int, fd: int, at: int) -> None:
    """length bytes of `source` from `start` into fd at `at`, copied by the kernel (no page enters this process)."""
    if not source.is_file():
        raise CtroptStoreError(f"external data file {source} not found")
    with open(source, "rb") as f:
        while length:
            done = os.copy_file_range(f.fileno(), fd, length, start, at)
            if not done:
                raise CtroptStoreError(f"{source} ends before the tensor's {length} last bytes")
            start, length, at = start + done, length - done, at + done


class CtroptStoreError(ValueError):
    """An input's external data cannot be read."""


def _renamed(ref: onnx.TensorProto, name: str) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(ref)
    copy.name = name
    return copy


def _subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    for n in graph.node:
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                yield g
                yield from _subgraphs(g)


def concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    """np.concatenate on axis 0, written straight into the active store when the result is a large tensor."""
    store = active()
    if store is None or sum(a.nbytes for a in arrays) < THRESHOLD or len({a.dtype for a in arrays}) != 1:
        return np.concatenate(arrays, axis=0)
    return store.join(arrays)


def attach(options, model: onnx.ModelProto) -> list:
    """Hand an onnxruntime SessionOptions the active store's mapped tensors for `model`'s stored initializers, to
    use as they are: every session then reads the same mapped pages (by path, each session maps and reads the
    files again; `add_external_initializers` copies). The references resolve in the store's folder. Returns the
    OrtValues, which must outlive the session."""
    store = active()
    if store is None or not stored(model):
        return []
    import onnxruntime as ort

    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(store.folder))
    values = []
    for name, array in store.initializers(model).items():
        values.append(ort.OrtValue.ortvalue_from_numpy(array))
        options.add_initializer(name, values[-1])
    return values
