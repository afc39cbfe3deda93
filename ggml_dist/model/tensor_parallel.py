"""Exact tensor parallelism for dense layers and expert parallelism for a mixture of experts: which rows
(or experts) of which weight a rank of K holds (one table, SPLITS), the rank's hyperparameters and
weights, and the rank's graph (issue 54).

Every matrix is cut into K slices of output rows (ne[1]); each output element is then computed whole,
on one rank, by the same kernel over the same row and the same (gathered) activations as in one
process, so the bits do not change. The ranks exchange activations by ALL_GATHER (core/ops_collective.py):

    per layer:  q, k, v = my heads' rows of Wq, Wk, Wv · n(h)             (head_dim, n_head/K, n_tokens)
                a  = all_gather(attn(q, k, v over my kv heads' cache))     (n_embd_head_v * n_head, n_tokens)
                h  = h + all_gather(my rows of Wo · a)                     every rank adds the same bits
                f  = all_gather(swiglu(my rows of Wgate · n(h), my rows of Wup · n(h)))      (n_ff, n_tokens)
                h  = h + all_gather(my rows of Wdown · f)
    logits = all_gather(my vocabulary rows of Wout · n(h))

Q/K/V split by heads keeps grouped-query attention local: q head h reads kv head h // (n_head / n_head_kv),
and rank r's q heads [r n_head/K, (r+1) n_head/K) read exactly its kv heads [r n_head_kv/K, ...), so a
rank's KV cache holds only its kv heads. kq_scale and the rope stay the whole model's (the head size
does not change). A weight's rows are contiguous in its tensor whatever its type (a quantized row is
whole blocks), so a slice is a byte range of the mapped file, zero-copy.

A mixture of experts' layer keeps its router on every rank (the same top-k everywhere: the same bits)
and places whole experts: rank r holds experts expert_bounds(E, K)[r] .. [r + 1] - 1 of every
ffn_{gate,up,down}_exps (a contiguous range of the 3-D tensor, equal bytes where K divides E, else one
expert apart). Its MUL_MAT_IDs compute only the slots its experts were chosen for (EXPERT_IDS), and
GATHER_EXPERTS brings every slot's output from its owner (core/ops_collective.py); the weighting and the
slots' sum then run on every rank in llama.cpp's order. qwen2moe's shared expert is split by rows as a
dense FFN is.
"""
from __future__ import annotations

import enum
import math
from dataclasses import replace

from ..core import ops
from ..core.context import Context, tensor_overhead
from ..core.graph import Graph
from ..core.ops_collective import all_gather, expert_ids, gather_experts
from ..core.tensor import Tensor
from .archs import LlamaHParams
from .graph_context import GraphInputs, GraphKey, GraphResult
from .kv_cache import KVCache
from .llama import LlamaGraphBuilder
from .model import LlamaModel
from .recurrent_state import RecurrentState

# separate Q/K/V (qwen2: with their biases; qwen3: a norm per head), a dense FFN or experts (Mixtral's llama)
TP_ARCHS = ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe")


class TensorParallelError(ValueError):
    """A model that cannot be split over K ranks exactly (the numbers say why)."""


class Split(enum.Enum):
    """How a weight is placed on the ranks (llama.cpp's meta backend: MIRRORED, AXIS_1)."""
    MIRRORED = "mirrored"           # whole on every rank
    Q_HEADS = "q_heads"             # rows of the rank's query heads
    KV_HEADS = "kv_heads"           # rows of the rank's key/value heads
    ROWS = "rows"                   # the rank's K-th of the output rows (n_embd, n_ff or n_vocab)
    EXPERTS = "experts"             # the rank's range of whole experts (ne[2] of a 3-D weight)


# the weight's name after "blk.{il}." (or the whole name), its weight and bias split the same way
SPLITS: dict[str, Split] = {
    "attn_q": Split.Q_HEADS, "attn_k": Split.KV_HEADS, "attn_v": Split.KV_HEADS,
    "attn_output": Split.ROWS, "ffn_gate": Split.ROWS, "ffn_up": Split.ROWS, "ffn_down": Split.ROWS,
    "output": Split.ROWS,           # the head; tied to token_embd: token_embd's rows, named output.weight
    "ffn_gate_exps": Split.EXPERTS, "ffn_up_exps": Split.EXPERTS, "ffn_down_exps": Split.EXPERTS,
    "ffn_gate_shexp": Split.ROWS, "ffn_up_shexp": Split.ROWS, "ffn_down_shexp": Split.ROWS,
}                                   # the routers (ffn_gate_inp, ffn_gate_inp_shexp) are mirrored


def split_of(name: str) -> Split:
    """The table's entry for a weight name: norms, token_embd (read by get_rows) and rope_freqs are mirrored."""
    base = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
    return SPLITS.get(base, Split.MIRRORED)


