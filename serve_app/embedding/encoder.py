"""`Encoder`: texts -> sentence vectors (L2-normalised) and token counts.

The model is sentence-transformers' own (`SentenceTransformer`, which the built-in
all-MiniLM-L6-v2 package depends on): its modules (the transformer, the pooling the folder names,
mean for all-MiniLM-L6-v2, a normalisation) compute each vector; a folder without a
sentence-transformers layout gets its default, mean pooling. The folder is read offline
(`local_files_only`), in float32. What this class adds is the serving side: the checks below,
batches by length, and vectors normalised whatever the folder's modules do.

Inputs are refused, never cut: an input longer than the model takes (its positions, or the
`max_seq_length` of a sentence-transformers folder), or one with no text besides the special
tokens, raises `InputRefused` naming it (`input[3]`) so the caller can
answer 400, as vLLM refuses an over-long embedding input. (sentence-transformers would silently
keep the first `max_seq_length` tokens instead; a client that wants that can cut its text.)

Threads: the forward pass uses torch's intra-op threads as the process has them; in a Ray
replica that is the deployment's `num_cpus` (Ray sets OMP_NUM_THREADS from it), the same rule
as the model replicas' engines (docs/cpu-serving.md). `num_threads` overrides it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch


class InputRefused(ValueError):
    """An input the encoder will not embed; `param` names it as the request does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class Encoder:
    """One embedding model on CPU. `encode` is the whole job; `tokenize` (the checks) and
    `embed` (the forward passes) are apart so that a caller can check several requests one by
    one and then embed them all in shared batches."""

    def __init__(
        self, path: str | Path, max_batch_size: int = 32, num_threads: int | None = None
    ) -> None:
        from sentence_transformers import SentenceTransformer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.max_batch_size = max_batch_size
        self.model = SentenceTransformer(str(path), device="cpu", local_files_only=True).eval()
        self.tokenizer = self.model.tokenizer
        self.dimensions: int = self.model.get_sentence_embedding_dimension()
        encoder = self.model[0].auto_model
        config = encoder.config
        # RoBERTa-style models number positions from pad_token_id + 1, so they hold that many
        # fewer tokens than max_position_embeddings; BERT's embeddings have no padding_idx.
        offset = getattr(getattr(encoder, "embeddings", None), "padding_idx", None)
        self.max_input_tokens: int = config.max_position_embeddings - (
            offset + 1 if isinstance(offset, int) else 0
        )
        # the length the model was trained on (sentence_bert_config.json: 256 for
        # all-MiniLM-L6-v2); vLLM takes it as the model's limit too
        if self.model.max_seq_length:
            self.max_input_tokens = min(self.max_input_tokens, self.model.max_seq_length)
        self.pad_token_id: int = self.tokenizer.pad_token_id or 0
        self._special_ids = frozenset(self.tokenizer.all_special_ids)
        # Fast tokenizers can fail with "Already borrowed" when one instance is used from
        # several threads at once (the tokenizer pool guards its tokenizers the same way).
        self._lock = threading.Lock()

    def encode(self, texts: list[str], param: str = "input") -> tuple[list[list[float]], list[int]]:
        """(one unit vector per text, in order; each text's token count, special tokens
        included, as usage.prompt_tokens counts them). InputRefused for a bad input."""
        ids = self.tokenize(texts, param)
        return self.embed(ids), [len(one) for one in ids]

    @property
    def num_threads(self) -> int:
        return torch.get_num_threads()

    def tokenize(self, texts: list[str], param: str = "input") -> list[list[int]]:
        """Each text's token ids with the special tokens ([CLS] ... [SEP]), after the checks:
        a text must be valid Unicode, have some text besides the special tokens (an empty or
        whitespace-only input has no meaning to embed) and fit `max_input_tokens`. The first
        bad one raises InputRefused as `{param}[i]`."""
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputRefused(f"{param}[{i}]", f"{param}[{i}] must be a string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate that came through JSON
                raise InputRefused(
                    f"{param}[{i}]",
                    f"{param}[{i}] is not valid Unicode text (character {exc.start} is a lone "
                    "surrogate)",
                ) from None
        if not texts:
            return []
        with self._lock:  # verbose=False: we refuse long inputs ourselves, no warning needed
            ids = self.tokenizer(list(texts), add_special_tokens=True, verbose=False)["input_ids"]
        for i, one in enumerate(ids):
            if len(one) > self.max_input_tokens:
                raise InputRefused(
                    f"{param}[{i}]",
                    f"{param}[{i}] is {len(one)} tokens long (special tokens included); this "
                    f"model takes at most {self.max_input_tokens} tokens per input, so shorten "
                    "it or split it",
                )
            if all(token in self._special_ids for token in one):
                raise InputRefused(
                    f"{param}[{i}]",
                    f"{param}[{i}] has no text to embed (it is empty or only whitespace)",
                )
        return ids

    def embed(self, ids: list[list[int]]) -> list[list[float]]:
        """Unit vectors for token id lists (already checked), in their order. Batches of at
        most `max_batch_size` inputs, formed by length so that each pads little."""
        vectors: list[list[float]] = [[] for _ in ids]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), self.max_batch_size):
            batch = order[start : start + self.max_batch_size]
            for i, vector in zip(batch, self._forward([ids[i] for i in batch]), strict=True):
                vectors[i] = vector
        return vectors

    @torch.inference_mode()
    def _forward(self, batch: list[list[int]]) -> list[list[float]]:
        width = max(len(one) for one in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, one in enumerate(batch):
            input_ids[row, : len(one)] = torch.tensor(one, dtype=torch.long)
            mask[row, : len(one)] = 1
        features = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self.tokenizer.model_input_names:
            features["token_type_ids"] = torch.zeros_like(input_ids)
        vectors = self.model(features)["sentence_embedding"]
        return torch.nn.functional.normalize(vectors, p=2, dim=1).tolist()
