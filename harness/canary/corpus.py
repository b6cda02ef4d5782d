"""Seeded synthetic dialogues for the canary models, one generator per scenario kind.

Every dialogue is a `Dialogue`: the chat the harness will replay (system prompt, user turns, what each
turn must satisfy) plus the gold assistant replies the canaries are trained on. The same object gives
the training tokens (`encode_dialogue`) and the scenario entry in the CONTRACTS.md YAML format
(`to_scenario`), so training text and replayed text cannot drift apart:
- the chat is rendered exactly as `harness/canary/tokenizer.py`'s chat template renders it;
- a long-context user turn is `insert_needle(filler_text(chars, seed), needle, depth) + "\\n" + question`,
  as `harness.scenarios.load` compiles it.

Held out vs train (`split`): arithmetic problems are split by a hash of the operands (one in ten is
held out), filler seeds come from disjoint ranges, and the random stream is seeded per split.

Task ranges (what the canaries are trained and measured on):
- arithmetic: `What is a * b + c * d?` with every operand in 0..9 (answers 0..162), reply = the number;
- recall: a name, number (1-4 digits) or colour planted in turn 1, asked 2-5 turns later;
- long context: a needle (code, magic word or room number) at any depth of 100..2000 filler characters
  (the stress canary: up to 16000);
- rule chats: "End every answer with the word X" and/or "Answer in one sentence", 2-4 user turns.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

from harness.canary.tokenizer import CHARACTERS, SPECIAL_TOKENS
from harness.scenarios.filler import filler_text, insert_needle

KINDS = ("arithmetic", "recall", "long_context", "chat")  # scenario kinds; training also uses "echo"
SPLITS = ("train", "heldout")
OPERAND_RANGE = (0, 9)  # inclusive, every operand of a * b + c * d
MAX_NEEDLE_CHARS = 2000  # longest filler the canaries are trained on (chars == tokens)
MIN_NEEDLE_CHARS = 100  # shortest training filler unless a run asks for longer ones (train.py --needle-min-chars)
FILLER_SEED_BASE = {"train": 0, "heldout": 1_000_000}  # disjoint filler seed ranges
FILLER_SEED_SPAN = 1_000_000

_TOKEN_ID = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
END_ID = _TOKEN_ID["<|end|>"]

# Small-talk topics: the user asks about one, the assistant answers with its two fixed sentences.
TOPICS = {
    "rivers": ("Rivers carry water from the hills down to the sea.", "Many towns were built beside them."),
    "mountains": ("Mountains rise high above the valleys.", "Their tops are often covered in snow."),
    "bread": ("Bread is baked from flour, water and yeast.", "It tastes best while still warm."),
    "the sea": ("The sea covers most of the earth.", "Its waves never stop moving."),
    "birds": ("Birds fly south when the weather turns cold.", "Many of them sing at dawn."),
    "trees": ("Trees give shade in summer.", "Some of them live for hundreds of years."),
    "music": ("Music is made of rhythm and melody.", "People everywhere enjoy it."),
    "books": ("Books keep stories and ideas for later readers.", "A library holds many of them."),
    "the moon": ("The moon circles the earth once a month.", "It shines with light from the sun."),
    "rain": ("Rain falls when clouds grow heavy with water.", "Plants need it to grow."),
    "coffee": ("Coffee is brewed from roasted beans.", "Many people drink it in the morning."),
    "cats": ("Cats are quiet and curious animals.", "They sleep for most of the day."),
    "dogs": ("Dogs are loyal and playful animals.", "They love long walks."),
    "gardens": ("Gardens are full of flowers and vegetables.", "They need care every week."),
    "trains": ("Trains carry people between cities.", "They run on steel rails."),
    "winter": ("Winter is the coldest season of the year.", "The days are short and dark."),
    "summer": ("Summer brings long and warm days.", "Many people travel then."),
    "bridges": ("Bridges let roads cross rivers and valleys.", "Some are made of stone."),
    "markets": ("Markets sell fresh food every morning.", "Farmers bring their goods there."),
    "boats": ("Boats float on rivers, lakes and seas.", "Some are moved by sails."),
    "apples": ("Apples grow on trees in the autumn.", "They can be sweet or sour."),
    "stars": ("Stars are distant suns that shine at night.", "Sailors once used them to find their way."),
    "cheese": ("Cheese is made from milk.", "Some kinds are aged for years."),
    "clocks": ("Clocks tell us the time of day.", "Old ones have a swinging pendulum."),
}
TOPIC_QUESTIONS = ("Tell me about {}.", "What do you know about {}?", "Can you describe {}?", "Say something about {}.")
PERSONAS = (
    "helpful assistant", "friendly tour guide", "sales assistant for a software product", "librarian",
    "patient teacher", "cheerful shop keeper", "ship captain", "museum guide", "travel agent", "baker",
)
RULE_WORDS = (
    "Thanks", "Cheers", "Indeed", "Okay", "Friend", "Amen", "Always", "Onward", "Truly", "Done",
    "Bravo", "Peace", "Enjoy", "Farewell", "Salut", "Certainly", "Hooray", "Splendid", "Goodbye", "Bingo",
)
NAMES = (
    "Alexander", "Maria", "John", "Sofia", "Liam", "Emma", "Noah", "Olivia", "Lucas", "Mia", "Ethan", "Ava",
    "Oscar", "Ella", "Hugo", "Chloe", "Felix", "Nora", "Leo", "Ruth", "Isaac", "Clara", "Victor", "Ingrid",
    "Pablo", "Yuki", "Omar", "Fatima", "Ivan", "Greta", "Kofi", "Amara", "Rahul", "Priya", "Mateo", "Lena",
)
COLOURS = (
    "red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "black", "white", "grey", "teal",
    "violet", "indigo", "maroon", "gold", "silver", "crimson", "turquoise", "beige", "olive", "navy",
)
SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "zu", "tor", "el", "an", "bri", "do", "fen", "gil", "ho", "ix", "jun")


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    reply: str  # the gold assistant reply (training target; generated by the model when replayed)
    expect: str | None = None  # answer the reply must contain, for the scored turn


@dataclass(frozen=True, slots=True)
class Dialogue:
    kind: str
    turns: tuple[Turn, ...]
    system: str | None = None
    rules: dict = field(default_factory=dict)  # chat: {"ends_with": word, "max_sentences": 1}
    facts: dict = field(default_factory=dict)  # recall: {"name": "Maria"}
    spec: dict = field(default_factory=dict)  # kind-specific scenario fields (prompt, needle, filler, ...)

    def messages(self, upto: int | None = None) -> list[dict[str, str]]:
        """System + turns[:upto] with gold replies, then turn `upto`'s user message (if `upto` given)."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.turns[: len(self.turns) if upto is None else upto]:
            messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.reply}]
        if upto is not None:
            messages.append({"role": "user", "content": self.turns[upto].user})
        return messages


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The canary chat template (`tokenizer.CHAT_TEMPLATE`) in plain Python, for fast corpus rendering."""
    text = "".join(f"<|{m['role']}|>{m['content']}<|end|>\n" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def encode_text(text: str) -> list[int]:
    """Character ids, one per character; content never holds special-token strings."""
    assert "<|" not in text, f"special-token marker inside content: {text[:80]!r}"
    return [_TOKEN_ID[c] for c in text]


_SPECIAL = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_ID_TOKEN = {i: token for token, i in _TOKEN_ID.items()}


def encode_text_with_specials(text: str) -> list[int]:
    """Ids of rendered chat text, special-token strings included (what the tokenizer gives)."""
    ids: list[int] = []
    for piece in _SPECIAL.split(text):  # the split keeps the special tokens as their own pieces
        ids += [_TOKEN_ID[piece]] if piece in SPECIAL_TOKENS else [_TOKEN_ID[c] for c in piece]
    return ids


def decode_reply(ids: list[int]) -> str:
    """Text of generated ids up to (not including) the first <|end|>, special tokens dropped."""
    text = []
    for i in ids:
        if i == END_ID:
            break
        token = _ID_TOKEN.get(i, "")
        text.append("" if token in SPECIAL_TOKENS else token)
    return "".join(text)


def encode_dialogue(dialogue: Dialogue) -> tuple[list[int], list[bool]]:
    """Token ids of the whole rendered chat and a mask that is True on assistant replies and their <|end|>."""
    ids: list[int] = []
    mask: list[bool] = []
    for message in dialogue.messages():
        content = encode_text(message["content"])
        trained = message["role"] == "assistant"
        ids += [_TOKEN_ID[f"<|{message['role']}|>"], *content, END_ID, _TOKEN_ID["\n"]]
        mask += [False] + [trained] * (len(content) + 1) + [False]
    return ids, mask


# --- generators ----------------------------------------------------------------------------------


def _fraction(text: str) -> float:
    """A stable pseudo-random number in [0, 1) from `text` (not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def arithmetic_split(a: int, b: int, c: int, d: int) -> str:
    return "heldout" if _fraction(f"arith:{a},{b},{c},{d}") < 0.1 else "train"


def arithmetic(rng: random.Random, split: str) -> Dialogue:
    low, high = OPERAND_RANGE
    while True:
        a, b, c, d = (rng.randint(low, high) for _ in range(4))
        if arithmetic_split(a, b, c, d) == split:
            break
    prompt = f"What is {a} * {b} + {c} * {d}?"
    answer = str(a * b + c * d)
    system = rng.choice((None, "Answer with the number only.", "You are a calculator. Answer with the number only."))
    return Dialogue("arithmetic", (Turn(prompt, answer, expect=answer),), system, spec={"prompt": prompt, "answer": answer})


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _small_talk(rng: random.Random, one_sentence: bool = False, end_word: str | None = None) -> Turn:
    topic = rng.choice(list(TOPICS))
    first, second = TOPICS[topic]
    reply = first if one_sentence else f"{first} {second}"
    if end_word:
        reply = f"{reply[:-1]}, {end_word}."
    return Turn(rng.choice(TOPIC_QUESTIONS).format(topic), reply)


def _fact(rng: random.Random) -> tuple[str, str, str, str, str, str]:
    """(fact key, value, planting user text, its reply, question, answer reply)."""
    key = rng.choice(("name", "number", "colour"))
    if key == "name":
        value = rng.choice(NAMES) if rng.random() < 0.5 else _pseudo_word(rng)
        plant = rng.choice(("Hello, my name is {}.", "Hi, my name is {}.", "Hello! My name is {}, nice to meet you."))
        return key, value, plant.format(value), f"Nice to meet you, {value}.", "What is my name?", f"Your name is {value}."
    if key == "number":
        value = str(rng.randint(0, 10 ** rng.randint(1, 4) - 1))
        plant = rng.choice(("My favourite number is {}.", "Please remember that my favourite number is {}."))
        return (key, value, plant.format(value), f"I will remember that your favourite number is {value}.",
                "What is my favourite number?", f"Your favourite number is {value}.")
    value = rng.choice(COLOURS)
    plant = rng.choice(("My favourite colour is {}.", "I really like {}, it is my favourite colour."))
    return (key, value, plant.format(value), f"I will remember that your favourite colour is {value}.",
            "What is my favourite colour?", f"Your favourite colour is {value}.")


def recall(rng: random.Random, split: str) -> Dialogue:
    key, value, plant, plant_reply, question, answer_reply = _fact(rng)
    filler_turns = [_small_talk(rng) for _ in range(rng.randint(1, 4))]  # asked 2-5 turns after the plant
    turns = (Turn(plant, plant_reply), *filler_turns, Turn(question, answer_reply, expect=value))
    system = rng.choice((None, "You are a helpful assistant.", "You are a friendly assistant with a good memory."))
    return Dialogue("recall", turns, system, facts={key: value})


def _needle(rng: random.Random) -> tuple[str, str, str, str]:
    """(needle sentence, question, answer, reply)."""
    form = rng.choice(("code", "word", "room"))
    if form == "code":
        answer = f"{rng.randint(0, 9999):04d}"
        return f"The secret code is {answer}.", "What is the secret code?", answer, f"The secret code is {answer}."
    if form == "word":
        answer = _pseudo_word(rng)
        return f"The magic word is {answer}.", "What is the magic word?", answer, f"The magic word is {answer}."
    answer = str(rng.randint(100, 999))
    return (f"The meeting is in room {answer}.", "Which room is the meeting in?", answer,
            f"The meeting is in room {answer}.")


def long_context(rng: random.Random, split: str, chars: int | None = None, depth: float | None = None,
                 max_chars: int = MAX_NEEDLE_CHARS, min_chars: int = MIN_NEEDLE_CHARS) -> Dialogue:
    needle, question, answer, reply = _needle(rng)
    chars = chars if chars is not None else rng.randint(min(min_chars, max_chars), max_chars)
    depth = depth if depth is not None else round(rng.random(), 2)
    seed = FILLER_SEED_BASE[split] + rng.randrange(FILLER_SEED_SPAN)
    user = insert_needle(filler_text(chars, seed), needle, depth) + "\n" + question
    spec = {"needle": needle, "question": question, "answer": answer,
            "filler": {"chars": chars, "depth": depth, "seed": seed}}
    return Dialogue("long_context", (Turn(user, reply, expect=answer),), spec=spec)


def rule_chat(rng: random.Random, split: str, with_rule: bool = True) -> Dialogue:
    """A persona system prompt with rules kept on every reply (no rule at all when `with_rule` is False)."""
    persona = f"You are a {rng.choice(PERSONAS)}."
    form = rng.choice(("end", "one", "both")) if with_rule else "none"
    word = (rng.choice(RULE_WORDS) if rng.random() < 0.5 else _pseudo_word(rng)) if form in ("end", "both") else None
    rule_text = {
        "end": f" End every answer with the word {word}.",
        "one": " Answer in one sentence.",
        "both": f" Answer in one sentence and end every answer with the word {word}.",
        "none": "",
    }[form]
    rules = {"end": {"ends_with": word}, "one": {"max_sentences": 1},
             "both": {"ends_with": word, "max_sentences": 1}, "none": {}}[form]
    one_sentence = form in ("one", "both")
    turns = tuple(_small_talk(rng, one_sentence, word) for _ in range(rng.randint(2, 4)))
    return Dialogue("chat", turns, persona + rule_text, rules=rules)


def echo(rng: random.Random, split: str) -> Dialogue:
    """Training-only drill: repeat a random string. Every reply token is a copy, so the attention
    heads that recall, needles and rule words need form in far fewer steps."""
    words = [_pseudo_word(rng) if rng.random() < 0.6 else str(rng.randint(0, 99999)) for _ in range(rng.randint(1, 6))]
    text = " ".join(words)
    prompt = rng.choice(("Repeat after me: {}", "Please repeat this: {}", "Say exactly this: {}"))
    return Dialogue("echo", (Turn(prompt.format(text), text, expect=text),))


def sample(rng: random.Random, kind: str, split: str, max_chars: int = MAX_NEEDLE_CHARS,
           min_chars: int = MIN_NEEDLE_CHARS) -> Dialogue:
    if kind == "echo":
        return echo(rng, split)
    if kind == "arithmetic":
        return arithmetic(rng, split)
    if kind == "recall":
        return recall(rng, split)
    if kind == "long_context":
        return long_context(rng, split, max_chars=max_chars, min_chars=min_chars)
    if kind == "chat":
        return rule_chat(rng, split, with_rule=split == "heldout" or rng.random() < 0.8)
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def split_rng(seed: int, split: str) -> random.Random:
    """The random stream for one split; train and held-out streams never share a seed."""
    assert split in SPLITS, split
    return random.Random(f"canary-corpus:{split}:{seed}")


# --- scenario files (CONTRACTS.md format) ----------------------------------------------------------

MAX_NEW_TOKENS = {"arithmetic": 8, "recall": 128, "long_context": 40, "chat": 128}  # longest gold reply: 104


def to_scenario(dialogue: Dialogue, scenario_id: str) -> dict:
    """The dialogue as one scenario entry; replies are left for the model to generate."""
    entry: dict = {"id": scenario_id, "kind": dialogue.kind, "tags": ["canary", dialogue.kind]}
    if dialogue.system:
        entry["system"] = dialogue.system
    entry["generation"] = {"max_new_tokens": MAX_NEW_TOKENS[dialogue.kind], "greedy": True}
    if dialogue.kind == "arithmetic":
        entry.update(prompt=dialogue.spec["prompt"], answer=dialogue.spec["answer"])
    elif dialogue.kind == "long_context":
        entry.update(dialogue.spec)
    elif dialogue.kind == "recall":
        (key,) = dialogue.facts
        entry["facts"] = dict(dialogue.facts)
        entry["turns"] = [{"user": t.user} for t in dialogue.turns[:-1]]
        entry["turns"].append({"user": dialogue.turns[-1].user, "expect": {"fact": key}})
    else:
        entry["rules"] = dict(dialogue.rules)
        entry["turns"] = [{"user": t.user} for t in dialogue.turns]
    return entry


def heldout_set(kind: str, count: int, seed: int, **overrides) -> list[Dialogue]:
    """`count` held-out dialogues of one kind; `overrides` (chars, depth) pin long-context fillers."""
    rng = split_rng(seed, "heldout")
    if kind == "long_context":
        return [long_context(rng, "heldout", **overrides) for _ in range(count)]
    return [sample(rng, kind, "heldout") for _ in range(count)]
