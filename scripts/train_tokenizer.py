"""Train the djax-tiny tokenizer: byte-level BPE (HF `tokenizers`) on the training split of the stdlib corpus.

    python scripts/train_tokenizer.py --out djax/assets/djax-tiny-v4/tokenizer.json

Ids 0 and 1 are `<|begin_of_text|>` and `<|end_of_text|>` (the models' bos and eos); encoding
prepends bos. Every byte has a token, so any text round-trips.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_corpus import corpus_files  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def train_tokenizer(texts: list[str], vocab_size: int = 8192) -> Tokenizer:
    """A byte-level BPE tokenizer with bos id 0 and eos id 1, trained on texts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)]
    )
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="djax/assets/djax-tiny-v4/tokenizer.json")
    ap.add_argument("--stdlib", help="stdlib directory (default: the running interpreter's)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    files = corpus_files(args.stdlib, "train")
    tok = train_tokenizer([text for _, text in files], args.vocab_size)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    held = corpus_files(args.stdlib, "heldout")
    n_bytes = sum(len(t.encode()) for _, t in held)
    n_tok = sum(len(e.ids) - 1 for e in tok.encode_batch([t for _, t in held]))
    print(
        f"{out}: vocab {tok.get_vocab_size()}, trained on {len(files)} files; "
        f"held-out {len(held)} files: {n_bytes / n_tok:.2f} bytes/token"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
