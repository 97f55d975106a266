"""Prompt dataset for RL: parquet rows -> left-padded prompt tensors + reward metadata.

Rows follow the Search-R1 layout (DESIGN.md 3.2): `data_source`, `prompt` (a chat
list), `reward_model`, `extra_info`. Every prompt is tokenized once, up front, so
over-long prompts are dropped (and counted) before training starts instead of
crashing a step hours later.

The rows veRL's `preprocess_search_r1_dataset.py` writes for its tool recipe load as they are
(prompt = [system, user], `extra_info.tools_kwargs` / `need_tools_kwargs`, `metadata`, data
sources `searchR1_<name>`): other columns are ignored, `extra_info` is kept whole. In the tool
protocol the prompt is rendered with the tool schemas (`tools=`), as veRL renders it, so the
model sees the tools it may call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from verl.utils import batch_keys as K

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = (K.DATA_SOURCE, K.REWARD_MODEL)
# data.truncation (veRL's): what becomes of a prompt longer than the bound that is not filtered out.
TRUNCATIONS = ("error", "left", "right", "middle")
# data.return_raw_chat (veRL's key and name): each row's chat messages, kept in the batch (non-tensor).
RAW_PROMPT = "raw_prompt"


@dataclass(frozen=True)
class DatasetStats:
    """What loading did to the rows: kept, dropped for length, subsampled away."""

    rows_read: int
    rows_subsampled_away: int
    rows_dropped_overlong: int
    rows_kept: int
    rows_truncated: int = 0


def _to_python(value: Any) -> Any:
    """Parquet gives numpy arrays for list columns; the reward code expects plain lists."""
    if isinstance(value, np.ndarray):
        return [_to_python(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_python(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def prompt_messages(prompt: Any) -> list[dict]:
    """A row's prompt as chat messages (a plain string is one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(_to_python(m)) for m in prompt]


