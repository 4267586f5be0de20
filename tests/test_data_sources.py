"""TextDataModule's sources: the same documents from JSONL, parquet, CSV and a `datasets` save_to_disk folder pack
into the same rows; other field names; errors that name the source and the row."""

import json
import os
import sys

import pytest
import torch

from lightning_slide.data import TextDataModule

datasets = pytest.importorskip("datasets")  # the [data] extra (in the test extra too)

TEXTS = [f"{a} plus {b} is {a + b}." for a in range(12) for b in range(3)]
CHATS = [
    [{"role": "user", "content": f"{a} times 2?"}, {"role": "assistant", "content": f"{2 * a}"}] for a in range(20)
]


def _rows(path, **kwargs):
    data = TextDataModule(path=str(path), seq_len=32, batch_size=2, val_fraction=0.1, **kwargs)
    data.setup("fit")
    return data.train_rows, data.val_rows


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("field", ["text", "messages"])
def test_parquet_csv_and_a_saved_dataset_pack_like_jsonl(tmp_path, field):
    records = [{"text": t} for t in TEXTS] if field == "text" else [{"messages": m} for m in CHATS]
    train, val = _rows(_jsonl(tmp_path / "docs.jsonl", records))
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "docs.parquet"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved"))
    sources = [tmp_path / "docs.parquet", tmp_path / "saved"]
    if field == "text":  # CSV holds flat columns only
        table.to_csv(str(tmp_path / "docs.csv"))
        sources.append(tmp_path / "docs.csv")
    for source in sources:
        other_train, other_val = _rows(source)
        assert _same(other_train, train), source
        assert _same(other_val, val), source


def test_other_field_names_and_a_split_of_a_saved_dataset(tmp_path):
    train, _ = _rows(_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS]))
    renamed = datasets.Dataset.from_list([{"body": t, "id": i} for i, t in enumerate(TEXTS)])
    junk = datasets.Dataset.from_list([{"body": "not this one", "id": 0}])
    datasets.DatasetDict({"train": junk, "extra": renamed}).save_to_disk(str(tmp_path / "saved"))
    other, _ = _rows(tmp_path / "saved", split="extra", text_field="body")
    assert _same(other, train)
    with pytest.raises(ValueError, match=r"has no split 'test'; it has train, extra \(split=...\)"):
        _rows(tmp_path / "saved", split="test", text_field="body")


def test_a_record_without_the_field_names_the_source_and_the_row(tmp_path):
    datasets.Dataset.from_list([{"text": "fine"}, {"txt": "typo"}]).to_parquet(str(tmp_path / "docs.parquet"))
    with pytest.raises(ValueError, match=r"docs.parquet, row 1: each document needs a 'text' string or a 'messages'"):
        _rows(tmp_path / "docs.parquet")


def test_missing_local_paths_and_unreachable_hub_names_are_named(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"no such file or folder"):
        TextDataModule(path=str(tmp_path / "nope.parquet"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: set where it is kept
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"'someone/no-such-dataset' is not a local file or folder, and the hub"):
        _rows("someone/no-such-dataset")


def test_without_datasets_installed_the_extra_is_named(tmp_path, monkeypatch):
    datasets.Dataset.from_list([{"text": t} for t in TEXTS]).to_parquet(str(tmp_path / "docs.parquet"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning-slide\[data\]'"):
        _rows(tmp_path / "docs.parquet")
    assert os.path.exists(tmp_path / "docs.parquet")
