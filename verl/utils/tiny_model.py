"""Build small models and tokenizers locally, with nothing downloaded.

Tests and the offline demo need a real Hugging Face tokenizer and a real
model. Both are made here from scratch: a byte-level BPE tokenizer trained on
given text (with the Search-R1 action tags as single tokens), and a randomly
initialised causal LM built from a config: Qwen2 (`build_tiny_qwen2`), or any of
`ARCHITECTURES` (`build_tiny_model`): Qwen3 dense (q/k norms, a head_dim that is
not hidden / heads) and the mixture-of-experts families whose experts
transformers 5 fuses (Qwen3-MoE, Qwen2-MoE, Mixtral).

    tok = train_bpe_tokenizer(texts, vocab_size=600)
    model = build_tiny_qwen2(tok, hidden_size=64, num_layers=2)
    moe = build_tiny_model(tok, "qwen3_moe")            # 4 experts, 2 a token
    save_model_and_tokenizer(model, tok, "/tmp/tiny")   # AutoModel/AutoTokenizer load it
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Action tags are single, non-special tokens: decode keeps them, and a tag is
# never split across two sampled tokens.
ACTION_TAGS = (
    "<think>", "</think>", "<search>", "</search>",
    "<answer>", "</answer>", "<information>", "</information>",
)
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|im_end|>"
BOS_CHAT_TOKEN = "<|im_start|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_CHAT_TOKEN)

# ChatML, as Qwen2.5 uses: one user turn, then the assistant's turn is opened.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with tools, in Qwen2.5's layout (the tool protocol's tests and demo): the tool schemas in the
# system turn, consecutive `tool` messages in one user turn as <tool_response> blocks.
TOOL_CHAT_TEMPLATE = (
    "{% set offset = 0 %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '"
    " + '<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": '"
    " + '<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3's thinking switch on the tool template: with `enable_thinking=false` (a chat-template variable, veRL's
# data.apply_chat_template_kwargs) the generation prompt carries an empty reasoning block, as Qwen3's own
# template writes it, so the model answers without thinking; by default (or true) the model opens <think> itself.
QWEN3_CHAT_TEMPLATE = TOOL_CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")
assert QWEN3_CHAT_TEMPLATE != TOOL_CHAT_TEMPLATE

DEFAULT_TEXTS = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top searched "
    "results between <information> and </information>. You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: where was the author born? Doc 1(Title: Paris) Paris is the capital of France. "
    "The quick brown fox jumps over the lazy dog. 0123456789 ?!.,;:'\"()[]{}-_/\\@#$%^&*+=<>|~`",
)


def train_bpe_tokenizer(
    texts: Iterable[str] = DEFAULT_TEXTS,
    vocab_size: int = 600,
    with_chat_template: bool = True,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`; tags and specials are single tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
    )
    fast.add_tokens(list(ACTION_TAGS))
    if with_chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized for `tokenizer` (fp32)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


# The architectures `build_tiny_model` builds (Hugging Face model_type names).
ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_config(tokenizer: PreTrainedTokenizerFast, arch: str = "qwen2", hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, head_dim: int | None = None,
                num_experts: int = 4, experts_per_token: int = 2, moe_intermediate_size: int = 32,
                max_position_embeddings: int = 4096, tie_word_embeddings: bool = True) -> PretrainedConfig:
    """The config of a tiny `arch` model sized for `tokenizer`. Qwen3's head_dim defaults to twice
    hidden / heads (Qwen3 sets head_dim on its own: 128 at every size), so code that assumes
    head_dim = hidden / heads fails on it; MoE layers get `num_experts` experts, `experts_per_token` a token."""
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if arch == "qwen2":
        return Qwen2Config(intermediate_size=intermediate_size, **common)
    if arch == "qwen3":
        return Qwen3Config(intermediate_size=intermediate_size, head_dim=head_dim or 2 * hidden_size // num_heads,
                           **common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
                              num_experts=num_experts, num_experts_per_tok=experts_per_token, norm_topk_prob=True,
                              head_dim=head_dim or 2 * hidden_size // num_heads, **common)
    if arch == "qwen2_moe":   # with its shared expert (a dense MLP beside the routed ones)
        return Qwen2MoeConfig(intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
                              shared_expert_intermediate_size=moe_intermediate_size, num_experts=num_experts,
                              num_experts_per_tok=experts_per_token, **common)
    if arch == "mixtral":
        return MixtralConfig(intermediate_size=moe_intermediate_size, num_local_experts=num_experts,
                             num_experts_per_tok=experts_per_token, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {list(ARCHITECTURES)}")


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, arch: str = "qwen2", seed: int = 0,
                     **config_kwargs) -> PreTrainedModel:
    """A randomly initialised `arch` causal LM (fp32) from `tiny_config(tokenizer, arch, **config_kwargs)`."""
    config = tiny_config(tokenizer, arch, **config_kwargs)
    config.dtype = "float32"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_model_and_tokenizer(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> Path:
    """Save both in HF format (safetensors) so `from_pretrained(path)` loads them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_checkpoint(path: str | Path, texts: Iterable[str] = DEFAULT_TEXTS, vocab_size: int = 600,
                         arch: str = "qwen2", **model_kwargs) -> Path:
    """Tokenizer + tiny model written to `path`; the usual fixture for tests (`arch`: one of
    ARCHITECTURES; Qwen2 through `build_tiny_qwen2`, as before)."""
    tok = train_bpe_tokenizer(texts, vocab_size=vocab_size)
    model = build_tiny_qwen2(tok, **model_kwargs) if arch == "qwen2" else build_tiny_model(tok, arch, **model_kwargs)
    return save_model_and_tokenizer(model, tok, path)
