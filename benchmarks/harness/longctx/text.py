"""Deterministic text pieces for the synthetic long-context tasks.

Everything here is ASCII, so under the project's byte-level tokenizer one
character is exactly one token and a text's length in characters is its length
in tokens.

The vocabularies are chosen so that the string-search solvers in the tests (and
a model) can only find a task's answer where the generator put it:

* filler prose uses lowercase English words (capitalised at sentence starts),
  no digits and no hyphens;
* needle keys are ``adjective-noun`` pairs joined by a hyphen, from lists that
  share no word with the filler vocabulary;
* needle values are digit strings, which filler never contains;
* variable names are five upper-case letters, which capitalised filler words
  ("The") never match as ``VAR NAME``.
"""

from __future__ import annotations

import random

FILLER_WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as by at from this are be have it
    not but or an which one all were they their has had there been more when who
    will would can no if so what about out up into than its only other some time
    very after most also made over such many then these two first where well
    between through could both under each those because long same while before
    used during world people year new work water life part place small city
    house river road town country land field hill garden village market bridge
    school church street valley forest lake island coast harbor mountain station
    library museum theater hospital factory farm mill tower castle palace temple
    train ship boat wagon engine machine paper letter book story song picture
    window door wall roof floor table chair lamp clock bell coat shoe hat basket
    morning evening night winter summer spring autumn season weather rain snow
    wind cloud storm sun moon star light shadow color sound voice word name
    teacher farmer doctor sailor soldier writer painter builder merchant child
    family friend neighbor stranger visitor crowd group member leader worker
    walked carried opened closed found kept brought built moved turned watched
    wrote read sang painted planted gathered crossed followed reached returned
    quiet busy early late old young bright dark warm cold wide narrow heavy
    slow quick simple careful strong gentle common rare plain famous local
    distant nearby ancient modern little large great good best usual
    always often sometimes never again together almost already still perhaps
    slowly quickly carefully suddenly finally nearly mostly rather quite
    """.split()
)
"""Lowercase English words of ordinary prose (no digits, no hyphens)."""

KEY_ADJECTIVES: tuple[str, ...] = tuple(
    """
    amber azure crimson golden ivory jade scarlet silver violet copper cobalt
    emerald indigo maroon ochre olive ruby sable teal umber coral cyan magenta
    saffron tawny lilac russet cerulean vermilion fuchsia hazel khaki mauve
    """.split()
)
"""First half of a needle key (not in :data:`FILLER_WORDS`)."""

KEY_NOUNS: tuple[str, ...] = tuple(
    """
    falcon otter badger heron lynx marten osprey panther raven salmon sparrow
    tiger walrus weasel zebra bison cobra condor coyote dingo eagle ferret gecko
    hornet jackal koala lemur mantis newt ocelot pelican puffin quail
    """.split()
)
"""Second half of a needle key (not in :data:`FILLER_WORDS`)."""


def sentence(rng: random.Random, min_words: int = 6, max_words: int = 14) -> str:
    """One capitalised filler sentence ending in a period."""
    n = rng.randint(min_words, max_words)
    words = [rng.choice(FILLER_WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


def filler_sentences(rng: random.Random, n_chars: int) -> list[str]:
    """Filler sentences whose ``" ".join`` is at most ``n_chars`` characters.

    The shortfall is below the length of one word plus two, because the last
    sentence is cut at a word boundary (it still ends in a period).
    """
    if n_chars < 0:
        raise ValueError(f"n_chars must be >= 0, got {n_chars}")
    out: list[str] = []
    used = 0
    while True:
        sep = 1 if out else 0
        s = sentence(rng)
        if used + sep + len(s) <= n_chars:
            out.append(s)
            used += sep + len(s)
            continue
        room = n_chars - used - sep
        words = s[:-1].split(" ")
        cut: list[str] = []
        size = 1  # the final period
        for w in words:
            extra = len(w) + (1 if cut else 0)
            if size + extra > room:
                break
            cut.append(w)
            size += extra
        if cut:
            out.append(" ".join(cut) + ".")
        return out


def filler_text(rng: random.Random, n_chars: int) -> str:
    """A filler document of at most ``n_chars`` characters (see :func:`filler_sentences`)."""
    return " ".join(filler_sentences(rng, n_chars))


def needle_key(rng: random.Random) -> str:
    """A random ``adjective-noun`` key (about 1000 distinct values)."""
    return f"{rng.choice(KEY_ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"


def number(rng: random.Random, digits: int) -> str:
    """A random decimal string of ``digits`` digits without a leading zero."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def variable_name(rng: random.Random) -> str:
    """Five random upper-case letters."""
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def coded_word(rng: random.Random) -> str:
    """A random lowercase letter string of 3-6 letters (a "coded word")."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))


def insert_at_boundaries(
    rng: random.Random, sentences: list[str], inserts: list[str]
) -> list[str]:
    """Insert ``inserts`` (in their order) at random sentence boundaries.

    Each insert lands at a uniformly random boundary (depth); inserts keep their
    relative order, which the variable-tracking task relies on (a variable is
    assigned before it is used).
    """
    slots = sorted(rng.randint(0, len(sentences)) for _ in inserts)
    out: list[str] = []
    prev = 0
    for slot, text in zip(slots, inserts):
        out.extend(sentences[prev:slot])
        out.append(text)
        prev = slot
    out.extend(sentences[prev:])
    return out
