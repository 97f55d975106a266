"""Retrievers: dense (encoder + FAISS inner product) and sparse (BM25).

Every retriever answers ``search_batch(queries, topk) -> list[list[Hit]]``: one list
per query, in query order, best first. Row ``r`` of an index is row ``r`` of the
corpus store (``corpus.Corpus``), which is how hits are turned back into passages.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from search_r1.search.corpus import Corpus
from search_r1.search.encoders import Encoder
from search_r1.search.schema import Hit

BM25_META_FILE = "search_r1_bm25.json"


class BaseRetriever(ABC):
    """A searchable corpus."""

    kind: str = "base"

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus

    @abstractmethod
    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Top-``topk`` hits for each query, best first (fewer only if the corpus is smaller)."""

    def search(self, query: str, topk: int) -> list[Hit]:
        return self.search_batch([query], topk)[0]

    def _hits(self, rows_QK: np.ndarray, scores_QK: np.ndarray) -> list[list[Hit]]:
        """Turn index rows/scores into hits; rows < 0 (FAISS padding) are dropped."""
        flat_rows = [int(r) for r in rows_QK.reshape(-1) if r >= 0]
        ids, contents = self.corpus.get_fields(flat_rows)
        by_row = {row: (i, c) for row, i, c in zip(flat_rows, ids, contents, strict=True)}
        results: list[list[Hit]] = []
        for rows_K, scores_K in zip(rows_QK, scores_QK, strict=True):
            hits = []
            for row, score in zip(rows_K, scores_K, strict=True):
                if row < 0:
                    continue
                doc_id, text = by_row[int(row)]
                hits.append(Hit.from_contents(doc_id, text, float(score)))
            results.append(hits)
        return results


def _to_all_gpus(index: object) -> object:
    import faiss

    if not hasattr(faiss, "index_cpu_to_all_gpus") or faiss.get_num_gpus() == 0:
        raise RuntimeError(
            "--faiss_gpu needs the faiss-gpu build and a visible GPU "
            "(conda install -c pytorch faiss-gpu, or pip install faiss-gpu-cu12); "
            "drop --faiss_gpu to search on CPU"
        )
    options = faiss.GpuMultipleClonerOptions()
    options.useFloat16 = True
    # Shard rather than replicate: wiki-18 e5 embeddings (~60 GiB) exceed one GPU.
    options.shard = True
    return faiss.index_cpu_to_all_gpus(index, co=options)


