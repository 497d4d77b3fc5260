"""Cut a GGUF model into one file per stage, deterministically, without decoding its vocabulary.

A stage file holds its blocks renumbered from 0, the per-layer metadata rewritten for the
slice, and a four-token stand-in vocabulary so that no full-vocabulary tensor is stored or
computed. The head file holds the last blocks, the output norm and projection, the token
embedding and the full tokenizer. Files are named by their sha256, so a member can cache and
check what it was sent.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from io import BufferedWriter
from pathlib import Path
from typing import Any, cast

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, ReaderTensor
from gguf.gguf_writer import WriterState

from kafila.contracts import CountProgress
from kafila.runtime.gguf.families import SliceView, family_of
from kafila.runtime.gguf.gguf_file import FastGGUFReader, GGUFFormatError, RawCopyWriter, raw_value
from kafila.runtime.gguf.stage_cache import make_room, mark_used, trim_stage_cache
from kafila.units import DISK_ROOM_HINT, human_bytes

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
HEAD_ONLY_TENSORS = ("token_embd.weight", "output.weight")
STAND_IN_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # SentencePiece order llama.cpp accepts
STAND_IN_TYPES = (3, 3, 3, 2)  # control, control, control, unknown
# A sliding window wider than any two positions of a context are apart masks nothing: what a block
# of global attention becomes in a slice of a family that llama.cpp always windows (gemma2,
# gpt-oss). Kafila's longest context (the CLI's --context limit), and no wider: llama.cpp sizes a
# windowed cache by window times sequences in uint32, and reserves room for a window's cells each
# time it builds a mask.
UNREACHED_WINDOW = 1 << 20
SIZE_POLL_S = 0.2
SHORT_WRITE_FULL = 1 << 20  # free bytes under which a short write means the disk filled (`disk_full_said`)
IDENTITY_BLOCKS_KEY = "kafila.slice.identity_blocks"  # blocks run before the slice's own (families.SliceRules)

"""(bytes done, bytes in all) of long work on a model file: hashing it, cutting it. A model of
tens of gigabytes takes minutes either way, and whoever waits should see it move."""

# A tensor's bytes, as an array of the type and shape the reader gives it: from the model file
# itself (`stored_data`), or from elsewhere (a stage kept here). A stage fetched from the hub by
# ranges is written by its `StageLayout` instead, each tensor's bytes straight to their place.
TensorData = Callable[[ReaderTensor], np.ndarray]


def stored_data(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's bytes in the file the reader opened."""
    return tensor.data


@dataclass(frozen=True)
class StageFile:
    index: int
    first_block: int
    end_block: int
    is_head: bool
    path: Path
    sha256: str
    n_bytes: int


class SliceError(ValueError):
    """The division does not fit the model, or the model cannot be cut."""


def file_sha256(path: Path, progress: CountProgress | None = None) -> str:
    """A file's sha256, read in 4 MiB pieces: what stage files are named and checked by."""
    digest = hashlib.sha256()
    total = path.stat().st_size if progress is not None else 0
    done = 0
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
            if progress is not None:
                done += len(chunk)
                progress(done, total)
    return digest.hexdigest()


@contextmanager
def disk_full_said(out: Path, doing: str, error: type[Exception] = SliceError) -> Iterator[None]:
    """A disk that fills up while `doing` raised as `error`, saying which disk and what to do about
    it; any other OSError as it came. Full is ENOSPC, or a short write that names no errno (numpy's
    `tofile`, which the gguf writer writes tensors with: "8192 requested and 7072 written") with
    less than `SHORT_WRITE_FULL` left on the disk."""
    try:
        yield
    except OSError as failure:
        if failure.errno != errno.ENOSPC and not (failure.errno is None and _free_bytes(out) < SHORT_WRITE_FULL):
            raise
        raise error(f"the disk holding {out} filled up while {doing}: {DISK_ROOM_HINT}") from None


def _free_bytes(out: Path) -> int:
    """What is free on the disk of `out`, a folder or a file still to be written (its folder's)."""
    for place in (out, out.parent):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(place).free
    return SHORT_WRITE_FULL  # not known: not taken for full


