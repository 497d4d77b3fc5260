"""Session codes people can read aloud: `7-crimson-harbor`.

A code is a number from 2 to 99 and two words from fixed lists of 128 each: 98 × 128 × 128 ≈ 1.6
million codes. That is too few to be a secret on its own, and it need not be one: a code admits
joins only while its session is filling, guesses are rate-limited per address, and every member
is introduced to the others with its key fingerprint before any data flows.
"""

from __future__ import annotations

import random
import re

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

MIN_NUMBER, MAX_NUMBER = 2, 99  # 0 and 1 read like letters; two digits stay short
CODE_PATTERN = re.compile(r"^([2-9]|[1-9][0-9])-([a-z]+)-([a-z]+)$")
_SEPARATORS = re.compile(r"[\s_.\-]+")


def new_code(rng: random.Random) -> str:
    """One code drawn from `rng` (a `random.SystemRandom` in service, a seeded one in tests)."""
    number = rng.randint(MIN_NUMBER, MAX_NUMBER)
    return f"{number}-{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def normalise_code(text: str) -> str:
    """What a person typed, as the canonical code: case, spaces and stray separators forgiven."""
    return _SEPARATORS.sub("-", text.strip().lower()).strip("-")[:64]


def is_well_formed(code: str) -> bool:
    match = CODE_PATTERN.match(code)
    return match is not None and match[2] in ADJECTIVES and match[3] in NOUNS
