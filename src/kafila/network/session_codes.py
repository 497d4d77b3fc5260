"""Session codes people can read aloud: `7-crimson-harbor-lemon-tiger-orbit-cactus`.

A full code has two halves:

- the channel, `7-crimson-harbor`: a number from 2 to 99 and two words from fixed lists of 128
  each (98 × 128 × 128 ≈ 1.6 million). The rendezvous draws it and keys the session with it; it
  is no secret, and need not be one: it admits joins only while its session is filling, and
  guesses are rate-limited per address.
- the secret, `lemon-tiger-orbit-cactus`: four words drawn by the host from BIP-39's English
  list of 2,048 (chosen so that no two words share their first four letters), so 2^44
  possibilities. It never goes to the rendezvous. Members use the whole code as the password of
  a SPAKE2 exchange (`kafila.network.pake`), which lets no one test guesses offline: each guess
  costs an exchange in which the joiner must prove its key before the host answers, so the host
  sees every try that is not a proof (a wrong one, an abort, garbage, silence, leaving) and takes
  at most `GUESS_BUDGET` of them in its whole life (`session.core`), so an attacker, the
  rendezvous included, wins with a chance of at most 3 in 2^44, about 1.7 × 10^-13.
"""

from __future__ import annotations

import random
import re

from mnemonic import Mnemonic

ADJECTIVES: tuple[str, ...] = tuple(
    """
    amber ancient autumn azure bold brave breezy bright brisk bronze calm candid cheerful clever cobalt cosmic
    crimson crisp curious dapper daring dusky eager early easy electric emerald fearless festive fluffy frosty gentle
    gilded glad golden graceful grand green happy hazel hidden hollow humble icy indigo ivory jade jolly keen kind
    lively lofty loyal lucky lunar magic mellow merry mighty misty modest mossy noble nimble northern oaken olive opal
    orange patient pearly plucky polar proud purple quick quiet radiant rapid rosy royal ruby rustic sandy scarlet
    serene shady shiny silent silver simple sleepy smooth snowy solar sparkly spring steady stormy sturdy sunny swift
    tidy tranquil trusty velvet vivid warm wild windy wise witty woolly young zesty agile arctic balmy cozy dreamy
    fuzzy gleaming hardy honest jovial lush mild peaceful
    """.split()
)

NOUNS: tuple[str, ...] = tuple(
    """
    harbor anchor apple arrow badger bamboo beacon beetle birch bison bramble breeze brook cactus camel canyon castle
    cloud clover comet coral cottage crane creek crystal dolphin dragon dune eagle ember falcon fern fjord flame forest
    fox garden gazelle glacier granite heron hill island jaguar jasmine kettle kite lagoon lantern lark lemon lily
    lotus lynx maple marble meadow meteor moon moose mountain nebula nest oak ocean orchid otter owl panda parrot pebble
    pepper pine planet plum pond poppy prairie puffin quartz rabbit raven reef river robin rocket saddle salmon sparrow
    spruce squirrel star stone summit swan thistle thunder tiger tulip tundra valley violet walnut whale willow wolf
    wren yak zebra acorn almond aspen atlas banjo barley basil bell berry blossom canoe cherry cliff compass delta dove
    feather garnet ginger
    """.split()
)

SECRET_WORDS: tuple[str, ...] = tuple(Mnemonic("english").wordlist)  # BIP-39: 2,048 distinct words
SECRET_LENGTH = 4  # words
SECRET_BITS = SECRET_LENGTH * 11  # log2(2048) bits a word
_SECRET_SET = frozenset(SECRET_WORDS)

MIN_NUMBER, MAX_NUMBER = 2, 99  # 0 and 1 read like letters; two digits stay short
CODE_PATTERN = re.compile(r"^([2-9]|[1-9][0-9])-([a-z]+)-([a-z]+)$")
_SEPARATORS = re.compile(r"[\s_.\-]+")
_CHANNEL_WORDS = 3  # the number and two words
EXAMPLE = "7-crimson-harbor-lemon-tiger-orbit-cactus"


class CodeFormatError(ValueError):
    """A full session code that cannot be used; the message says what is wrong with it."""


def new_code(rng: random.Random) -> str:
    """One code drawn from `rng` (a `random.SystemRandom` in service, a seeded one in tests)."""
    number = rng.randint(MIN_NUMBER, MAX_NUMBER)
    return f"{number}-{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def normalise_code(text: str) -> str:
    """What a person typed, as the canonical code: case, spaces and stray separators forgiven."""
    return _SEPARATORS.sub("-", text.strip().lower()).strip("-")[:64]


def is_well_formed(code: str) -> bool:
    """Whether `code` is a channel code (the half the rendezvous sees)."""
    match = CODE_PATTERN.match(code)
    return match is not None and match[2] in ADJECTIVES and match[3] in NOUNS


def new_secret(rng: random.Random) -> str:
    """The secret half, drawn by the host from `rng` (a `random.SystemRandom` in service)."""
    return "-".join(rng.choice(SECRET_WORDS) for _ in range(SECRET_LENGTH))


def full_code(channel: str, secret: str) -> str:
    """The code the host reads out: channel and secret; `CodeFormatError` if either is malformed."""
    code = f"{normalise_code(channel)}-{normalise_code(secret)}"
    split_code(code)
    return code


def channel_part(text: str) -> str:
    """The channel half of what a person typed (full code or not): all the rendezvous may see."""
    return "-".join(normalise_code(text).split("-")[:_CHANNEL_WORDS])


def split_code(text: str) -> tuple[str, str]:
    """A full code as (channel, secret), normalised; `CodeFormatError` saying what is wrong."""
    code = normalise_code(text)
    words = code.split("-") if code else []
    channel = "-".join(words[:_CHANNEL_WORDS])
    secret_words = words[_CHANNEL_WORDS:]
    if len(words) < _CHANNEL_WORDS or not is_well_formed(channel):
        raise CodeFormatError(
            f"{repr(code) if code else 'an empty code'} is not a session code: it looks like {EXAMPLE} "
            f"(a number, then {2 + SECRET_LENGTH} words)"
        )
    if not secret_words:
        raise CodeFormatError(
            f"{channel} is only the first half of the session code: the host's full code has "
            f"{SECRET_LENGTH} more words (like {EXAMPLE}); ask the host for all of it"
        )
    if len(secret_words) != SECRET_LENGTH:
        raise CodeFormatError(
            f"the secret half of the code has {len(secret_words)} word{'s' * (len(secret_words) != 1)}, "
            f"not {SECRET_LENGTH} "
            f"(a full code looks like {EXAMPLE}); check the code with the host"
        )
    unknown = [w for w in secret_words if w not in _SECRET_SET]
    if unknown:
        raise CodeFormatError(
            f"{', '.join(repr(w) for w in unknown)} {'is' if len(unknown) == 1 else 'are'} not among the code's "
            "words; check the code with the host"
        )
    return channel, "-".join(secret_words)
