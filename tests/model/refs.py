"""What the llama.cpp reference data covers (shared by tests and tests/data/make_reference.py)."""
from __future__ import annotations

from ggml_dist.model.synthetic import SyntheticSpec
from ggml_dist.model.synthetic_moe import SyntheticMoESpec

TOP_K = 20
N_GEN = 32

# token ids for the synthetic models (BOS first), evaluated as one batch and one at a time
TOKENS = [1, 300, 17, 402, 259, 260, 511, 299, 333, 42, 270, 480]

SYNTHETIC_SPECS = [
    SyntheticSpec(wtype="F32", embd_type="F32", tied=True, seed=1),
    SyntheticSpec(wtype="F16", embd_type="F16", tied=False, seed=2),
    SyntheticSpec(wtype="Q8_0", embd_type="Q8_0", tied=True, seed=3),
    SyntheticSpec(wtype="Q4_0", embd_type="Q8_0", tied=False, seed=4),
    SyntheticSpec(wtype="Q4_1", embd_type="Q8_0", tied=True, seed=5),
    SyntheticSpec(wtype="Q4_0", embd_type="Q4_0", tied=True, n_vocab=520, seed=8),   # never-repacked head
    SyntheticSpec(wtype="Q4_K", embd_type="Q8_0", tied=True, n_embd=256, n_ff=512, seed=6),
    SyntheticSpec(arch="qwen2", wtype="Q8_0", embd_type="Q8_0", tied=True, n_head=4, n_head_kv=1,
                  seed=7),
]

# Llama 3.1's rope (base 500000, rope_freqs.weight: 4 of the 8 pairs slowed, one blended) and qwen3 with
# heads of 24 (not 64/4: Wq and Wo are not square; 1/sqrtf(24) is one f32 ulp from a double 1/sqrt), over
# LONG_TOKENS: the slow pairs' angles, and so the frequency factors, need long positions to show
LONG_SPECS = [
    SyntheticSpec(wtype="Q4_0", embd_type="Q8_0", tied=False, n_ctx_train=131072, rope_freq_base=500000.0,
                  rope_scaling="llama3", seed=9),
    SyntheticSpec(arch="qwen3", wtype="Q8_0", embd_type="Q8_0", tied=True, n_head=4, n_head_kv=2,
                  head_dim=24, rope_freq_base=1000000.0, seed=10),
]
SYNTHETIC_SPECS += LONG_SPECS
LONG_TOKENS = [1] + [3 + (7919 * i) % 509 for i in range(1, 320)]     # 320 positions, ids 3..511


def tokens_of(spec: SyntheticSpec) -> list[int]:
    return LONG_TOKENS if spec in LONG_SPECS else TOKENS


def n_ctx_of(spec: SyntheticSpec) -> int:
    """The context both sides run in: the KV cells llama.cpp attends over (n_kv) follow from it."""
    return 512 if spec in LONG_SPECS else 256


# several sequences, each in its own KV stream (kv_unified=False, n_seq_max=3): the batches, in order,
# each a list of (token, pos, seq, output). The prompts differ in length (split_equal leaves ubatches of
# fewer sequences), and two steps skip a sequence (non-consecutive streams: two ubatches)
STREAM_SPECS = [SYNTHETIC_SPECS[3], SYNTHETIC_SPECS[4], SYNTHETIC_SPECS[7]]
N_STREAMS = 3


def stream_batches() -> list[list[tuple[int, int, int, bool]]]:
    prompts = [TOKENS[:5], TOKENS[3:9], TOKENS[1:8]]
    batches = [[(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]]
    n_past = [len(p) for p in prompts]
    for step, seqs in enumerate([(0, 1, 2), (0, 1, 2), (0, 2), (1, 2), (0, 1, 2)]):
        batch = []
        for s in seqs:
            batch.append((TOKENS[(3 * step + s) % len(TOKENS)], n_past[s], s, True))
            n_past[s] += 1
        batches.append(batch)
    return batches


def kv_type_of(spec: SyntheticSpec) -> str:
    """The f32 model is checked with an f32 KV cache (to see ~1e-6 agreement), the rest with f16."""
    return "f32" if spec.wtype == "F32" else "f16"


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "In machine learning, overfitting means",
    "List of planets: Mercury, Venus,",
    "import numpy as np\n\nx = np.arange(10)\n",
    "The quick brown fox",
]


