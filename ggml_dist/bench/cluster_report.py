"""bench cluster's report from its measured points: each pipeline point's bounds and efficiency, the greedy
tokens checked against one process's, the side-by-side summary, and the plot (cluster.py's docstring says
what the bounds mean)."""
from __future__ import annotations

from pathlib import Path


def bounds(rows: list[dict], slices: dict[int, list[dict]] | None = None) -> None:
    """Each pipeline point's bounds and efficiency, from the one-host points at the same prompt; for a
    model bigger than a host, from its slice's one-host points (slices: hosts -> the slice's rows)."""
    one = {(r["prompt"], r["sequences"]): r["decode_tok_s"] for r in rows if r["hosts"] == 1 and r["decode_tok_s"]}
    for r in rows:
        if slices and r["hosts"] in slices:
            k, m = r["hosts"], min(r["hosts"], r["sequences"])
            sl = {(x["prompt"], x["sequences"]): x["decode_tok_s"] for x in slices[k] if x["decode_tok_s"]}
            if r["sequences"] % m == 0 and sl.get((r["prompt"], r["sequences"] // m)):
                r["pipeline_bound"] = round(m / k * sl[(r["prompt"], r["sequences"] // m)], 3)
                r["efficiency"] = round(r["decode_tok_s"] / r["pipeline_bound"], 3)
            continue
        base = one.get((r["prompt"], r["sequences"]))
        if base:
            r["x_one_host"] = round(r["decode_tok_s"] / base, 3)
            r["linear_bound"] = round(r["hosts"] * base, 3)
        m = min(r["hosts"], r["sequences"])
        if r["sequences"] % m == 0 and one.get((r["prompt"], r["sequences"] // m)):
            r["pipeline_bound"] = round(m * one[(r["prompt"], r["sequences"] // m)], 3)
            r["efficiency"] = round(r["decode_tok_s"] / r["pipeline_bound"], 3)


def check_tokens(rows: list[dict]) -> list[str]:
    """Greedy tokens of every multi-host point against one process's at the same prompt and sequences. One
    sequence must match (the same cells, the same one-row batches); with N sequences a pipeline decodes
    them in micro-batches of N/k where one process takes all N in one batch, and on some weight types a
    row's bits depend on the batch (docs/numerics.md): a difference there is reported, not an error."""
    one = {(r["prompt"], r["sequences"]): r["tokens"] for r in rows if r["hosts"] == 1}
    bad = [f"{r['hosts']} hosts, prompt {r['prompt']}, {r['sequences']} seq" for r in rows
           if r["hosts"] > 1 and r["sequences"] == 1 and one.get((r["prompt"], 1)) not in (None, r["tokens"])]
    for r in rows:
        r["tokens_match_one_process"] = r["hosts"] == 1 or one.get((r["prompt"], r["sequences"])) == r["tokens"]
        r.pop("tokens")
    return bad


def plot(models: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        for impl, style in (("ours", "-o"), ("llama.cpp", "--s")):
            pts = [r for r in m["points"] if r["impl"] == impl and r["prompt"] == min(x["prompt"] for x in m["points"])]
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
    """Per (prompt, sequences, hosts): ours and llama.cpp side by side."""
    rows: dict[tuple, dict] = {}
    for r in m["points"]:
        key = (r["prompt"], r["sequences"], r["hosts"])
        d = rows.setdefault(key, {"prompt": key[0], "sequences": key[1], "hosts": key[2]})
        tag = "ours" if r["impl"] == "ours" else "llamacpp"
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
