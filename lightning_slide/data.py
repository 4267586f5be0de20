"""``TextDataModule``: documents (``text``, or chat ``messages``) tokenized, packed and split for causal-LM
training — from JSONL, or through the ``datasets`` library from parquet, CSV, a ``save_to_disk`` folder or the hub —
and a built-in corpus and byte-level tokenizer, so the quickstart needs no network.

Packing concatenates documents into rows of ``seq_len`` tokens. Each document's positions restart at 0, which is
how packed batches reach the attention kernel (``attn_implementation="slide"`` runs one variable-length kernel,
and transformers' SDPA path masks by the restarts too), and no token is trained to predict the first token of
the next document. Chat documents are rendered with the tokenizer's chat template and only assistant turns carry
labels.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

IGNORE = -100
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def builtin_tokenizer():
    """A byte-level tokenizer (256 bytes + 6 special tokens) with a chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|eos|>", pad_token="<|pad|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE
    return tokenizer


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def builtin_documents(n: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """A small synthetic corpus with learnable structure: arithmetic facts as text, and as chats."""
    rng, words = random.Random(seed), NUMBER_WORDS
    docs: list[dict[str, Any]] = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        fact = f"{words[a]} plus {words[b]} is {a + b}."
        if i % 4 == 3:
            question = {"role": "user", "content": f"what is {words[a]} plus {words[b]}?"}
            docs.append({"messages": [question, {"role": "assistant", "content": fact}]})
        else:
            c = rng.randrange(10)
            docs.append({"text": f"{fact} {words[c]} times two is {2 * c}. count: {' '.join(words[: c + 1])}."})
    return docs


DATASET_FILES = {".parquet": "parquet", ".csv": "csv"}  # read through `datasets`; any other file is JSONL


def read_documents(path: str, split: str = "train", text_field: str = "text",
                   messages_field: str = "messages") -> list[dict[str, Any]]:  # fmt: skip
    """Documents from a JSONL file, or through ``datasets`` from a parquet or CSV file, a ``save_to_disk``
    folder (its ``split``) or a hub dataset (its ``split``); each needs ``text_field`` (a string) or
    ``messages_field`` (a list of ``{'role', 'content'}`` turns)."""
    local = os.path.expanduser(path)
    if os.path.isfile(local) and os.path.splitext(local)[1] not in DATASET_FILES:
        lines = _jsonl_lines(local)
        docs = [document(raw, f"{local}, line {n}", text_field, messages_field) for n, raw in lines]
    else:
        rows = _dataset(path, split)
        docs = [document(row, f"{path}, row {i}", text_field, messages_field) for i, row in enumerate(rows)]
    if not docs:
        raise ValueError(f"{path} holds no documents.")
    return docs


def _jsonl_lines(path: str) -> list[tuple[int, Any]]:
    lines = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                byte = raw[err.start : err.start + 1]
                raise ValueError(f"{path}, line {number}: not UTF-8 (byte {err.start}: {byte!r}).") from None
            if not line.strip():
                continue
            try:
                lines.append((number, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg}).") from None
    return lines


def document(raw: Any, where: str, text_field: str, messages_field: str) -> dict[str, Any]:
    """One document as ``{"text": ...}`` or ``{"messages": ...}``, from a record with those fields."""
    text = raw.get(text_field) if isinstance(raw, dict) else None
    messages = raw.get(messages_field) if isinstance(raw, dict) else None
    if isinstance(text, str):
        return {"text": text}
    if not isinstance(messages, list):
        raise ValueError(
            f"{where}: each document needs a '{text_field}' string or a '{messages_field}' list of"
            " {'role', 'content'} turns (TextDataModule(text_field=..., messages_field=...) name other fields)."
        )
    if (bad := _bad_turn(messages)) is not None:
        raise ValueError(f"{where}: turn {bad} of '{messages_field}' is not a {{'role': str, 'content': str}} object.")
    return {"messages": messages}


def _dataset(path: str, split: str):
    """Rows of a parquet or CSV file, a ``save_to_disk`` folder or a hub dataset, through ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data path {path!r}: parquet, CSV, saved and hub datasets are read with the `datasets` library:"
            " pip install 'lightning-slide[data]'."
        ) from None
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        loaded = datasets.load_from_disk(local)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"data path {path!r} has no split {split!r}; it has {', '.join(loaded)} (split=...).")
            loaded = loaded[split]
        return loaded
    if os.path.isfile(local):
        return datasets.load_dataset(DATASET_FILES[os.path.splitext(local)[1]], data_files=local, split="train")
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as err:  # offline, unknown name, no such split: datasets' own errors vary
        raise ValueError(
            f"data path {path!r} is not a local file or folder, and the hub dataset of that name could not be loaded"
            f" (split {split!r}): {type(err).__name__}: {err}"
        ) from err


def _bad_turn(messages: list) -> int | None:
    # the index of the first turn without a string role and content
    for i, turn in enumerate(messages):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            return i
    return None


def tokenize(doc: dict[str, Any], tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of one document (ending with EOS) and which of them are trained on."""
    if "text" in doc:
        ids = tokenizer(doc["text"])["input_ids"]  # with the tokenizer's own specials (a BOS, for most)
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids = [*ids, tokenizer.eos_token_id]
        return ids, [True] * len(ids)
    messages = doc["messages"]
    ids: list[int] = []
    trained: list[bool] = []
    for i, turn in enumerate(messages):
        # NOTE: a turn's tokens are the difference between the renderings of the conversation up to it and up to
        # the turn before (chat templates render a prefix as a prefix; checked). Of an assistant turn, the header
        # that the generation prompt renders is not trained, only what the model would generate after it.
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
        head = len(ids)
        if turn["role"] == "assistant":
            head = len(tokenizer.apply_chat_template(messages[:i], tokenize=True, return_dict=False,
                                                     add_generation_prompt=True))  # fmt: skip
        if full[: len(ids)] != ids or head > len(full):
            raise ValueError("The tokenizer's chat template does not render a conversation's prefix as its prefix.")
        trained += [False] * (head - len(ids)) + [turn["role"] == "assistant"] * (len(full) - head)
        ids = list(full)
    return ids + [tokenizer.eos_token_id], trained + [True]


def pack(docs: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int) -> dict[str, Tensor]:
    """Rows of ``seq_len`` tokens: documents back to back, positions restarting at each document."""
    ids, labels, positions = [], [], []
    for tokens, trained in docs:
        for start in range(0, len(tokens), seq_len):  # a document longer than a row continues as a new document
            piece = tokens[start : start + seq_len]
            ids += piece
            labels += [t if ok else IGNORE for t, ok in zip(piece, trained[start : start + seq_len])]
            labels[len(labels) - len(piece)] = IGNORE  # nothing predicts a document's first token
            positions += range(len(piece))
    pad = (-len(ids)) % seq_len
    ids += [pad_id] * pad
    labels += [IGNORE] * pad
    positions += range(pad)
    rows = len(ids) // seq_len

    def as_rows(values):
        return torch.tensor(values, dtype=torch.long).view(rows, seq_len)

    return {"input_ids": as_rows(ids), "labels": as_rows(labels), "position_ids": as_rows(positions)}


def _written_as_path(name: str) -> bool:
    # a local path, not a hub id ("owner/name")
    return name.startswith(("/", ".", "~"))


def _missing_local(path: str) -> bool:
    """``path`` names a local file or folder (by its form, or a file's extension) and nothing is there."""
    named = _written_as_path(path) or os.path.splitext(path)[1] in (*DATASET_FILES, ".jsonl")
    return named and not os.path.exists(os.path.expanduser(path))


def _missing_directory(name: str | None) -> bool:
    """``name`` is written as a local path (not a hub id) and no such directory exists."""
    return name is not None and _written_as_path(name) and not os.path.isdir(os.path.expanduser(name))


class _Rows(Dataset):
    def __init__(self, rows: dict[str, Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, key: int | list[tuple[int, int]]) -> dict[str, Tensor]:
        if isinstance(key, list):  # a training batch: (row, target tokens of the row's whole optimizer step) each
            index = torch.tensor([i for i, _ in key])
            step_tokens = torch.tensor([total for _, total in key])
            return {**{k: v[index] for k, v in self.rows.items()}, "step_tokens": step_tokens}
        return {k: v[key] for k, v in self.rows.items()}


class _StepBatches(DistributedSampler):
    """Batches in the sampler's order; each row comes with the number of target tokens in all the batches of its
    optimizer step (``accumulate`` batches), so a loss can be normalized by the whole step's token count.

    With ``replicas`` processes (data parallel), each run of ``replicas * batch_size`` rows in that order is one batch
    of every process, the ``rank``-th slice this process's; a step's tokens count every process's rows. At an epoch's
    end every process gets as many rows (up to ``replicas - 1`` rows are left out). A ``DistributedSampler``: Lightning
    then leaves it as it is (it would replace a plain sampler under data parallel).
    """

    def __init__(self, dataset: Dataset, sampler: ResumableSampler, batch_size: int, accumulate: int, targets: Tensor,
                 replicas: int = 1, rank: int = 0) -> None:  # fmt: skip
        super().__init__(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=sampler.seed)
        self.sampler, self.batch_size, self.accumulate, self.targets = sampler, batch_size, accumulate, targets

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at every epoch start
        super().set_epoch(epoch)
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size * self.num_replicas)
        return full + (rest >= self.num_replicas)

    def __iter__(self):
        order, span = list(self.sampler), self.batch_size * self.num_replicas
        batches = []  # each: every process's rows
        for start in range(0, len(order), span):
            rows = order[start : start + span]
            each = len(rows) // self.num_replicas
            if each:
                batches.append([rows[r * each : (r + 1) * each] for r in range(self.num_replicas)])
        for g in range(0, len(batches), self.accumulate):
            group = batches[g : g + self.accumulate]
            total = int(sum(self.targets[i] for batch in group for part in batch for i in part))
            for batch in group:
                yield [(i, total) for i in batch[self.rank]]


class ResumableSampler(Sampler[int]):
    """A seeded shuffle per epoch (the same order on every run) that can start part-way into one epoch.

    Args:
        size: the dataset's length.
        seed: with the epoch number, fixes each epoch's order.
        resume: ``(epoch, samples)``: that epoch starts after its first ``samples`` samples.
    """

    def __init__(self, size: int, seed: int, resume: tuple[int, int] | None = None) -> None:
        self.size, self.seed, self.resume = size, seed, resume
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at every epoch start
        self.epoch = epoch

    def _skip(self) -> int:
        return self.resume[1] if self.resume is not None and self.resume[0] == self.epoch else 0

    def __len__(self) -> int:
        # NOTE: the whole epoch, also when resuming: Lightning's epoch loop restores its batch count and runs to
        # the end of the (shorter) iteration; a shorter length would end the epoch early.
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator)[self._skip() :].tolist()
        self.resume = None  # only the first pass after a resume skips
        return iter(order)


