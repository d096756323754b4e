"""Real prompts for the benchmarks on the real model, built offline from text that ships here.

These machines have no network, so the passages are plain-text files in ``bench/data/`` (written
for kvstack: technical explanations of paging, caches, compilers, networking, databases, LLM
serving, garbage collection and the history of computing, ~900-1,200 words each). A prompt is one
passage with a task instruction (summarise it, or answer a question about it), rendered with the
tokenizer's chat template as one user turn with the generation prompt appended, as a chat user
would send it.

``build_prompts(tokenizer)`` gives the eight full prompts (each 1-4k tokens with the SmolLM2
tokenizer; checked, so an edited passage cannot silently fall outside the range);
``build_prompts(tokenizer, quick=True)`` gives two short ones (the first paragraph of two
passages) for tests of the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstack.errors import InvalidArgumentError

DATA_DIR = Path(__file__).parent / "data"

FULL_TOKEN_RANGE = (1024, 4096)  # what the vToken workload asks of every full prompt


@dataclass(frozen=True)
class PromptSpec:
    """A passage (``bench/data/<passage>.txt``) and what the user asks about it."""

    name: str
    passage: str
    instruction: str
    instruction_first: bool  # summaries lead with the task; questions follow the text


PROMPT_SPECS: tuple[PromptSpec, ...] = (
    PromptSpec(
        "paging-summary",
        "virtual_memory",
        "Summarise the following article in five bullet points for an engineer who has never "
        "studied operating systems.",
        True,
    ),
    PromptSpec(
        "caches-question",
        "cpu_caches",
        "Using only the article above, explain what false sharing is, why it slows programs "
        "down, and how to avoid it.",
        False,
    ),
    PromptSpec(
        "compilers-summary",
        "compilers",
        "Read the following text and write a one-paragraph summary of each stage of the "
        "compiler it describes.",
        True,
    ),
    PromptSpec(
        "tcp-question",
        "tcp_congestion",
        "According to the text above, what is the difference between how TCP reacts to a "
        "retransmission timeout and to three duplicate acknowledgements, and why?",
        False,
    ),
    PromptSpec(
        "history-summary",
        "computing_history",
        "Summarise this history of computing as a timeline with one line per decade.",
        True,
    ),
    PromptSpec(
        "database-question",
        "database_storage",
        "Based on the passage above, explain how a database recovers after a crash and why "
        "committing a transaction does not require writing its data pages.",
        False,
    ),
    PromptSpec(
        "serving-summary",
        "llm_serving",
        "Summarise the following article in three short paragraphs and list the open "
        "problems it mentions.",
        True,
    ),
    PromptSpec(
        "gc-question",
        "garbage_collection",
        "From the article above: why do generational collectors need a write barrier, and "
        "what does it record?",
        False,
    ),
)

QUICK_SPECS: tuple[PromptSpec, ...] = (PROMPT_SPECS[0], PROMPT_SPECS[6])


@dataclass(frozen=True)
class Prompt:
    """One chat-templated prompt, tokenized: ``input_ids`` [1, T], no padding."""

    name: str
    passage: str
    instruction: str
    text: str  # the rendered chat text
    input_ids: torch.Tensor  # [1, T]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def read_passage(name: str, *, first_paragraph_only: bool = False) -> str:
    """The passage ``bench/data/<name>.txt`` (title line and body), stripped."""
    path = DATA_DIR / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in DATA_DIR.glob("*.txt"))
        raise InvalidArgumentError(f"passage {name!r} not found at {path}; known: {known}")
    text = path.read_text(encoding="utf-8").strip()
    if first_paragraph_only:
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        text = "\n\n".join(paragraphs[:2])  # the title and the first paragraph
    return text


def _render(tokenizer: Any, spec: PromptSpec, passage: str) -> str:
    content = (
        f"{spec.instruction}\n\n{passage}"
        if spec.instruction_first
        else f"{passage}\n\n{spec.instruction}"
    )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def build_prompts(tokenizer: Any, *, quick: bool = False) -> list[Prompt]:
    """The benchmark prompts, tokenized with ``tokenizer`` (the model's own).

    Full: the eight ``PROMPT_SPECS``, each checked to be within ``FULL_TOKEN_RANGE`` tokens.
    Quick: two prompts over the first paragraph of two passages (~100-150 tokens).
    """
    prompts = []
    for spec in QUICK_SPECS if quick else PROMPT_SPECS:
        text = _render(tokenizer, spec, read_passage(spec.passage, first_paragraph_only=quick))
        # The chat template already holds the special tokens; do not add a BOS again.
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        prompt = Prompt(spec.name, spec.passage, spec.instruction, text, ids)
        low, high = FULL_TOKEN_RANGE
        if not quick and not low <= prompt.num_tokens <= high:
            raise InvalidArgumentError(
                f"prompt {spec.name!r} has {prompt.num_tokens} tokens; expected {low}-{high} "
                f"(edit bench/data/{spec.passage}.txt)"
            )
        prompts.append(prompt)
    return prompts
