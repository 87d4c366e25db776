"""The native model pass: a decode step or a verification pass of a few tokens in one call.

A small model's decode step is nearly all fixed time: the demo target's eager step is some
800 library calls, 1.4 ms a token against well under 0.3 ms of bytes, where llama.cpp takes
0.3 ms in all. `moespec/kernels/step.c` runs the whole pass (embedding, norms, projections,
q/k norms, rotary embedding, cache writes, attention, router, experts or dense MLP, head) in
one call, on the products and the attention of `moespec/kernels/native.c` for this CPU's
family, reached through function pointers.

Its bits are its own, not the eager pass's (sums of squares and exponentials round in other
orders), but it computes every row of a pass as a one-token pass would: products give each row
its one-row bits, each row attends over exactly the positions it sees, the rest is row-wise.
So a verification pass of k + 1 tokens reproduces k + 1 one-token steps bit for bit, greedy
speculation equals plain greedy decoding, and the slot and deduplicating kernels (which only
change which rows share a weight's read) give the same bits. It takes every pass of batch 1
and at most MAX_TOKENS tokens of a supported model, in either mode: decode steps, verification
passes, a draft model's catch-up, short prompts. Longer prompts stay eager (the library's
attention over a whole prompt at once); they are shared by plain and speculative decoding.

`NativeStep.batch` runs several sequences' passes as one (step.c's `moespec_step_batch`,
moespec.models.batch): each sequence's rows at its own positions of its own cache, attending
over its own positions only, the rest row-wise over all rows, so each sequence gets the bits
of its own pass while the batch reads every weight (and, deduplicating, every distinct
expert) once.

Supported: bf16 models whose every product is in the native pair layout (bf16 or int8), with
full attention (no sliding window, sinks, biases, output gate or clipping), q/k norms per head,
over the projection or none, and softmax top-k routing (renormalised or not) over plain SwiGLU
experts without shared experts, or dense SwiGLU MLPs. Anything else runs eagerly, and
`report()` says why.

What a pass of n tokens can cost, on the demo target (2-core AVX-512-BF16 host, 1 thread;
its 29 MB of weights stay in the 300 MiB L3, which one thread reads at 21-22 GB/s): the dense
weights (attention, routers, head: 3.8 MB) and each distinct expert of a layer (393 KB) are
read once per pass; random tokens route to 8, 12.2, 15.5, 21.9 and 29.0 distinct experts over
the 4 layers at n = 1, 2, 3, 5, 9, so 6.9, 8.6, 9.9, 12.4 and 15.2 MB: bytes alone allow
tau(n)/tau(1) of 1.24, 1.42, 1.78 and 2.19. But every row costs 3.47M multiply-adds (the
head 1.05M of them), and `vdpbf16ps` peaks near 31 GMAC/s here (a [4096, 256] product: 109 us
at 1 row, 312 at 9), so a pass of 9 takes at least 1.0 ms of products against 0.32 ms of
bytes for one token: tau(9)/tau(1) >= ~3 with these loops, 2.5 or less only with a denser
multiply (AMX tiles, which would change every row's bits together). The demo draft reads
5.0 MB a step (its 2 MB tied head included) against the target's 6.9: 0.72 of a target step
by bytes, so a draft step of 0.35 of the target's is out of reach of any loop.
"""

import ctypes
import weakref

import torch

from moespec.kernels import native as nat
from moespec.kernels.isa import cpu_flags, this_cpu
from moespec.kernels.native import PairWeight
from moespec.kernels.quant import Int8Weight
from moespec.kernels.threads import SMALL_WORK_BYTES

KERNELS = ("slot", "dedup")  # the expert kernels a native pass computes (the same bits)
QK_NORMS = {"none": 0, "head": 1, "projection": 2}
MAX_ROTARY = 1024  # step.c's rotation buffer
# The longest native pass: verification passes are at most 9 tokens; a draft's catch-up after
# plain steps and a prompt are longer (eagerly, the 2.6M-parameter demo draft took 2.5 ms to
# catch up on some 20 tokens, and up to 13 ms on longer runs of missed tokens).
MAX_TOKENS = 256

_U64, _I64 = ctypes.c_uint64, ctypes.c_int64


