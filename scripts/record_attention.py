"""The attention of the recorded laptop translator, for the translation chapter's attention explorer.

The build must not train, and the checkpoint is not in git; this script runs the record's averaged model over a few
short test sentences and writes every attention weight (encoder self-attention, decoder self-attention and
cross-attention; every layer and head) to a small results file beside the record it belongs to. The target is the
model's own translation with the record's chosen beam setting, which must equal the translation the record kept:
that ties the weights to the record's model.

    python scripts/record_attention.py --checkpoint runs/laptop-bf16/average.pt \\
        --record book/results/multi30k-laptop.json --output book/results/attention-laptop.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from annotated_transformer.beam_search import translate_ids
from annotated_transformer.data import EOS_ID, load_split
from annotated_transformer.download import sha256
from annotated_transformer.translation import attention_maps, load_translator

MAX_PIECES = 14  # short sentences: the explorer draws a square of this many pieces at most
SENTENCES = 4


def record_attention(checkpoint: Path, record: dict) -> list[dict]:
    model, tokenizer, _ = load_translator(checkpoint, device="cpu")
    chosen = record["test"]["beam_tuned"]
    kept = record["translations"]["beam_tuned"]
    found = []
    for index, (german, _) in enumerate(load_split("test")):
        source = tokenizer.encode(german)
        if len(source) > MAX_PIECES:
            continue
        target = translate_ids(model, tokenizer, [source], beam_size=chosen["beam_size"],
                               length_penalty=chosen["length_penalty"])[0]
        if tokenizer.decode(target) != kept[index]:
            raise SystemExit(f"test sentence {index}: the checkpoint translates it as {tokenizer.decode(target)!r}, "
                             f"the record as {kept[index]!r}: is it the record's model?")
        if len(target) + 1 > MAX_PIECES:
            continue
        target = target + [EOS_ID]
        maps = attention_maps(model, source, target)
        found.append(dict(index=index, german=german, english=kept[index],
                          source=[tokenizer.piece(i) for i in source],
                          target=[tokenizer.piece(i) for i in target],
                          **{kind: torch.round(weights.float(), decimals=3).tolist()
                             for kind, weights in maps.items()}))
        if len(found) == SENTENCES:
            return found
    raise SystemExit(f"fewer than {SENTENCES} test sentences of at most {MAX_PIECES} pieces")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text(encoding="utf-8"))
    torch.set_num_threads(1)
    sentences = record_attention(args.checkpoint, record)
    result = dict(command="python " + " ".join(map(shlex.quote, ["scripts/record_attention.py", *sys.argv[1:]])),
                  record=args.record.name, record_date=record["date"],
                  checkpoint_sha256=sha256(args.checkpoint),
                  date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  kinds={"encoder": "encoder self-attention (query: source piece, key: source piece)",
                         "decoder": "decoder self-attention (query: target piece, key: earlier target piece)",
                         "cross": "cross-attention (query: target piece, key: source piece)"},
                  sentences=sentences)
    args.output.write_text(json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{args.output}: {len(sentences)} sentences, {args.output.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
