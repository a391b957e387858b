"""The request mixes of bench/engine.py: plain English from invented sentences, and requests cut
from it with drawn prompt and output lengths and Poisson arrivals.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

_SUBJECTS = ["The engineer", "A small team", "The old library", "Our new scheduler", "The river",
             "Every student", "The committee", "A curious child", "The city council",
             "The research group", "My neighbour", "The orchestra", "A quiet village",
             "The compiler", "The museum guide", "Each traveller", "The weather service",
             "The kitchen staff", "A stray cat", "The historian"]
_VERBS = ["described", "measured", "rebuilt", "questioned", "painted", "followed", "explained",
          "collected", "ignored", "celebrated", "reviewed", "planned", "tested", "remembered",
          "translated", "repaired", "organised", "watched", "compared", "discovered"]
_OBJECTS = ["the northern bridge", "a forgotten manuscript", "the morning schedule",
            "several broken clocks", "the long winter", "a set of careful notes",
            "the results of the experiment", "the harbour lights", "an unusual melody",
            "the budget for next year", "the mountain trail", "a cup of strong coffee",
            "the latest weather report", "the old train station", "a list of questions",
            "the garden behind the school", "three different maps", "the evening news"]
_TAILS = ["before the sun went down", "with great patience", "for the third time this week",
          "while everyone else was asleep", "in front of a small crowd", "without saying a word",
          "after a long discussion", "because nobody else would", "during the storm",
          "as the bells rang in the distance", "with a little help from friends",
          "to the surprise of the visitors", "in the corner of the room", "at dawn"]
_JOINS = ["Later,", "Meanwhile,", "However,", "As a result,", "In the end,", "Afterwards,",
          "At the same time,", "Surprisingly,"]


def make_text(rng: random.Random, num_sentences: int) -> str:
    """Plain English made of random, grammatical sentences (deterministic from `rng`)."""
    out = []
    for i in range(num_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.7:
            s += " " + rng.choice(_TAILS)
        if i and rng.random() < 0.25:
            s = rng.choice(_JOINS) + " " + s[0].lower() + s[1:]
        out.append(s + ".")
        if rng.random() < 0.15:
            out.append("\n\n")
    return " ".join(out)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the scenario starts


def make_requests(tokenizer, rng: random.Random, n: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], window_s: float, tag: str) -> list[Req]:
    """n requests: prompt token ids cut from real text at a random offset, drawn lengths,
    Poisson arrivals (exponential gaps with mean window_s / n; the first at 0)."""
    corpus = tokenizer.encode(make_text(rng, 1500))
    reqs, t = [], 0.0
    for i in range(n):
        plen = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - plen)
        olen = rng.randint(*output_range)
        if i:
            t += rng.expovariate(n / window_s) if window_s > 0 else 0.0
        reqs.append(Req(f"{tag}-{i}", corpus[start:start + plen], olen, t))
    return reqs

