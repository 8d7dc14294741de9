"""The simulated workload: shared system prompts, multi-turn conversations, aborts.

Everything is drawn from one :class:`random.Random`, so a seed fixes the whole workload. A
conversation starts with one of a few system prompts followed by user text; when a turn
finishes, the next turn (with some probability) arrives a few steps later with the previous
prompt, the previous output and new user text as its prompt, so it shares a long prefix with
the turn before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Turn", "Workload", "WorkloadConfig"]

_VOCAB = 32000


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Shape of the workload.

    Attributes:
        num_requests: total requests, follow-up turns included.
        num_system_prompts: distinct shared system prompts.
        system_prompt_tokens: (min, max) length of a system prompt.
        user_tokens: (min, max) length of the new user text of a turn.
        output_tokens: (min, max) tokens generated per turn.
        followup_prob: probability that a finished turn gets a follow-up.
        think_steps: (min, max) steps between a turn's end and its follow-up's arrival.
        arrival_prob: per-step probability that a new conversation arrives (while the
            request budget lasts and fewer than ``max_open`` conversations are open).
        max_open: at most this many conversations in flight at once.
        abort_prob: per-request probability of being aborted at a random later step.
        skip_prefix_prob: probability that a request sets ``skip_reading_prefix_cache``.
        abort_during_load_prob: probability that a request whose load starts is aborted at
            the next step (while its load is usually still in flight).
        max_seq_tokens: a conversation ends when its next turn would not fit in this many
            tokens.
    """

    num_requests: int = 800
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (48, 160)
    user_tokens: tuple[int, int] = (8, 96)
    output_tokens: tuple[int, int] = (4, 48)
    followup_prob: float = 0.6
    think_steps: tuple[int, int] = (1, 12)
    arrival_prob: float = 0.5
    max_open: int = 24
    abort_prob: float = 0.08
    skip_prefix_prob: float = 0.02
    abort_during_load_prob: float = 0.05
    max_seq_tokens: int = 768


@dataclass(slots=True)
class Turn:
    """One request to submit: its prompt and how it should end."""

    req_id: str
    conv: int
    prompt: list[int]
    max_output: int
    abort_after: int | None = None
    """Abort this many steps after arrival (None: runs to completion)."""
    skip_prefix: bool = False
    output: list[int] = field(default_factory=list)


class Workload:
    """Produces turns step by step; told when turns end so follow-ups can be planned."""

    def __init__(self, cfg: WorkloadConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.system_prompts = [
            self._tokens(rng.randint(*cfg.system_prompt_tokens))
            for _ in range(cfg.num_system_prompts)
        ]
        self.issued = 0
        self.open_convs = 0
        self._next_conv = 0
        self._followups: list[tuple[int, Turn]] = []

    def _tokens(self, n: int) -> list[int]:
        r = self.rng.randrange
        return [r(_VOCAB) for _ in range(n)]

    def _finish_turn(self, turn: Turn) -> Turn:
        cfg, rng = self.cfg, self.rng
        if rng.random() < cfg.abort_prob:
            turn.abort_after = rng.randint(0, 20)
        turn.skip_prefix = rng.random() < cfg.skip_prefix_prob
        self.issued += 1
        return turn

    @property
    def exhausted(self) -> bool:
        """No more turns will ever be produced."""
        return self.issued >= self.cfg.num_requests and not self._followups

    def arrivals(self, step: int) -> list[Turn]:
        """The turns that arrive at ``step``."""
        out_turns = [t for due, t in self._followups if due <= step]
        self._followups = [(due, t) for due, t in self._followups if due > step]
        cfg, rng = self.cfg, self.rng
        if (
            self.issued < cfg.num_requests
            and self.open_convs < cfg.max_open
            and rng.random() < cfg.arrival_prob
        ):
            conv = self._next_conv
            self._next_conv += 1
            self.open_convs += 1
            prompt = list(rng.choice(self.system_prompts))
            prompt += self._tokens(rng.randint(*cfg.user_tokens))
            turn = Turn(f"c{conv}t0", conv, prompt, rng.randint(*cfg.output_tokens))
            out_turns.append(self._finish_turn(turn))
        return out_turns

    def turn_ended(self, turn: Turn, step: int, completed: bool) -> None:
        """``turn`` finished (``completed``) or was aborted at ``step``."""
        cfg, rng = self.cfg, self.rng
        prompt: list[int] = []
        if completed and self.issued < cfg.num_requests and rng.random() < cfg.followup_prob:
            prompt = turn.prompt + turn.output + self._tokens(rng.randint(*cfg.user_tokens))
        if prompt and len(prompt) + cfg.output_tokens[1] <= cfg.max_seq_tokens:
            idx = int(turn.req_id.rsplit("t", 1)[1]) + 1
            nxt = Turn(f"c{turn.conv}t{idx}", turn.conv, prompt, rng.randint(*cfg.output_tokens))
            self._followups.append((step + rng.randint(*cfg.think_steps), self._finish_turn(nxt)))
        else:
            self.open_convs -= 1

    def next_token(self) -> int:
        """A sampled output token."""
        return self.rng.randrange(_VOCAB)
