"""Build a retrieval index over a JSONL corpus (dense FAISS or BM25).

Same flags and output names as the original Search-R1 ``index_builder.py``:

    python -m search_r1.search.index_builder --retrieval_method e5 \\
        --model_path intfloat/e5-base-v2 --corpus_path wiki-18.jsonl --save_dir indexes/ \\
        --max_length 256 --batch_size 512 --use_fp16 --faiss_type Flat --save_embedding

writes ``indexes/e5_Flat.index``; ``--retrieval_method bm25`` writes the folder
``indexes/bm25`` (a bm25s index, no Java needed, unlike the original's pyserini).

Differences from the original: the corpus is streamed from a memory-mapped Arrow
store; embeddings go to a disk-backed memmap, so a 21M-passage build does not need
the embedding matrix in RAM; any FAISS factory string works and is built for inner
product (vectors are L2-normalised).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a file, as the original's `python search_r1/search/<script>.py ...` did:
    # make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from search_r1.search.corpus import Corpus  # noqa: E402
from search_r1.search.encoders import Encoder  # noqa: E402
from search_r1.search.retrievers import BM25_META_FILE, bm25_tokenize, english_stemmer  # noqa: E402

# IVF/PQ training does not improve past a few hundred points per centroid; cap the sample.
_MAX_TRAIN_VECTORS = 1_000_000


def index_file_name(retrieval_method: str, faiss_type: str) -> str:
    """The original's naming: ``{method}_{faiss_type}.index`` (method = a path's basename)."""
    method = os.path.basename(os.path.normpath(retrieval_method))
    return f"{method}_{faiss_type}.index"


def build_bm25_index(corpus: Corpus, save_dir: str | os.PathLike) -> Path:
    """Index ``corpus`` with bm25s into ``save_dir/bm25``; returns that folder."""
    import bm25s

    out = Path(save_dir) / "bm25"
    out.mkdir(parents=True, exist_ok=True)
    stemmer = english_stemmer()
    tokens: list[list[str]] = []
    for _, contents in tqdm(corpus.iter_batches(4096), desc="tokenize", total=-(-len(corpus) // 4096)):
        tokens.extend(bm25_tokenize(contents, stemmer))
    bm25 = bm25s.BM25()
    bm25.index(tokens, show_progress=False)
    bm25.save(str(out))
    meta = {"num_docs": len(corpus), "corpus_path": corpus.path, "stemmer": "english", "stopwords": "en"}
    (out / BM25_META_FILE).write_text(json.dumps(meta, indent=2))
    return out


def encode_corpus(
    corpus: Corpus, encoder: Encoder, batch_size: int, embedding_path: str | os.PathLike
) -> np.ndarray:
    """Encode every passage into a float32 memmap at ``embedding_path`` (row = corpus row)."""
    emb_ND = np.lib.format.open_memmap(
        str(embedding_path), mode="w+", dtype=np.float32, shape=(len(corpus), encoder.dim)
    )
    row = 0
    with tqdm(total=len(corpus), desc="encode", unit="psg") as bar:
        for _, contents in corpus.iter_batches(batch_size):
            emb_ND[row : row + len(contents)] = encoder.encode(contents, is_query=False, batch_size=batch_size)
            row += len(contents)
            bar.update(len(contents))
    emb_ND.flush()
    return emb_ND


def make_faiss_index(dim: int, faiss_type: str) -> object:
    """An empty inner-product index from a FAISS factory string (checked before encoding)."""
    import faiss

    try:
        return faiss.index_factory(dim, faiss_type, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise ValueError(f"--faiss_type {faiss_type!r} is not a valid FAISS factory string: {err}") from err


def fill_faiss_index(index: object, emb_ND: np.ndarray, faiss_gpu: bool = False) -> object:
    """Train ``index`` if its type needs it, add ``emb_ND`` in chunks; returns a CPU index."""
    import faiss

    if faiss_gpu:
        from search_r1.search.retrievers import _to_all_gpus

        index = _to_all_gpus(index)
    if not index.is_trained:
        rng = np.random.default_rng(0)
        n_train = min(len(emb_ND), _MAX_TRAIN_VECTORS)
        sample = np.sort(rng.choice(len(emb_ND), size=n_train, replace=False))
        index.train(np.ascontiguousarray(emb_ND[sample]))
    chunk = 100_000
    for start in tqdm(range(0, len(emb_ND), chunk), desc="add to index"):
        index.add(np.ascontiguousarray(emb_ND[start : start + chunk]))
    if faiss_gpu:
        index = faiss.index_gpu_to_cpu(index)
    return index


def build_index(
    retrieval_method: str,
    corpus_path: str,
    save_dir: str,
    model_path: str | None = None,
    max_length: int = 256,
    batch_size: int = 512,
    use_fp16: bool = False,
    faiss_type: str = "Flat",
    save_embedding: bool = False,
    faiss_gpu: bool = False,
    pooling: str = "auto",
) -> Path:
    """Build the index and return its path (a ``.index`` file, or the ``bm25`` folder)."""
    import faiss

    corpus = Corpus.open(corpus_path)
    if len(corpus) == 0:
        raise ValueError(f"corpus {corpus_path} holds no passages")
    if retrieval_method == "bm25":
        return build_bm25_index(corpus, save_dir)
    os.makedirs(save_dir, exist_ok=True)
    encoder = Encoder(
        model_path or retrieval_method,
        pooling=pooling,
        max_length=max_length,
        use_fp16=use_fp16,
        family_hint=retrieval_method,
    )
    index = make_faiss_index(encoder.dim, faiss_type)
    method = os.path.basename(os.path.normpath(retrieval_method))
    embedding_path = Path(save_dir) / f"emb_{method}.npy"
    emb_ND = encode_corpus(corpus, encoder, batch_size, embedding_path)
    index = fill_faiss_index(index, emb_ND, faiss_gpu)
    out = Path(save_dir) / index_file_name(retrieval_method, faiss_type)
    tmp = out.with_name(out.name + ".tmp")
    faiss.write_index(index, str(tmp))
    os.replace(tmp, out)
    del emb_ND
    if not save_embedding:
        embedding_path.unlink()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Build a dense (FAISS) or BM25 index over a JSONL corpus.")
    p.add_argument("--retrieval_method", required=True, help="e5, bge, bm25, or an HF model name/path")
    p.add_argument("--model_path", default=None, help="encoder path (defaults to --retrieval_method)")
    p.add_argument("--corpus_path", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--max_length", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--use_fp16", action="store_true", default=False)
    p.add_argument("--pooling_method", default="auto", choices=["auto", "mean", "cls", "pooler"])
    p.add_argument("--faiss_type", default="Flat", help="FAISS factory string, e.g. Flat, HNSW64, IVF4096,Flat")
    p.add_argument("--save_embedding", action="store_true", default=False)
    p.add_argument("--faiss_gpu", action="store_true", default=False)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = build_index(
        retrieval_method=args.retrieval_method,
        corpus_path=args.corpus_path,
        save_dir=args.save_dir,
        model_path=args.model_path,
        max_length=args.max_length,
        batch_size=args.batch_size,
        use_fp16=args.use_fp16,
        faiss_type=args.faiss_type,
        save_embedding=args.save_embedding,
        faiss_gpu=args.faiss_gpu,
        pooling=args.pooling_method,
    )
    print(f"index written to {out}")


if __name__ == "__main__":
    main()
