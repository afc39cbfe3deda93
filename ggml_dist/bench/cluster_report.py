"""bench cluster's report from its measured points: each pipeline point's bounds and efficiency, the greedy
tokens checked against one process's, the side-by-side summary, and the plot (cluster.py's docstring says
what the bounds mean)."""
from __future__ import annotations

from pathlib import Path


def bounds(rows: list[dict], slices: dict[int, list[dict]] | None = None, n_layer: int = 0) -> None:
    """Each pipeline point's bounds and efficiency, from the one-host points at the same prompt; for a
    model bigger than a host (n_layer layers), from one host's points on slices of it (slices: hosts ->
    the slices' rows, each with its "slice_layers"): slice_bound."""
    one = {(r["prompt"], r["sequences"]): r["decode_tok_s"] for r in rows if r["hosts"] == 1 and r["decode_tok_s"]}
    for r in rows:
        if slices and r["hosts"] in slices:
            bound = slice_bound(slices[r["hosts"]], n_layer, r["prompt"], r["sequences"], r["hosts"])
            if bound:
                r["pipeline_bound"] = round(bound, 3)
                r["efficiency"] = round(r["decode_tok_s"] / bound, 3)
            continue
        base = one.get((r["prompt"], r["sequences"]))
        if base:
            r["x_one_host"] = round(r["decode_tok_s"] / base, 3)
            r["linear_bound"] = round(r["hosts"] * base, 3)
        m = min(r["hosts"], r["sequences"])
        if r["sequences"] % m == 0 and one.get((r["prompt"], r["sequences"] // m)):
            r["pipeline_bound"] = round(m * one[(r["prompt"], r["sequences"] // m)], 3)
            r["efficiency"] = round(r["decode_tok_s"] / r["pipeline_bound"], 3)


def slice_bound(slice_rows: list[dict], n_layer: int, prompt: int, n_seq: int, k: int) -> float | None:
    """The pipeline bound of k stages over a model of n_layer layers that no host holds, from one host's
    decode rates on two slices of it (s = ceil(n_layer / k) layers, a stage's share, and fewer), each a
    whole model (embeddings, its layers, the head). A step of n sequences costs a stage t = head + layers x
    t_layer (the head only on the last stage), so the two slices give t_layer and t_head, and the whole
    model's step t_full = t_head + n_layer x t_layer. With m = min(k, N) micro-batches of n = N / m: each
    micro-batch's next step waits for its previous one through every stage (a cycle >= t_full(n)), and the
    busiest stage, the last with s layers and the head, takes every micro-batch in turn (a cycle >= m x
    t_s(n)); N tokens a cycle: min(m n / t_full(n), n / t_s(n)). With one slice only (s = 1), t_full = k t_s."""
    m = min(k, n_seq)
    if n_seq % m:
        return None
    n = n_seq // m
    t = {x["slice_layers"]: n / x["decode_tok_s"] for x in slice_rows
         if x["prompt"] == prompt and x["sequences"] == n and x["decode_tok_s"]}
    if not t:
        return None
    s = max(t)
    if len(t) == 1:
        t_full = k * t[s]
    else:
        h = min(t)
        t_layer = (t[s] - t[h]) / (s - h)
        t_full = t[s] + (n_layer - s) * t_layer
    return min(m * n / t_full, n / t[s])


def check_tokens(rows: list[dict]) -> list[str]:
    """Greedy tokens of every multi-host point against one process's at the same prompt and sequences. One
    sequence must match (the same cells, the same one-row batches); with N sequences a pipeline decodes
    them in micro-batches of N/k where one process takes all N in one batch, and on some weight types a
    row's bits depend on the batch (docs/numerics.md): a difference there is reported, not an error."""
    one = {(r["prompt"], r["sequences"]): r["tokens"] for r in rows if r["hosts"] == 1}
    bad = [f"{r['hosts']} hosts, prompt {r['prompt']}, {r['sequences']} seq" for r in rows
           if r["hosts"] > 1 and r["sequences"] == 1 and one.get((r["prompt"], 1)) not in (None, r["tokens"])]
    for r in rows:                 # None: no one-process run to compare with (a model bigger than a host)
        ref = one.get((r["prompt"], r["sequences"]))
        r["tokens_match_one_process"] = True if r["hosts"] == 1 else None if ref is None else ref == r["tokens"]
        r.pop("tokens")
    return bad


def check_tp_tokens(ours: list[dict], tp: list[dict], fits: bool) -> list[str]:
    """check_tokens for the tensor-parallel rows (before ours' own check: it reads copies of ours' tokens):
    against one process, or for a model bigger than a host against the pipeline (checked by its logits)
    at one sequence (N sequences it splits into micro-batches: other bits where a row's depend on the batch)."""
    ref = [dict(r) for r in ours if r["hosts"] == 1] if fits else [{**r, "hosts": 1} for r in ours
                                                                  if r["sequences"] == 1]
    for r in tp if not fits else ():
        r["tokens_compared_with"] = "pipeline"
    return check_tokens(ref + tp)


def plot(models: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        for impl, style in (("ours", "-o"), ("llama.cpp", "--s")):
            pts = [r for r in m["points"] if r["impl"] == impl and r["prompt"] == min(x["prompt"] for x in m["points"])
                   and not r.get("link_delay_ms")]                      # the plain link's points
            for n in sorted({r["sequences"] for r in pts}):
                xs = sorted((r["hosts"], r["decode_tok_s"]) for r in pts if r["sequences"] == n)
                ax.plot([x for x, _ in xs], [y for _, y in xs], style, label=f"{impl}, {n} seq")
        ax.set_title(f"{Path(m['model']).name}: decode on k hosts")
        ax.set_xlabel("hosts")
        ax.set_ylabel("aggregate tok/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(m: dict) -> list[dict]:
    """Per (prompt, sequences, hosts, link delay): ours and llama.cpp side by side."""
    rows: dict[tuple, dict] = {}
    for r in m["points"]:
        key = (r["prompt"], r["sequences"], r["hosts"], r.get("link_delay_ms", 0.0))
        d = rows.setdefault(key, {"prompt": key[0], "sequences": key[1], "hosts": key[2], "link_delay_ms": key[3]})
        tag = {"ours": "ours", "ours-tp": "ours_tp"}.get(r["impl"], "llamacpp")
        d[f"{tag}_tok_s"] = r["decode_tok_s"]
        for f in ("x_one_host", "efficiency", "pipeline_bound"):
            if f in r:
                d[f"{tag}_{f}"] = r[f]
    for d in rows.values():
        if d.get("ours_tok_s") and d.get("llamacpp_tok_s"):
            d["ours_x_llamacpp"] = round(d["ours_tok_s"] / d["llamacpp_tok_s"], 3)
    if len(m["serve"]) == 2 and m["serve"][0]["aggregate_tok_s"]:
        s1, sk = m["serve"]
        rows[("serve",)] = {"serve_clients": s1["clients"], "hosts": sk["hosts"],
                            "x_one_host": round(sk["aggregate_tok_s"] / s1["aggregate_tok_s"], 3),
                            "errors": s1["errors"] + sk["errors"], "ttft_p50_s": [s1["ttft_p50_s"], sk["ttft_p50_s"]]}
    return list(rows.values())
