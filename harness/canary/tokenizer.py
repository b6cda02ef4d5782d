"""Character-level tokenizer with a chat template, shared by the canaries and the tiny test models.

Built with the `tokenizers` library and saved as `tokenizer.json`, so `AutoTokenizer.from_pretrained`
loads it offline. One token per character keeps digits, names and codes unambiguous for small models.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|pad|>", "<|unk|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]  # newline + printable ASCII
VOCAB_SIZE = 128  # padded past len(SPECIAL_TOKENS) + len(CHARACTERS) = 102, a friendly matmul size

# One message per block: role marker, content, end marker. The assistant's reply ends with <|end|>,
# which is also EOS, so greedy decoding stops where a turn ends.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer():
    """Return a `PreTrainedTokenizerFast` over single characters with the chat template set."""
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|end|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(directory: str | Path) -> None:
    build_tokenizer().save_pretrained(str(directory))
