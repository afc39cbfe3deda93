"""The model context: decode batches ubatch by ubatch, reusing graphs (llama_context; spec §4.1).

    decode(batch):  for each ubatch:  find slot -> apply -> reuse or (reset, build, alloc) -> set inputs
                                      -> compute -> collect the output rows' logits

A graph is rebuilt only when its GraphKey (n_tokens, n_outputs, n_kv padded to 256, and without a
unified KV cache the ubatch's stream range) changes; a reused graph keeps the scheduler's splits and the
allocator's plan, and only its input tensors are rewritten. The last MAX_GRAPHS graphs are kept with
their scheduler plans and recalled when their key comes back (a server's batch shapes alternate); on a
pipeline one per key and input copy slot.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from ..backends import host
from ..backends.base import Backend, BackendOptions, tensor_get, tensor_set
from ..core.types import GGMLType
from ..scheduler.sched import Sched
from .graph_inputs import GraphInputs
from .hooks import PipelineHooks
from .kv_cache import ContextFullError, KVCache
from .llama import GraphKey, GraphResult, LlamaGraphBuilder
from .model import LlamaModel
from .recovery import Recovery, StageLostError, UbatchRecord
from .recurrent_state import recurrent_state
from .sampling import RowSampling
from .sequences import SequenceOps
from .ubatch import Batch, BatchError, BatchSplitter, Ubatch
from .warmup import Warmup, background_compile

MAX_GRAPHS = 64         # graphs kept by shape (GraphKey; ~2 MB each for SmolLM2) for continuous batching


@dataclass
class ContextParams:
    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    type_k: GGMLType = GGMLType.F16
    type_v: GGMLType = GGMLType.F16
    exact: bool = False             # keep f32 activations in MUL_MAT (not ggml's numerics)
    kv_unified: bool = True         # one KV stream for all sequences; False: a stream per sequence
    numba: bool = True              # False: the numpy reference kernels only (same bits; GGML_DIST_NO_NUMBA=1)
    # a cold kernel cache compiles in a background process while the numpy kernels run (model/warmup.py)
    background_compile: bool = False
    # every MUL_MAT and attention row reduced in the order of a row alone (ComputeOptions.batch_invariant):
    # a token's logits do not depend on the other tokens and sequences of its ubatch
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.n_ctx <= 0 or self.n_batch <= 0 or self.n_ubatch <= 0:
            raise ValueError(f"n_ctx, n_batch, n_ubatch must be positive "
                             f"({self.n_ctx}, {self.n_batch}, {self.n_ubatch})")
        self.n_ubatch = min(self.n_ubatch, self.n_batch)
        if self.type_k not in (GGMLType.F16, GGMLType.F32) or self.type_v not in (GGMLType.F16, GGMLType.F32):
            raise ValueError("the KV cache type must be F16 or F32")
        if self.batch_invariant and self.exact:
            raise ValueError("batch_invariant (--deterministic) keeps ggml's numerics; it does not combine "
                             "with exact (--exact), whose float32 BLAS products round by batch shape")

    def compute_options(self) -> host.HostOptions:
        """The options of the host backends this context creates."""
        return host.compute_options(self.exact, self.numba, self.batch_invariant)

    def backend_options(self, n_threads: int = 0) -> BackendOptions:
        """What this context's numerics ask of a backend in another process (a stage's device)."""
        return BackendOptions(exact=self.exact, compiled=self.numba, batch_invariant=self.batch_invariant,
                              n_threads=n_threads)


def _choose_before_free(rec: UbatchRecord) -> None:
    """A record whose tokens are chosen here from its logits chooses them before the logits go."""
    if rec.sampling is not None and rec.fetch_tokens is None and rec.value is not None:
        rec.chosen()


def _increasing(idx: list[int]) -> bool:
    return all(a < b for a, b in pairwise(idx))


class PendingLogits:
    """The logits of a submitted batch; `result()` waits for the ubatches that produce them, and
    recovers the context once if a stage was lost on the way."""

    def __init__(self, ctx: LlamaContext, records: list[UbatchRecord], n_vocab: int) -> None:
        self._ctx = ctx
        self._records = records
        self._n_vocab = n_vocab
        self._out: np.ndarray | None = None

    def result(self) -> np.ndarray:
        if self._out is None:
            self._out = self._recovering(self._collect)
        return self._out

    def tokens(self) -> list[int]:
        """The tokens chosen for the output rows, in batch order (the batch was submitted with
        sampling=); on a pipeline its last stage chose them, and only they crossed the wire."""
        return self._recovering(self._collect_tokens)

    def rows(self) -> list[tuple[UbatchRecord, int]]:
        """Per output, in batch order: the ubatch record that computes it and its row there."""
        rows = {i: (rec, r) for rec in self._records for r, i in enumerate(rec.ub.out_idx)}
        return [rows[i] for i in sorted(rows)]

    def _recovering(self, collect: Callable):
        return self._ctx.recovery.retrying(collect, self._ctx.recover)

    def _collect_tokens(self) -> list[int]:
        toks: dict[int, int] = {}
        for rec in self._records:
            if rec.sampling is None:
                raise RuntimeError("tokens(): the batch was submitted without sampling=")
            for r, i in enumerate(rec.ub.out_idx):
                toks[i] = rec.chosen()[r]
        return [toks[i] for i in sorted(toks)]

    def _collect(self) -> np.ndarray:
        rec = self._records[0] if len(self._records) == 1 else None
        if rec is not None and rec.ub.n_outputs > 0 and _increasing(rec.ub.out_idx):
            out = rec.result()                  # one ubatch, rows in batch order (a decode step): no
                                                # second copy of the logits (1.5 MB for 8 rows)
            _choose_before_free(rec)
            rec.value = rec.fetch = None
            out = out.reshape(-1, out.shape[-1])
            return out if out.flags.writeable else out.copy()    # (a Ray object is read-only)
        rows: dict[int, np.ndarray] = {}
        for rec in self._records:
            out = rec.result()
            out = out.reshape(-1, out.shape[-1])
            for r, i in enumerate(rec.ub.out_idx):
                rows[i] = out[r]
        order = sorted(rows)
        out = np.stack([rows[i] for i in order]) if order else np.zeros((0, self._n_vocab), np.float32)
        for rec in self._records:          # the log keeps records for replay, not their results:
            _choose_before_free(rec)
            rec.value = rec.fetch = None   # free the logits and the result handles they pin
        return out


class LlamaContext(SequenceOps):
    """Owns the KV cache, the scheduler over its backends and the previous graph (for reuse).

    With backends that take their inputs by value (Ray stage proxies), ubatches are submitted without
    waiting: stage k works on ubatch u+1 while stage k+1 still works on u, and logits are fetched only
    when asked for. Its log and replay after a lost stage are model/recovery.py's, the graph inputs'
    writing model/graph_inputs.py's; what is left (~330 lines) is llama_context's decode: split, find
    cells, pick or build the graph, run it, and fetch or sample its rows, one path for every backend."""
    builder_type: Callable[..., LlamaGraphBuilder] = LlamaGraphBuilder   # a tensor-parallel rank's: its own

    def __init__(self, model: LlamaModel, params: ContextParams | None = None,
                 pipeline: PipelineHooks | None = None) -> None:
        """In this process on the host's backend, or on a pipeline (its hooks: PipelineHooks)."""
        if params is None:
            params = ContextParams()
        self.model = model
        self.params = params
        hp = model.hp
        self.warmup: Warmup | None = None
        self.pipeline = pipeline
        if pipeline is None:
            opts = params.compute_options()
            if opts.numba and params.background_compile:
                self.warmup = background_compile(model.path)
            backends: list[Backend] = [host.host_backend(replace(opts, numba=opts.numba and self.warmup is None))]
        else:
            backends = pipeline.backends
        self.backends = backends
        self.pipelined = any(b.inputs_by_value for b in backends)
        # the KV cache of the attention layers; a hybrid model's recurrent layers keep a state instead
        self.kv = KVCache(hp.n_embd_k_gqa, hp.n_embd_v_gqa, params.n_ctx, hp.attention_layers,
                          params.type_k, params.type_v, params.n_seq_max, params.kv_unified)
        self.kv.allocate(backends[-1].device.get_buffer_type(), None if pipeline is None else pipeline.layer_buft)
        self.rs = recurrent_state(hp, params.n_seq_max, backends[-1].device.get_buffer_type, pipeline)
        self.builder = self.builder_type(hp, model.weights if pipeline is None else pipeline.weights, self.kv,
                                         self.rs)
        self.n_copies = 1 if pipeline is None else pipeline.n_copies
        self.sched = Sched(backends, graph_size=self.builder.max_nodes, n_copies=self.n_copies)
        # ubatches in flight: n_copies; a pipeline of stages that take their inputs by value (no copy slot
        # is overwritten while in use) may keep more
        self.max_inflight = self.n_copies if pipeline is None else pipeline.max_inflight
        self._inflight: deque = deque()      # per ubatch in flight: the events of its stages
        self.recovery = Recovery(self.rs)    # recoverable where the pipeline can restore its stages
        self.recovery.restore = None if pipeline is None else pipeline.restore
        self.gf_res_prev: GraphResult | None = None
        self.inputs = GraphInputs(self.kv, hp.n_swa, self.rs)
        # graphs built before, by shape: a batch of a shape seen recently (continuous batching alternates
        # a few) reuses its graph instead of building one, and its scheduler plan (splits, addresses)
        # while the compute buffer has not grown since, instead of splitting and planning again
        self._graphs: OrderedDict[tuple[GraphKey, int], GraphResult] = OrderedDict()   # (key, copy slot)
        self.n_reused = self.n_rebuilt = self.n_recalled = 0
        self.n_plans_restored = 0           # recalled graphs whose scheduler plan came back unchanged
        self._reserve()

    @property
    def n_ctx(self) -> int:
        return self.kv.kv_size

    def _reserve(self) -> None:
        """sched_reserve: plan for the worst case (a full ubatch over the whole cache) once, so real
        graphs never grow the compute buffers."""
        n_tokens = min(self.kv.kv_size, self.params.n_ubatch)
        res = self.builder.build(GraphKey(n_tokens, n_tokens, self.kv.kv_size))
        self.sched.reserve(res.graph)
        self.gf_res_prev = None

    def compute_buffer_size(self) -> int:
        return sum(self.sched.get_buffer_size(b) for b in self.backends)

    # -- decoding ------------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> np.ndarray:
        """Evaluate a batch; returns the logits of its output tokens, in batch order [n_out, n_vocab]."""
        return self.submit(batch).result()

    def submit(self, batch: Batch, sampling: list[RowSampling] | None = None,
               keep_logits: bool = True, embeddings: bool = False,
               tokens_from: PendingLogits | None = None) -> PendingLogits:
        """Queue every ubatch of a batch; the KV cells advance now, the logits come with result().
        sampling: one RowSampling per output token (batch order): result's tokens() are chosen where
        the logits are (a pipeline's last stage), and with keep_logits=False only they come back.
        embeddings: the outputs are the final norm's rows [n_out, n_embd] instead of logits.
        tokens_from: an earlier submit (with sampling=) whose chosen tokens, in order, are this batch's
        tokens (the batch's own ids are placeholders). Positions, masks and cells do not depend on
        them, so the batch is queued before they are known: on a pipeline the last stage's token goes
        to the first stage as a handle, and the driver never waits for it (token feedback); elsewhere
        the tokens are waited for when the batch runs."""
        if embeddings and sampling is not None:
            raise BatchError("embeddings are not sampled")
        token_src = None if tokens_from is None else self._token_sources(tokens_from, batch)
        if self.warmup is not None and self.warmup.ready():
            self._compiled_kernels_ready()
        hp = self.model.hp
        batch.validate(hp.n_vocab, self.params.n_seq_max)
        rank = None
        if sampling is not None:
            out_idx = np.flatnonzero(batch.output)
            if len(sampling) != len(out_idx):
                raise BatchError(f"{len(sampling)} samplings for a batch of {len(out_idx)} outputs")
            rank = {int(i): r for r, i in enumerate(out_idx)}
        elif not keep_logits:
            raise BatchError("keep_logits=False needs sampling= (something must come back)")
        if batch.n_tokens > self.params.n_batch:
            raise BatchError(f"batch of {batch.n_tokens} tokens exceeds n_batch={self.params.n_batch}; "
                             f"split it or raise n_batch")
        batch.check_positions(self.kv.cells.seq_pos_min, self.kv.cells.seq_pos_max)
        self._check_room(batch)
        records = []
        splitter = BatchSplitter(batch)
        cells, ubatch_size = self.kv.cells, self.params.n_ubatch
        while True:
            ub = splitter.split_memory(ubatch_size, self.kv.unified, self.rs is not None)
            if ub is None:
                break
            slot = cells.find_slot_ubatch(ub.seq_ids, ub.n_seqs)
            cells.apply(slot, ub.pos, ub.seq_ids)
            rec = UbatchRecord(ub, slot, cells.n_kv(self._streams(ub)), embd=embeddings)
            if token_src is not None:
                rec.token_src = [token_src[i] for i in ub.idx]
            if sampling is not None and rank is not None:
                rec.sampling = [sampling[rank[i]] for i in ub.out_idx]
                rec.keep_logits = keep_logits
            self.recovery.record(rec)
            self._submit_recovering(rec)
            if ub.n_outputs:
                records.append(rec)
        return PendingLogits(self, records, hp.n_embd if embeddings else hp.n_vocab)

    @staticmethod
    def _token_sources(tokens_from: PendingLogits, batch: Batch) -> list[tuple[UbatchRecord, int]]:
        src = tokens_from.rows()
        if any(rec.sampling is None for rec, _ in src):
            raise BatchError("tokens_from: that batch was submitted without sampling= (no tokens are chosen)")
        if len(src) != batch.n_tokens:
            raise BatchError(f"tokens_from: that batch chooses {len(src)} tokens, this batch has "
                             f"{batch.n_tokens}")
        return src

    def _compiled_kernels_ready(self) -> None:
        """The background compile has cached the kernels: from this ubatch on, the compiled ones run
        (the same bits as the numpy kernels that ran until now)."""
        self.warmup = None
        host.use_compiled_kernels(self.backends)

    def _check_room(self, batch: Batch) -> None:
        """ContextFullError before anything is written: the batch's tokens need free cells (in the stream
        of each sequence, without a unified cache, where a token must belong to one stream)."""
        kv, cells = self.kv, self.kv.cells
        if kv.unified:
            need = {0: batch.n_tokens}
        else:
            need = {}
            for i, s in enumerate(batch.seq_ids):
                streams = {cells.stream_of(q) for q in s}
                if len(streams) > 1:
                    raise BatchError(f"token {i} belongs to sequences {sorted(s)}, which own different KV "
                                     f"streams; a token shared by sequences needs a unified KV cache")
                stream = streams.pop()
                need[stream] = need.get(stream, 0) + 1
        for st, n in need.items():
            free = kv.kv_size - cells.used_in(st)
            if n > free:
                where = f"sequence {st}'s {kv.kv_size} cells" if not kv.unified else f"{kv.kv_size} cells"
                raise ContextFullError(f"context full: {n} tokens need cells, {free} of {where} are free; "
                                       f"use a larger --ctx")

    def _streams(self, ub: Ubatch) -> range:
        """The KV streams a ubatch's token groups use: s0 .. s0 + n_seqs - 1 (split_equal(sequential)
        takes consecutive sequences), or the one unified stream."""
        if self.kv.unified:
            return range(1)
        s0 = self.kv.cells.stream_of(min(ub.seq_ids[0]))
        return range(s0, s0 + ub.n_seqs)

    def synchronize(self) -> None:
        self.sched.synchronize()

    # -- recovery (model/recovery.py) ------------------------------------------------------------------
    def _submit_recovering(self, rec: UbatchRecord) -> None:
        try:
            self._run(rec)
        except StageLostError:
            if not self.recoverable or self.recovery.max_recoveries == 0:
                raise
            self.recover()                   # the replay runs `rec` too: it is already in the log

    def recover(self) -> None:
        """Restore lost backends (the pipeline's hook), then rebuild their KV caches by replaying
        every logged ubatch whose tokens the cache still holds, in order, on the same cells."""
        self.recovery.recover(self._forget_in_flight, self._run, self.kv.cells)

    def _forget_in_flight(self) -> None:
        self._inflight.clear()
        self.gf_res_prev = None
        self.sched.reset()

    def _run(self, rec: UbatchRecord) -> None:
        """Build or reuse the graph of the record's shape, set its inputs, compute (asynchronously on
        a pipeline); rec.fetch then reads its logits."""
        ub, slot = rec.ub, rec.slot
        streams = self._streams(ub)
        key = GraphKey(ub.n_tokens, ub.n_outputs, rec.n_kv, len(streams), streams.start, rec.embd,
                       ub.n_seqs if self.rs is not None else 1)
        res = self.gf_res_prev
        if res is not None and res.key == key:
            if not self.pipelined:              # the previous compute may still read the inputs
                self.sched.synchronize()
            self.n_reused += 1
        else:
            self.sched.reset()
            # on a pipeline a graph is split for one input copy slot (split_graph points its nodes at
            # that slot's copies), and alloc_graph / restore_plan take the next slot: keep one per slot
            gkey = (key, self.sched.next_copy)
            res = self._graphs.get(gkey)
            if res is None:
                res = self.builder.build(key)
                self.n_rebuilt += 1
                self._graphs[gkey] = res
                if len(self._graphs) > MAX_GRAPHS:
                    self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(gkey)
                self.n_recalled += 1
            if res.plan is not None and self.sched.restore_plan(res.plan):
                self.n_plans_restored += 1
            else:
                self.sched.alloc_graph(res.graph)
                res.plan = self.sched.save_plan()
            if self.pipeline is not None:
                self.pipeline.after_alloc(self.sched, res.graph)
            self.gf_res_prev = res
        fed = self._resolve_tokens(rec)
        compiled = self.params.numba and host.COMPILED_DEFAULT and self.warmup is None
        self.inputs.set(res, ub, slot, key.n_kv, compiled)
        logits = res.logits
        outputs = self.pipeline
        # the token comes from the stage that sampled it, else it is waited for (a compiled graph takes no handles)
        if fed is not None and (outputs is None or not outputs.feed(res.inputs.tokens, fed)):
            self._known_tokens(rec)
            tensor_set(res.inputs.tokens, ub.tokens.astype(np.int32))
            fed = None
        # the stage that computes the logits samples them
        remote = rec.sampling is not None and ub.n_outputs > 0 and outputs is not None and \
            outputs.sample(logits, rec.sampling, rec.keep_logits)
        if self.pipelined:                     # at most max_inflight ubatches in flight
            while len(self._inflight) >= self.max_inflight:
                done, events = self._inflight.popleft()
                if not done():                 # its result already read: every stage is past it
                    for ev in events:
                        ev.wait()
        self.sched.graph_compute_async(res.graph)
        if fed is not None and outputs is not None and outputs.feed(res.inputs.tokens, None):
            raise RuntimeError("the tokens' feed was not taken: no stage copies the token input in")
        if self.pipelined:
            self._inflight.append((rec.fetched, [b.event_record() for b in self.backends
                                                 if b.inputs_by_value and b.event_record is not None]))
        rec.value, rec.tokens, rec.fetch_tokens, rec.done = None, None, None, False
        if ub.n_outputs == 0:                  # nothing to read: pin no result
            if not self.pipelined:
                self.sched.synchronize()
            rec.fetch = None
            return
        fetch_async = logits.buffer.get_tensor_async
        if remote:
            assert outputs is not None and fetch_async is not None, f"{logits.buffer!r} cannot fetch its logits"
            rec.fetch_tokens = outputs.fetch_tokens(logits)
            rec.fetch = fetch_async(logits) if rec.keep_logits else None
            return
        if fetch_async is not None:
            rec.fetch = fetch_async(logits)
            return
        self.sched.synchronize()
        view = self.inputs.view(res, logits, (logits.ne[1], logits.ne[0]))
        value = tensor_get(logits) if view is None else view.copy()
        rec.fetch = lambda: value

    def _resolve_tokens(self, rec: UbatchRecord) -> Callable[[], np.ndarray] | None:
        """A record's tokens from its sources (submit's tokens_from): known ones are written into its
        ubatch, for good (a replay needs no source then). Returns the fetch to feed instead where every
        token is the next unread row of one remote sampling, in order; else waits for the tokens."""
        rec.settle()
        src = rec.token_src
        if src is None:
            return None
        s0 = src[0][0]
        if all(s is s0 and r == i for i, (s, r) in enumerate(src)) and len(src) == s0.ub.n_outputs \
                and s0.tokens is None and s0.fetch_tokens is not None:
            return s0.fetch_tokens
        self._known_tokens(rec)
        return None

    @staticmethod
    def _known_tokens(rec: UbatchRecord) -> None:
        """Wait for the record's tokens and write them in."""
        assert rec.token_src is not None
        for s, _ in rec.token_src:
            s.chosen()
        rec.settle()

    @property
    def recoverable(self) -> bool:
        return self.recovery.recoverable
