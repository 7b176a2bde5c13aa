"""The words of the built-in environments, in one documented place.

The tiny model's tokenizer (``compactionrl model init``) makes every word here
a single token, with and without a leading space, so that the environments'
text costs one token per word and the tiny model learns fast. Text outside
this list still tokenizes (byte-level fallback), it only costs more tokens.
Add words here when an environment's text changes; rebuild the tiny model.
"""

from __future__ import annotations

#: Roles of the chat format and words of the agent's own instructions
#: (summary request, resume template).
AGENT_WORDS = """
system user assistant agent tool task goal step steps summary summarise summarize history
context keep kept write your you the a an of and or to in on at is are was were be
with for from by as it this that these those what which when where who how not no
yes all each every any some one next last first new old before after then now so
done result results action actions fact facts found value values path error errors
continue resume earlier previous progress remaining left below above here there
must should will can need needs only exact exactly short list find its like hold
""".split()

#: The keyvault environment: rooms, codes, digits, commands and answers.
KEYVAULT_WORDS = """
room rooms page pages door doors vault vaults key keys code codes digit digits
position note notes sign label card letter wall floor desk shelf box drawer
open go read look visit visited move enter exit back north south east west
answer submit say reply correct wrong partial credit reward success failure
alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima
zero one two three four five six seven eight nine ten
first second third fourth fifth sixth seventh eighth ninth tenth
unknown command invalid usage try again nothing here empty end
""".split()

#: Distractor text around the facts: ordinary, irrelevant words.
DISTRACTOR_WORDS = """
red blue green yellow white black grey orange purple brown
cat dog bird fish horse mouse lamp table chair window book clock rug plant
dust light dark quiet loud warm cold small large tall round square soft hard
rain wind sun moon star tree river stone glass paper wood metal water fire
smells looks seems feels sounds hangs sits lies stands rests
""".split()

#: Every word the tiny tokenizer must hold as one token, without duplicates.
WORDS: tuple[str, ...] = tuple(dict.fromkeys(AGENT_WORDS + KEYVAULT_WORDS + DISTRACTOR_WORDS))
