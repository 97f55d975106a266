"""One dump row per trajectory of a batch: veRL's fields and ours (the dumps' format, docs/viewer.md).

    rows = dump_rows(batch, tokenizer, step, picked)   # list of JSON-ready dicts, one per picked row

veRL's keys (`trainer.rollout_data_dir` files): `input` and `output` (the prompt and the response
decoded without special tokens), `gts` (the ground truth), `score` (the rule reward's sum) and
`step`. Ours, per row: `data_source`, `uid`, `index` (extra_info.index), `reward` (the token-level
rewards' sum: the score after in-reward KL and shaping), `reward_parts` (the reward's parts,
`reward_extra_info`, and the rollout's `tool_rewards`, `reward_scores`, `turn_scores` when a tool or
an interaction scored the row), `correct` (exact match where known, else score > 0), `advantage` (mean over
trained tokens), `trained_tokens`, `response_length`, `n_searches`, `stop_reason`, and `turns`:

    {"policy": str, "action": str, "queries": [str], "observation": str, "doc_ids": [[str]],
     "calls": [str], "opened": str | null, "policy_tokens": int, "obs_tokens": int, "trained": int,
     "tokens": [str] | null,      # the policy text cut at token borders (null when pieces do not join to it)
     "adv": float | [float],      # per policy token; one number when it is the same for all
     "lp": [float] | null}        # the rollout policy's log-prob per policy token (old_log_probs)

The response is the turns' policy and observation texts back to back (special tokens kept), so
an observation span in the dump is exactly what the policy read and was not trained on.
Turns come from the rollout's `agent_trace` (token counts per turn); a batch without it (single
turn, or an engine that gives none) is cut where the loss mask changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl.utils import batch_keys as K

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it

# Rewards a rollout leaves on a row (agent loops, tools, interactions), shown with the reward's parts.
ROLLOUT_REWARDS = (K.TOOL_REWARDS, K.REWARD_SCORES, K.TURN_SCORES)


def _num(value: float, digits: int = 4) -> float | None:
    """A float for JSON: rounded; NaN/inf as None."""
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


def _plain(value: Any) -> Any:
    """A value of the batch (numpy scalars and arrays, tensors) as JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    if isinstance(value, (np.floating, float)):
        return _num(value, 6)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Exactly what the ids say: special tokens kept, no space clean-up."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_pieces(tokenizer: Any, ids: Sequence[int], text: str) -> list[str] | None:
    """The text of each id such that the pieces join to `text`, or None. Byte-level BPE decodes
    one id at a time; a SentencePiece space or a character split over ids needs the id before it."""
    ids = list(ids)
    if not ids:
        return []
    pieces = [_decode(tokenizer, [i]) for i in ids]
    if "".join(pieces) == text:
        return pieces
    pieces = [pieces[0]]
    for k in range(1, len(ids)):
        pair, prev = _decode(tokenizer, ids[k - 1: k + 1]), _decode(tokenizer, ids[k - 1: k])
        if not pair.startswith(prev):
            return None
        pieces.append(pair[len(prev):])
    return pieces if "".join(pieces) == text else None


def _mask_turns(mask: list[int]) -> list[tuple[int, int]]:
    """(policy tokens, observation tokens) per turn from a 0/1 mask: a run of 1s and the 0s after it
    (leading 0s: a turn with no policy tokens)."""
    turns: list[tuple[int, int]] = []
    pos = 0
    while pos < len(mask):
        start = pos
        while pos < len(mask) and mask[pos] == 1:
            pos += 1
        mid = pos
        while pos < len(mask) and mask[pos] == 0:
            pos += 1
        turns.append((mid - start, pos - mid))
    return turns


def _turn_spans(trace: Any, policy_mask: list[int]) -> list[tuple[int, int, Any]]:
    """(policy tokens, observation tokens, TurnTrace or None) per turn: the trace's counts when they
    cover the response exactly, else the mask's runs."""
    turns = getattr(trace, "turns", None)
    if turns and sum(t.policy_tokens + t.obs_tokens for t in turns) == len(policy_mask):
        return [(t.policy_tokens, t.obs_tokens, t) for t in turns]
    return [(p, o, None) for p, o in _mask_turns(policy_mask)]


