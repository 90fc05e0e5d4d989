"""DCP storage for checkpoints: a writer that leaves a verifiable manifest, and a reader and
load planner that unpickle nothing beyond tensors, plain values and DCP's own metadata."""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from framework.checkpoint.integrity import MANIFEST, file_entries, write_manifest


class VerifiedWriter(FileSystemWriter):
    """DCP's file writer, plus: every rank first writes its small files (`small`: name -> bytes)
    into the folder, then, after its shards, measures (and with `digests`, digests) everything
    it wrote; the coordinator writes the manifest of all ranks before DCP's `.metadata`. Both
    run where DCP writes: in the background thread of an async save. A rank's write error
    (a full disk) reaches every rank through DCP's own gather, so all of them fail together."""

    def __init__(self, path: str, small: dict[str, bytes], digests: bool):
        super().__init__(path)
        self.small, self.digests = small, digests

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        for name, data in self.small.items():
            with open(os.path.join(self.path, name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        results = super().write_data(plan, planner).wait()
        names = sorted({r.storage_data.relative_path for r in results} | set(self.small))
        entries = file_entries(str(self.path), names, self.digests)
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, WriteResult(MetadataIndex(MANIFEST), 0, entries)])
        return done

    def finish(self, metadata, results: list[list[WriteResult]]) -> None:
        entries, kept = {}, []
        for rank_results in results:
            kept.append([r for r in rank_results if r.index.fqn != MANIFEST])
            for r in rank_results:
                if r.index.fqn == MANIFEST:
                    entries.update(r.storage_data)
        write_manifest(str(self.path), entries)
        super().finish(metadata, kept)


class _MetadataUnpickler(pickle.Unpickler):
    """`.metadata` holds DCP's metadata dataclasses, torch sizes and dtypes: nothing else loads."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
             ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}  # fmt: skip

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format)
        if module in self.MODULES or (module, name) in self.NAMES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f".metadata asks for {module}.{name}, which a checkpoint never holds")


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (optimizer hyperparameters) read `weights_only`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_metadata(path: str):
    """A checkpoint's DCP metadata, through the restricted unpickler (raises if unreadable)."""
    return SafeReader(path).read_metadata()
