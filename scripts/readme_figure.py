"""The README's figure: the laptop translator's cross-attention over one test sentence, from its recorded run.

Reads `book/results/multi30k-laptop.json` (written by the laptop command of the translation chapter), draws the
last decoder layer's cross-attention (mean of the heads) of its first example, and writes `docs/translator.png`.

    python scripts/readme_figure.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "book" / "results" / "multi30k-laptop.json"
FIGURE = ROOT / "docs" / "translator.png"


def draw(record: dict, path: Path) -> Path:
    attention = record["attention"][0]
    beam = record["test"].get("beam_tuned", record["test"]["beam"])["bleu"]  # the headline
    minutes = record["train_seconds"] / 60
    fig, ax = plt.subplots(figsize=(7, 5.4))
    ax.imshow(attention["weights"], cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(attention["source"])), attention["source"], rotation=90, fontsize=8)
    ax.set_yticks(range(len(attention["target"])), attention["target"], fontsize=8)
    ax.set_xlabel("German source pieces")
    ax.set_ylabel("English pieces produced")
    ax.set_title(f"Cross-attention of the laptop translator ({minutes:.0f} min on 2 CPU threads,\n"
                 f"test2016 BLEU {beam:.1f} with beam search); last decoder layer, mean of heads", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main() -> int:
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    print(draw(record, FIGURE).relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
