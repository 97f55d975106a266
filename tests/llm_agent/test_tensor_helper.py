from __future__ import annotations

import torch

from search_r1.llm_agent.tensor_helper import (
    cut_to_effective_len,
    left_pad,
    position_ids_from_mask,
    real_tokens,
    right_pad,
)


def test_left_pad_and_real_tokens_round_trip():
    rows = [[5, 6, 7], [8], []]
    ids, mask = left_pad(rows, pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert real_tokens(ids, mask) == rows


def test_pad_id_inside_a_row_is_kept_by_mask():
    ids, mask = left_pad([[0, 4]], pad_token_id=0)
    assert real_tokens(ids, mask) == [[0, 4]]


def test_right_pad_to_width():
    assert right_pad([[1, 2], [3]], pad_value=9, width=3).tolist() == [[1, 2, 9], [3, 9, 9]]


def test_position_ids_start_at_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_cut_to_effective_len_drops_all_pad_columns():
    ids, mask = left_pad([[1, 2], [3]], pad_token_id=0, width=5)
    cut = cut_to_effective_len({"ids": ids, "mask": mask}, mask)
    assert cut["ids"].tolist() == [[1, 2], [0, 3]]