class TextDataModule(L.LightningDataModule):
    """Documents, tokenized and packed into rows, with a train/validation split.

    Args:
        path: a JSONL file with a ``text`` or ``messages`` field per line; a parquet or CSV file, a folder
            written by ``datasets``' ``save_to_disk`` or a hub dataset name (these through ``datasets``: ``pip
            install 'lightning-slide[data]'``); ``None``: the built-in corpus.
        tokenizer: hub id or local directory for ``AutoTokenizer``; ``None``: the built-in byte-level tokenizer
            (262 tokens: give the model ``vocab_size >= 262``).
        seq_len: tokens per row.
        batch_size: rows per batch.
        val_fraction: share of documents held out for validation (0: no validation).
        seed: seed of the split and the shuffling.
        split: the split of a hub dataset or of a saved ``DatasetDict`` (a file is one split).
        text_field: the field of plain text.
        messages_field: the field of chat turns (``{'role', 'content'}``), rendered by the tokenizer's chat template.

    A run resumed from a checkpoint taken mid-epoch continues with exactly the batches it had not yet seen
    (the checkpoint records the epoch and how many batches of it were consumed). Training batches also carry
    ``step_tokens``: the target tokens of the whole optimizer step they belong to (see
    ``CausalLMModule(normalize="step")``).
    """

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        split: str = "train",
        text_field: str = "text",
        messages_field: str = "messages",
    ) -> None:
        super().__init__()
        if path is not None and _missing_local(path):
            raise FileNotFoundError(
                f"data path {path!r}: no such file or folder. Give a JSONL, parquet or CSV file, a folder written by"
                " datasets' save_to_disk, a hub dataset name, or no path (built-in data)."
            )
        if _missing_directory(tokenizer):
            raise FileNotFoundError(f"tokenizer={tokenizer!r}: no such directory.")
        if seq_len < 2 or batch_size < 1 or not 0 <= val_fraction < 1:
            raise ValueError(
                f"seq_len must be >= 2, batch_size >= 1 and 0 <= val_fraction < 1; got {seq_len}, {batch_size},"
                f" {val_fraction}."
            )
        self.path, self.tokenizer_name = path, tokenizer
        self.split, self.text_field, self.messages_field = split, text_field, messages_field
        self.seq_len, self.batch_size, self.val_fraction, self.seed = seq_len, batch_size, val_fraction, seed
        self.tokenizer = None
        self.train_rows: dict[str, Tensor] | None = None
        self.val_rows: dict[str, Tensor] | None = None
        self._resume: dict[str, int] | None = None

    @property
    def tokens_per_batch(self) -> int:
        """Tokens of each batch (rows of ``seq_len``), for the strategy's placement plan."""
        return self.batch_size * self.seq_len

    def setup(self, stage: str) -> None:
        if self.train_rows is not None:
            return
        docs = (
            read_documents(self.path, self.split, self.text_field, self.messages_field)
            if self.path
            else builtin_documents(seed=self.seed)
        )
        self.load_tokenizer()
        order = list(range(len(docs)))
        random.Random(self.seed).shuffle(order)
        n_val = round(len(docs) * self.val_fraction) if self.val_fraction else 0
        n_val = max(n_val, 1) if self.val_fraction and len(docs) > 1 else n_val
        if n_val >= len(docs):
            raise ValueError(
                f"val_fraction={self.val_fraction} holds out {n_val} of the {len(docs)} documents, leaving none to"
                " train on: lower val_fraction (0 turns validation off) or add documents."
            )
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

        def rows(indices):
            return pack([tokenize(docs[i], self.tokenizer) for i in indices], self.seq_len, pad)

        self.train_rows = rows(order[n_val:])
        self.val_rows = rows(order[:n_val]) if n_val else None

    def load_tokenizer(self):
        """The tokenizer (loaded once): the built-in one, or ``AutoTokenizer`` from ``tokenizer``."""
        if self.tokenizer is None:
            if self.tokenizer_name is None:
                self.tokenizer = builtin_tokenizer()
            else:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(self.tokenizer_name))
        return self.tokenizer

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        resume = None
        if self._resume is not None:  # the rows every process consumed
            resume = (self._resume["epoch"], self._resume["batches"] * self.batch_size * replicas)
            self._resume = None
        sampler = ResumableSampler(len(self.train_rows["input_ids"]), self.seed, resume)
        targets = (self.train_rows["labels"][:, 1:] != IGNORE).sum(1)  # what each row's loss is summed over
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        rows = _Rows(self.train_rows)
        batches = _StepBatches(rows, sampler, self.batch_size, accumulate, targets, replicas, rank)
        return DataLoader(rows, sampler=batches, batch_size=None)  # each item a whole batch

    def state_dict(self) -> dict[str, int]:
        """Saved in checkpoints: the epoch, and how many of its batches training has consumed."""
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": self.trainer.current_epoch, "batches": progress.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = dict(state)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_rows is None:
            return []
        return DataLoader(_Rows(self.val_rows), batch_size=self.batch_size)