def check_split(hp: LlamaHParams, size: int) -> None:
    """Refuse, with the numbers, a model that K = size ranks cannot split exactly."""
    if hp.arch not in TP_ARCHS:
        raise TensorParallelError(f"tensor parallelism covers {', '.join(TP_ARCHS)}, not '{hp.arch}'")
    if size < 1:
        raise TensorParallelError(f"--tensor-parallel {size}: at least one rank")
    if hp.n_expert and hp.n_expert < size:
        raise TensorParallelError(f"{hp.n_expert} experts cannot give each of {size} ranks one; use fewer ranks")
    counts = [("head_count", hp.n_head), ("head_count_kv", hp.n_head_kv), ("embedding_length", hp.n_embd),
              ("vocabulary", hp.n_vocab)]
    if not hp.n_expert:                 # experts' widths are not split; a shared expert's rows: rank_weights
        counts.append(("feed_forward_length", hp.n_ff))
    for what, n in counts:
        if n % size:
            raise TensorParallelError(f"{what} {n} does not divide into {size} ranks; use a K that divides "
                                      f"head_count_kv ({hp.n_head_kv}) and the other sizes")


def _rows(hp: LlamaHParams, split: Split, n_rows: int, size: int) -> int:
    """The rows of a rank's slice; refuses a slice whose row count would change the product's kernel."""
    # check_split made K divide every count: a slice of Q/K/V rows is whole heads (rows = heads * head size)
    part = n_rows // size
    heads = {Split.Q_HEADS: hp.n_head, Split.KV_HEADS: hp.n_head_kv}.get(split, size)
    if part * size != n_rows or n_rows % heads:
        raise TensorParallelError(f"{n_rows} rows do not divide into {size} ranks' slices; use a K that divides them")
    # ggml picks a product's path by the weight's row count: repacked Q4_0/Q4_K/MXFP4 from M % 8 == 0,
    # tinyBLAS for F16/F32 from M % 4 == 0 (blocks.ggml_repacks, ops._mul_mat_float): each output row's
    # bits are the path's, so a slice must take the path the whole matrix takes
    if part % math.gcd(n_rows, 8):
        raise TensorParallelError(f"{size} slices of {n_rows} rows have {part} rows each, not a multiple of "
                                  f"{math.gcd(n_rows, 8)} as the whole is: the slice's product would take "
                                  f"another kernel path (other bits); use fewer ranks")
    return part


