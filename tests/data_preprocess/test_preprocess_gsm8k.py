"""data_preprocess/gsm8k.py: row schema, ground truths, bad-row report, sources, hub failure, full data."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "data_preprocess" / "gsm8k.py"
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

EXPECTED_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                              ("question", pa.string())])),
])

TRAIN = [
    {"question": "Q0: how many?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
    {"question": "Q1: no marker", "answer": "the answer is 7"},
    {"question": "Q2: big", "answer": "1000 + 234 = 1,234\n#### 1,234"},
    {"question": "Q3: also no marker", "answer": "## 3"},
    {"question": "Q4: negative", "answer": "#### -12"},
]
TEST = [{"question": "T0: decimal?", "answer": "half of 3 is 1.5\n#### 1.5"}]


@pytest.fixture(scope="module")
def prep():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _expected_row(rec: dict, split: str, index: int, truth: str) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": rec["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": rec["answer"], "question": rec["question"]},
    }


def test_fixture_rows_schema_and_bad_row_report(prep, tmp_path, capsys):
    src = tmp_path / "src"
    _write_jsonl(src / "train.jsonl", TRAIN)
    _write_jsonl(src / "test.jsonl", TEST)
    out = prep.main(["--local_dataset_path", str(src), "--local_save_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "gsm8k train: skipped 2 of 5 records whose answer has no '####' (first at index 1)" in err
    assert "gsm8k test: skipped" not in err

    train = pq.read_table(out["train"])
    assert train.schema.equals(EXPECTED_SCHEMA)
    assert train.to_pylist() == [
        _expected_row(TRAIN[0], "train", 0, "5"),
        _expected_row(TRAIN[2], "train", 2, "1234"),  # commas removed; index is the source position
        _expected_row(TRAIN[4], "train", 4, "-12"),
    ]
    assert pq.read_table(out["test"]).to_pylist() == [_expected_row(TEST[0], "test", 0, "1.5")]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["test.parquet", "train.parquet"]  # no temp files


def test_parquet_files_and_hub_layout(prep, tmp_path):
    snapshot = tmp_path / "snap" / "main"  # the hub snapshot layout: main/<split>-00000-of-00001.parquet
    snapshot.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(TRAIN), snapshot / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(TEST), snapshot / "test-00000-of-00001.parquet")
    out = prep.preprocess(str(tmp_path / "a"), [str(tmp_path / "snap")])
    assert pq.read_table(out["train"]).num_rows == 3

    # explicit files, split from the name; --local_dir is an alias of --local_save_dir
    out = prep.main(["--local_dataset_path", str(snapshot / "train-00000-of-00001.parquet"),
                     str(snapshot / "test-00000-of-00001.parquet"), "--local_dir", str(tmp_path / "b")])
    assert out["test"] == tmp_path / "b" / "test.parquet"
    assert pq.read_table(out["test"]).column("reward_model").to_pylist()[0]["ground_truth"] == "1.5"


def test_source_errors(prep, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prep.preprocess(str(tmp_path / "o"), [str(tmp_path / "missing")])
    _write_jsonl(tmp_path / "only" / "train.jsonl", TRAIN)
    with pytest.raises(FileNotFoundError, match="no test file found"):
        prep.preprocess(str(tmp_path / "o"), [str(tmp_path / "only")])
    _write_jsonl(tmp_path / "odd" / "dev.jsonl", TEST)
    with pytest.raises(ValueError, match="cannot tell the split of .*dev.jsonl"):
        prep.preprocess(str(tmp_path / "o"), [str(tmp_path / "odd" / "dev.jsonl")])
    _write_jsonl(tmp_path / "cols" / "train.jsonl", [{"q": 1}])
    _write_jsonl(tmp_path / "cols" / "test.jsonl", TEST)
    with pytest.raises(ValueError, match="train.jsonl record 0: expected an object with 'question' and 'answer'"):
        prep.preprocess(str(tmp_path / "o"), [str(tmp_path / "cols")])
    _write_jsonl(tmp_path / "allbad" / "train.jsonl", [TRAIN[1]])
    _write_jsonl(tmp_path / "allbad" / "test.jsonl", TEST)
    with pytest.raises(ValueError, match="gsm8k train: no usable records"):
        prep.preprocess(str(tmp_path / "o"), [str(tmp_path / "allbad")])
    _write_jsonl(tmp_path / "json" / "test.jsonl", TEST)
    (tmp_path / "json" / "train.jsonl").write_text(json.dumps(TRAIN[0]) + "\n\nnot json\n")
    with pytest.raises(ValueError, match=r"train\.jsonl line 3: not valid JSON \(Expecting value"):
        prep.preprocess(str(tmp_path / "o"), [str(tmp_path / "json")])


def test_unreachable_hub_points_to_local_dataset_path(prep, tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"could not load 'openai/gsm8k'.*ConnectionError.*--local_dataset_path"):
        prep.main(["--local_save_dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_cli_reports_errors_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--local_dataset_path", str(tmp_path / "missing"), "--local_save_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: --local_dataset_path") and "does not exist" in result.stderr


@pytest.mark.skipif(not SHARED_GSM8K.is_dir(), reason=f"shared gsm8k data not found at {SHARED_GSM8K}")
def test_full_shared_gsm8k(prep, tmp_path):
    out = prep.preprocess(str(tmp_path), [str(SHARED_GSM8K)])
    train, test = pq.read_table(out["train"]), pq.read_table(out["test"])
    assert (train.num_rows, test.num_rows) == (7473, 1319)
    assert train.schema.equals(EXPECTED_SCHEMA) and test.schema.equals(EXPECTED_SCHEMA)
    with open(SHARED_GSM8K / "train.jsonl") as f:
        first = json.loads(f.readline())
    assert train.slice(0, 1).to_pylist()[0] == _expected_row(first, "train", 0, "72")
    truths = train.column("reward_model").to_pylist()
    assert all("," not in t["ground_truth"] and t["ground_truth"] for t in truths)
    assert test.column("extra_info").to_pylist()[-1]["index"] == 1318
