"""Decoding speed: tokens per second of greedy decoding (with and without the key/value cache) and beam search.

Run from the repository root:

    python tests/bench_decoding.py            # the base model on a GPU, a smaller one on a CPU
    python tests/bench_decoding.py --smoke    # a tiny model and short outputs: a few seconds anywhere

The model is untrained (random weights) and decoding runs without an end symbol, so every sentence produces
exactly ``--tokens`` tokens and all methods do the same amount of output. A row's number is output tokens
(sentences x tokens) per second of wall time, encoder included, the best of ``--repeats`` runs. The file is not
collected by pytest (its name has no ``test_`` prefix); tests/test_decoding.py runs it with ``--smoke``.
"""
from __future__ import annotations

import argparse
import time

import torch

from annotated_transformer.beam_search import beam_search
from annotated_transformer.decoding import greedy_decode
from annotated_transformer.masks import padding_mask
from annotated_transformer.model import make_model
from annotated_transformer.runtime import get_device

SIZES = {  # name: (d_model, layers, heads, d_ff, vocab)
    "base": (512, 6, 8, 2048, 8000),
    "small": (128, 2, 4, 512, 1000),
    "tiny": (32, 1, 2, 64, 50),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu, cuda, mps... (default: CUDA, MPS, then CPU)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model size (default: base on CUDA, small otherwise; tiny with --smoke)")
    parser.add_argument("--tokens", type=int, default=None, help="output tokens per sentence (default: 64; 8 with --smoke)")
    parser.add_argument("--src-len", type=int, default=None, help="source length (default: 32; 8 with --smoke)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: 1 64 (1 4 with --smoke)")
    parser.add_argument("--beam-sizes", type=int, nargs="+", default=[1, 4, 8], help="default: 1 4 8")
    parser.add_argument("--repeats", type=int, default=None, help="runs per cell, best kept (default: 3; 1 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run that checks the script works")
    args = parser.parse_args(argv)
    device = get_device(args.device)
    if args.size is None:
        args.size = "tiny" if args.smoke else ("base" if device.type == "cuda" else "small")
    args.tokens = args.tokens or (8 if args.smoke else 64)
    args.src_len = args.src_len or (8 if args.smoke else 32)
    args.batch_sizes = args.batch_sizes or ([1, 4] if args.smoke else [1, 64])
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.device = device
    return args


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    tic = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - tic


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    d_model, layers, heads, d_ff, vocab = SIZES[args.size]
    torch.manual_seed(0)
    model = make_model(vocab, vocab, N=layers, d_model=d_model, d_ff=d_ff, h=heads, dropout=0.0).to(device).eval()
    max_len = args.tokens + 1  # the start symbol, then the output tokens
    methods = {"greedy, no cache": lambda s, m: greedy_decode(model, s, m, max_len, 1, use_cache=False),
               "greedy, cache": lambda s, m: greedy_decode(model, s, m, max_len, 1)}
    for k in args.beam_sizes:
        methods[f"beam {k}"] = lambda s, m, k=k: beam_search(model, s, m, max_len, 1, None, beam_size=k)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"device: {name}; torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"model: {args.size} (d_model={d_model}, N={layers}, h={heads}, d_ff={d_ff}, vocab={vocab}), untrained; "
          f"source length {args.src_len}, {args.tokens} output tokens, best of {args.repeats}")
    header = f"{'method':<18}" + "".join(f"{f'batch {b} (tok/s)':>20}" for b in args.batch_sizes)
    print(header)
    print("-" * len(header))
    for label, decode in methods.items():
        row = f"{label:<18}"
        for batch in args.batch_sizes:
            src = torch.randint(3, vocab, (batch, args.src_len), device=device)
            mask = padding_mask(src, 0)
            with torch.no_grad():
                decode(src[:1], mask[:1])  # warm up
                seconds = min(timed(device, lambda: decode(src, mask)) for _ in range(args.repeats))
            row += f"{batch * args.tokens / seconds:20,.0f}"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
