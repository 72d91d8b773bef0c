"""The user's personal adapter: one adapter for the user, shared by every expert.

A user's facts and style are the user's, not an expert's: "my dog is called Rex" taught in a
chat (L0) must hold when a later request routes to the agent (L1). So the learner trains one
personal adapter on all of the user's feedback, each episode with the expert that answered it
underneath (on a model without expert adapters every slot is the bare base, so they share it),
and the chat stacks it on whichever expert a turn is routed to.

In the registry it is the slot `personal`: one deployment pointer per base model, rolled back
and forgotten like any other. Versions learned per expert slot by earlier releases still serve
their own slot until a personal version is deployed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from macaron_local.catalog import SLOTS

PERSONAL_SLOT = "personal"
#: Every registry slot the chat may serve a learned version from.
SERVED_SLOTS: tuple[str, ...] = (*SLOTS, PERSONAL_SLOT)

Handle = TypeVar("Handle")


def personal_for(slot: str, served: Mapping[str, Handle]) -> Handle | None:
    """The learned adapter to stack on expert `slot`'s turns: the shared personal one when one
    is deployed, else the slot's own (a version from before the personal slot), else None."""
    return served.get(PERSONAL_SLOT) or served.get(slot)
