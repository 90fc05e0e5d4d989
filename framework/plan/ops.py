"""The work of one forward, traced once on the meta device: every operator the model dispatches
for a micro-batch, with the module it runs in. The time model (framework.plan.timing) prices it.

An operator is one of:
- a matmul (mm, addmm, bmm): its (M, K, N), a batched one's batch folded into M;
- attention (scaled_dot_product_attention, whatever kernel runs it): the scores' matmul shape
  (B·H·Tq, D, Tk), priced as two such matmuls (the scores and the weighted sum; no causal
  discount, as the CPU and flash kernels compute every tile of a short sequence);
- any other operator: its dispatch, and the bytes of its tensor inputs and outputs, of one of two
  kinds: math-bound (activations, norms, softmax: MATH), memory-bound (adds, scales, copies,
  casts, the embedding's gather), or none for a view, which moves nothing.

Under torch.compile the elementwise operators fuse: each run of them between two matmuls (or
attention) is one kernel, which reads a tensor made outside the run once and writes only what a
later run, a matmul or attention reads (`Region.fused_bytes`, what framework.plan.timing prices
a compiled step's elementwise work at).

A converter's module (`owned`: its path -> how the converter prices it, framework.plan.convert)
is priced by its converter: its matmuls are recorded with their formats (float8's "fp8") and the
bytes of its own casts replace the operators it dispatches (an emulation's are not the real
kernel's).

Each is placed by the module it runs in: before the blocks, after them, or in block i, where it
is `sharded` under tensor parallel when it runs inside a planned module or a container of one
(attention's core between its column- and row-wise projections, the MLP's activation), else
`replicated` (norms and residual adds: split along the sequence under sequence parallel only).

The backward is not traced: each forward matmul (M, K, N) has two of its transposed shapes
(the input's and the weight's gradients, exact for linear layers), attention's backward is
BACKWARD_ATTENTION times its forward (the kernels recompute the scores), and the other operators
move BACKWARD_BYTES times their forward bytes with BACKWARD_OPS times as many dispatches (they
read the output's gradient and the saved input, and write the input's gradient).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

BACKWARD_ATTENTION = 2.5
BACKWARD_BYTES = 2.0
BACKWARD_OPS = 1.6  # the ratio a traced backward of gpt and llama blocks dispatches (views included)

# the plan's styles that split a module's compute over the tensor-parallel ranks (the others,
# sequence_parallel and the embeddings, place its input or output, and split nothing but the sequence)
SPLIT = {"colwise", "rowwise", "gather_input", "output"}
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
# operators whose cost per byte is arithmetic (a CPU runs them several times slower than an add)
MATH = {"gelu", "silu", "tanh", "sigmoid", "erf", "exp", "softmax", "_softmax", "log_softmax", "_log_softmax",
        "native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm"}  # fmt: skip
VIEWS = {"_unsafe_view", "alias", "lift_fresh"}  # views whose schema does not say so


def byte_kind(func) -> str | None:
    """ "math", "memory" or None (a view: it moves no bytes) for an aten operator."""
    name = func.__name__.split(".")[0]
    if func.is_view or name in VIEWS:
        return None
    return "math" if name in MATH else "memory"


@dataclass
class Region:
    """The forward work of one place of the model (the top-level modules before or after the
    blocks, or one block's sharded or replicated part)."""

    # (M, K, N, tp style, formats): formats (forward, input_grad, weight_grad), None: the compute dtype's
    matmuls: list[tuple[int, int, int, str | None, tuple | None]] = field(default_factory=list)
    attention: list[tuple[int, int, int]] = field(default_factory=list)  # the scores' (B·H·Tq, D, Tk)
    bytes: float = 0.0  # memory-bound operators' bytes
    ops: int = 0
    math_bytes: float = 0.0  # math-bound operators' bytes
    cast_bytes: float = 0.0  # autocast's casts of the parameters (FSDP's gathers cast instead)
    causal: bool = False  # its attention is causal (is_causal=True): a GPU's kernel skips half the scores
    fused_bytes: float = 0.0  # its elementwise bytes, both kinds, as the compiler's fused kernels move them
    converted_bytes: tuple[float, float] = (0.0, 0.0)  # a converter's own casts: (forward, backward)


@dataclass
class Trace:
    """One micro-batch's forward: regions by place, keyed "pre", "post", (block, "sharded") and
    (block, "replicated"), a block named by its path (`blocks.3`)."""

    regions: dict = field(default_factory=dict)
    batch: int = 1
    seq_len: int = 1

    def region(self, key) -> Region:
        return self.regions.setdefault(key, Region())

    def compiled(self) -> Trace:
        """The same work as torch.compile runs it: each region's elementwise bytes are its fused kernels'."""
        if "_compiled" not in self.__dict__:
            regions = {k: replace(r, bytes=r.fused_bytes, math_bytes=0.0) for k, r in self.regions.items()}
            self.__dict__["_compiled"] = Trace(regions, self.batch, self.seq_len)
        return self.__dict__["_compiled"]


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class _Recorder(TorchDispatchMode):
    """Every aten operator of a forward, into the region its module's place names."""

    def __init__(self, trace: Trace, place, owned: dict | None = None):
        super().__init__()
        self.trace, self.place, self.in_attention, self.kinds = trace, place, 0, {}
        self.params: set[int] = set()  # ids of the tensors the model's parameters are called with
        self.owned = owned or {}
        self.fusion = _Fusion(trace)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_attention or func.namespace == "prim":  # the kernel's own operators; a fake tensor's queries
            return out
        key, style, owner = self.place()
        region = self.trace.region(key)
        region.ops += 1
        name = str(func)
        if name in MATMULS:
            a, b = (args[1], args[2]) if name in ("aten.addmm.default", "aten.baddbmm.default") else args[:2]
            m = a.shape[0] * a.shape[1] if a.dim() == 3 else a.shape[0]
            price = self.owned.get(owner) or {}
            region.matmuls.append((m, a.shape[-1], b.shape[-1], style, price.get("formats")))
            if price:
                region.converted_bytes = _plus(region.converted_bytes, _casts(price, m, a.shape[-1], b.shape[-1]))
            self.fusion.boundary(args)
            return out
        if owner is not None:  # the converter's casts price what its module dispatches
            self.fusion.boundary(args, ends_run=False)
            return out
        kind = self.kinds.get(func, False)
        if kind is False:  # once per operator: a name costs more than most small operators
            kind = self.kinds[func] = byte_kind(func)
        if kind == "memory" and func is torch.ops.aten._to_copy.default and id(args[0]) in self.params:
            region.cast_bytes += _nbytes(args[0]) + _nbytes(out)
        elif kind is None:
            self.fusion.view(args, out)
        else:
            moved = _nbytes(list(args)) + _nbytes(out)
            if kind == "memory":
                region.bytes += moved
            else:
                region.math_bytes += moved
            self.fusion.elementwise(key, args, out)
        return out


def _casts(price: dict, m: int, k: int, n: int) -> tuple[float, float]:
    """(forward, backward) bytes of a converted matmul's casts: its price's bytes per element of
    the input (m x k), the weight (k x n) and the output (m x n)."""
    forward, backward = price.get("casts", ((0, 0, 0), (0, 0, 0)))
    sizes = (m * k, k * n, m * n)
    return sum(a * e for a, e in zip(forward, sizes, strict=True)), sum(
        a * e for a, e in zip(backward, sizes, strict=True)
    )


def _plus(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] + b[0], a[1] + b[1]


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Fusion:
    """The compiler's fusion of elementwise runs (a run: the operators between two matmuls):
    each region's fused bytes, from who made and who reads each tensor."""

    def __init__(self, trace: Trace):
        self.trace, self.run = trace, 0
        self.made: dict[int, list] = {}  # tensor id -> [run, region key, bytes, written]
        self.alias: dict[int, int] = {}  # a view's id -> its base's
        self.read: set[tuple[int, int]] = set()  # (run, base id) read from memory already
        self.held: list = []  # every tensor seen, so that no id is reused while tracing

    def _base(self, t) -> int:
        return self.alias.get(id(t), id(t))

    def _write(self, base: int) -> None:
        made = self.made.get(base)
        if made is not None and not made[3]:
            made[3] = True
            self.trace.region(made[1]).fused_bytes += made[2]

    def boundary(self, args, ends_run: bool = True) -> None:
        """A matmul or attention (or a converter's module) reads its operands from memory."""
        for t in _tensors(list(args)):
            self._write(self._base(t))
        self.run += ends_run

    def view(self, args, out) -> None:
        ins = _tensors(list(args))
        if ins:
            for o in _tensors(out):
                self.alias[id(o)] = self._base(ins[0])
                self.held.append(o)

    def elementwise(self, key, args, out) -> None:
        region = self.trace.region(key)
        for t in _tensors(list(args)):
            base = self._base(t)
            made = self.made.get(base)
            if made is not None and made[0] == self.run:
                continue  # made in this run: it stays in registers
            if (self.run, base) not in self.read:
                self.read.add((self.run, base))
                region.fused_bytes += _nbytes(t)
                self._write(base)
        for o in _tensors(out):
            self.made[id(o)] = [self.run, key, _nbytes(o), False]
            self.held.append(o)


class _Attention(TorchFunctionMode):
    """scaled_dot_product_attention as one operator of its FLOPs, whatever it decomposes into on meta."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        q, k = args[0], args[1]
        key = self.recorder.place()[0]
        self.recorder.fusion.boundary(args[:3])
        region = self.recorder.trace.region(key)
        region.ops += 1
        region.attention.append((q.shape[:-1].numel(), q.shape[-1], k.shape[-2]))
        region.causal = region.causal or bool((kwargs or {}).get("is_causal"))
        self.recorder.in_attention += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.recorder.in_attention -= 1


def trace_forward(model: nn.Module, spec, batch: int, seq_len: int, autocast: torch.dtype | None = None,
                  owned: dict | None = None) -> Trace:  # fmt: skip
    """The forward of `model` (built on meta) on a (batch, seq_len) batch of tokens, by place;
    `spec`: its contract (the blocks' path and the tensor-parallel plan). `autocast`: the CPU
    autocast dtype the run computes in: the forward then runs on fake CPU tensors (autocast has no
    meta kernels), so the trace holds autocast's casts and each operator's own dtype's bytes.
    `owned`: the converters' modules by path, each priced by its converter (framework.plan.convert)."""
    from framework.contract import expand_plan, logits_of

    trace, stack = Trace(batch=batch, seq_len=seq_len), []
    names = {module: name for name, module in model.named_modules()}
    blocks = spec.blocks
    styles = expand_plan(model, spec) if spec.tp_plan else {}
    planned_parents = {name.rpartition(".")[0] for name, style in styles.items() if style in SPLIT}
    seen_blocks = [False]

    def place():
        style = next((styles[n] for n in reversed(stack) if styles.get(n) in SPLIT), None)
        owner = next((n for n in stack if n in owned), None) if owned else None
        inner, prefix = (stack[-1] if stack else ""), f"{blocks}."
        if blocks and inner.startswith(prefix):
            seen_blocks[0] = True
            block = prefix + inner[len(prefix) :].split(".")[0]
            inside = [n for n in stack if n.startswith(block + ".")]
            sharded = style is not None or any(n in planned_parents for n in inside)
            return (block, "sharded" if sharded else "replicated"), style, owner
        return ("post" if seen_blocks[0] else "pre"), style, owner

    def push(module, _args):
        stack.append(names.get(module, ""))

    def pop(module, _args, _out):
        stack.pop()

    pre = nn.modules.module.register_module_forward_pre_hook(push)
    post = nn.modules.module.register_module_forward_hook(pop)
    recorder = _Recorder(trace, place, owned)
    try:
        with _inputs(model, autocast) as (state, device):
            recorder.params = {id(t) for t in state.values()}
            tokens = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
            with torch.no_grad(), _Attention(recorder), recorder:
                logits_of(torch.func.functional_call(model, state, (tokens,)) if state else model(tokens))
    finally:
        pre.remove()
        post.remove()
    return trace


@contextlib.contextmanager
def _inputs(model: nn.Module, autocast: torch.dtype | None):
    """(parameters and buffers to call `model` with, the tokens' device): the model's own on meta,
    or, under autocast, fake CPU copies (no memory) inside a fake-tensor mode and the autocast."""
    if autocast is None or autocast == torch.float32:
        yield {}, "meta"
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = {name: torch.empty(t.shape, dtype=t.dtype, device="cpu") for name, t in named}
        with torch.autocast("cpu", dtype=autocast):
            yield state, "cpu"


def _record(fn) -> Region:
    trace = Trace()
    recorder = _Recorder(trace, lambda: ("pre", None, None))
    with torch.no_grad(), _Attention(recorder), recorder:
        fn()
    return trace.region("pre")


def count_ops(fn) -> int:
    """The operators `fn()` dispatches, counted as a trace counts them (attention as one)."""
    return _record(fn).ops


def elementwise_bytes(fn) -> dict[str, float]:
    """{"memory": bytes, "math": bytes} of `fn()`'s operators, counted as a trace counts them."""
    region = _record(fn)
    return {"memory": region.bytes, "math": region.math_bytes}
