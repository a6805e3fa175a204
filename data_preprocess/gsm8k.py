"""Preprocess GSM8K into the RL parquet schema: ``train.parquet`` and ``test.parquet``.

    python data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k
    python data_preprocess/gsm8k.py --local_dataset_path /work/shared/data/gsm8k --local_save_dir ~/data/gsm8k

Source: the hub dataset ``openai/gsm8k`` (config "main") through ``datasets``, or
``--local_dataset_path``: a directory holding ``train*``/``test*`` files (``.jsonl``, ``.json`` or
``.parquet``, also under a ``main/`` subdirectory as in a hub snapshot), or the files themselves,
whose names say their split. Each record needs ``question`` and ``answer``. Records whose answer has
no ``####`` are reported (count and first index) and skipped. Outputs are written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

try:
    import grpo_npu  # noqa: F401  (installed with `pip install -e .`)
except ImportError:  # run from a checkout without installing: the repository root holds the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_npu.data.parquet import write_parquet_atomic
from grpo_npu.data.schema import GSM8K_DATA_SOURCE, extract_ground_truth, make_row

HUB_DATASET = ("openai/gsm8k", "main")
SPLITS = ("train", "test")
SUFFIXES = (".jsonl", ".json", ".parquet")
PROGRESS_MIN_ROWS = 5000  # below this a progress bar is noise


def _split_of(path: Path) -> str:
    """The split a file holds, from its name: ``train*`` or ``test*``."""
    hits = [s for s in SPLITS if path.name.startswith(s)]
    if len(hits) != 1:
        raise ValueError(f"cannot tell the split of {path}: its name must start with one of {SPLITS}")
    return hits[0]


def find_local_files(paths: list[str]) -> dict[str, list[Path]]:
    """Map each split to its files, given directories and/or files."""
    found: dict[str, list[Path]] = {s: [] for s in SPLITS}
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--local_dataset_path {path} does not exist")
        if path.is_file():
            found[_split_of(path)].append(path)
            continue
        for folder in (path, path / "main"):
            for split in SPLITS:
                found[split] += sorted(
                    f for f in folder.glob(f"{split}*") if f.is_file() and f.suffix in SUFFIXES
                )
    missing = [s for s in SPLITS if not found[s]]
    if missing:
        raise FileNotFoundError(
            f"--local_dataset_path {paths}: no {' or '.join(missing)} file found "
            f"(expected names starting with {SPLITS} ending in {SUFFIXES}, or a main/ subdirectory)"
        )
    return found


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err})") from None


def read_records(path: Path) -> list[dict]:
    """Records of a jsonl/json/parquet file, each with ``question`` and ``answer``."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        records = []
        with path.open() as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    records.append(_json(line, f"{path} line {number}"))
    elif path.suffix == ".json":
        records = _json(path.read_text(), str(path))
    else:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {SUFFIXES}")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "question" not in rec or "answer" not in rec:
            raise ValueError(f"{path} record {i}: expected an object with 'question' and 'answer' fields")
    return records


def load_hub_splits() -> dict[str, list[dict]]:
    """The hub dataset's records per split; a clear error when the hub cannot be reached."""
    try:
        import datasets

        ds = datasets.load_dataset(*HUB_DATASET)
        return {s: ds[s].to_list() for s in SPLITS}
    except Exception as err:  # offline, DNS, proxy, missing cache: all end the same way for the user
        raise RuntimeError(
            f"could not load {HUB_DATASET[0]!r} ({HUB_DATASET[1]!r}) from the Hugging Face hub "
            f"({type(err).__name__}: {err}). Without hub access, pass --local_dataset_path DIR where DIR "
            "holds train/test .jsonl or .parquet files with 'question' and 'answer' fields."
        ) from err


def build_rows(records: list[dict], split: str, data_source: str = GSM8K_DATA_SOURCE) -> tuple[list[dict], list[int]]:
    """RL rows of one split, and the indices of the records skipped for lacking ``####``."""
    rows, skipped = [], []
    progress = tqdm(records, desc=f"gsm8k {split}", disable=len(records) < PROGRESS_MIN_ROWS, file=sys.stderr)
    for index, rec in enumerate(progress):
        ground_truth = extract_ground_truth(rec["answer"])
        if ground_truth is None:
            skipped.append(index)
            continue
        rows.append(make_row(rec["question"], rec["answer"], ground_truth, split, index, data_source))
    return rows, skipped


def preprocess(save_dir: str, local_dataset_path: list[str] | None = None) -> dict[str, Path]:
    """Write ``train.parquet``/``test.parquet`` under ``save_dir``; returns split -> path."""
    if local_dataset_path:
        files = find_local_files(local_dataset_path)
        splits = {s: [rec for f in files[s] for rec in read_records(f)] for s in SPLITS}
    else:
        splits = load_hub_splits()
    out = {}
    for split, records in splits.items():
        rows, skipped = build_rows(records, split)
        if skipped:
            print(
                f"gsm8k {split}: skipped {len(skipped)} of {len(records)} records whose answer has no "
                f"'####' (first at index {skipped[0]})",
                file=sys.stderr,
            )
        if not rows:
            raise ValueError(f"gsm8k {split}: no usable records (every answer lacks '####')")
        out[split] = write_parquet_atomic(rows, Path(save_dir).expanduser() / f"{split}.parquet")
        print(f"gsm8k {split}: wrote {len(rows)} rows to {out[split]}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_save_dir", "--local_dir", dest="local_save_dir", default="~/data/gsm8k",
                        help="where train.parquet and test.parquet go (--local_dir is an alias)")
    parser.add_argument("--local_dataset_path", nargs="+", default=None,
                        help="a directory or files with question/answer records (jsonl/json/parquet) instead of the hub")
    args = parser.parse_args(argv)
    return preprocess(args.local_save_dir, args.local_dataset_path)


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
