"""The prompts of bench/prefix_cache.py: an invented report with short questions on it in a chat
template, and the user messages of the multi-turn conversations.
"""
from __future__ import annotations

import random

_PEOPLE = ["the harbour master", "the night baker", "a retired surveyor", "the choir director",
           "the young archivist", "a travelling tinker", "the lighthouse keeper",
           "the village doctor", "a patient gardener", "the ferry captain", "the clockmaker",
           "a shy violinist", "the mayor's secretary", "the beekeeper", "a visiting botanist",
           "the schoolteacher", "the stationmaster", "a wandering painter", "the miller",
           "the postwoman"]
_ACTIONS = ["repaired", "catalogued", "measured", "painted", "questioned", "rebuilt",
            "translated", "inspected", "mapped", "photographed", "restored", "counted",
            "described", "guarded", "moved", "sketched", "weighed", "tested", "polished",
            "recorded"]
_THINGS = ["the copper weathervane", "forty crates of apples", "the eastern sea wall",
           "an unsigned letter", "the broken organ pipes", "the tide tables",
           "a map of the marshes", "the bell tower stairs", "the winter grain stores",
           "a box of glass lenses", "the old signal lamps", "the orchard fences",
           "the ledger of ship arrivals", "a cracked stone bridge", "the festival banners",
           "the school's star charts", "a crate of tin soldiers", "the mill's water wheel"]
_WHEN = ["before dawn on Tuesday", "during the long storm", "after the spring fair",
         "in the second week of March", "while the river was frozen", "on a foggy evening",
         "just before the harvest", "the day the ferry was late", "at the end of autumn",
         "under a full moon", "in the middle of the night", "after the council meeting"]
_WHY = ["because the council asked for it", "to settle an old argument", "for the museum",
        "as a favour to a neighbour", "to prepare for the visitors", "out of simple curiosity",
        "because nobody else could", "to win a small wager", "for the town records",
        "so the children could learn"]
_LINKS = ["Afterwards,", "Meanwhile,", "Later that week,", "Surprisingly,", "As a result,",
          "In the end,", "Not long after,", "At the same time,"]


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_PEOPLE)} {rng.choice(_ACTIONS)} {rng.choice(_THINGS)} " \
        f"{rng.choice(_WHEN)} {rng.choice(_WHY)}."
    s = f"{rng.choice(_LINKS)} {s}" if rng.random() < 0.3 else s[0].upper() + s[1:]
    return s


def make_document_ids(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Exactly `num_tokens` token ids of an invented report (paragraphs of sentences)."""
    rng = random.Random(seed)
    paragraphs, total = [], 0
    while total < num_tokens + 64:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(3, 6)))
        paragraphs.append(para)
        total += len(tokenizer.encode(para)) + 1
    text = "Report on the town of Westmere.\n\n" + "\n\n".join(paragraphs)
    ids = tokenizer.encode(text)
    assert len(ids) >= num_tokens, (len(ids), num_tokens)
    return ids[:num_tokens]


def make_questions(n: int, seed: int) -> list[str]:
    """`n` different short questions (~10-20 tokens each)."""
    rng = random.Random(seed)
    stems = ["What did {p} do {w}?", "Why did {p} work on {t}?", "When did {p} visit {t}?",
             "Who helped {p} with {t}?", "How long did {p} spend on {t}?",
             "What happened to {t} {w}?", "Summarise what the report says about {p}.",
             "Which event involved {t} and {p}?"]
    seen, out = set(), []
    while len(out) < n:
        q = rng.choice(stems).format(p=rng.choice(_PEOPLE), t=rng.choice(_THINGS),
                                     w=rng.choice(_WHEN))
        q = q[0].upper() + q[1:]
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


def template_parts(tokenizer) -> tuple[str, str]:
    """Chat-template text before and after a single user message's content."""
    marker = "\u2063DOC\u2063"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    except Exception:  # noqa: BLE001 - no chat template: plain text
        return "", "\nAnswer:"
    head, tail = text.split(marker)
    return head, tail


def shared_report_prompts(tokenizer, doc_ids: list[int], questions: list[str]) -> list[list[int]]:
    """Template header + document + "\\n\\nQuestion: q" + template tail, tokenized in pieces so
    every prompt starts with exactly the same ids."""
    head, tail = template_parts(tokenizer)
    head_ids = tokenizer.encode(head)
    return [head_ids + doc_ids + tokenizer.encode(f"\n\nQuestion: {q}{tail}") for q in questions]


_TOPICS = ["the harbour", "the bell tower", "the orchard", "the old mill", "the marshes",
           "the ferry", "the spring fair", "the lighthouse", "the town museum", "the bakery",
           "the star charts", "the sea wall"]
_FOLLOWUPS = ["Can you say more about that?", "Who else was involved?", "Why does that matter?",
              "What happened next?", "Give me one more detail.", "Is that unusual?",
              "How would you explain it to a child?", "What should I ask next?",
              "Summarise that in one line.", "What is the most surprising part?"]


def conversation_user_message(conv: int, turn: int, seed: int) -> str:
    rng = random.Random(seed * 1000003 + conv * 101 + turn)
    if turn == 0:
        return f"Tell me a short story about {_TOPICS[conv % len(_TOPICS)]} and " \
               f"{rng.choice(_PEOPLE)}."
    return rng.choice(_FOLLOWUPS)