class TorchFlatIP:
    """Exact inner-product search over an ``IndexFlatIP``'s vectors with a torch matmul.

    The faiss-cpu wheels' batched (BLAS) path measured ~10x slower per query than torch's
    matmul here (200k x 384, 128 queries: 39 vs 3.6 ms/query), which would cancel the
    gain of batching requests. Results equal FAISS's up to ties. The database is scanned
    in blocks so the (queries x rows) score matrix stays small.
    """

    def __init__(self, index: object, block_rows: int | None = None) -> None:
        import faiss
        import torch

        self._index = index  # owns the memory the tensor below views
        flat = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d)
        self.xb_ND = torch.from_numpy(np.asarray(flat).reshape(index.ntotal, index.d))
        self.ntotal = index.ntotal
        self.d = index.d
        self.block_rows = block_rows

    def search(self, q_QD: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        q = torch.from_numpy(np.ascontiguousarray(q_QD, dtype=np.float32))
        # Default block: about 64M scores (256 MiB) per matmul whatever the batch size.
        block = self.block_rows or max(4096, (64 * 1024 * 1024) // max(1, len(q)))
        best_s = best_i = None
        with torch.inference_mode():
            for start in range(0, self.ntotal, block):
                scores_QB = q @ self.xb_ND[start : start + block].T
                s, i = scores_QB.topk(min(k, scores_QB.shape[1]), dim=1)
                i = i + start
                if best_s is not None:
                    merged = torch.cat([best_s, s], dim=1)
                    s, pick = merged.topk(min(k, merged.shape[1]), dim=1)
                    i = torch.cat([best_i, i], dim=1).gather(1, pick)
                best_s, best_i = s, i
        return best_s.numpy(), best_i.numpy()


def _use_torch_flat(index: object) -> bool:
    import faiss

    return isinstance(index, faiss.IndexFlat) and index.metric_type == faiss.METRIC_INNER_PRODUCT


class DenseRetriever(BaseRetriever):
    """Encoder + FAISS inner-product index (vectors are unit-norm, so IP = cosine)."""

    kind = "dense"

    def __init__(
        self,
        index_path: str,
        corpus: Corpus,
        encoder: Encoder,
        faiss_gpu: bool = False,
        batch_size: int = 64,
        ef_search: int = 128,
        nprobe: int = 64,
    ) -> None:
        import faiss

        super().__init__(corpus)
        if not os.path.exists(index_path):
            raise FileNotFoundError(f"FAISS index not found: {index_path}")
        index = faiss.read_index(index_path)
        if index.ntotal != len(corpus):
            raise ValueError(
                f"index {index_path} holds {index.ntotal} vectors but corpus {corpus.path} has "
                f"{len(corpus)} passages; rebuild the index from this corpus"
            )
        if index.d != encoder.dim:
            raise ValueError(
                f"index {index_path} has dimension {index.d} but encoder "
                f"{encoder.model_name_or_path} produces {encoder.dim}"
            )
        if hasattr(index, "hnsw"):
            index.hnsw.efSearch = ef_search
        try:
            faiss.extract_index_ivf(index).nprobe = nprobe
        except RuntimeError:
            pass  # not an IVF index
        if faiss_gpu:
            self.index = _to_all_gpus(index)
        elif _use_torch_flat(index):
            self.index = TorchFlatIP(index)
        else:
            self.index = index
        self.encoder = encoder
        self.batch_size = batch_size
        self.index_path = index_path

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if not queries:
            return []
        emb_QD = self.encoder.encode(queries, is_query=True, batch_size=self.batch_size)
        scores_QK, rows_QK = self.index.search(emb_QD, min(topk, self.index.ntotal))
        return self._hits(rows_QK, scores_QK)


def bm25_tokenize(texts: list[str], stemmer: object, show_progress: bool = False) -> list[list[str]]:
    """The one tokenization used for BM25 indexing and querying (they must agree)."""
    import bm25s

    return bm25s.tokenize(
        texts, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=show_progress
    )


def english_stemmer() -> object:
    import Stemmer

    return Stemmer.Stemmer("english")


def is_lucene_index(path: str | os.PathLike) -> bool:
    """Lucene indexes (pyserini's) are folders holding a ``segments_N`` file."""
    path = Path(path)
    return path.is_dir() and any(p.name.startswith("segments_") for p in path.iterdir())


class BM25Retriever(BaseRetriever):
    """BM25 over a bm25s index folder (default) or a pyserini Lucene index."""

    kind = "bm25"

    def __init__(self, index_path: str, corpus: Corpus) -> None:
        super().__init__(corpus)
        if not os.path.isdir(index_path):
            raise FileNotFoundError(f"BM25 index folder not found: {index_path}")
        self.index_path = index_path
        self._lucene = None
        if is_lucene_index(index_path):
            self._open_lucene(index_path)
            return
        import bm25s

        meta_path = Path(index_path) / BM25_META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(
                f"{index_path} is neither a Lucene index nor a bm25s index built by index_builder "
                f"(no {BM25_META_FILE})"
            )
        meta = json.loads(meta_path.read_text())
        if meta["num_docs"] != len(corpus):
            raise ValueError(
                f"BM25 index {index_path} covers {meta['num_docs']} passages but corpus {corpus.path} has "
                f"{len(corpus)}; rebuild the index from this corpus"
            )
        self._bm25 = bm25s.BM25.load(index_path, mmap=True)
        self._stemmer = english_stemmer()

    def _open_lucene(self, index_path: str) -> None:
        try:
            from pyserini.search.lucene import LuceneSearcher
        except ImportError as err:
            raise ImportError(
                f"{index_path} is a Lucene index, which needs pyserini (pip install pyserini, plus a Java 21 "
                "runtime); or build a bm25s index with `python -m search_r1.search.index_builder "
                "--retrieval_method bm25`"
            ) from err
        self._lucene = LuceneSearcher(index_path)
        self.kind = "bm25-lucene"

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if not queries:
            return []
        if self._lucene is not None:
            return [self._lucene_search(q, topk) for q in queries]
        import torch

        k = min(topk, len(self.corpus))
        tokens = bm25_tokenize(queries, self._stemmer)
        # bm25s.retrieve picks the top-k with np.argpartition, most of the cost on a large
        # corpus (many tied zero scores); torch.topk on the same scores is ~2-3x cheaper.
        # One query at a time keeps the score vector in cache: stacking a block of them
        # measured slower.
        rows_QK = np.empty((len(queries), k), dtype=np.int64)
        scores_QK = np.empty((len(queries), k), dtype=np.float32)
        for q, query_tokens in enumerate(tokens):
            scores_N = self._bm25.get_scores_from_ids(self._bm25.get_tokens_ids(query_tokens))
            s, i = torch.from_numpy(scores_N.astype(np.float32, copy=False)).topk(k)
            rows_QK[q], scores_QK[q] = i.numpy(), s.numpy()
        return self._hits(rows_QK, scores_QK)

    def _lucene_search(self, query: str, topk: int) -> list[Hit]:
        hits = self._lucene.search(query, k=topk)
        out = []
        for hit in hits:
            raw = self._lucene.doc(hit.docid).raw()
            contents = json.loads(raw).get("contents") if raw else None
            if contents is None:
                # Index built without stored documents: docids are corpus rows.
                doc_ids, texts = self.corpus.get_fields([int(hit.docid)])
                doc_id, contents = doc_ids[0], texts[0]
            else:
                doc_id = str(hit.docid)
            out.append(Hit.from_contents(doc_id, contents, float(hit.score)))
        return out


def build_retriever(
    retriever_name: str,
    index_path: str,
    corpus_path: str,
    retriever_model: str | None = None,
    faiss_gpu: bool = False,
    pooling: str = "auto",
    max_length: int = 256,
    use_fp16: bool | None = None,
    batch_size: int = 512,
    corpus_cache_dir: str | None = None,
    encode_workers: int = 1,
) -> BaseRetriever:
    """Open the corpus and index named on the server's command line.

    Encoder defaults are the original server's: 256 query tokens, batches of 512, fp16 on a
    GPU (``use_fp16=None``; ``encoders.encoder_dtype``), fp32 on CPU."""
    corpus = Corpus.open(corpus_path, cache_dir=corpus_cache_dir)
    if retriever_name == "bm25":
        return BM25Retriever(index_path, corpus)
    if not retriever_model:
        raise ValueError(f"retriever_name={retriever_name!r} is dense and needs --retriever_model")
    encoder = Encoder(
        retriever_model,
        pooling=pooling,
        max_length=max_length,
        use_fp16=use_fp16,
        family_hint=retriever_name,
        workers=encode_workers,
    )
    return DenseRetriever(index_path, corpus, encoder, faiss_gpu=faiss_gpu, batch_size=batch_size)