@contextmanager
def _reporting_size(path: Path, report: Callable[[int], None]) -> Iterator[None]:
    """Report `path`'s size as it grows, from a thread: the gguf writer tells no caller how far
    it has got (it can only draw a tqdm bar of its own)."""
    stopped = threading.Event()

    def watch() -> None:
        while not stopped.wait(SIZE_POLL_S):
            try:
                report(path.stat().st_size)
            except OSError:  # gone: the write failed, and the caller says why
                return

    watcher = threading.Thread(target=watch, name="kafila-slice-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stopped.set()
        watcher.join()


def _check_division(counts: Sequence[int], n_blocks: int) -> None:
    if not counts or any(c < 1 for c in counts):
        raise SliceError(f"every stage needs at least one block; got counts {list(counts)}")
    if sum(counts) != n_blocks:
        raise SliceError(f"the division covers {sum(counts)} blocks but the model has {n_blocks}")


def stored_blocks(reader: FastGGUFReader, arch: str) -> int:
    n_blocks = reader.scalar(f"{arch}.block_count")
    if not isinstance(n_blocks, int) or isinstance(n_blocks, bool):
        raise GGUFFormatError(f"the model has no {arch}.block_count")
    return n_blocks


def prediction_blocks(reader: FastGGUFReader, arch: str) -> int:
    """The multi-token prediction ("nextn") blocks stored after the last block: counted in
    block_count, but llama.cpp's graph runs only the blocks before them (llama_hparams::n_layer)
    and loads them only for speculative decoding, which Kafila does not do. No slice holds them."""
    count = reader.scalar(f"{arch}.nextn_predict_layers", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise GGUFFormatError(f"metadata {arch}.nextn_predict_layers is {count!r}, not a count")
    return count


class StagePiece:
    """Everything needed to write one stage file from an open source model (its header: the
    tensors' bytes are given when it is written, `TensorData`).

    `n_blocks` counts the blocks the source's graph runs; per-layer arrays list one value for
    each stored block, prediction blocks included."""

    def __init__(self, reader: FastGGUFReader, arch: str, n_blocks: int, first: int, end: int, is_head: bool):
        self.reader, self.arch, self.n_blocks = reader, arch, n_blocks
        self.n_stored = stored_blocks(reader, arch)
        self.first, self.end, self.is_head = first, end, is_head
        self.rules = family_of(arch).rules(SliceView(arch, n_blocks, first, end, is_head, reader.scalar))
        if self.rules.refusal is not None:
            raise SliceError(self.rules.refusal)
        self.identity = self.rules.identity_blocks
        if self.identity and self._sliding_blocks() is not None:
            raise SliceError(f"{arch}: identity blocks in a slice with sliding-window blocks are not supported")

    def metadata(self, writer: RawCopyWriter) -> None:
        count = self.identity + self.end - self.first
        pattern_key = f"{self.arch}.attention.sliding_window_pattern"
        window_key = f"{self.arch}.attention.sliding_window"
        sliding = self._sliding_blocks()
        always_windowed = family_of(self.arch).always_windowed
        global_only = sliding is not None and not any(sliding)
        swa_base_key = f"{self.arch}.rope.freq_base_swa"
        for key in self.reader.fields:
            if key in (window_key, pattern_key) and global_only:
                continue  # llama.cpp aborts on a window that no block uses: written below if it must be
            if key == swa_base_key and global_only and always_windowed:
                continue  # `_unreached_window` writes it
            if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
                continue  # the writer adds these itself, and pads tensor data its own way
            if not self.is_head and (key.startswith("tokenizer.") or key == "general.name"):
                continue  # llama.cpp looks up tokens by the model's name (a Phi-3's <s>): stand-ins lack them
            if key in self.rules.values:
                continue  # the family's rule for the slice is written below
            if key == f"{self.arch}.nextn_predict_layers":
                continue  # a slice holds no prediction blocks
            vtype, value = raw_value(self.reader, key)
            per_layer = self._per_layer_values(key)
            if key == f"{self.arch}.block_count":
                writer.add_uint32(key, count)
            elif per_layer is not None:
                sub_type = self.reader.fields[key].types[-1]
                values = per_layer[:1] * self.identity + per_layer[self.first : self.end]
                writer.add_key_value(key, values, vtype, sub_type=sub_type)
            elif key != pattern_key:  # a scalar pattern period is rewritten below as an array
                writer.add_key_value(key, value, vtype)
        if sliding is not None and any(sliding) and self._per_layer_values(pattern_key) is None:
            writer.add_array(pattern_key, sliding)
        if global_only and always_windowed:
            self._unreached_window(writer, count)
        for key, (rule_type, rule_value) in self.rules.values.items():
            items = _array_type(rule_value) if rule_type == GGUFValueType.ARRAY else None
            writer.add_key_value(key, rule_value, rule_type, sub_type=items)
        if not self.is_head:
            self._stand_in_vocabulary(writer)
        writer.add_uint32("kafila.slice.first_block", self.first)
        writer.add_uint32("kafila.slice.source_block_count", self.n_blocks)
        writer.add_bool("kafila.slice.is_head", self.is_head)
        if self.identity:
            writer.add_uint32(IDENTITY_BLOCKS_KEY, self.identity)

    def _unreached_window(self, writer: RawCopyWriter, count: int) -> None:
        """A family that llama.cpp always windows cannot drop the window of a slice of global blocks
        only: its blocks are windowed instead, by a window no position reaches, and take the global
        blocks' rope base (llama.cpp gives windowed blocks the `freq_base_swa` one)."""
        writer.add_uint32(f"{self.arch}.attention.sliding_window", UNREACHED_WINDOW)
        writer.add_array(f"{self.arch}.attention.sliding_window_pattern", [True] * count)
        base_key, swa_key = f"{self.arch}.rope.freq_base", f"{self.arch}.rope.freq_base_swa"
        if swa_key in self.reader.fields:
            base = self.reader.scalar(base_key, 10000.0)  # llama.cpp's default where the file names none
            writer.add_float32(swa_key, float(base))

    def _sliding_blocks(self) -> list[bool] | None:
        """Which of this slice's blocks use a sliding window, or None for a family without one."""
        family = family_of(self.arch)
        period = family.sliding_window_period
        pattern_key = f"{self.arch}.attention.sliding_window_pattern"
        window_named = f"{self.arch}.attention.sliding_window" in self.reader.fields
        if period is None or not (window_named or family.default_sliding_window is not None):
            return None
        stored = self._per_layer_values(pattern_key)
        if stored is not None:
            return [bool(v) for v in stored[self.first : self.end]]
        if pattern_key in self.reader.fields:
            period = int(self.reader.scalar(pattern_key))
        return family_of(self.arch).sliding_blocks(self.first, self.end - self.first, period)

    def _per_layer_values(self, key: str) -> list[object] | None:
        """The values of a per-layer array (one entry per block of the source), else None."""
        field = self.reader.fields.get(key)
        if field is None or field.types[0] != GGUFValueType.ARRAY or not key.startswith(f"{self.arch}."):
            return None
        if field.types[-1] == GGUFValueType.STRING:
            return None
        values = self.reader.scalar(key)
        return values if len(values) == self.n_stored else None

    @staticmethod
    def _stand_in_vocabulary(writer: RawCopyWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(list(STAND_IN_TOKENS))
        writer.add_token_scores([0.0] * len(STAND_IN_TOKENS))
        writer.add_token_types(list(STAND_IN_TYPES))
        writer.add_pad_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_bos_token_id(2)
        writer.add_unk_token_id(3)

    def _identity_tensors(self) -> Iterator[tuple[str, ReaderTensor]]:
        """The tensors of source block 0 under each identity block's name: written as zeros."""
        for block in range(self.identity):
            for tensor in self.reader.tensors:
                match = _BLOCK_TENSOR.match(tensor.name)
                if match and int(match.group(1)) == 0:
                    yield f"blk.{block}.{match.group(2)}", tensor

    def _kept(self) -> Iterator[tuple[str, ReaderTensor]]:
        """The source tensors this slice holds, each under its name in the slice: its blocks,
        renumbered from the first after any identity blocks, and the rest but the head's own
        tensors, which only the head keeps."""
        for tensor in self.reader.tensors:
            match = _BLOCK_TENSOR.match(tensor.name)
            if match:
                index = int(match.group(1))
                if self.first <= index < self.end:
                    yield f"blk.{self.identity + index - self.first}.{match.group(2)}", tensor
            elif self.is_head or tensor.name not in HEAD_ONLY_TENSORS:
                yield tensor.name, tensor

    def data_bytes(self) -> int:
        """The tensor bytes this stage file will hold: what its disk space is mostly for."""
        pieces = itertools.chain(self._identity_tensors(), self._kept())
        return sum(int(tensor.n_bytes) for _name, tensor in pieces)

    def source_tensors(self) -> list[ReaderTensor]:
        """The source's tensors whose bytes this stage reads: exactly what a stage fetched by
        ranges fetches (identity blocks and stand-ins take only shapes)."""
        return [tensor for _name, tensor in self._kept()]

    def copied(self) -> dict[str, str]:
        """Each source tensor this stage file holds byte for byte (not scaled), by its source name →
        its name here: what a later stage of the same model may take from this file rather than
        fetch again."""
        return {tensor.name: name for name, (tensor, factor) in self.sources().items() if factor is None}

    def sources(self) -> dict[str, tuple[ReaderTensor, float | None]]:
        """Each tensor of this stage file made from a source tensor's bytes, by its name here: that
        source tensor, and the factor its values are multiplied by (float32 only), or None."""
        found: dict[str, tuple[ReaderTensor, float | None]] = {}
        for name, tensor in self._kept():
            match = _BLOCK_TENSOR.match(name)
            found[name] = tensor, self.rules.tensor_scales.get(match.group(2)) if match else None
        return found

    def tensors(self, writer: RawCopyWriter, data: TensorData = stored_data) -> None:
        for name, tensor in self._identity_tensors():
            writer.add_tensor(name, np.zeros_like(tensor.data), raw_dtype=tensor.tensor_type)  # zeros in any type
        for name, (tensor, factor) in self.sources().items():
            if factor is None:
                writer.add_tensor(name, data(tensor), raw_dtype=tensor.tensor_type)
            elif tensor.tensor_type != GGMLQuantizationType.F32:
                kind = tensor.tensor_type.name
                raise SliceError(f"{tensor.name} must be float32 for this slice to scale it; it is {kind}")
            else:
                writer.add_tensor(name, (np.asarray(data(tensor), dtype=np.float32) * np.float32(factor)))
        if not self.is_head:
            embedding = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
            if embedding is None:
                raise SliceError("the model has no token_embd.weight")
            # Rows for the stand-in tokens: never read, since a stage is fed hidden states.
            n_embd = int(embedding.shape[0])
            writer.add_tensor("token_embd.weight", np.zeros((len(STAND_IN_TOKENS), n_embd), dtype=np.float32))
            if family_of(self.arch).output_required:  # its logits are computed, never read
                writer.add_tensor("output.weight", np.zeros((len(STAND_IN_TOKENS), n_embd), dtype=np.float32))


class VocabularyPiece(StagePiece):
    """What a host whose head is on a member reads of the model: every metadata key (the tokenizer,
    the chat template, the family's settings: `VocabularyOnly` and `prefix_cut_of` read them as
    from the whole file) and the token embedding (`TokenEmbedding`), and no block. For a model
    known by its header alone, that is one range to fetch rather than the whole file."""

    def __init__(self, reader: FastGGUFReader, arch: str, n_blocks: int) -> None:  # no slice, so no slice rules
        self.reader, self.arch, self.n_blocks = reader, arch, n_blocks
        self.first, self.end, self.is_head = 0, 0, False
        self.embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if self.embedding is None:
            raise SliceError("the model has no token_embd.weight")

    def metadata(self, writer: RawCopyWriter) -> None:
        for key in self.reader.fields:
            if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
                continue  # the writer adds these itself
            vtype, value = raw_value(self.reader, key)
            writer.add_key_value(key, value, vtype)
        writer.add_bool("kafila.vocabulary_only", True)

    def data_bytes(self) -> int:
        assert self.embedding is not None
        return int(self.embedding.n_bytes)

    def source_tensors(self) -> list[ReaderTensor]:
        assert self.embedding is not None
        return [self.embedding]

    def sources(self) -> dict[str, tuple[ReaderTensor, float | None]]:
        assert self.embedding is not None
        return {self.embedding.name: (self.embedding, None)}

    def tensors(self, writer: RawCopyWriter, data: TensorData = stored_data) -> None:
        assert self.embedding is not None
        writer.add_tensor(self.embedding.name, data(self.embedding), raw_dtype=self.embedding.tensor_type)


def vocabulary_piece(reader: FastGGUFReader, label: str) -> VocabularyPiece:
    """The vocabulary file of an open model (a whole file, or a header alone): `write_stage` writes it."""
    reader, arch, n_blocks = _model(reader, label)
    return VocabularyPiece(reader, arch, n_blocks)


def _array_type(values: list[Any]) -> GGUFValueType:
    """The GGUF type of a rule's array's items: bools, whole numbers as int32, or float32."""
    if all(isinstance(v, bool) for v in values):
        return GGUFValueType.BOOL
    return GGUFValueType.INT32 if all(isinstance(v, int) for v in values) else GGUFValueType.FLOAT32


def _open(source: Path) -> tuple[FastGGUFReader, str, int]:
    """The model, its family and the blocks its graph runs (those a division covers)."""
    return _model(FastGGUFReader(source), source)


def _model(reader: FastGGUFReader, source: str | Path) -> tuple[FastGGUFReader, str, int]:
    arch = reader.scalar("general.architecture")
    if not isinstance(arch, str):
        raise GGUFFormatError(f"{source} has no general.architecture")
    stored, prediction = stored_blocks(reader, arch), prediction_blocks(reader, arch)
    if prediction >= stored:
        raise GGUFFormatError(f"{source} has {stored} blocks, of which {prediction} predict further tokens")
    return reader, arch, stored - prediction


def check_family(arch: str, n_blocks: int) -> None:
    """UnsupportedFamily or SliceError where a model of this family and block count cannot be split."""
    family = family_of(arch)  # refuse an unsupported family before writing anything
    if n_blocks in family.unsplittable_block_counts:
        why = family.unsplittable_reason or (
            "llama.cpp derives a setting of theirs from the block count, which a slice would change"
        )
        raise SliceError(f"{arch} models with {n_blocks} blocks cannot be split: {why}")


def check_cuts(arch: str, n_blocks: int, value: Callable[[str], Any], cuts: Sequence[int]) -> None:
    """SliceError where a stage would start at a block the family's llama.cpp code cannot start a
    file at (`Family.cut_points`), naming the blocks it can."""
    allowed = family_of(arch).cut_points(n_blocks, value)
    if allowed.starts is None:
        return
    wrong = [cut for cut in cuts if cut not in allowed.starts]
    if not wrong:
        return
    if not allowed.starts:
        raise SliceError(f"this {arch} model cannot be split: {allowed.reason}")
    raise SliceError(
        f"{arch} models cannot be cut at block {wrong[0]}: {allowed.reason}. "
        f"This one can be cut at blocks {', '.join(map(str, allowed.starts))}"
    )


def check_room(out: Path, need: int, what: str) -> None:
    """SliceError before a byte is written, where the disk of the folder `out` has less than `need`
    bytes free: what `what` needs, where, and what is free."""
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if need > free:
        raise SliceError(
            f"{what} needs {human_bytes(need)} in {out}, which has {human_bytes(free)} free: {DISK_ROOM_HINT}"
        )


def _write(
    piece: StagePiece, out: Path, progress: Callable[[int], None] | None = None, data: TensorData = stored_data
) -> tuple[Path, str]:
    """Write one stage file under a temporary name, then rename it to its sha256. `progress` hears
    the bytes done, each byte counting half when written and half when hashed."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, suffix=".partial", delete=False) as temporary:
        partial = Path(temporary.name)
    try:
        with disk_full_said(out, "a stage file was written"):
            with _reporting_size(partial, lambda n: progress(n // 2)) if progress is not None else nullcontext():
                writer = RawCopyWriter(partial, arch=piece.arch)
                piece.metadata(writer)
                piece.tensors(writer, data)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
                writer.close()
            size = partial.stat().st_size
            hashed = None if progress is None else (lambda done, _total: progress((size + done) // 2))
            digest = file_sha256(partial, hashed)
            final = out / f"{digest}.gguf"
            os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return final, digest


def _past(base: int, total: int, progress: CountProgress) -> Callable[[int], None]:
    """A piece's progress, reported as the whole's: `base` bytes of it were done before."""
    return lambda done: progress(min(total, base + done), total)


def _write_all(
    pieces: Sequence[StagePiece], out: Path, progress: CountProgress | None, data: TensorData = stored_data
) -> list[tuple[Path, str]]:
    """`_write` each piece, with `progress` over them all (the tensor bytes, which are nearly all
    of each file: the count is held at the total for the headers past it)."""
    total = sum(piece.data_bytes() for piece in pieces)
    written: list[tuple[Path, str]] = []
    finished = 0
    for piece in pieces:
        path, digest = _write(piece, out, None if progress is None else _past(finished, total, progress), data)
        written.append((path, digest))
        finished += path.stat().st_size
    if progress is not None:
        progress(total, total)
    return written


def slice_model(
    source: str | os.PathLike[str],
    counts: Sequence[int],
    out_dir: str | os.PathLike[str],
    progress: CountProgress | None = None,
) -> list[StageFile]:
    """Write one file per stage for a division given in chain order (block 0 first, head last).

    A single stage is the whole model: the original file is returned as it is (and hashed).
    """
    source = Path(source)
    reader, arch, n_blocks = _open(source)
    _check_division(counts, n_blocks)
    if len(counts) == 1:
        return [StageFile(0, 0, n_blocks, True, source, file_sha256(source, progress), source.stat().st_size)]
    check_family(arch, n_blocks)
    bounds = list(itertools.accumulate(counts, initial=0))
    check_cuts(arch, n_blocks, reader.scalar, bounds[1:-1])
    pieces = [
        StagePiece(reader, arch, n_blocks, first, end, index == len(counts) - 1)
        for index, (first, end) in enumerate(itertools.pairwise(bounds))
    ]
    need = sum(piece.data_bytes() for piece in pieces)
    check_room(Path(out_dir), need, f"cutting {source.name} into {len(counts)} stage files")
    written = _write_all(pieces, Path(out_dir), progress)
    return [
        StageFile(index, piece.first, piece.end, piece.is_head, path, digest, path.stat().st_size)
        for index, (piece, (path, digest)) in enumerate(zip(pieces, written, strict=True))
    ]


def cached_slices(
    source: str | os.PathLike[str],
    counts: Sequence[int],
    out_dir: str | os.PathLike[str],
    progress: CountProgress | None = None,
) -> list[StageFile]:
    """`slice_model`, reusing the files of an earlier cut of the same file and division.

    The index is keyed by the source's path, size and modification time and by the division;
    an entry is used only while every file it names is still there with the size it had.
    """
    source = Path(source)
    out = Path(out_dir)
    stat = source.stat()
    key = json.dumps([str(source.resolve()), stat.st_size, stat.st_mtime_ns, list(counts)])
    index_path = out / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    entry = index.get(key) if isinstance(index, dict) else None
    if isinstance(entry, list):
        try:
            stages = [StageFile(**{**item, "path": Path(item["path"])}) for item in entry]
            if all(stage.path.is_file() and stage.path.stat().st_size == stage.n_bytes for stage in stages):
                for stage in stages:
                    mark_used(stage.path)
                trim_stage_cache(out, [stage.path for stage in stages])
                return stages
        except (TypeError, KeyError, OSError):
            pass
    if len(counts) > 1:
        make_room(out, stat.st_size)  # the cut is about the model's size
    stages = slice_model(source, counts, out, progress)
    if len(stages) > 1:
        index = index if isinstance(index, dict) else {}
        index[key] = [{**stage.__dict__, "path": str(stage.path)} for stage in stages]
        trim_stage_cache(out, [stage.path for stage in stages])
        index = {k: v for k, v in index.items() if _all_present(v)}  # entries whose files the trim (or anyone) removed
        partial = index_path.with_suffix(".partial")
        partial.write_text(json.dumps(index))
        os.replace(partial, index_path)
    return stages


def _all_present(entry: object) -> bool:
    try:
        return isinstance(entry, list) and all(Path(item["path"]).is_file() for item in entry)
    except (TypeError, KeyError, OSError):
        return False


def block_range_file(
    source: str | os.PathLike[str],
    first: int,
    end: int,
    out_dir: str | os.PathLike[str],
    is_head: bool = False,
    progress: CountProgress | None = None,
) -> StageFile:
    """The stage file for blocks [first, end) alone, byte for byte what `slice_model` writes for that
    stage (`is_head`: the last blocks with the head): a member with its own copy of the model cuts
    its stage itself."""
    piece = stage_piece(FastGGUFReader(Path(source)), first, end, is_head, str(source))
    return write_stage(piece, out_dir, progress, name=Path(source).name)


def stage_piece(reader: FastGGUFReader, first: int, end: int, is_head: bool, label: str) -> StagePiece:
    """The stage of blocks [first, end) of an open model (a whole file, or a header alone), checked
    as `slice_model` checks a division: what `write_stage` writes, and `source_tensors` lists."""
    reader, arch, n_blocks = _model(reader, label)
    if not 0 <= first < end <= n_blocks:
        raise SliceError(f"blocks {first}..{end} are not a range of the model's {n_blocks}")
    check_family(arch, n_blocks)
    if is_head and end != n_blocks:
        raise SliceError(f"the head holds the last blocks; blocks {first}..{end} stop short of {n_blocks}")
    check_cuts(arch, n_blocks, reader.scalar, [cut for cut in (first, end) if 0 < cut < n_blocks])
    return StagePiece(reader, arch, n_blocks, first, end, is_head)


def write_stage(
    piece: StagePiece,
    out_dir: str | os.PathLike[str],
    progress: CountProgress | None = None,
    data: TensorData = stored_data,
    name: str = "the model",
) -> StageFile:
    """One stage file, named by its sha256, its tensors' bytes from `data`: the same bytes whichever
    source gives them."""
    what = f"cutting blocks {piece.first}-{piece.end - 1} of {name}"
    check_room(Path(out_dir), piece.data_bytes(), what)
    [(path, digest)] = _write_all([piece], Path(out_dir), progress, data)
    return StageFile(0, piece.first, piece.end, piece.is_head, path, digest, path.stat().st_size)


@dataclass(frozen=True)
class StageLayout:
    """A stage file laid out from its piece alone, before any tensor's bytes are at hand: what a
    stage fetched by ranges is written into, each source tensor's bytes straight to their place,
    with no second pass over them. `prefix`: the header, metadata and tensor infos, padded to the
    first tensor; `places` and `lengths`: each source tensor's bytes in the file, by its source
    name; `scales`: the source tensors (float32) whose values are multiplied by a factor there;
    `fills`: tensors the slicer makes (identity blocks, stand-ins) holding a byte other than zero.
    Every other byte of the file is zero."""

    prefix: bytes
    size: int
    places: dict[str, int]
    lengths: dict[str, int]
    scales: dict[str, float]
    fills: tuple[tuple[int, bytes], ...]

    def start(self, fd: int) -> None:
        """The file open at `fd` made this size, its prefix and fills written; the bytes an earlier
        start's tensors got there are kept (a fetch resumed)."""
        os.ftruncate(fd, self.size)
        os.pwrite(fd, self.prefix, 0)
        for at, data in self.fills:
            os.pwrite(fd, data, at)

    def scaled(self, name: str, raw: bytes) -> bytes:
        """The bytes the stage file holds for source tensor `name`, from its bytes in the source."""
        factor = self.scales.get(name)
        if factor is None:
            return raw
        return (np.frombuffer(raw, dtype=np.float32) * np.float32(factor)).tobytes()


def stage_layout(piece: StagePiece) -> StageLayout:
    """Where `write_stage` puts each of the piece's tensors, and the bytes around them: the same file,
    byte for byte, once every source tensor's bytes are written at its place."""
    writer = RawCopyWriter(None, arch=piece.arch)
    piece.metadata(writer)
    piece.tensors(writer, _shape_only)
    buffer = io.BytesIO()
    writer.fout, writer.state = (
        [cast(BufferedWriter, buffer)],
        WriterState.EMPTY,
    )  # the header to memory: the file gets the tensors
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_padding(buffer, buffer.tell())
    prefix = buffer.getvalue()
    sources = piece.sources()
    places, lengths, scales, fills = {}, {}, {}, []
    at = len(prefix)
    for name, info in writer.tensors[0].items():
        source = sources.get(name)
        if source is not None:
            tensor, factor = source
            if factor is not None and tensor.tensor_type != GGMLQuantizationType.F32:
                raise SliceError(f"{tensor.name} must be float32 for this slice to scale it")
            places[tensor.name], lengths[tensor.name] = at, int(info.nbytes)
            if factor is not None:
                scales[tensor.name] = factor
        elif info.tensor is not None and info.tensor.any():
            fills.append((at, info.tensor.tobytes()))
        at += GGUFWriter.ggml_pad(int(info.nbytes), writer.data_alignment)
    return StageLayout(prefix, at, places, lengths, scales, tuple(fills))


def _shape_only(tensor: ReaderTensor) -> np.ndarray:
    """A tensor of the source's type and shape that holds no bytes: what laying a file out needs."""
    return np.broadcast_to(np.zeros((), dtype=tensor.data.dtype), tensor.data.shape)