# Gemma 3 270M (Q4_K_M, `ggml-dist pull gemma3-270m`): free-running greedy continuations of these prompts
# (BOS added, no space prefix), and the teacher-forced logits of GEMMA3_LONG_PROMPT, longer than the
# 512-token sliding window, in a context of GEMMA3_N_CTX cells (ubatches of 512: 512 + the rest)
GEMMA3_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<start_of_turn>user\nWhat is 17 times 3?<end_of_turn>\n<start_of_turn>model\n",
    "In machine learning, overfitting means",
    "List of planets: Mercury, Venus,",
    "import numpy as np\n\nx = np.arange(10)\n",
    "The quick brown fox",
]
GEMMA3_N_CTX = 1024
GEMMA3_N_GEN = 32


def gemma3_long_prompt() -> str:
    """A deterministic text of some 700 tokens (numbered sentences, so that no two windows are alike)."""
    subjects = ["The river", "A small robot", "The old library", "Every winter", "The mathematician",
                "A quiet train", "The city council", "My grandmother"]
    verbs = ["remembers", "carries", "measures", "describes", "ignores", "repairs", "follows", "invents"]
    objects = ["the first snow of the year", "a map of forgotten roads", "seventeen red apples",
               "the sound of distant bells", "an unfinished letter", "the shape of the coastline",
               "a theorem about prime numbers", "the last lantern in the harbour"]
    out = []
    for i in range(60):
        out.append(f"{i + 1}. {subjects[i % 8]} {verbs[(3 * i + 1) % 8]} {objects[(5 * i + 2) % 8]}.")
    return " ".join(out)


# -- mixtures of experts (ggml_dist/model/synthetic_moe.py; tests/data/moe_refs.npz) ---------------------
# every architecture, the expert types llama.cpp treats differently (Q4_0 and MXFP4 repacked into 8x8
# tiles, K-quants, F16, a real Q4_K_M mix from llama_model_quantize), each evaluated over MOE_TOKENS as one
# batch and one token at a time; llama.cpp's chosen experts (ffn_moe_topk-{il}) are stored with the logits
MOE_TOKENS = LONG_TOKENS[:32]
MOE_N_CTX = 256
MOE_TIE_MIN = 1e-3      # every reference token's k-th and (k+1)-th router logits differ by more than this
# (the seeds below were chosen, among a few, for a margin >= 5e-3 in both runs and for every expert in use
# in every layer; tests/data/make_reference.py prints the margins)
MOE_SPECS = [
    # Qwen3-MoE: q/k norms, heads of 32 (Wq not square), 16 experts top-4
    SyntheticMoESpec(arch="qwen3moe", n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_expert=16,
                     n_expert_used=4, n_ff_exp=64, exp_type="Q8_0", seed=2101),
    # Q4_0 experts (ne[1] % 8 == 0: llama.cpp repacks them to q4_0_8x8 for MUL_MAT_ID)
    SyntheticMoESpec(arch="qwen3moe", exp_type="Q4_0", tied=False, seed=102),
    SyntheticMoESpec(arch="qwen3moe", exp_type="F16", wtype="F16", seed=1103),
    # K-quant experts (random blocks: Q4_K; Q5_K gate/up with Q6_K down) and llama.cpp's own Q4_K_M mix of
    # an F16 file (Q4_K experts, Q6_K ffn_down_exps in layer 1, Q5_K attn_output, Q8_0 attn_k/v): rows of 256
    SyntheticMoESpec(arch="qwen3moe", n_embd=256, n_head=4, n_head_kv=2, n_ff_exp=256, exp_type="Q4_K",
                     tied=False, seed=1104),
    SyntheticMoESpec(arch="qwen3moe", n_embd=256, n_head=4, n_head_kv=2, n_ff_exp=256, exp_type="Q5_K",
                     down_type="Q6_K", tied=False, seed=1110),
    SyntheticMoESpec(arch="qwen3moe", n_embd=256, n_head=4, n_head_kv=2, n_ff_exp=256, tied=False,
                     quantize="Q4_K_M", seed=3105),
    # Qwen1.5-MoE: q/k/v biases, routed experts without renormalisation + a sigmoid-gated shared expert
    SyntheticMoESpec(arch="qwen2moe", exp_type="Q4_1", tied=False, seed=106),
    # Mixtral: "llama" with expert_count, the experts' width in feed_forward_length
    SyntheticMoESpec(arch="llama", exp_type="Q5_0", tied=False, seed=2107),
    SyntheticMoESpec(arch="llama", exp_type="F32", seed=3108),
    # gpt-oss: biases, sinks, sliding window of 8 on even layers, yarn, MXFP4 experts (repacked), SWIGLU_OAI
    # with gate/up values past its clamp (limit 7), SOFTMAX_WEIGHT gating
    SyntheticMoESpec(arch="gpt-oss", n_embd=96, n_head=4, n_head_kv=2, head_dim=32, n_expert=8,
                     n_expert_used=4, n_ff_exp=64, exp_type="MXFP4", tied=False, n_swa=8, exp_std=3.0,
                     seed=1109),
]