class _Product(ctypes.Structure):
    _fields_ = [("weight", _U64), ("scales", _U64), ("out", _I64), ("in_", _I64), ("bytes", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _U64),
        ("post_norm", _U64),
        ("qkv", _Product),
        ("o", _Product),
        ("q_norm", _U64),
        ("k_norm", _U64),
        ("qk_norm", _I64),
        ("experts", _I64),
        ("top_k", _I64),
        ("renormalize", _I64),
        ("router", _Product),
        ("gate_up", _U64),
        ("down", _U64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _I64),
        ("hidden", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("rotary", _I64),
        ("vocab", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("embed", _U64),
        ("norm", _U64),
        ("head", _Product),
        ("layer", ctypes.POINTER(_Layer)),
        ("bf16_batch", _U64),
        ("int8_batch", _U64),
        ("attend", _U64),
        ("small_bytes", _I64),
        ("attend_rows", _U64),
        ("isa", _I64),
        ("scratch", _U64),
    ]


class _Scratch(ctypes.Structure):
    """step.c's Scratch: a pass's buffers, kept from pass to pass."""

    _fields_ = [("p", ctypes.c_void_p), ("bytes", _I64), ("busy", _I64)]


# moespec_step(model, tokens, T, start, cache, capacity, cos, sin, dedup, all_logits, logits,
# ids, weights, threads, attend_threads): addresses as integers, typed once
_STEP = ctypes.CFUNCTYPE(
    ctypes.c_int,
    *[_U64, _U64, _I64, _I64, _U64, _I64, _U64, _U64],
    *[ctypes.c_int] * 2,
    *[_U64] * 3,
    *[ctypes.c_int] * 2,
)


class _Segment(ctypes.Structure):
    """step.c's Segment: one sequence of a batched pass, T rows at `start` of its own cache
    (per layer the keys' and values' addresses), rotated by its rows of the tables."""

    _fields_ = [
        ("T", _I64),
        ("start", _I64),
        ("capacity", _I64),
        ("cache", _U64),
        ("cos", _U64),
        ("sin", _U64),
        ("attend_threads", _I64),
    ]


# moespec_step_batch(model, tokens, B, segments, dedup, all_logits, logits, ids, weights,
# threads)
_STEP_BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int, _U64, _U64, _I64, _U64, *[ctypes.c_int] * 2, *[_U64] * 3, ctypes.c_int
)


def _isa(family: str) -> int:
    """step.c's elementwise instructions for a CPU family: 2 AVX-512, 1 AVX2 (with FMA), 0."""
    if family in ("amx", "avx512-bf16", "avx512"):
        return 2
    return 1 if family == "avx2" and "fma" in cpu_flags() else 0


def _native_weight(w) -> bool:
    if isinstance(w, PairWeight):
        return w.shape[1] % 2 == 0
    return isinstance(w, Int8Weight) and w.pairs is not None


def _library_lacks(symbol: str) -> str | None:
    lib = nat.native()
    if lib.lib is None:
        return f"no native library: {lib.reason}"
    return None if lib.has(symbol) else f"the native library lacks {symbol}"


def _loops_lack(weights) -> str | None:
    """Why this CPU has no pair-layout loop for some of `weights` (bf16 or int8), or None."""
    family = this_cpu()[2]
    for kind, cls in (("bf16", PairWeight), ("int8", Int8Weight)):
        if any(isinstance(w, cls) for w in weights):
            name, why = nat.layout_function(kind, family)
            if name is None:
                return why
    return None


def unsupported(model) -> str | None:
    """Why the native pass cannot run `model`, or None when it can."""
    from moespec.models.layers import Attention, DenseMLP
    from moespec.models.moe import MoEBlock

    if (why := _library_lacks("moespec_step")) is not None:
        return why
    if model.dtype != torch.bfloat16:
        return f"the native pass computes in bf16, the model in {model.dtype}"
    if nat.attention_function() is None:
        return "no native attention on this CPU"
    c = model.config
    if c.qk_norm not in QK_NORMS or c.clip_qkv is not None:
        return f"q/k norm {c.qk_norm!r} or clipping is not in the native pass"
    if any(w is not None for w in c.attention_windows):
        return "sliding-window attention is not in the native pass"
    if c.rotary_dims % 2 or c.rotary_dims > min(c.head_dim, MAX_ROTARY) or c.head_dim % 2:
        return f"rotary dims {c.rotary_dims} of head dim {c.head_dim} are not in the native pass"
    products = [model.lm_head]
    for i, layer in enumerate(model.layers):
        a, mlp = layer.attention, layer.mlp
        if type(a) is not Attention or any(
            t is not None for t in (a.qkv_bias, a.o_bias, a.sinks, a.output_gate)
        ):
            return f"layer {i}'s attention is not in the native pass"
        # [D] each per head; [N D] and [K D] over the projection
        want = {
            "head": [c.head_dim, c.head_dim],
            "projection": [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim],
        }.get(c.qk_norm)
        if want is not None and [a.q_norm.numel(), a.k_norm.numel()] != want:
            return f"layer {i}'s q/k norm weights are not of the native pass's shapes"
        products += [a.qkv, a.o]
        if isinstance(mlp, MoEBlock):
            e = mlp.experts
            extras = (mlp.routing, mlp.router_bias, mlp.correction_bias, mlp.shared)
            if any(t is not None for t in extras) or mlp.shared_gate is not None:
                return f"layer {i}'s router or shared experts are not in the native pass"
            if not e.is_plain_swiglu or not e.is_packed:
                return f"layer {i}'s experts are not packed plain SwiGLU experts"
            products += [mlp.router, *e.packed_gate_up, *e.packed_down]
        elif type(mlp) is DenseMLP:
            products += [mlp.gate_up, mlp.down]
        else:
            return f"layer {i}'s MLP is not in the native pass"
    if not all(_native_weight(w) for w in products):
        return "not every weight is in the native pair layout (load the model packed)"
    return _loops_lack(products)


def experts_unsupported(experts) -> str | None:
    """Why `NativeExperts` cannot run these experts (one layer's ExpertWeights), or None."""
    if (why := _library_lacks("moespec_experts")) is not None:
        return why
    if experts.dtype != torch.bfloat16:
        return f"the native expert operation computes in bf16, the experts are {experts.dtype}"
    if not experts.is_plain_swiglu or not experts.is_packed:
        return "the experts are not packed plain SwiGLU experts"
    weights = [*experts.packed_gate_up, *experts.packed_down]
    if not all(_native_weight(w) for w in weights):
        return "not every expert weight is in the native pair layout"
    return _loops_lack(weights)


def _raise_for(rc: int, what: str, function: str, args) -> None:
    """The error of a native call's return code beyond its own: an argument its C checks
    refused (negative: a ValueError naming it), no memory (1), shapes a product refused."""
    if rc < 0:
        raise nat.refused(function, rc, args)
    if rc == 1:
        raise MemoryError(f"{what}: no memory for its buffers")
    if rc:
        raise RuntimeError(f"{what}: a product refused its shapes")


def _functions(lib, family: str) -> dict[str, int]:
    """The addresses of this CPU family's bf16 and int8 pair-layout batch products (0: none)."""
    out = {}
    for kind in ("bf16", "int8"):
        name, _ = nat.layout_function(kind, family)
        fn = getattr(lib, f"{name}_batch", None) if name else None
        out[kind] = ctypes.cast(fn, ctypes.c_void_p).value if fn else 0
    return out


class _Weights:
    """The ctypes structures' view of tensors: their addresses, the tensors kept alive."""

    def __init__(self):
        self._keep = []  # every tensor and array whose address the structures hold

    def _ptr(self, t: torch.Tensor) -> int:
        t = t.contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _product(self, w) -> _Product:
        if isinstance(w, PairWeight):
            data, scales = w.packed, 0
        else:
            data, scales = w.pairs, self._ptr(w.scales)
        self._keep.append(data)
        return _Product(data.data_ptr(), scales, w.shape[0], w.shape[1], w.nbytes)

    def _products(self, weights) -> int:
        array = (_Product * len(weights))(*[self._product(w) for w in weights])
        self._keep.append(array)
        return ctypes.addressof(array)


class NativeExperts(_Weights):
    """`experts(x [T, H] bf16, ids [T, m], weights [T, m], dedup) -> [T, H] bf16`: one MoE
    layer's expert operation exactly as the native model pass runs it (step.c's
    `moe_experts`: the same products, orders and rounding; slot and dedup give the same
    bits). The calibration times this where the engine's passes run natively, so that its
    fits describe the expert operation the engine runs. T may be 0; calls from several
    threads at once are safe (each passes its own top k; the structures are only read)."""

    def __init__(self, experts, family: str | None = None):
        super().__init__()
        why = experts_unsupported(experts)
        if why is not None:
            raise ValueError(f"the native expert operation cannot run these experts: {why}")
        lib = nat.native().lib
        self._fn = lib.moespec_experts  # typed by moespec.kernels.native.load
        functions = _functions(lib, family or this_cpu()[2])
        self.layer = _Layer(
            experts=experts.num_experts,
            gate_up=self._products(experts.packed_gate_up),
            down=self._products(experts.packed_down),
        )
        self.hidden = experts.hidden_size
        self.model = _Model(
            layers=1,
            hidden=self.hidden,
            layer=ctypes.pointer(self.layer),
            bf16_batch=functions["bf16"],
            int8_batch=functions["int8"],
            small_bytes=SMALL_WORK_BYTES,
            isa=_isa(family or this_cpu()[2]),
        )
        self.openmp = nat.native().openmp
        self._structures = (ctypes.addressof(self.model), ctypes.addressof(self.layer))

    def __call__(self, x, ids, weights, dedup: bool) -> torch.Tensor:
        tokens, top_k = ids.shape
        if x.dtype != torch.bfloat16 or tuple(x.shape) != (tokens, self.hidden):
            raise ValueError(f"x must be bf16 [{tokens}, {self.hidden}], got {x.dtype} {x.shape}")
        if weights.shape != ids.shape:
            raise ValueError(f"routing weights {tuple(weights.shape)} and ids {tuple(ids.shape)}")
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(tokens, self.hidden, dtype=torch.bfloat16)
        # top_k goes with the call, not into the shared layer structure: concurrent calls
        # with other k would otherwise read each other's
        threads = torch.get_num_threads() if self.openmp else 1
        args = (*self._structures, x.data_ptr(), tokens, top_k, ids.data_ptr())
        args += (weights.data_ptr(), bool(dedup), out.data_ptr(), threads)
        rc = self._fn(*args)
        if rc == 4:
            raise IndexError(f"expert ids outside 0-{self.layer.experts - 1} in {ids.tolist()}")
        _raise_for(rc, "native expert operation", "moespec_experts", args)
        return out


def _pointer_array(cache):
    """The addresses step.c reads a cache by: per layer its keys' then its values'."""
    tensors = [t for pair in zip(cache.keys, cache.values, strict=True) for t in pair]
    if cache.keys[0].shape[0] != 1 or not all(
        t.is_contiguous() and t.dtype == torch.bfloat16 for t in tensors
    ):
        raise ValueError("the native pass wants a contiguous bf16 cache of batch 1")
    return (_U64 * len(tensors))(*[t.data_ptr() for t in tensors])


class NativeStep(_Weights):
    """`step(tokens [1, T], cache, kernel, all_logits, routing_sink) -> logits` of a pass of
    T <= MAX_TOKENS tokens at the cache's length, as `Transformer.forward` returns them ([1, T, V]
    or [1, 1, V], float32); writes the pass's keys and values and advances the cache. The
    weights are read in place (the model's own tensors, kept alive here)."""

    def __init__(self, model, family: str | None = None):
        # family: the CPU family whose loops to call (this CPU's; tests pass "avx2" on an
        # AVX-512 host to run the AVX2 loops, which read the same layout)
        super().__init__()
        c = model.config
        lib = nat.native().lib
        family = family or this_cpu()[2]
        self._fn = _STEP(("moespec_step", lib))
        self._batch_fn = _STEP_BATCH(("moespec_step_batch", lib))
        # the pass's buffers, grown to its largest pass and freed with this object
        self._scratch = _Scratch()
        weakref.finalize(self, lib.moespec_scratch_free, ctypes.byref(self._scratch))
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            layers[i] = self._layer(layer)
        self._layers = layers
        functions = _functions(lib, family)
        self.model = _Model(
            layers=len(model.layers),
            hidden=c.hidden_size,
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rotary=c.rotary_dims,
            vocab=c.vocab_size,
            eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5,
            embed=self._ptr(model.embed),
            norm=self._ptr(model.norm),
            head=self._product(model.lm_head),
            layer=layers,
            bf16_batch=functions["bf16"],
            int8_batch=functions["int8"],
            attend=ctypes.cast(getattr(lib, nat.ATTENTION[family]), ctypes.c_void_p).value,
            small_bytes=SMALL_WORK_BYTES,
            attend_rows=ctypes.cast(
                getattr(lib, nat.ATTENTION[family] + "_rows"), ctypes.c_void_p
            ).value,
            isa=_isa(family),
            scratch=ctypes.addressof(self._scratch),
        )
        self._model = ctypes.addressof(self.model)
        self.vocab = c.vocab_size
        self.rotary = model.rotary
        self._tables, self._cos, self._sin, self._positions = None, 0, 0, 0
        self._row_bytes = c.rotary_dims * 2  # a row of the bf16 rotary tables
        # bytes one layer's attention reads per cached position (batch 1, bf16 keys and values)
        self._position_bytes = 2 * c.num_kv_heads * c.head_dim * 2
        self.moe_layers = [i for i, x in enumerate(self._layers) if x.experts]
        self.top_k = max((self._layers[i].top_k for i in self.moe_layers), default=1)
        self.openmp = nat.native().openmp
        self._cache_key, self._cache_ptrs, self._cache_address = None, None, 0
        self._batch_caches = weakref.WeakKeyDictionary()  # cache: (its key, its addresses)
        self.passes = 0  # passes run natively

    def _layer(self, layer) -> _Layer:
        from moespec.models.moe import MoEBlock

        a, mlp = layer.attention, layer.mlp
        c = a.config
        mode = QK_NORMS[c.qk_norm]
        out = _Layer(
            input_norm=self._ptr(layer.input_norm),
            post_norm=self._ptr(layer.post_attention_norm),
            qkv=self._product(a.qkv),
            o=self._product(a.o),
            q_norm=self._ptr(a.q_norm) if mode else 0,
            k_norm=self._ptr(a.k_norm) if mode else 0,
            qk_norm=mode,
        )
        if isinstance(mlp, MoEBlock):
            e = mlp.experts
            out.experts, out.top_k, out.renormalize = e.num_experts, mlp.top_k, mlp.renormalize
            out.router = self._product(mlp.router)
            out.gate_up = self._products(e.packed_gate_up)
            out.down = self._products(e.packed_down)
        else:
            out.experts, out.top_k = 0, 1
            out.gate_up = self._products([mlp.gate_up])
            out.down = self._products([mlp.down])
        return out

    def _cache_addresses(self, cache) -> int:
        # every layer's address, every pass: a new cache can reuse an old one's id and the
        # address of its first tensor while its other tensors lie elsewhere
        key = [t.data_ptr() for t in cache.keys] + [t.data_ptr() for t in cache.values]
        if key != self._cache_key:
            self._cache_ptrs = _pointer_array(cache)
            self._cache_address = ctypes.addressof(self._cache_ptrs)
            self._cache_key = key
        return self._cache_address

    def _batch_cache_addresses(self, cache) -> int:
        """`_cache_addresses` for one of a batch's caches, each kept with its own key."""
        key = [t.data_ptr() for t in cache.keys] + [t.data_ptr() for t in cache.values]
        held = self._batch_caches.get(cache)
        if held is None or held[0] != key:
            held = key, _pointer_array(cache)
            self._batch_caches[cache] = held
        return ctypes.addressof(held[1])

    def _rotary_tables(self, positions: int) -> None:
        """Hold the rotary tables for `positions` (and their addresses): a pass reads its rows
        from the start of its position, with no slicing of tensors per pass."""
        positions = max(positions, 2 * self._positions, 256)  # grown as a cache grows
        self._tables = self.rotary.tables(0, positions)  # kept alive while its rows are read
        cos, sin = self._tables
        self._cos, self._sin, self._positions = cos.data_ptr(), sin.data_ptr(), cos.shape[0]

    def __call__(self, tokens: torch.Tensor, cache, *, kernel: str, all_logits: bool, sink=None):
        # every decode step runs this: what does not change is computed once (the structures'
        # and tables' addresses, the function's types), the rest in plain integers
        length = tokens.shape[-1]
        if not 1 <= length <= MAX_TOKENS:
            raise ValueError(f"a native pass holds 1-{MAX_TOKENS} tokens, got {length}")
        if tokens.dtype != torch.int64 or not tokens.is_contiguous():
            tokens = tokens.to(torch.int64).contiguous()
        start = cache.length
        end = start + length
        cache.reserve(length)
        if end > self._positions:
            self._rotary_tables(end)
        rows = length if all_logits else 1
        logits = torch.empty(1, rows, self.vocab, dtype=torch.float32)
        ids = weights = None
        if sink is not None:
            n = len(self._layers)
            ids = torch.zeros(n, length, self.top_k, dtype=torch.int64)
            weights = torch.zeros(n, length, self.top_k, dtype=torch.float32)
        threads = torch.get_num_threads() if self.openmp else 1
        attend = threads if end * self._position_bytes >= SMALL_WORK_BYTES else 1
        args = (
            self._model,
            tokens.data_ptr(),
            length,
            start,
            self._cache_addresses(cache),
            cache.capacity,
            self._cos + start * self._row_bytes,
            self._sin + start * self._row_bytes,
            kernel == "dedup",
            all_logits,
            logits.data_ptr(),
            0 if ids is None else ids.data_ptr(),
            0 if weights is None else weights.data_ptr(),
            threads,
            attend,
        )
        rc = self._fn(*args)
        if rc == 3:
            raise IndexError(f"token ids outside the vocabulary (0-{self.vocab - 1}) in {tokens}")
        _raise_for(rc, "native pass", "moespec_step", args)
        cache.advance(length)
        self.passes += 1
        if sink is not None:
            for i in self.moe_layers:
                k = self._layers[i].top_k
                sink(i, ids[i, :, :k], weights[i, :, :k])
        return logits

    def batch(self, feeds, caches, *, kernel: str, all_logits: bool, sinks=None) -> list:
        """Logits of B sequences' passes in one call: feeds[b] (int64 [T_b]) at the end of
        caches[b] (B distinct caches: `batch_pass` checks what this trusts), each row with the
        bits of its sequence's pass alone (step.c's
        `moespec_step_batch`); per sequence float32 [T_b, V] (all_logits) or [1, V]. Writes
        every sequence's keys and values to its own cache and advances it. sinks: None, or per
        sequence a routing sink (or None), called per MoE layer with that sequence's rows."""
        feeds = [torch.as_tensor(f, dtype=torch.int64) for f in feeds]
        lengths = [f.numel() for f in feeds]
        if not feeds or min(lengths) < 1 or sum(lengths) > MAX_TOKENS:
            raise ValueError(
                f"a native batched pass holds 1-{MAX_TOKENS} tokens in all and at least one a "
                f"sequence, got {lengths}"
            )
        tokens = (feeds[0] if len(feeds) == 1 else torch.cat(feeds)).contiguous()
        segments = self._segments(lengths, caches)
        total, rows = sum(lengths), sum(lengths) if all_logits else len(feeds)
        logits = torch.empty(rows, self.vocab, dtype=torch.float32)
        ids = weights = None
        if sinks is not None and any(s is not None for s in sinks):
            ids = torch.zeros(len(self._layers), total, self.top_k, dtype=torch.int64)
            weights = torch.zeros(len(self._layers), total, self.top_k, dtype=torch.float32)
        threads = torch.get_num_threads() if self.openmp else 1
        args = (self._model, tokens.data_ptr(), len(feeds), ctypes.addressof(segments))
        args += (kernel == "dedup", all_logits, logits.data_ptr())
        args += (0 if ids is None else ids.data_ptr(), 0 if weights is None else weights.data_ptr())
        rc = self._batch_fn(*args, threads)
        if rc == 3:
            raise IndexError(f"token ids outside the vocabulary (0-{self.vocab - 1}) in {tokens}")
        _raise_for(rc, "native batched pass", "moespec_step_batch", (*args, threads))
        for cache, n in zip(caches, lengths, strict=True):
            cache.advance(n)
        self.passes += 1
        firsts = [sum(lengths[:b]) for b in range(len(feeds))]  # each sequence's first row
        if ids is not None:
            for sink, first, n in zip(sinks, firsts, lengths, strict=True):
                for i in self.moe_layers if sink is not None else ():
                    k = self._layers[i].top_k
                    sink(i, ids[i, first : first + n, :k], weights[i, first : first + n, :k])
        if not all_logits:  # slices: split() costs some 10 us a call
            return [logits[b : b + 1] for b in range(len(feeds))]
        return [logits[first : first + n] for first, n in zip(firsts, lengths, strict=True)]

    def _segments(self, lengths: list[int], caches) -> ctypes.Array:
        """step.c's Segments of a batch: each cache's room reserved, its position, addresses
        and rotary rows, and its attention's threads (by the positions it reads)."""
        for cache, n in zip(caches, lengths, strict=True):
            cache.reserve(n)
        ends = [c.length + n for c, n in zip(caches, lengths, strict=True)]
        if max(ends) > self._positions:
            self._rotary_tables(max(ends))
        threads = torch.get_num_threads() if self.openmp else 1
        segments = (_Segment * len(lengths))()
        for s, cache, n, end in zip(segments, caches, lengths, ends, strict=True):
            s.T, s.start, s.capacity = n, cache.length, cache.capacity
            s.cache = self._batch_cache_addresses(cache)
            s.cos = self._cos + cache.length * self._row_bytes
            s.sin = self._sin + cache.length * self._row_bytes
            s.attend_threads = threads if end * self._position_bytes >= SMALL_WORK_BYTES else 1
        return segments
