"""llama.cpp through llama-cpp-python's bindings of its C API: the only module that imports llama_cpp.

kvviz calls llama.cpp's public API (load a GGUF model, make a context with one unified KV cache,
`llama_decode` a batch kvviz built, `llama_memory_seq_cp` / `seq_rm`, the state API) and patches
nothing. It observes through two public doors:

- ggml's evaluation callback (`cb_eval`, the hook llama.cpp's own eval-callback and imatrix tools
  use), asked for three kinds of node only: the first layer's K write (`SET_ROWS` into `cache_k_l0`,
  whose index input says which cell each token's K/V went to), each layer's `kq_soft_max-<layer>`
  (the attention weights, with the mask llama.cpp built from the cells' sequence sets as its second
  input) and, with flash attention, each `FLASH_ATTN_EXT` node, whose weights kvviz recomputes in
  float32 from the node's own Q, K and mask and checks against its output;
- the state API: `llama_state_seq_get_data(ctx, .., -1)` writes every cell's position and sequence
  ids (then its K/V), which is how kvviz reads the cache after a step.

The struct layout of `ggml_tensor` and the state format are those of the release KNOWN pins; another
release is refused before anything runs.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ..engine import kernel_check
from ..errors import WorkloadError
from .facts import BatchToken, Cell, Listener, Ubatch

KNOWN = "0.3.36"  # llama-cpp-python, vendoring the llama.cpp whose graph names and state format are read here
REQUIREMENT = f"llama-cpp-python=={KNOWN}"
F16_EPS = 2.0**-10  # flash attention reads K/V as float16 and rounds Q to it: its tolerance unit


class BackendError(WorkloadError):
    """llama.cpp cannot run this workload as asked (the message names the field or the call)."""


class CallFailed(BackendError):
    """A llama.cpp call returned failure mid-run."""


def check_version() -> None:
    """Refuse a missing or unknown llama-cpp-python in one sentence, before anything runs."""
    try:
        import llama_cpp
    except ImportError as e:
        raise BackendError(f"engine.backend 'llama.cpp' needs {REQUIREMENT} (pip install -r requirements.txt: it "
                           f"builds llama.cpp from source with cmake, about 5 minutes on 2 cores): {e}") from None
    version = getattr(llama_cpp, "__version__", None)
    if version != KNOWN:
        raise BackendError(f"llama-cpp-python {version}: kvviz's llama.cpp adapter reads the graph and state layout "
                           f"of release {KNOWN}; install {REQUIREMENT}")


def _lib():
    """llama_cpp, ggml's name helper and the tensor struct, bound once (after the version check)."""
    global _BOUND
    if _BOUND is None:
        import llama_cpp
        base = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
        base.ggml_op_name.restype, base.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]

        @llama_cpp.llama_log_callback
        def quiet(level, text, user_data):  # llama.cpp logs every load and decode: keep its errors only
            if level == LOG_ERROR or (level == LOG_CONT and ERRORS):
                ERRORS.append(text.decode(errors="replace"))

        llama_cpp.llama_log_set(quiet, None)
        llama_cpp.llama_backend_init()
        ops = {base.ggml_op_name(i).decode(): i for i in range(100) if base.ggml_op_name(i)}
        _BOUND = (llama_cpp, ops, quiet)
    return _BOUND


_BOUND = None
LOG_ERROR, LOG_CONT = 4, 5  # ggml_log_level
ERRORS: deque[str] = deque(maxlen=32)  # llama.cpp's last error lines, said when a call fails


def _last_error() -> str:
    """llama.cpp's last logged error, as one line (empty if it logged none)."""
    text = " ".join(" ".join(ERRORS).split())
    ERRORS.clear()
    return f": {text}" if text else ""


