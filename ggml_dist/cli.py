"""The `ggml-dist` command: pull, run, logits, tokenize, bench."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a GGUF path or a known name (smollm2-135m)")
    p.add_argument("--ctx", type=int, default=2048, help="context size in tokens (default 2048)")
    p.add_argument("--batch", type=int, default=512, help="n_batch (default 512)")
    p.add_argument("--ubatch", type=int, default=512, help="n_ubatch (default 512)")
    p.add_argument("--cache-type", choices=["f16", "f32"], default="f16", help="KV cache type")
    p.add_argument("--exact", action="store_true",
                   help="keep f32 activations in matmuls instead of ggml's quantized vec_dot numerics")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggml-dist", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pull", help="fetch a known model into the cache and print its path")
    p.add_argument("name")

    p = sub.add_parser("run", help="generate text")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    p = sub.add_parser("logits", help="write the logits of every position of a token list")
    _add_model_args(p)
    p.add_argument("--tokens", required=True, help="comma-separated token ids (no BOS is added)")
    p.add_argument("--out", required=True, help="output .npz (array 'logits' [n_tokens, n_vocab])")

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("bench", help="benchmarks (each prints one JSON object)")
    p.add_argument("what", choices=["alloc"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, MemoryError) as e:
        print(f"ggml-dist {args.cmd}: error: {e}", file=sys.stderr)
        return 1


def _cmd_pull(args: argparse.Namespace) -> int:
    from .model.pull import pull
    print(pull(args.name))
    return 0


def _load(args: argparse.Namespace):
    from .core.types import GGMLType
    from .model.context import ContextParams, LlamaContext
    from .model.model import LlamaModel
    from .model.pull import resolve_model
    model = LlamaModel.load(resolve_model(args.model))
    kv_type = GGMLType.F16 if args.cache_type == "f16" else GGMLType.F32
    params = ContextParams(n_ctx=args.ctx, n_batch=args.batch, n_ubatch=args.ubatch, type_k=kv_type,
                           type_v=kv_type, exact=args.exact)
    return model, LlamaContext(model, params)


def _cmd_run(args: argparse.Namespace) -> int:
    from .model.generate import generate
    from .model.sampling import SamplingParams
    model, lctx = _load(args)
    tok = model.tokenizer
    prompt = args.prompt
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    sp = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repeat_penalty=args.repeat_penalty, seed=args.seed)
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    res = generate(lctx, tok, ids, args.n_predict, sp, on_text=on_text, n_batch=args.batch)
    timings = {"prompt_tok_s": round(res.prompt_tok_s, 3), "decode_tok_s": round(res.decode_tok_s, 3)}
    if args.json:
        print(json.dumps({"prompt_tokens": res.prompt_tokens, "tokens": res.tokens, "text": res.text,
                          "timings": timings, "stop_reason": res.stop_reason,
                          "graphs": {"reused": lctx.n_reused, "rebuilt": lctx.n_rebuilt}}))
    else:
        sys.stdout.write("\n")
        print(f"prompt: {len(res.prompt_tokens)} tokens, {timings['prompt_tok_s']} tok/s | "
              f"decode: {len(res.tokens)} tokens, {timings['decode_tok_s']} tok/s | "
              f"graphs reused {lctx.n_reused}, rebuilt {lctx.n_rebuilt}", file=sys.stderr)
    return 0


def _cmd_logits(args: argparse.Namespace) -> int:
    from .model.ubatch import Batch
    try:
        ids = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got '{args.tokens}'") from None
    _, lctx = _load(args)
    logits = lctx.decode(Batch.from_tokens(ids, all_outputs=True))
    np.savez(args.out, logits=logits.astype(np.float32))
    print(f"wrote {args.out}: logits {list(logits.shape)}", file=sys.stderr)
    return 0


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from .model.gguf import load_gguf
    from .model.pull import resolve_model
    from .model.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(load_gguf(resolve_model(args.model)))
    ids = tok.encode(args.text, add_special=not args.no_special, parse_special=True)
    if args.json:
        print(json.dumps({"tokens": ids, "pieces": [tok.token_to_piece(i).decode("utf-8", "replace")
                                                   for i in ids]}))
    else:
        print(" ".join(str(i) for i in ids))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import alloc
    mains = {"alloc": alloc.main}
    return mains[args.what](args.rest)


_COMMANDS = {"pull": _cmd_pull, "run": _cmd_run, "logits": _cmd_logits, "tokenize": _cmd_tokenize,
             "bench": _cmd_bench}

if __name__ == "__main__":
    sys.exit(main())