def _advantages(values: list[float]) -> float | list[float] | None:
    if not values:
        return None
    if max(values) - min(values) <= 1e-6:
        return _num(values[0])
    return [_num(v) for v in values]


def _column(batch: DataProto, key: str, row: int, start: int, end: int) -> list[float] | None:
    if batch.batch is None or key not in batch.batch.keys():
        return None
    return batch.batch[key][row, start:end].float().tolist()


def _turns(batch: DataProto, tokenizer: Any, row: int, response_ids: list[int], policy_mask: list[int],
           trained_mask: list[int], trace: Any) -> list[dict[str, Any]]:
    turns = []
    pos = 0
    for n_policy, n_obs, t in _turn_spans(trace, policy_mask):
        p_end, o_end = pos + n_policy, pos + n_policy + n_obs
        policy_ids = response_ids[pos:p_end]
        policy = _decode(tokenizer, policy_ids)
        adv = _column(batch, K.ADVANTAGES, row, pos, p_end)
        lp = _column(batch, K.OLD_LOG_PROBS, row, pos, p_end) or _column(batch, K.ROLLOUT_LOG_PROBS, row, pos, p_end)
        turns.append({
            "policy": policy,
            "action": t.action if t is not None else None,
            "queries": list(t.queries) if t is not None else [],
            "observation": _decode(tokenizer, response_ids[p_end:o_end]),
            "doc_ids": [list(ids) for ids in t.doc_ids] if t is not None else [],
            "calls": list(t.calls) if t is not None else [],
            "opened": t.opened if t is not None else None,
            "policy_tokens": n_policy,
            "obs_tokens": n_obs,
            "trained": int(sum(trained_mask[pos:p_end])),
            "tokens": token_pieces(tokenizer, policy_ids, policy),
            "adv": _advantages(adv) if adv is not None else None,
            "lp": [_num(v, 3) for v in lp] if lp is not None else None,
        })
        pos = o_end
    return turns


def _stop_reason(trace: Any, response_ids: list[int], eos_ids: frozenset[int], budget: int) -> str:
    reason = getattr(trace, "stop_reason", None)
    if reason:
        return str(reason)
    if response_ids and response_ids[-1] in eos_ids:
        return "eos"
    return "length" if len(response_ids) >= budget else "stop"


def _ground_truth(reward_model: Any) -> Any:
    if isinstance(reward_model, dict):
        return _plain(reward_model.get("ground_truth"))
    return None