class _Tensor(ctypes.Structure):
    """ggml.h's struct ggml_tensor (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""


_Tensor._fields_ = [
    ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(_Tensor) * 10), ("view_src", ctypes.POINTER(_Tensor)), ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8),
]
_DTYPES = {0: np.float32, 1: np.float16, 26: np.int32, 27: np.int64}  # ggml_type numbers of the types read here


def _array(t: _Tensor) -> np.ndarray:
    """A tensor's data as a numpy array in ggml's order reversed ([ne3, ne2, ne1, ne0]), copied out."""
    dtype = _DTYPES.get(t.type)
    if dtype is None or not t.data:
        raise BackendError(f"llama.cpp tensor {t.name.decode()!r} has a type kvviz does not read ({t.type})")
    ne, nb = list(t.ne)[::-1], list(t.nb)[::-1]
    span = sum((n - 1) * b for n, b in zip(ne, nb, strict=True)) + np.dtype(dtype).itemsize
    buf = (ctypes.c_char * span).from_address(t.data)
    return np.lib.stride_tricks.as_strided(np.frombuffer(buf, dtype=dtype), shape=ne, strides=nb).copy()


class _Models:
    """Loaded GGUF models, one per file per process (read only: every context shares it)."""

    def __init__(self) -> None:
        self.lock, self.models = threading.Lock(), {}

    def get(self, path: Path):
        L = _lib()[0]
        key = str(path.resolve())
        with self.lock:
            if key not in self.models:
                params = L.llama_model_default_params()
                model = L.llama_model_load_from_file(key.encode(), params)
                if not model:
                    raise BackendError(f"model: llama.cpp could not load {path} (not a GGUF file of an architecture "
                                       "this llama.cpp knows)")
                self.models[key] = model
            return self.models[key]


MODELS = _Models()


class LlamaContext:
    """One llama.cpp context: a KV cache of `n_ctx` cells shared by up to `n_seq_max` sequences (one
    stream when `unified`), decoding batches of up to `n_batch` tokens in one graph evaluation each."""

    def __init__(self, gguf: Path, *, n_ctx: int, n_batch: int, n_seq_max: int, unified: bool, flash_attn: bool,
                 listener: Listener | None, threads: int | None = None):
        check_version()
        L, ops, _ = _lib()
        self.L, self.listener, self.flash = L, listener, flash_attn
        self.model = MODELS.get(gguf)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_layer = L.llama_model_n_layer(self.model)
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, n_seq_max
        p.kv_unified, p.flash_attn_type = unified, (1 if flash_attn else 0)
        p.n_threads = p.n_threads_batch = threads or os.cpu_count() or 1
        p.no_perf = True
        self._set_rows, self._soft_max, self._fattn = ops["SET_ROWS"], ops["SOFT_MAX"], ops["FLASH_ATTN_EXT"]
        self._callback = L.ggml_backend_sched_eval_callback(self._on_tensor)  # kept: llama.cpp holds the pointer
        if listener is not None:
            p.cb_eval, p.cb_eval_user_data = self._callback, None
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise BackendError(f"engine.num_blocks: llama.cpp could not make a context of {n_ctx} cells for "
                               f"{n_seq_max} sequences here")
        # llama.cpp rounds each stream up to a multiple of 256 cells; without kv_unified a stream per sequence
        self.stream_size, self.n_stream = L.llama_n_ctx_seq(self.ctx), 1 if unified else n_seq_max
        self.n_ctx = self.stream_size * self.n_stream
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_batch, 0, n_seq_max)
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self._layer = 0
        self._state = (ctypes.c_uint8 * 0)()
        self._seen_write = False
        self._error: BaseException | None = None

    # -- the C API -----------------------------------------------------------------------------
    def decode(self, tokens: list[BatchToken]) -> list[int]:
        """One `llama_decode` of these tokens; the batch indices whose logits were asked for."""
        b, out = self.batch, []
        if len(tokens) > self.n_batch:
            raise BackendError(f"a batch of {len(tokens)} tokens is over n_batch {self.n_batch}")
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t.token, t.pos, len(t.seqs), t.logits
            for j, s in enumerate(t.seqs):
                b.seq_id[i][j] = s
            if t.logits:
                out.append(i)
        b.n_tokens = len(tokens)
        self._seen_write, self._layer, self._error = False, 0, None
        ERRORS.clear()
        rc = self.L.llama_decode(self.ctx, b)
        if self._error is not None:
            raise self._error
        if rc != 0:
            why = {1: "no room in the KV cache for the batch", 2: "aborted", -1: "invalid batch"}.get(rc, "error")
            raise CallFailed(f"llama_decode returned {rc} ({why}){_last_error()}")
        return out

    def logits(self, index: int) -> torch.Tensor:
        """The float32 logits of batch token `index` of the last decode."""
        ptr = self.L.llama_get_logits_ith(self.ctx, index)
        if not ptr:
            raise CallFailed(f"llama_get_logits_ith({index}) returned nothing")
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if not self.L.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise CallFailed(f"llama_memory_seq_rm({seq}, {p0}, {p1}) refused")

    def seq_state(self, seq: int) -> bytes:
        """One sequence's cells and K/V (`llama_state_seq_get_data`): what llama-server's prompt cache keeps."""
        n = self.L.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * n)()
        if self.L.llama_state_seq_get_data(self.ctx, buf, n, seq) != n:
            raise CallFailed(f"llama_state_seq_get_data({seq}) wrote less than its size")
        return bytes(buf)

    def restore(self, state: bytes, seq: int) -> None:
        """A saved sequence's cells and K/V into sequence `seq` (`llama_state_seq_set_data`)."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if self.L.llama_state_seq_set_data(self.ctx, buf, len(state), seq) == 0:
            raise CallFailed(f"llama_state_seq_set_data into sequence {seq} failed")

    def cells(self) -> list[list[Cell]]:
        """Every stream's occupied cells in cell order, as llama.cpp's state API writes them (position and
        sequence ids; it writes no cell indices, so kvviz places them by what it saw written)."""
        n = self.L.llama_state_seq_get_size(self.ctx, -1)
        if len(self._state) < n:  # one buffer, grown as the cache fills: the state holds every cell's K/V too
            self._state = (ctypes.c_uint8 * max(n, 2 * len(self._state)))()
        if self.L.llama_state_seq_get_data(self.ctx, self._state, n, -1) != n:
            raise CallFailed("llama_state_seq_get_data(-1) wrote less than its size")
        return parse_cells(memoryview(self._state)[:n])

    def close(self) -> None:
        if self.ctx:
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.ctx = None

    # -- the evaluation callback ---------------------------------------------------------------
    def _on_tensor(self, ptr, ask: bool, user_data) -> bool:
        """ggml asks (ask=True) whether kvviz wants a node, then hands over the ones it does, computed."""
        t = ctypes.cast(ptr, ctypes.POINTER(_Tensor)).contents
        wanted = (t.op == self._set_rows and not self._seen_write and t.name.startswith(b"cache_k_l")) or \
            t.op == (self._fattn if self.flash else self._soft_max)
        if ask or not wanted:
            return bool(wanted)
        try:
            if t.op == self._set_rows:
                self._seen_write = True
                self._cells = _array(t.src[1].contents).reshape(-1).tolist()
            elif t.op == self._soft_max:
                self._attention(t.ne[0], _array(t.src[1].contents))
                self.listener.on_layer(self._layer, torch.from_numpy(_array(t)[0]))  # [H, T, n_kv]
                self._layer += 1
            else:
                self._flash(t)
        except BaseException as e:  # raised by decode() on kvviz's side, never into llama.cpp's C frames
            self._error = e
            return False
        return True

    def _attention(self, n_kv: int, mask: np.ndarray) -> torch.Tensor:
        """What the mask lets each token see [T, n_kv]; at the first attention layer, the ubatch's facts."""
        if mask.shape[0] != 1:
            raise BackendError(f"llama.cpp evaluated {mask.shape[0]} streams at once; kvviz decodes one at a time")
        visible = torch.from_numpy(mask.reshape(-1, mask.shape[-1])[:len(self._cells)] == 0)
        if self._layer == 0:
            base = self._cells[0] // self.stream_size * self.stream_size
            self.listener.on_ubatch(Ubatch(cells=self._cells, n_kv=n_kv, visible=visible, base=base))
        return visible

    def _flash(self, t: _Tensor) -> None:
        """Flash attention returns no weights: recompute them from its own Q, K and mask, in float32, and
        say how far its output is from theirs."""
        q, k, v, mask = (_array(t.src[i].contents) for i in range(4))
        visible = self._attention(k.shape[-2], mask)
        scale = struct.unpack("f", struct.pack("i", t.op_params[0]))[0]
        c = kernel_check.check(torch.from_numpy(q[0]).float(), torch.from_numpy(k[0]).float(),
                               torch.from_numpy(v[0]).float(), visible, scale,
                               torch.from_numpy(_array(t)[0]).float(), eps=F16_EPS)
        self.listener.on_layer(self._layer, c.weights)
        self.listener.on_kernel(self._layer, c.excess)
        self._layer += 1