def expert_bounds(n_expert: int, size: int) -> list[int]:
    """Each rank's first expert, then n_expert: whole experts, as even as the count allows (the experts of
    a weight are the same size, so an even count is an even share of bytes)."""
    return [r * n_expert // size for r in range(size + 1)]


def rank_hparams(hp: LlamaHParams, size: int) -> LlamaHParams:
    """The hyperparameters a rank's graph and KV cache see: its own head counts, the rest the model's."""
    return replace(hp, n_head=hp.n_head // size, n_head_kv=hp.n_head_kv // size)


def rank_weights(weights: dict[str, Tensor], hp: LlamaHParams, rank: int, size: int,
                 tied_head: bool = True) -> dict[str, Tensor]:
    """Rank `rank`'s weights: each a tensor over the same mapped bytes, a slice of output rows where
    SPLITS says so (a bias: its elements of those rows), the whole tensor elsewhere. tied_head: without
    output.weight, the head is token_embd's vocabulary rows (False: weights are a stage's without the head)."""
    check_split(hp, size)
    names = dict(weights)
    if tied_head and "output.weight" not in names:
        names["output.weight"] = weights["token_embd.weight"]
    ctx = Context(len(names) * tensor_overhead() + 1024, no_alloc=True, name=f"weights of rank {rank}")
    out: dict[str, Tensor] = {}
    bounds = expert_bounds(hp.n_expert, size)
    for name, w in names.items():
        split = split_of(name)
        assert w.data is not None, f"'{name}': a weight must be bound to the mapped file"
        if split == Split.EXPERTS:      # experts lo..hi-1: a contiguous range of the 3-D tensor
            lo, hi = bounds[rank], bounds[rank + 1]
            assert w.n_dims == 3 and w.ne[2] == hp.n_expert, f"'{name}': {w.ne} is not {hp.n_expert} stacked experts"
            t = ctx.new_tensor(w.type, (w.ne[0], w.ne[1], hi - lo)).set_name(name)
            t.buffer, t.data = w.buffer, w.data + lo * w.nb[2]
            out[name] = t
            continue
        matrix = w.n_dims >= 2
        assert w.n_dims <= 2, f"'{name}': {w.n_dims}-d weights are split as experts only"
        n_rows = w.ne[1] if matrix else w.ne[0]
        part = n_rows if split == Split.MIRRORED else _rows(hp, split, n_rows, size)
        first = 0 if split == Split.MIRRORED else rank * part
        t = ctx.new_tensor(w.type, (w.ne[0], part) if matrix else (part,)).set_name(name)
        t.buffer, t.data = w.buffer, w.data + first * (w.nb[1] if matrix else w.nb[0])
        out[name] = t
    return out


def rank_model(model: LlamaModel, rank: int, size: int) -> LlamaModel:
    """The model as rank `rank` of `size` sees it: its hparams (heads) and weights (rows)."""
    return replace(model, hp=rank_hparams(model.hp, size), weights=rank_weights(model.weights, model.hp, rank, size))


class TensorParallelBuilder(LlamaGraphBuilder):
    """The graph of one rank of `size`: its hparams are rank_hparams' (its heads), its weights
    rank_weights' (its rows); the blocks gather what the next block reads whole."""

    def __init__(self, hp: LlamaHParams, weights: dict[str, Tensor], kv: KVCache,
                 rs: RecurrentState | None = None, *, size: int, rank: int) -> None:
        super().__init__(hp, weights, kv, rs)
        self.size, self.rank = size, rank
        self.bounds = expert_bounds(hp.n_expert, size)

    def gather(self, ctx: Context, part: Tensor) -> Tensor:
        """Every rank's equal part of each token column, in rank order: ne = (size * part.ne[0], n_tokens)."""
        return all_gather(ctx, part, [part.ne[0]] * self.size)

    def build_attn(self, ctx: Context, gf: Graph, il: int, q: Tensor, k_cur: Tensor, v_cur: Tensor,
                   inp: GraphInputs, key: GraphKey, scale: float | None = None, wo: bool = True) -> Tensor:
        """The rank's heads' attention, gathered (all heads, in order), then the rank's rows of Wo, gathered."""
        cur = super().build_attn(ctx, gf, il, q, k_cur, v_cur, inp, key, scale, wo=False)
        cur = self.gather(ctx, cur).set_name(f"kqv_out_all-{il}")   # ne = (n_embd_head_v * n_head, n_tokens)
        if not wo:
            return cur
        cur = ops.mul_mat(ctx, self.w[f"blk.{il}.attn_output.weight"], cur)     # ne = (n_embd / K, n_tokens)
        return self.gather(ctx, cur).set_name(f"attn_out-{il}")                 # ne = (n_embd, n_tokens)

    def build_ffn(self, ctx: Context, x: Tensor, il: int, gelu: bool = False, suffix: str = "") -> Tensor:
        """SwiGLU on the rank's rows of n_ff, gathered; the rank's rows of Wdown, gathered (suffix _shexp:
        qwen2moe's shared expert)."""
        assert not gelu, "tensor parallelism builds SwiGLU FFNs only"
        gate = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_gate{suffix}.weight"], x)     # ne = (n_ff / K, n_tokens)
        up = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_up{suffix}.weight"], x)
        cur = ops.swiglu(ctx, gate, up).set_name(f"ffn_swiglu{suffix}-{il}")
        cur = self.gather(ctx, cur)                                                 # ne = (n_ff, n_tokens)
        cur = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_down{suffix}.weight"], cur)    # ne = (n_embd / K, n_tokens)
        return self.gather(ctx, cur).set_name(f"ffn_out{suffix}-{il}")

    def expert_ids(self, ctx: Context, selected: Tensor, il: int) -> Tensor:
        """The router's choice as this rank's expert ids (-1: another rank's expert, not computed here)."""
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        return expert_ids(ctx, selected, lo, hi).set_name(f"ffn_moe_topk_local-{il}")

    def expert_outputs(self, ctx: Context, y: Tensor, selected: Tensor, il: int) -> Tensor:
        """Every slot's expert output, each from the rank that owns the expert."""
        return gather_experts(ctx, y, selected, self.bounds).set_name(f"ffn_moe_down_all-{il}")

    def build_output(self, ctx: Context, gf: Graph, h: Tensor, inp: GraphInputs, key: GraphKey) -> GraphResult:
        """The rank's vocabulary rows of the head, gathered: every rank holds the whole logits."""
        if key.embd:
            return super().build_output(ctx, gf, h, inp, key)
        cur = self.build_norm(ctx, h, "output_norm.weight", "result_norm")
        cur = ops.mul_mat(ctx, self.w["output.weight"], cur)                    # ne = (n_vocab / K, n_outputs)
        logits = self.gather(ctx, cur).set_name("result_output")               # ne = (n_vocab, n_outputs)
        logits.set_output()
        gf.build_forward_expand(logits)
        return GraphResult(key, gf, inp, logits, ctx)