def prompt_to_text(prompt: Any, tokenizer: Any, tools: list[dict] | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The string the model sees: chat template (with the assistant turn opened) if any, else raw content.

    `tools` (the tool protocol's OpenAI function schemas) go to the chat template, which must have one.
    `chat_template_kwargs` (veRL's data.apply_chat_template_kwargs, e.g. Qwen3's `enable_thinking`) are
    the template's own variables, passed to every rendering.
    """
    messages = prompt_messages(prompt)
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tool protocol (actor_rollout_ref.rollout.multi_turn.enable) renders prompts with the "
                             "tool schemas through the tokenizer's chat template, and this tokenizer has none")
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return "".join(str(m["content"]) for m in messages)


def chat_template_kwargs(config: Any) -> dict[str, Any]:
    """data.apply_chat_template_kwargs (veRL's key) as a plain dict; anything but a mapping of names is
    refused naming the key."""
    node = config.data.get("apply_chat_template_kwargs") if "data" in config else None
    if node is None:
        return {}
    from omegaconf import DictConfig, OmegaConf

    value = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"data.apply_chat_template_kwargs must be a mapping of the chat template's variables "
                         f"(e.g. {{enable_thinking: false}}), got {value!r}")
    return value


def check_template_renders_tools(prompt: Any, tokenizer: Any, tools: list[dict]) -> None:
    """Refuse a chat template that ignores `tools=`: the model would never be shown the tools it may call."""
    if prompt_to_text(prompt, tokenizer, tools) == prompt_to_text(prompt, tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"the chat template of the tokenizer {name} ignores tools=: the tool protocol "
                         "(actor_rollout_ref.rollout.multi_turn.enable) needs a template that renders the tool "
                         "schemas (e.g. Qwen2.5's); use such a model or the tag protocol")


def truncate_ids(ids: Sequence[int], length: int, side: str) -> list[int]:
    """`ids` cut to `length` tokens (data.truncation): `left` keeps the end, `right` the start, `middle`
    the first length // 2 and the last length - length // 2."""
    ids = list(ids)
    if len(ids) <= length:
        return ids
    if side == "left":
        return ids[len(ids) - length:]
    if side == "right":
        return ids[:length]
    if side == "middle":
        head = length // 2
        return ids[:head] + ids[len(ids) - (length - head):]
    raise ValueError(f"data.truncation={side!r} is unknown; choose one of {list(TRUNCATIONS)}")


def left_pad(ids_list: Sequence[Sequence[int]], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (N, length), with the padding on the left."""
    input_ids = torch.full((len(ids_list), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids_list), length), dtype=torch.long)
    for row, ids in enumerate(ids_list):
        if ids:
            input_ids[row, length - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, length - len(ids):] = 1
    return input_ids, attention_mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    # Positions count real tokens only, so a left-padded prompt starts at 0 like in training.
    return torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


class RLHFDataset(Dataset):
    """Prompts from one or more parquet files, tokenized and left-padded to `max_prompt_length`.

    Each item: input_ids / attention_mask / position_ids (P,) tensors plus the
    non-tensor fields data_source, reward_model, extra_info, index (and raw_prompt, the chat
    messages, with `return_raw_chat`; and agent_name, with raw_prompt, when the data has veRL's
    `agent_name` column: the agent loop each row runs).

    A prompt longer than `max_prompt_length` tokens is dropped and counted with
    `filter_overlong_prompts`; otherwise `truncation` decides (veRL's data.truncation): `error`
    raises naming the file and row, `left` / `right` / `middle` cut the rendered prompt's token ids.
    `tools`: the tool protocol's function schemas, given to the chat template; `chat_template_kwargs`:
    data.apply_chat_template_kwargs, the template's own variables (Qwen3's `enable_thinking`).
    """

    def __init__(
        self,
        parquet_files: str | Sequence[str],
        tokenizer: Any,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        filter_overlong_prompts: bool = True,
        data_num: int | None = None,
        seed: int = 1,
        truncation: str = "error",
        tools: list[dict] | None = None,
        return_raw_chat: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        files = [parquet_files] if isinstance(parquet_files, str | Path) else list(parquet_files)
        if not files:
            raise ValueError("RLHFDataset: no parquet files given")
        if tokenizer.pad_token_id is None:
            raise ValueError("RLHFDataset: the tokenizer has no pad token (pad_token_id is None)")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"RLHFDataset: data.truncation={truncation!r} is unknown; choose one of {list(TRUNCATIONS)}")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = int(max_prompt_length)
        self.return_raw_chat = bool(return_raw_chat)
        self.agent_name: list[str] | None = None

        import pandas as pd  # here, not at import: preflight reads REQUIRED_COLUMNS without pandas

        frames = [self._read(str(f), prompt_key) for f in files]
        frame = pd.concat(frames, ignore_index=True)
        rows_read = len(frame)

        if data_num is not None and data_num < len(frame):
            # Sorted so a subsample keeps file order; the seed fixes which rows.
            keep = np.sort(np.random.default_rng(seed).permutation(len(frame))[:data_num])
            frame = frame.iloc[keep].reset_index(drop=True)
        rows_subsampled_away = rows_read - len(frame)

        if tools and len(frame):
            check_template_renders_tools(frame[prompt_key].iloc[0], tokenizer, tools)
        texts = [prompt_to_text(p, tokenizer, tools, chat_template_kwargs) for p in frame[prompt_key]]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        overlong = np.nonzero(lengths > self.max_prompt_length)[0]
        rows_dropped = rows_truncated = 0
        if len(overlong) and filter_overlong_prompts:
            rows_dropped = len(overlong)
            logger.warning("RLHFDataset: dropped %d prompts longer than %d tokens", rows_dropped, self.max_prompt_length)
        elif len(overlong) and truncation == "error":
            row = int(overlong[0])
            raise ValueError(
                f"RLHFDataset: prompt in {frame['__file__'].iloc[row]} row {int(frame['__row__'].iloc[row])} "
                f"has {lengths[row]} tokens > max_prompt_length={self.max_prompt_length} "
                "(set data.filter_overlong_prompts=True to drop such rows, or data.truncation=left|right|middle "
                "to cut them)"
            )
        elif len(overlong):
            rows_truncated = len(overlong)
            for row in overlong:
                encoded[row] = truncate_ids(encoded[row], self.max_prompt_length, truncation)
            lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
            logger.warning("RLHFDataset: cut %d prompts longer than %d tokens (data.truncation=%s)",
                           rows_truncated, self.max_prompt_length, truncation)
        keep_mask = lengths <= self.max_prompt_length
        kept_ids = [ids for ids, ok in zip(encoded, keep_mask, strict=True) if ok]
        frame = frame[keep_mask].reset_index(drop=True)

        self.input_ids, self.attention_mask = left_pad(kept_ids, self.max_prompt_length, tokenizer.pad_token_id)
        self.position_ids = position_ids_from_mask(self.attention_mask)
        self.data_source = [str(v) for v in frame[K.DATA_SOURCE]]
        self.reward_model = [_to_python(v) for v in frame[K.REWARD_MODEL]]
        if K.EXTRA_INFO in frame.columns:
            self.extra_info = [_to_python(v) if v is not None else {} for v in frame[K.EXTRA_INFO]]
        else:
            self.extra_info = [{} for _ in range(len(frame))]
        self.index = [
            info.get("index", int(row)) if isinstance(info, dict) else int(row)
            for info, row in zip(self.extra_info, frame["__row__"], strict=True)
        ]
        if K.AGENT_NAME in frame.columns:   # veRL's column: the agent loop of each row (an agent loop reads raw_prompt)
            self.agent_name = ["" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v)
                               for v in frame[K.AGENT_NAME]]
            self.return_raw_chat = True
        self.raw_prompt = [prompt_messages(p) for p in frame[prompt_key]] if self.return_raw_chat else []
        self.stats = DatasetStats(rows_read, rows_subsampled_away, int(rows_dropped), len(frame), int(rows_truncated))

    @staticmethod
    def _read(path: str, prompt_key: str) -> pd.DataFrame:
        if not Path(path).exists():
            raise FileNotFoundError(f"RLHFDataset: parquet file not found: {path}")
        import pandas as pd

        frame = pd.read_parquet(path)
        for column in (prompt_key, *REQUIRED_COLUMNS):
            if column not in frame.columns:
                raise KeyError(f"RLHFDataset: {path} has no column '{column}' (columns: {list(frame.columns)})")
        frame["__file__"] = path
        frame["__row__"] = np.arange(len(frame))
        return frame

    def __len__(self) -> int:
        return len(self.data_source)

    def __getitem__(self, item: int) -> dict[str, Any]:
        row = {
            K.INPUT_IDS: self.input_ids[item],
            K.ATTENTION_MASK: self.attention_mask[item],
            K.POSITION_IDS: self.position_ids[item],
            K.DATA_SOURCE: self.data_source[item],
            K.REWARD_MODEL: self.reward_model[item],
            K.EXTRA_INFO: self.extra_info[item],
            K.INDEX: self.index[item],
        }
        if self.return_raw_chat:
            row[RAW_PROMPT] = self.raw_prompt[item]
        if self.agent_name is not None:
            row[K.AGENT_NAME] = self.agent_name[item]
        return row


class EpochShuffleSampler(Sampler[int]):
    """A fresh permutation each epoch, seeded by (seed, epoch); resumable mid-epoch.

    Used instead of a shared torch.Generator because the position of such a generator
    is not restored exactly after a mid-epoch resume (later epochs would differ).
    """

    def __init__(self, n_rows: int, seed: int) -> None:
        self.n_rows = n_rows
        self.seed = int(seed)
        self.epoch = 0
        self.yielded = 0
        self._resume_at = 0

    def __len__(self) -> int:
        return self.n_rows

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.n_rows, generator=generator).tolist()
        self.yielded, self._resume_at = self._resume_at, 0
        for row in order[self.yielded:]:
            self.yielded += 1
            yield row
        self.epoch += 1
        self.yielded = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._resume_at = int(state["yielded"])


def build_dataloader(dataset: RLHFDataset, batch_size: int, train: bool, seed: int = 1, shuffle: bool = True):
    """StatefulDataLoader of DataProto batches: train = seeded shuffle + drop_last; val = in order, every row kept.

    Its state_dict() goes into each checkpoint, so a resumed run continues from the
    same position in the same epoch order.
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    from verl.protocol import collate_fn

    if train:
        sampler = EpochShuffleSampler(len(dataset), seed) if shuffle else None
        return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                                  collate_fn=collate_fn, num_workers=0)
    return StatefulDataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False,
                              collate_fn=collate_fn, num_workers=0)