def parse_cells(state: bytes | memoryview) -> list[list[Cell]]:
    """The cells of `llama_state_seq_get_data(.., -1)`: after a magic number and the sequence id, per
    stream a cell count, each cell's position, sequence count and ids, then the stream's K/V (skipped:
    kvviz reads K/V in the graph): whether V is transposed, the layer count, then K and V layer by layer."""
    view, at, streams = memoryview(state), 8, []

    def u32() -> int:
        nonlocal at
        at += 4
        return struct.unpack_from("<I", view, at - 4)[0]

    def skip_rows(layers: int, count: int) -> None:
        nonlocal at
        for _ in range(layers):
            at += 4  # type
            (row,) = struct.unpack_from("<Q", view, at)
            at += 8 + row * count

    n_stream = u32()
    for _ in range(n_stream):
        count, cells = u32(), []
        for _ in range(count):
            pos, n = struct.unpack_from("<iI", view, at)
            at += 8
            seqs = struct.unpack_from(f"<{n}i", view, at)
            at += 4 * n
            cells.append(Cell(pos=pos, seqs=frozenset(seqs)))
        streams.append(cells)
        if count:
            v_trans, layers = u32(), u32()
            skip_rows(layers, count)  # K
            if not v_trans:
                skip_rows(layers, count)
            else:
                for _ in range(layers):
                    at += 4
                    size, dim = struct.unpack_from("<II", view, at)
                    at += 8 + size * dim * count
    return streams