def dump_rows(batch: DataProto, tokenizer: Any, step: int, picked: Sequence[int],
              scores: Sequence[float] | None = None, eos_ids: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """The dump rows of `batch`'s rows `picked`, for step `step`. `scores`: each row's score where the
    batch has no token_level_scores (validation: the validation reward's)."""
    tensors, nt = batch.batch, batch.non_tensor_batch
    responses = tensors[K.RESPONSES].cpu()
    width = responses.shape[-1]
    attention = tensors[K.ATTENTION_MASK][:, -width:].cpu().long()
    prompts = tensors[K.PROMPTS].cpu()
    prompt_attention = tensors[K.ATTENTION_MASK][:, : prompts.shape[-1]].cpu().long()
    policy_masks = (tensors[K.LOSS_MASK] if K.LOSS_MASK in tensors.keys() else attention).cpu().long()
    trained_masks = (tensors[K.RESPONSE_MASK] if K.RESPONSE_MASK in tensors.keys() else policy_masks).cpu().long()
    has = tensors.keys()
    score_B = tensors[K.TOKEN_LEVEL_SCORES].sum(-1).tolist() if K.TOKEN_LEVEL_SCORES in has else scores
    reward_B = tensors[K.TOKEN_LEVEL_REWARDS].sum(-1).tolist() if K.TOKEN_LEVEL_REWARDS in has else None
    eos_ids = eos_ids or frozenset({tokenizer.eos_token_id})
    rows = []
    for i in picked:
        length = int(attention[i].sum())
        response_ids = responses[i, :length].tolist()
        prompt_ids = prompts[i][prompt_attention[i].bool()].tolist()
        trained = trained_masks[i, :length].tolist()
        trace = nt[K.AGENT_TRACE][i] if K.AGENT_TRACE in nt else None
        parts = _plain(nt[K.REWARD_EXTRA_INFO][i]) if K.REWARD_EXTRA_INFO in nt else {}
        for key in ROLLOUT_REWARDS:   # what the row's tools and interactions scored (veRL's names)
            if key in nt and nt[key][i] is not None and len(nt[key][i]):
                parts[key] = _plain(nt[key][i])
        score = _num(score_B[i]) if score_B is not None else None
        turns = _turns(batch, tokenizer, i, response_ids, policy_masks[i, :length].tolist(), trained, trace)
        adv = tensors[K.ADVANTAGES][i, :length].float() if K.ADVANTAGES in has else None
        n_trained = int(sum(trained))
        extra = nt[K.EXTRA_INFO][i] if K.EXTRA_INFO in nt else None
        rows.append({
            "input": tokenizer.decode(prompt_ids, skip_special_tokens=True),
            "output": tokenizer.decode(response_ids, skip_special_tokens=True),
            "gts": _ground_truth(nt[K.REWARD_MODEL][i]) if K.REWARD_MODEL in nt else None,
            "score": score,
            "step": int(step),
            "data_source": str(nt[K.DATA_SOURCE][i]) if K.DATA_SOURCE in nt else None,
            "uid": str(nt[K.UID][i]) if K.UID in nt else None,
            "index": _plain(extra.get("index")) if isinstance(extra, dict) else None,
            "reward": _num(reward_B[i]) if reward_B is not None else score,
            "reward_parts": parts,
            "correct": bool(parts["em"]) if "em" in parts else (score is not None and score > 0),
            "advantage": (_num(float((adv * torch.tensor(trained, dtype=adv.dtype)).sum()) / max(n_trained, 1))
                          if adv is not None else None),
            "trained_tokens": n_trained,
            "response_length": length,
            "n_searches": sum(len(t["queries"]) for t in turns) if trace is not None else 0,
            "stop_reason": _stop_reason(trace, response_ids, eos_ids, width),
            "turns": turns,
        })
    return rows


def picked_rows(batch: DataProto, cap: int | None, whole_groups: bool) -> list[int]:
    """Which rows a step's file keeps: all, or at most `cap`. With `whole_groups`, whole groups (rows of
    one uid: a GRPO group, a validation question's samples) in the order they first appear, so a
    group's advantages can be read together; validation's come in data order, so the same questions
    are kept at every validation. Else the first rows."""
    n = len(batch)
    if not whole_groups or K.UID not in batch.non_tensor_batch:
        return list(range(n if cap is None else min(n, cap)))
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(batch.non_tensor_batch[K.UID].tolist()):
        groups.setdefault(str(uid), []).append(i)
    out: list[int] = []
    for members in groups.values():
        if cap is not None and len(out) + len(members) > cap:
            if not out:
                out = members[:cap]
            break
        out += members
    return out


def texts(batch: DataProto, tokenizer: Any) -> list[tuple[str, str]]:
    """(input, output) of every row, decoded as the dump's `input` and `output` are."""
    prompts, responses = batch.batch[K.PROMPTS].cpu(), batch.batch[K.RESPONSES].cpu()
    mask = batch.batch[K.ATTENTION_MASK].cpu().bool()
    width = prompts.shape[-1]
    return [(tokenizer.decode(prompts[i][mask[i, :width]].tolist(), skip_special_tokens=True),
             tokenizer.decode(responses[i][mask[i, width:]].tolist(), skip_special_tokens=True))
            for i in range(len(batch))]
