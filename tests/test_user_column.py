"""hf_dp.user_column: the user column of a `datasets.Dataset` read once through Arrow, a code per row (the rows a
selection holds, in its order) and a value per distinct id; columns the row walk must decide are left to it."""

from __future__ import annotations

import numpy as np
from datasets import Dataset

from hf_dp.user_column import arrow_user_codes, table_column


def _ids(read) -> list:
    codes, values = read
    return [None if code < 0 else values[code] for code in codes]


def test_strings_numbers_and_nulls_come_back_as_the_rows_hold_them():
    for ids in (["b", None, "a", "b", ""], [5, None, -2, 5, 2**62], [0.5, None, float("nan"), 0.5]):
        data = Dataset.from_dict({"user_id": ids, "row": list(range(len(ids)))})
        read = arrow_user_codes(data, "user_id")
        assert read is not None and read[0].dtype == np.int64
        got = _ids(read)
        assert [repr(v) for v in got] == [repr(v) for v in data["user_id"]]  # NaN stays NaN: a missing id later
    nulls = Dataset.from_dict({"user_id": [None, None], "row": [1, 2]})
    assert arrow_user_codes(nulls, "user_id")[0].tolist() == [-1, -1]


def test_a_selection_reads_its_own_rows_in_its_own_order():
    data = Dataset.from_dict({"user_id": [f"u{i % 5}" for i in range(40)], "row": list(range(40))})
    for view in (data.select([7, 3, 3, 30]), data.shuffle(seed=1), data.filter(lambda r: r["row"] % 3 == 0)):
        assert _ids(arrow_user_codes(view, "user_id")) == list(view["user_id"])
        array, indices = table_column(view, "row")
        assert array.to_numpy()[indices].tolist() == list(view["row"])
    assert table_column(data, "row")[1] is None  # no selection: the table as it is


def test_what_the_row_walk_must_decide_is_left_to_it():
    lists = Dataset.from_dict({"user_id": [[1, 2], [3]], "row": [1, 2]})
    signed_zeros = Dataset.from_dict({"user_id": [0.0, -0.0, 1.0], "row": [1, 2, 3]})  # one user for a dict
    transformed = Dataset.from_dict({"user_id": ["a", "b"], "row": [1, 2]}).with_transform(lambda batch: batch)
    flags = Dataset.from_dict({"user_id": [True, False], "row": [1, 2]})
    for data in (lists, signed_zeros, transformed, flags):
        assert arrow_user_codes(data, "user_id") is None
    assert arrow_user_codes([{"user_id": "a"}], "user_id") is None and table_column({"user_id": []}, "user_id") is None
