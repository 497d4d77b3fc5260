"""The thin layer over llama-cpp-python's low-level API that every stage shares: a model, a
context with an optional graph callback, batches filled from token ids or from hidden states,
and a tensor read out of the running graph. Stage logic above it sees numpy arrays only."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kafila.runtime.gguf.arriving import Arrival, arrival_of
from kafila.runtime.llama.errors import forget_errors, last_error
from kafila.runtime.llama.loading import GGMLBase, QuietThreadpool, llama, model_params
from kafila.runtime.llama.threads import serving_threads


@dataclass(frozen=True)
class ContextSettings:
    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 4
    n_threads: int = field(default_factory=serving_threads)  # as the probe measured with
    gpu_layers: int = 999  # everything, on a GPU build; ignored on CPU; 0: the CPU alone (see LlamaModel)
    quiet_threads: bool = True  # idle threads sleep: stages sharing a machine do not starve each other
    repack: bool | None = None  # llama.cpp's repacked weight buffers; None: as `repack_choice` decided here
    # Rows a decode may ask logits of; None: every row (llama.cpp's default, n_batch). llama.cpp
    # reserves its compute buffer for this many rows of logits, n_vocab floats each: 512 MiB for a
    # 262k vocabulary at n_batch 512, where a head that asks one row per sequence needs n_seq_max.
    max_outputs: int | None = None
    # Flash attention on or off; None leaves llama.cpp to choose (auto: on where the backend has it).
    # Stages of one ring may differ: the floats then differ slightly, which `agreement` measures.
    flash_attn: bool | None = None


class VocabularyOnly:
    """A model's tokenizer and chat template without its weights: a host whose head is on a member
    tokenizes, detokenizes and samples with this, and holds none of the output projection."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._llama = llama()
        forget_errors()
        self.model = self._llama.llama_model_load_from_file(str(path).encode(), model_params(vocab_only=True))
        if not self.model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {path}: {last_error()}")
        self.vocab = self._llama.llama_model_get_vocab(self.model)
        self.n_vocab = int(self._llama.llama_vocab_n_tokens(self.vocab))

    def close(self) -> None:
        if getattr(self, "model", None):
            self._llama.llama_model_free(self.model)
            self.model = None


class _TensorsWait:
    """llama.cpp's progress callback for a load of a file whose tensor bytes still arrive
    (`arriving`): it asks before reading each tensor's data, and its first ask waits for the last
    byte (False: they never all came, and the load is aborted)."""

    def __init__(self, llama_lib: Any, arrival: Arrival) -> None:
        self.arrival = arrival
        self.asked = False  # whether llama.cpp asked before reading any tensor: else the load is not trusted
        self._complete = False
        self.callback = llama_lib.llama_progress_callback(self._ask)

    def _ask(self, _progress: float, _user: object) -> bool:
        if not self.asked:
            self._complete = self.arrival.wait()
            self.asked = True
        return self._complete


def _load_model(llama_lib: Any, path: str | os.PathLike[str], params: Any) -> Any:
    """llama.cpp's model of `path`; RuntimeError where it cannot load it. A file whose tensor
    bytes still arrive (`arriving.arrival_of`) is read up to its tensors' data at once, and its
    tensors once every byte is in; a load that read them without asking first (a llama.cpp that
    reads a tensor outside `load_all_data`) is loaded again once the bytes are in."""
    arrival = arrival_of(path)
    wait = _TensorsWait(llama_lib, arrival) if arrival is not None else None
    unasked = params.progress_callback
    if wait is not None:
        params.progress_callback = wait.callback
    forget_errors()
    model = llama_lib.llama_model_load_from_file(str(path).encode(), params)
    if wait is not None and not wait.asked:  # what it read may predate the bytes: not trusted
        if model:
            llama_lib.llama_model_free(model)
        if not wait.arrival.wait():
            raise RuntimeError(f"{path} was loading while its bytes arrived, and they never all came")
        params.progress_callback = unasked
        forget_errors()
        model = llama_lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        if wait is not None and not wait.arrival.wait():
            raise RuntimeError(f"{path} was loading while its bytes arrived, and they never all came")
        raise RuntimeError(f"llama.cpp could not load {path}: {last_error()}")
    return model


