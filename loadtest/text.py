"""Deterministic filler text of about N tokens: common English words, one token each in most
byte-level BPE vocabularies (a leading space, lower case). Exact token counts depend on the
server's tokenizer, which the server reports back in usage.prompt_tokens."""
from __future__ import annotations

import random

WORDS = ("the of and to in is was that for on with as by at from his her they this which "
         "be or are an had not but what all were when we there can one their so if will "
         "up out them about then she many some would other into has more two time like "
         "could no see way people my than first water been call who its now find long down "
         "day did get come made may part over new sound take only little work know place "
         "year live me back give most very after thing our just name good sentence man "
         "think say great where help through much before line right too mean old any same "
         "tell boy follow came want show also around form three small set put end does "
         "another well large must big even such because turn here why ask went men read "
         "need land different home us move try kind hand picture again change off play "
         "spell air away animal house point page letter mother answer found study still "
         "learn should world high every near add food between own below country plant last "
         "school father keep tree never start city earth eye light thought head under story "
         "saw left few while along might close something seem next hard open example begin "
         "life always those both paper together got group often run important until children "
         "side feet car mile night walk white sea began grow took river four carry state once "
         "book hear stop without second later miss idea enough eat face watch far really "
         "almost let above girl sometimes mountain cut young talk soon list song being leave "
         "family market report revenue quarter growth cost price customer model service").split()


def words(rng: random.Random, n: int) -> str:
    """n words drawn from WORDS, space separated, with a leading space."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))