MROPE_TYPES = (8, 40)  # LLAMA_ROPE_TYPE_MROPE, LLAMA_ROPE_TYPE_IMROPE: llama_hparams::n_pos_per_embd


MROPE_SECTIONS = 4


_DECODE_FAILURES = {-1: "invalid batch", 2: "aborted", -2: "out of memory", -3: "compute failed"}


class LlamaModel:
    """A loaded model and one context over it; frees both when closed.

    `input_restored_at`: a graph node where llama.cpp transforms embeddings given as input as it
    does token embeddings (gemma2's `inp_scaled`); each decode of hidden states writes its rows back
    over that node's result, since they are already past the transform.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        settings: ContextSettings,
        eval_callback: Callable[[int, bool, Any], bool] | None = None,
        input_restored_at: str | None = None,
    ) -> None:
        self._llama = llama()
        self.settings = settings
        self._restored_at = input_restored_at.encode() if input_restored_at else None
        self._input_rows: npt.NDArray[np.float32] | None = None
        self._restores = 0
        self._user_callback = eval_callback
        if self._restored_at is not None:
            self._ggml = GGMLBase.load()
            eval_callback = self._restoring_input
        self.model = _load_model(self._llama, path, model_params(settings.gpu_layers, repack=settings.repack))
        params = self._llama.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch  # one graph per decode, so a callback sees every row at once
        # A windowed cache keeps every cell a cut may need (`keeps_window_cells`): each cell also
        # belongs to a keeper, a sequence in the slot above the context's.
        self._keeper = settings.n_seq_max if self._window_cells_kept() else None
        slots = settings.n_seq_max + (self._keeper is not None)
        if slots > int(self._llama.llama_max_parallel_sequences()):
            self._llama.llama_model_free(self.model)
            limit = int(self._llama.llama_max_parallel_sequences()) - 1
            raise ValueError(f"a windowed model's context holds at most {limit} sequences, not {settings.n_seq_max}")
        params.n_seq_max = slots
        params.swa_full = True  # a window's cache as large as the context: one whose cells stay holds every position
        # llama.cpp reserves a row of logits for each sequence at least, the keeper's included
        params.n_outputs_max = max(settings.max_outputs, slots) if settings.max_outputs else 0
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.kv_unified = True  # keeps a batch's tokens in order across sequences
        params.no_perf = True
        if settings.gpu_layers == 0 and self._llama.llama_supports_gpu_offload():
            # No layer on a GPU means no work there either: llama.cpp would otherwise run a large
            # batch's products on a GPU it finds (a CPU stage of a mixed ring). The KV cache stays
            # with its layers, on the CPU, as it is.
            params.op_offload = False
        if settings.flash_attn is not None:
            ll = self._llama
            params.flash_attn_type = (
                ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        self._callback = None
        if eval_callback is not None:
            self._callback = self._llama.ggml_backend_sched_eval_callback(eval_callback)
            params.cb_eval = self._callback
            params.cb_eval_user_data = None
        self.ctx = self._llama.llama_init_from_model(self.model, params)
        if not self.ctx:
            self._llama.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {path}: {last_error()}")
        self._threadpool = None
        if settings.quiet_threads:
            self._threadpool = QuietThreadpool(settings.n_threads)
            self._threadpool.attach(self.ctx)
        self.vocab = self._llama.llama_model_get_vocab(self.model)
        self.n_embd = int(self._llama.llama_model_n_embd(self.model))
        self.n_vocab = int(self._llama.llama_vocab_n_tokens(self.vocab))
        self._token_batch = self._llama.llama_batch_init(settings.n_batch, 0, 1)
        # A model that rotates by sections takes 4 positions a row of embeddings (all 4 a text
        # token's own), section by section; llama_batch_init sizes `pos` by its first argument.
        rope_type = int(self._llama.llama_model_rope_type(self.model))
        self._positions_per_row = MROPE_SECTIONS if rope_type in MROPE_TYPES else 1
        rows = settings.n_batch * self._positions_per_row
        self._embd_batch = self._llama.llama_batch_init(rows, self.n_embd, 1)

    def _window_cells_kept(self) -> bool:
        """Whether this model's cache needs keepers: llama.cpp's window cache (`swa_full` or not)
        hands a decode any cell whose position has left the window of its sequence's last one
        (llama_kv_cache::find_slot, `is_masked_swa`), and then drops the sequence's positions up
        to that cell's (apply_ubatch keeps each sequence's positions contiguous). But a sequence's
        last position may be a draft still to be checked, or a wave behind it, and a request may
        resume a history edited anywhere (`PrefixCut.ANYWHERE`): a cut back then needs cells a
        decode in between took (a later row would read a window with holes). A cell that belongs
        to two sequences is never taken, so every sequence's cells also belong to a keeper."""
        return self.sliding_window > 0 and self.holds_positions

    def _keep_cells(self, sequences: Sequence[int], positions: Sequence[int]) -> None:
        """Give the cells a decode just filled to the keeper too."""
        memory = self._llama.llama_get_memory(self.ctx)
        spans: dict[int, tuple[int, int]] = {}
        for sequence, position in zip(sequences, positions, strict=True):
            low, high = spans.get(sequence, (position, position))
            spans[sequence] = (min(low, position), max(high, position))
        for sequence, (low, high) in spans.items():
            self._llama.llama_memory_seq_cp(memory, sequence, self._keeper, low, high + 1)

    def _cut(self, sequence: int, position: int) -> bool:
        """Drop a sequence's rows from `position` on, and the keeper's hold on their cells (which
        are then free). The keeper's cells go by position whatever sequence they hold, so it lets go
        of every cell from `position` on and takes back the other sequences' ones."""
        ll, memory = self._llama, self._llama.llama_get_memory(self.ctx)
        done = bool(ll.llama_memory_seq_rm(memory, sequence, position, -1))
        if done and self._keeper is not None:
            ll.llama_memory_seq_rm(memory, self._keeper, position, -1)
            for other in range(self.settings.n_seq_max):
                if ll.llama_memory_seq_pos_max(memory, other) >= position:
                    ll.llama_memory_seq_cp(memory, other, self._keeper, position, -1)
        return done

    @property
    def keeps_window_cells(self) -> bool:
        """Whether a windowed cache here keeps the cells of every position until a cut drops them,
        as a full cache does: then drafts in flight, or another sequence's wave decoded while
        drafts are out, cannot take cells that a cut back needs."""
        return self._keeper is not None

    def _restoring_input(self, tensor: int, ask: bool, user: object) -> bool:
        """The graph callback where input is restored: it writes the decode's rows over the node's
        result, then lets the stage's own callback, if any, see every other node."""
        if self._ggml.get_name(tensor) == self._restored_at:
            rows = self._input_rows
            if ask:
                return rows is not None  # token ids: llama.cpp's own transform is the one they need
            if rows is None or self._ggml.nbytes(tensor) != rows.nbytes:
                return False  # stop the graph: decode() finds the input not restored and says so
            self._ggml.tensor_set(tensor, rows.ctypes.data, 0, rows.nbytes)
            self._restores += 1
            return True
        if self._user_callback is not None:
            return self._user_callback(tensor, ask, user)
        return not ask

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._llama.llama_batch_free(self._token_batch)
            self._llama.llama_batch_free(self._embd_batch)
            self._llama.llama_free(self.ctx)
            self._llama.llama_model_free(self.model)
            if self._threadpool is not None:
                self._threadpool.close()
            self.ctx = None

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def decode(
        self,
        sequences: Sequence[int],
        positions: Sequence[int],
        outputs: Sequence[bool],
        tokens: Sequence[int] | None = None,
        states: npt.NDArray[np.float32] | None = None,
    ) -> None:
        """One llama_decode over a batch given row by row, as token ids or as hidden states."""
        n = len(sequences)
        if n == 0 or n > self.settings.n_batch:
            raise ValueError(f"a decode takes 1 to {self.settings.n_batch} rows, not {n}")
        limit = self.settings.max_outputs
        if limit is not None and sum(map(bool, outputs)) > limit:  # llama.cpp would abort the process
            raise ValueError(f"a decode of this context returns at most {limit} rows of logits")
        if tokens is not None:
            batch = self._token_batch
            for i, token in enumerate(tokens):
                batch.token[i] = token
        else:
            assert states is not None
            batch = self._embd_batch
            rows = np.ascontiguousarray(states, dtype=np.float32)  # kept alive until the copy is done
            if rows.shape != (n, self.n_embd):
                raise ValueError(f"hidden states of shape {rows.shape}; expected ({n}, {self.n_embd})")
            ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
            self._input_rows, self._restores = rows, 0
        batch.n_tokens = n
        sections = 1 if tokens is not None else self._positions_per_row
        for i in range(n):
            for section in range(sections):
                batch.pos[section * n + i] = positions[i]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequences[i]
            batch.logits[i] = outputs[i]
        try:
            status = self._llama.llama_decode(self.ctx, batch)
        finally:
            self._input_rows = None
        if status == 0 and states is not None and self._restored_at is not None and self._restores != 1:
            node = self._restored_at.decode()
            raise RuntimeError(f"the input rows were put back at graph node {node} {self._restores} times, not once")
        if status == 1:
            raise RuntimeError(f"the KV cache has no room for {n} more rows (llama_decode status 1)")
        if status != 0:
            why = _DECODE_FAILURES.get(status, "unknown failure")
            raise RuntimeError(f"llama_decode failed with status {status} ({why})")
        if self._keeper is not None:
            self._keep_cells(sequences, positions)

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        pointer = self._llama.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def check_sequence(self, sequence: int) -> None:
        """Refuse a sequence id this context has no slot for: llama.cpp's cache calls abort the whole
        process on one out of their range (and -1, which a large id can wrap to, means every sequence)."""
        if not 0 <= sequence < self.settings.n_seq_max:
            raise ValueError(f"sequence {sequence} is outside this context's {self.settings.n_seq_max} slots")

    def next_position(self, sequence: int) -> int:
        """Where a sequence's next row goes: one past the last position its cache holds (0 when empty)."""
        self.check_sequence(sequence)
        return int(self._llama.llama_memory_seq_pos_max(self._llama.llama_get_memory(self.ctx), sequence)) + 1

    def truncate(self, sequence: int, position: int) -> bool:
        """Drop a sequence's rows from `position` on: what undoes a failed forward. False where the
        cache cannot: a recurrent state holds no earlier positions, so it can only be dropped whole."""
        self.check_sequence(sequence)
        return self._cut(sequence, position)

    @property
    def keeps_recurrent_state(self) -> bool:
        """Whether some blocks keep a recurrent state per sequence (a hybrid such as qwen3next):
        llama.cpp then runs the rows of each sequence of a decode as a graph of their own."""
        return bool(self._llama.llama_model_is_recurrent(self.model) or self._llama.llama_model_is_hybrid(self.model))

    @property
    def sliding_window(self) -> int:
        """The model's attention window (0: none), whose cache reuses cells that fall out of it."""
        return int(self._llama.llama_model_n_swa(self.model))

    def forget(self, sequence: int, keep: int = 0) -> None:
        """Drop a sequence's cache from position `keep` on (all of it by default), for the next
        request in its slot (an id with no slot holds nothing)."""
        if 0 <= sequence < self.settings.n_seq_max:
            self._cut(sequence, max(0, keep))

    @property
    def holds_positions(self) -> bool:
        """Whether the cache is by position (KV), so a sequence can be cut after a prefix; a
        recurrent state (mamba, rwkv, the linear layers of a hybrid) holds only its latest."""
        model = self.model
        return not (self._llama.llama_model_is_recurrent(model) or self._llama.llama_model_is_hybrid(model))
